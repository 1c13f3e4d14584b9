"""What encode and plan refuse before torch is imported or DATA is listed: what the arguments, OUT's own records and
a known family's frame and size rules already say. Torch-free; start-up checks all of it again (and the rest) once
the VAE is loaded, so these only answer sooner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vaecache.errors import UsageError


def known_frame_rule(spec: str, model: str | None) -> Any | None:
    """The frame and size rule of the VAE `spec` names, read without torch where its family is known from files alone
    (a diffusers folder's config.json `_class_name`; builtin:small's config in its weights file's header); None where
    only loading it tells (builtin:tiny, a single checkpoint file, a python: plugin). `model` (--model) is checked to
    train on that class, and its own rule taken (Kandinsky 5's)."""
    from vaecache.models import rule_of_config, vae_class

    found = _class_and_config(spec)
    if found is None or vae_class(found[0]) is None:
        return None
    class_name, config = found
    return rule_of_config({**config, "_class_name": class_name}, model, f"--vae {spec}")


def _class_and_config(spec: str) -> tuple[str, dict[str, Any]] | None:
    """(diffusers class, config) of a VAE spec, from its files without loading it; None where they do not say."""
    if spec == "builtin:small":
        import vaecache.vae
        from vaecache.weights import safetensors_header

        # the file vae/load.py's BUILTIN_SMALL_WEIGHTS names (that module imports torch)
        weights = Path(vaecache.vae.__file__).parent / "weights" / "builtin_small.safetensors"
        metadata = safetensors_header(weights).get("__metadata__") or {}
        return str(metadata.get("class")), json.loads(metadata.get("config") or "{}")
    if not spec.startswith("diffusers:"):
        return None
    path, _, sub = spec[len("diffusers:"):].partition("#")
    folder = Path(path).expanduser() / sub if sub else Path(path).expanduser()
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None  # start-up names what is wrong with the folder
    if not isinstance(config, dict) or not isinstance(config.get("_class_name"), str):
        return None
    return config["_class_name"], config


def check_before_torch(cfg: Any, encode: bool) -> None:
    """Refuse what the settings `cfg` (an EncodeConfig or PlanConfig) and OUT already show to be wrong: the --vae spec
    (a Hub id, a missing folder, a checkpoint file's header), --num-frames and --size against the VAE's rule where
    its family is known, and, for encode, an OUT that holds something else or a run of other settings."""
    from vaecache.vae.specs import check_vae_spec

    check_vae_spec(cfg.vae.spec, cfg.vae.config, cfg.vae.allow_pickle_weights)
    rule = known_frame_rule(cfg.vae.spec, cfg.vae.model)
    if rule is not None:
        rule.check_buckets(cfg.clip.sampling.lengths, cfg.clip.sizes)
    if encode and not cfg.out.overwrite:
        check_out(cfg)


def check_out(cfg: Any) -> None:
    """An OUT folder on disk that is not a vaecache cache and holds something, or whose run record says it was made
    with other clip settings or from other data (what a resume must keep), refused as start-up would refuse it
    after the probe (cache/outdir.py:prepare_out)."""
    from vaecache.cache.layout import OWNED_ENTRIES, RUN
    from vaecache.differences import describe_differences
    from vaecache.urls import is_url

    out = cfg.out.location
    if is_url(str(out)) or not Path(out).is_dir():
        return
    out = Path(out)
    run = out / RUN
    if not run.exists():
        foreign = sorted(entry.name for entry in out.iterdir() if entry.name not in OWNED_ENTRIES)
        if foreign:
            raise UsageError(f"{out}: not empty and not a vaecache output (holds {', '.join(foreign[:3])}); "
                             "choose another --out")
        return
    try:
        recorded = json.loads(run.read_text()).get("fingerprint") or {}
    except (OSError, ValueError, AttributeError):
        return  # start-up names a damaged run record
    wanted = {"latents": {key: value for key, value in cfg.clip.to_record().items() if value != "auto"},
              "data": cfg.source.to_record()["data"]}
    before = {"latents": recorded.get("latents"), "data": recorded.get("data")}
    if not isinstance(before["latents"], dict):
        return
    before["latents"] = {key: value for key, value in before["latents"].items() if key in wanted["latents"]}
    wanted["latents"] = {key: value for key, value in wanted["latents"].items() if key in before["latents"]}
    diffs = describe_differences(before, wanted)
    if diffs:
        raise UsageError(f"{out} was made with other settings ({'; '.join(diffs[:4])}); use the same settings to "
                         "resume, or --overwrite to start over")
