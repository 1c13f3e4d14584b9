"""The text family of a --text-encoder SPEC: the pipeline a diffusers folder names, looked up among the families'
declarations (`vaecache.models`, each family's `TextEncoders`), in a --text-convention; or a generic one for
`transformers:PATH` (any transformers encoder with its tokenizer at a given length and hidden layer, with the
attention mask, rows trimmed to the mask: world models that condition on scene descriptions, MagicDriveDiT's T5).
No torch."""

from __future__ import annotations

from vaecache.models import registry
from vaecache.models.base import TextEncoders, TextFamily

TEXT_CONVENTIONS = ("pipeline", "musubi")
"""--text-convention: the pipeline's own embedding (diffusers'), or musubi-tuner's where its trainer embeds otherwise
(the families declaring `TextEncoders.musubi`)."""


def declared_text() -> list[TextEncoders]:
    """The families' text declarations, in the registry's order (the order their refusals list them)."""
    return [family.text for family in registry().families.values() if family.text is not None]


def musubi_templates() -> tuple[str, ...]:
    """--k5-template: the templates musubi's convention can embed with where a family has several."""
    return tuple(dict.fromkeys(name for text in declared_text() for name in text.musubi_templates))


def family_for_pipeline(class_name: str, where: str, convention: str = "pipeline",
                        k5_template: str | None = None) -> TextFamily:
    """The family of a diffusers pipeline folder's model_index.json `_class_name` in a --text-convention (and, for
    a family with several musubi templates, a --k5-template); a ValueError naming what is supported otherwise."""
    text = _pipeline_text(class_name, where)
    templates = musubi_templates()
    if k5_template is not None and k5_template not in templates:
        raise ValueError(f"--k5-template must be one of {', '.join(templates)}, got {k5_template!r}")
    if k5_template is not None and (not text.musubi_templates or convention != "musubi"):
        raise ValueError(f"{where}: --k5-template applies to a Kandinsky 5 pipeline with --text-convention musubi "
                         "(diffusers' Kandinsky5T2VPipeline embeds with its video template)")
    if convention == "pipeline":
        return text.pipeline
    if convention != "musubi":
        raise ValueError(f"--text-convention must be one of {', '.join(TEXT_CONVENTIONS)}, got {convention!r}")
    if text.musubi is None:
        labels = [other.musubi_label for other in declared_text() if other.musubi is not None]
        raise ValueError(f"{where}: --text-convention musubi applies to {', '.join(labels[:-1])} and {labels[-1]} "
                         "(musubi-tuner embeds the other architectures' prompts as the pipelines do), "
                         f"not {class_name}")
    if k5_template is not None:
        return text.musubi_templates[k5_template]
    return text.musubi


def family_named(name: str) -> str:
    """The --text-convention a recorded family name was embedded in."""
    return "musubi" if name.endswith("-musubi") else "pipeline"


def _pipeline_text(class_name: str, where: str) -> TextEncoders:
    declared = declared_text()
    for text in declared:
        if class_name in text.pipelines:
            return text
    every = [name for text in declared for name in text.pipelines]
    supported = (f"supported: {', '.join(every)}; "
                 "any other encoder as transformers:PATH with --text-length")
    not_yet = {name: what for text in declared for name, what in text.not_yet.items()}
    if class_name in not_yet:
        raise ValueError(f"{where}: {class_name} ({not_yet[class_name]}) text embeddings are not reproduced yet "
                         f"({supported})")
    raise ValueError(f"{where}: no text-encoder family for pipeline {class_name!r} ({supported})")


def installed_version(name: str) -> str | None:
    """The installed version of package `name`, or None (ftfy's is recorded with a Wan set: its cleaning is ftfy's)."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


TEXT_PACKAGES = ("transformers", "tokenizers", "ftfy")


def check_text_spec(spec: str) -> str:
    """A --text-encoder SPEC's form, and the packages it needs, checked before anything runs (an encode with
    --text-encoder must not find out after hours of video that it cannot embed): a UsageError otherwise."""
    from importlib.util import find_spec

    from vaecache.errors import UsageError

    if not isinstance(spec, str) or spec.partition(":")[0] not in ("diffusers", "transformers") or not \
            spec.partition(":")[2]:
        raise UsageError(f"--text-encoder must be diffusers:PATH[#SUBFOLDER] or transformers:PATH, got {spec!r}")
    missing = [name for name in TEXT_PACKAGES if find_spec(name) is None]
    if missing:
        raise UsageError(f"--text-encoder needs {', '.join(missing)}: pip install 'vaecache[text]'")
    return spec


def generic_family(length: int, cleaning: str = "strip") -> TextFamily:
    return TextFamily("generic", length, cleaning, "the encoder's last_hidden_state (or hidden_states[layer]) with "
                      "the attention mask, rows trimmed to the mask")
