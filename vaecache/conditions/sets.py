"""Image-to-video condition sets of a finished cache: written by `vaecache embed --condition` (and `encode
--condition`), read by LatentCache, checked by verify. One set per kind (vaecache.conditions.kinds), through OUT's
store like the text sets (vaecache.cache.sets).

OUT/conditions/<kind>/<generation>/
  conditions-00000.safetensors  one tensor per clip, named by its clip id: (cameras, C, latent frames, h, w), the
                                VAE's posterior mean of each camera's condition video, in the VAE's dtype (what the
                                pipeline's `retrieve_latents(..., "argmax")` returns)
  clips.parquet                 id, shard, frames, the tensor's min/max/mean/std, per camera tiled and
                                units_per_forward (the out-of-memory backoff), and inputs (the sha256 of what the
                                clip's frames are: clip_inputs): every clip, in the clip table's order

The frames are the clip's as encode saw them (LatentCache.source_frames: its sources, frame indices, resize and
fit, decode backend); the VAE is the cache's own, loaded with its recorded settings and fingerprint-checked, and it
encodes through the same runner as the latents (views batched as recorded, out-of-memory backoff). manifest.json's
"conditions" object holds each set's record; the set becomes part of the cache when that manifest is written.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from vaecache.cache.sets import (
    generation_of,
    pack_shards,
)
from vaecache.conditions.kinds import (
    REFERENCE,
    parse_condition_kinds,
)
from vaecache.errors import UsageError
from vaecache.settings.parts import ConditionsConfig

SHARD_PREFIX = "conditions-"
CLIPS_TABLE = "clips.parquet"
DEFAULT_SHARD_BYTES = 256 << 20


def check_condition_request(conditions: ConditionsConfig) -> tuple[str, ...]:
    """encode --condition: the kinds (returned), and the image encoder's options, folders, config and weights files,
    checked at start-up before any video is probed (a typo must not cost the whole encode). Once the VAE is loaded,
    start-up checks it has the pipeline the latent kinds follow (kinds.check_condition_vae)."""
    if conditions.kinds is None:
        return ()
    kinds = parse_condition_kinds(conditions.kinds)
    if not kinds:
        raise UsageError("--condition: name at least one kind (first-frame, first-last, image-features)")
    if "image-features" in kinds:
        from vaecache.conditions.images import check_image_options, image_encoder_folders

        check_image_options(conditions.image_encoder, conditions.image_convention)
        image_encoder_folders(conditions.image_encoder, conditions.image_convention)  # type: ignore[arg-type]
    return kinds


@dataclass(frozen=True)
class ConditionRequest:
    """What `vaecache embed --condition` was asked to do (validated here; the CLI only parses)."""

    out: str
    kinds: tuple[str, ...]
    replace: bool = False
    shard_bytes: int = DEFAULT_SHARD_BYTES
    device: str = "auto"
    vae: str | None = None
    """Another path to the cache's VAE (its fingerprint must be the recorded one); default the recorded spec."""
    allow_pickle_weights: bool = False
    storage_options: tuple[tuple[str, Any], ...] = ()
    image_encoder: str | None = None
    """image-features: the image encoder's spec (vaecache.conditions.images)."""
    image_convention: str = "wan-diffusers"
    pipeline: str = "auto"
    """--condition-pipeline: the image-to-video pipeline the latent kinds follow (auto: the VAE family's own)."""

    def __post_init__(self) -> None:
        from vaecache.conditions.kinds import CONDITION_PIPELINES

        if self.pipeline not in CONDITION_PIPELINES:
            raise UsageError(f"--condition-pipeline must be one of {', '.join(CONDITION_PIPELINES)}, got "
                             f"{self.pipeline!r}")
        kinds = parse_condition_kinds(self.kinds)
        if not kinds:
            raise UsageError("--condition: name at least one kind")
        object.__setattr__(self, "kinds", kinds)
        if "image-features" in kinds:
            from vaecache.conditions.images import check_image_options

            check_image_options(self.image_encoder, self.image_convention)
        elif self.image_encoder is not None:
            raise UsageError("--image-encoder applies to --condition image-features")
        if self.shard_bytes < 1:
            raise UsageError(f"--shard-size must be at least 1 byte, got {self.shard_bytes}")


def condition_fingerprint(manifest: dict[str, Any], kind: str, dtype: torch.dtype,
                          pipeline: str | None = "auto") -> dict[str, Any]:
    """What decides a set's bytes: the kind and reference, the cache's VAE (as recorded, with its encode
    settings), the frame rule, the stored dtype."""
    from vaecache.conditions.kinds import UNNAMED, condition_pipeline, pipeline_reference

    vae = {k: v for k, v in (manifest.get("vae") or {}).items() if k not in ("spec", "encoder_variant")}
    settings = manifest.get("settings") or {}
    resolved = condition_pipeline(vae, pipeline)
    if resolved != UNNAMED.name:  # (the sets of the pipeline first reproduced keep the record they always had)
        return {"kind": kind, "reference": pipeline_reference(vae, pipeline)[0], "pipeline": resolved, "vae": vae,
                "vae_settings": {k: settings.get(k) for k in ("dtype", "tiling", "views_per_forward", "decoder")},
                "frame_rule": manifest.get("frame_rule"), "stored_dtype": str(dtype).removeprefix("torch."),
                "stored": "posterior mean of the first frame encoded alone, (cameras, C, 1, h, w)"}
    return {"kind": kind, "reference": REFERENCE, "vae": vae,
            "vae_settings": {k: settings.get(k) for k in ("dtype", "tiling", "views_per_forward", "decoder")},
            "frame_rule": manifest.get("frame_rule"), "stored_dtype": str(dtype).removeprefix("torch."),
            "stored": "posterior mean of the condition video, (cameras, C, latent frames, h, w)"}


def image_fingerprint(manifest: dict[str, Any], encoder: Any) -> dict[str, Any]:
    """What decides an image-features set's bytes: the encoder, its processor and convention, how frames decode."""
    settings = manifest.get("settings") or {}
    return {"kind": "image-features", "reference": encoder.fingerprint()["reference"],
            "image_encoder": encoder.fingerprint(), "frames": {"decoder": settings.get("decoder")},
            "stored_dtype": str(encoder.stored_dtype).removeprefix("torch."),
            "stored": "features of each camera's first frame, (cameras, tokens, hidden)"}


def clip_inputs(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(clip id, a hash of what its frames are: sources, their recorded identity, frame indices (per camera where a
    rig's cameras differ), image-sequence files, bucket, cameras) for every clip: with the fingerprint, what a set's
    generation hashes, so verify can tell a set made from other clips."""
    return [(record["id"], hashlib.sha256(json.dumps(
        [record.get("sources"), record.get("source_identity"), record.get("frames"), record.get("camera_frames"),
         record.get("frame_files"), record.get("bucket"), record.get("cameras")],
        sort_keys=True, default=str).encode()).hexdigest()) for record in records]


def set_generation(fingerprint: dict[str, Any], shard_bytes: int, records: list[dict[str, Any]]) -> str:
    return generation_of({"fingerprint": fingerprint, "shard_bytes": shard_bytes}, clip_inputs(records))


def shard_cut(records: list[dict[str, Any]], shard_bytes: int) -> list[list[str]]:
    """Clips into shards, in clip-table order, by their latents' size in float32 bytes: one cut for every kind (each
    clip's frames are decoded once for all of them), a function of the clips alone, whichever kinds run together."""
    ids = [record["id"] for record in records]
    return pack_shards(ids, [int(torch.Size(latent_shape(record)).numel()) * 4 for record in records], 1,
                       shard_bytes)


def latent_shape(record: dict[str, Any]) -> list[int]:
    """The clip's latent shape as its record gives it: (cameras, C, F, h, w)."""
    tensors = record.get("tensors") or {}
    entry = tensors.get("mean") or tensors.get("sample") or next(iter(tensors.values()), {})
    return list(entry.get("shape") or [])


def absolute_spec(spec: str | None) -> str:
    """A local spec with its path made absolute (recorded: verify --reencode loads it from anywhere)."""
    from pathlib import Path

    kind, _, location = str(spec).partition(":")
    return f"{kind}:{Path(location).expanduser().absolute()}"


__all__ = ["ConditionRequest", "clip_inputs", "condition_fingerprint", "image_fingerprint",
           "set_generation", "shard_cut"]
