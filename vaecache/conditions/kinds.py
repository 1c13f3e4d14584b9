"""Image-to-video conditions, as the pipelines build them: which pipeline a cache conditions for, and its tensor
arithmetic, which the family declaring the pipeline supplies (vaecache.models: `ConditionPipeline.arithmetic`, e.g.
Wan's `models/_wan_conditions.py`); no I/O.

A cache stores the posterior mean (the only input that depends on weights and frames); the mask and the
normalization are rebuilt from the recorded frame count, temporal factor and constants, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from vaecache.errors import UsageError
from vaecache.models import registry
from vaecache.models.base import ConditionPipeline

CONDITION_KINDS = ("first-frame", "first-last", "image-features")
LATENT_KINDS = ("first-frame", "first-last")
"""The kinds encoded with the cache's VAE; image-features come from an image encoder (vaecache.conditions.images)."""


def declared_pipelines() -> tuple[dict[str, list[ConditionPipeline]], dict[str, tuple[str, ConditionPipeline]]]:
    """(VAE class -> its own pipelines, the ones a config selects first; --condition-pipeline NAME -> (the VAE class
    it conditions with, the pipeline)), as the model families declare them."""
    own: dict[str, list[ConditionPipeline]] = {}
    asked: dict[str, tuple[str, ConditionPipeline]] = {}
    for family in registry().families.values():
        for pipeline in family.conditions:
            vae_class = family.vae_classes[0]
            if pipeline.asked:
                asked[pipeline.name] = (vae_class, pipeline)
            else:
                own.setdefault(vae_class, []).append(pipeline)
    return own, asked


OWN_PIPELINES, ASKED = declared_pipelines()
BY_NAME = {pipeline.name: pipeline for pipelines in OWN_PIPELINES.values() for pipeline in pipelines} | \
    {name: pipeline for name, (_, pipeline) in ASKED.items()}
PIPELINES = {vae_class: next((p.name, p.reference, p.kinds) for p in pipelines if p.selects is None)
             for vae_class, pipelines in OWN_PIPELINES.items()}
"""VAE class -> (the image-to-video pipeline whose condition vaecache reproduces, its reference, the kinds it has),
where its config selects no other."""
ASKED_PIPELINES = {name: (vae_class, pipeline.reference, pipeline.kinds)
                   for name, (vae_class, pipeline) in ASKED.items()}
"""--condition-pipeline NAME -> (the VAE class it conditions with, its reference, its kinds): pipelines a cache's VAE
does not tell, because another pipeline shares the VAE."""
UNNAMED = next(pipeline for pipeline in BY_NAME.values() if pipeline.unnamed_record)
"""The pipeline whose sets record no pipeline name (made before it was recorded), and the one a cache whose VAE has
no pipeline is checked against."""
REFERENCE = UNNAMED.reference
CONDITION_PIPELINES = ("auto", *ASKED_PIPELINES)
SUPPORTED_FAMILIES = (*PIPELINES, *(family for family, _, _ in ASKED_PIPELINES.values()))
MISSING_CONSTANT = {"scaling_factor": "records no scaling_factor for its VAE (the pipeline scales the image latent)",
                    "latents_std": "records no latents_mean/latents_std for its VAE (needed to normalize the "
                                   "condition as the pipeline does)"}


def parse_condition_kinds(text: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """`--condition KIND[,KIND]` -> the kinds in the documented order; unknown kinds refused, naming the known."""
    if not text:
        return ()
    parts = text.split(",") if isinstance(text, str) else list(text)
    kinds = {part.strip() for part in parts if part.strip()}
    unknown = sorted(kinds - set(CONDITION_KINDS))
    if unknown:
        raise UsageError(f"--condition: unknown kind {', '.join(unknown)}; the kinds are {', '.join(CONDITION_KINDS)}")
    return tuple(kind for kind in CONDITION_KINDS if kind in kinds)


def condition_pipeline(vae: dict, asked: str | None = "auto") -> str:
    """The image-to-video pipeline a cache's VAE record conditions for: the one `asked` (--condition-pipeline), else
    the one its config selects among its VAE class's, else the class's own (UNNAMED for a class without one: the
    refusal is check_condition_vae's)."""
    asked = _model_pipeline(vae, asked)
    if asked not in (None, "auto"):
        return str(asked)
    config = vae.get("config") or {}
    pipelines = OWN_PIPELINES.get(str(vae.get("family")), [UNNAMED])
    return next(p.name for p in pipelines if p.selects is None or p.selects(config))


def _model_pipeline(vae: dict, asked: str | None) -> str | None:
    """--condition-pipeline auto on a cache encoded for a model whose pipeline is one of those asked by name (a
    Kandinsky 5 cache, `encode --model kandinsky5`): that pipeline."""
    model = vae.get("model")
    return model if asked in (None, "auto") and model in ASKED_PIPELINES else asked


def pipeline_reference(vae: dict, asked: str | None = "auto") -> tuple[str, tuple[str, ...]]:
    """(the reference, the latent kinds) of the pipeline a cache's VAE record conditions for."""
    pipeline = BY_NAME[condition_pipeline(vae, asked)]
    return pipeline.reference, pipeline.kinds


def check_condition_vae(vae: dict, where: str, kinds: tuple[str, ...] = LATENT_KINDS,
                        asked: str | None = "auto") -> None:
    """Refuse a cache whose VAE has no image-to-video pipeline vaecache follows for `kinds` (or not the one `asked`
    with --condition-pipeline), naming the supported ones."""
    family = vae.get("family")
    asked = _model_pipeline(vae, asked)
    if asked not in (None, *CONDITION_PIPELINES):
        raise UsageError(f"--condition-pipeline must be one of {', '.join(CONDITION_PIPELINES)}, got {asked!r}")
    if asked in ASKED_PIPELINES and family != ASKED_PIPELINES[asked][0]:
        raise UsageError(f"{where}: --condition-pipeline {asked} conditions with a {ASKED_PIPELINES[asked][0]} "
                         f"cache; its VAE is {family or 'unrecorded'}")
    if family not in SUPPORTED_FAMILIES:
        references = " and ".join(reference for _, reference, _ in PIPELINES.values())
        raise UsageError(f"{where}: its VAE is {family or 'unrecorded'}; image-to-video conditions follow "
                         f"{references}, for the VAE families {', '.join(SUPPORTED_FAMILIES)}")
    if family not in PIPELINES and asked in (None, "auto"):
        choices = [name for name, (owner, _, _) in ASKED_PIPELINES.items() if owner == family]
        raise UsageError(f"{where}: its VAE is {family}, which more than one image-to-video pipeline uses: name the "
                         f"one with --condition-pipeline ({', '.join(choices)}; HunyuanVideo's own I2V condition is "
                         "not reproduced)")
    pipeline = BY_NAME[condition_pipeline(vae, asked)]
    unknown = [kind for kind in kinds if kind in LATENT_KINDS and kind not in pipeline.kinds]
    if unknown:
        raise UsageError(f"{where}: its VAE is {family}, whose image-to-video pipeline ({pipeline.reference}) has no "
                         f"{', '.join(unknown)} condition; its kinds: {', '.join(pipeline.kinds)}")
    if not (vae.get("normalization") or {}).get(pipeline.needs):
        raise UsageError(f"{where}: {MISSING_CONSTANT[pipeline.needs]}")


def _arithmetic(pipeline: str) -> Any:
    return BY_NAME[pipeline].arithmetic()


def condition_video(frames: torch.Tensor, kind: str, clip: str = "", pipeline: str = UNNAMED.name) -> torch.Tensor:
    """(views, 3, T, H, W) frames as encode saw them -> what the pipeline encodes for each view (Wan's
    `video_condition`; the first frame alone for the pipelines that encode it alone)."""
    return _arithmetic(pipeline).condition_video(frames, kind, clip)


def pipeline_masks(mean: torch.Tensor, kind: str, num_frames: int, temporal_factor: int,
                   pipeline: str) -> dict[str, torch.Tensor]:
    """What the pipeline returns beside the condition, where it returns the mask apart (Wan 2.2 TI2V):
    `condition_mask/<kind>`, (views, 1, latent frames, h, w); else nothing (the mask is inside the condition)."""
    if kind not in LATENT_KINDS:
        return {}
    return _arithmetic(pipeline).masks(mean, kind, num_frames, temporal_factor)


def pipeline_condition(mean: torch.Tensor, kind: str, num_frames: int, temporal_factor: int,
                       latents_mean: list[float], latents_std: list[float], pipeline: str = UNNAMED.name,
                       scaling_factor: float = 1.0) -> torch.Tensor:
    """(views, C, F, H, W) stored posterior mean -> the tensor the pipeline's prepare_latents returns for each view
    (its family's arithmetic). image-features are stored as the pipeline uses them and returned unchanged."""
    if kind not in LATENT_KINDS:
        return mean
    normalization = {"latents_mean": latents_mean, "latents_std": latents_std, "scaling_factor": scaling_factor}
    return _arithmetic(pipeline).condition(mean, kind, num_frames, temporal_factor, normalization)


__all__ = ["ASKED_PIPELINES", "BY_NAME", "CONDITION_KINDS", "CONDITION_PIPELINES", "LATENT_KINDS", "PIPELINES",
           "REFERENCE", "SUPPORTED_FAMILIES", "UNNAMED", "check_condition_vae", "condition_pipeline", "condition_video",
           "parse_condition_kinds", "pipeline_condition", "pipeline_masks", "pipeline_reference"]
