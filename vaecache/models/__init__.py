"""The model families vaecache knows, one module each, and the registry the engines read.

A family is a model people train (HunyuanVideo, FramePack, Kandinsky 5, ...), not a VAE class: one class can serve
several, each encoding with it as its own trainers do (`base.ReferenceEncode`). `encode --model NAME` names the
family where the VAE class does not tell it; the cache records it (`vae.model` and `vae.reference_encode` in the
manifest). Importable without torch."""

from __future__ import annotations

from typing import Any, Mapping

from vaecache.errors import UsageError
from vaecache.models import (
    cogvideox,
    framepack,
    hunyuanvideo,
    hunyuanvideo15,
    image,
    kandinsky5,
    ltx2,
    ltx_video,
    wan,
)
from vaecache.models.base import Family, ReferenceEncode

BUILT_IN: tuple[Family, ...] = (wan.FAMILY, hunyuanvideo.FAMILY, framepack.FAMILY, kandinsky5.FAMILY,
                                hunyuanvideo15.FAMILY, cogvideox.FAMILY, ltx_video.FAMILY, ltx2.FAMILY, image.FAMILY)
FAMILIES: dict[str, Family] = {family.name: family for family in BUILT_IN}


def families_of_class(class_name: str) -> list[Family]:
    """The families that train on this VAE class's latents, its default first."""
    serving = [family for family in FAMILIES.values() if class_name in family.vae_classes]
    return sorted(serving, key=lambda family: class_name not in family.default_for)


def family_for(class_name: str, requested: str | None, where: str) -> Family | None:
    """The family a VAE of `class_name` encodes for: `requested` (--model), checked to train on that class, or the
    class's default; None for a class no family declares (a python: plugin). A UsageError names the choices."""
    serving = families_of_class(class_name)
    if requested is None:
        return serving[0] if serving else None
    family = FAMILIES.get(requested)
    if family is None:
        raise UsageError(f"--model {requested!r} is not a model vaecache knows; models: {', '.join(FAMILIES)}")
    if class_name not in family.vae_classes:
        others = ", ".join(f.name for f in serving) or "none: its latents are recorded without a model"
        raise UsageError(f"--model {requested}: {family.label} trains on {', '.join(family.vae_classes)} latents; "
                         f"{where} is {class_name} (its models: {others})")
    return family


def recorded_family(vae: Mapping[str, Any]) -> tuple[Family | None, ReferenceEncode | None]:
    """The family and reference encode a cache's `vae` record names. A cache written before they were recorded
    gets its class's default family and the encode vaecache ran then: diffusers' default (HunyuanVideo's time tiles
    above 16 frames), the family's own reference for every other class."""
    class_name = str(vae.get("family"))
    name = vae.get("model")
    family = FAMILIES.get(name) if isinstance(name, str) else (families_of_class(class_name) or [None])[0]
    if family is None:
        return None, None
    record = vae.get("reference_encode")
    if record is None and "model" not in vae:
        return family, (family.legacy_references or (family.reference,))[0]
    return family, family.reference_recorded(record if isinstance(record, Mapping) else None)


def unrecorded_vae_part(vae: Mapping[str, Any]) -> dict[str, Any]:
    """A VAE fingerprint written before the family was recorded, in today's terms (its family and the encode that
    made it), so a resume or a reload compares like with like."""
    if "model" in vae or "family" not in vae:
        return dict(vae)
    family, reference = recorded_family(vae)
    if family is None or reference is None:
        return dict(vae)
    return {**vae, "model": family.name, "reference_encode": reference.record()}


def encode_problem(vae: Mapping[str, Any], settings: Mapping[str, Any], record: Mapping[str, Any]) -> str | None:
    """Why a clip's latents are not the ones its family's trainers make (None where they are): encoded with the VAE's
    own tiling (--tiling, or the out-of-memory fallback), or by an older vaecache's encode that tiled it in time."""
    if settings.get("tiling"):
        return "encoded with the VAE's own tiling (--tiling)"
    encode = record.get("encode")
    if isinstance(encode, Mapping) and encode.get("tiled"):
        cameras = ", ".join(map(str, encode.get("tiled_cameras") or [])) or "some camera"
        return f"{cameras} encoded with the VAE's own tiling after running out of memory"
    family, reference = recorded_family(vae)
    if family is None or reference is None or reference is family.reference:
        return None
    frames = len(record.get("frames") or [])
    if reference.time_tiles_above is not None and frames > reference.time_tiles_above:
        return (f"its {frames} frames were tiled in time ({reference.description}; vaecache 0.6 and earlier, before "
                "the encode was recorded)")
    return None


__all__ = ["BUILT_IN", "FAMILIES", "Family", "ReferenceEncode", "encode_problem", "families_of_class", "family_for",
           "recorded_family", "unrecorded_vae_part"]
