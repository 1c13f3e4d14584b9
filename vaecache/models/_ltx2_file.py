"""LTX-2's checkpoint file, the way its authors release it (`ltx-2-19b-dev.safetensors`, `ltx-2.3-22b-dev.safetensors`:
the transformer, `vae.*` the video VAE, `audio_vae.*` the audio VAE, the vocoder and the text connectors in one
safetensors file whose `__metadata__["config"]` holds each part's config, as ltx-core's model configurators read it),
or its video VAE alone, read into diffusers' classes, strictly.

- **Video VAE** (`AutoencoderKLLTX2Video`): ltx-core's names in diffusers' by the renaming of diffusers'
  `scripts/convert_ltx2_to_diffusers.py` (`LTX_2_3_VIDEO_VAE_RENAME_DICT`: 2.0's, plus 2.3's fourth decoder level;
  diffusers 0.42's single-file `convert_ltx2_vae_to_diffusers` has 2.0's only, so a 2.3 decoder would be left
  unmapped), the per-channel statistics' channel index and mean of stds dropped (`LTX_2_0_VAE_SPECIAL_KEYS_REMAP`).
  The config is the release's (`get_ltx2_video_vae_config`, shipped in vaecache/models/configs/), told from the
  encoder's widths, or --vae-config.
- **Audio VAE** (`AutoencoderKLLTX2Audio`): vaecache.audio.release_file, from the same file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vaecache.errors import VaeSpecError, first_line

VIDEO_RENAMES = {
    "down_blocks.0": "down_blocks.0",
    "down_blocks.1": "down_blocks.0.downsamplers.0",
    "down_blocks.2": "down_blocks.1",
    "down_blocks.3": "down_blocks.1.downsamplers.0",
    "down_blocks.4": "down_blocks.2",
    "down_blocks.5": "down_blocks.2.downsamplers.0",
    "down_blocks.6": "down_blocks.3",
    "down_blocks.7": "down_blocks.3.downsamplers.0",
    "down_blocks.8": "mid_block",
    "up_blocks.0": "mid_block",
    "up_blocks.1": "up_blocks.0.upsamplers.0",
    "up_blocks.2": "up_blocks.0",
    "up_blocks.3": "up_blocks.1.upsamplers.0",
    "up_blocks.4": "up_blocks.1",
    "up_blocks.5": "up_blocks.2.upsamplers.0",
    "up_blocks.6": "up_blocks.2",
    "last_time_embedder": "time_embedder",
    "last_scale_shift_table": "scale_shift_table",
    "res_blocks": "resnets",
    "per_channel_statistics.mean-of-means": "latents_mean",
    "per_channel_statistics.std-of-means": "latents_std",
    "up_blocks.7": "up_blocks.3.upsamplers.0",
    "up_blocks.8": "up_blocks.3",
}
"""diffusers' scripts/convert_ltx2_to_diffusers.py LTX_2_3_VIDEO_VAE_RENAME_DICT, in its order (each rule is applied
to the result of the ones before)."""
DROPPED_STATISTICS = ("per_channel_statistics.channel", "per_channel_statistics.mean-of-stds")
VIDEO_PREFIX, AUDIO_PREFIX = "vae.", "audio_vae."


def _shape(shapes: dict[str, Any], key: str) -> tuple[int, ...] | None:
    """The shape of `key` under `vae.` or bare, or None where the file has neither (a 0-dim tensor's shape is ())."""
    found = shapes.get(f"{VIDEO_PREFIX}{key}")
    found = shapes.get(key) if found is None else found
    return tuple(found) if found is not None else None


def video_config_name(shapes: dict[str, Any]) -> str | None:
    """The LTX-2 release whose video VAE the shapes are, or None. LTX-2.0's VAE has LTX-Video 0.9.5's encoder (its
    widths end at 2048) and a decoder of three levels without timestep conditioning (every LTX-Video VAE from 0.9.1
    on has it: `decoder.timestep_scale_multiplier`); LTX-2.3's encoder ends at 1024 and its decoder has a fourth
    level (`decoder.up_blocks.8`), which no LTX-Video VAE has with that encoder."""
    last = _shape(shapes, "encoder.conv_out.conv.weight")
    if not last or len(last) < 2:
        return None
    fourth = _shape(shapes, "decoder.up_blocks.8.res_blocks.0.conv1.conv.weight") is not None
    conditioned = _shape(shapes, "decoder.timestep_scale_multiplier") is not None
    if last[1] == 2048 and not fourth and not conditioned and \
            _shape(shapes, "decoder.up_blocks.6.res_blocks.0.conv1.conv.weight") is not None:
        return "ltx-2.0_vae.json"
    if last[1] == 1024 and fourth and not conditioned:
        return "ltx-2.3_vae.json"
    return None


def is_ltx2_checkpoint(keys: list[str], shapes: dict[str, Any]) -> bool:
    """An LTX-2 checkpoint rather than an LTX-Video one (both keep `vae.per_channel_statistics`): a whole LTX-2 file
    holds its audio VAE beside (`audio_vae.*`); its video VAE alone has a released LTX-2 VAE's shapes
    (video_config_name). Another size of LTX-2 video VAE alone is told by --vae-config's class."""
    return any(key.startswith(AUDIO_PREFIX) for key in keys) or video_config_name(shapes) is not None


def convert_ltx2_video_vae(config: dict[str, Any], checkpoint: dict[str, Any]) -> dict[str, Any]:
    """LTX-2's video VAE tensors in AutoencoderKLLTX2Video's names (VIDEO_RENAMES), the dropped statistics left out.
    `config` is unused (the signature of diffusers' converters)."""
    del config
    converted: dict[str, Any] = {}
    for key, value in checkpoint.items():
        new = key.removeprefix(VIDEO_PREFIX)
        if any(dropped in new for dropped in DROPPED_STATISTICS):
            continue
        for old, renamed in VIDEO_RENAMES.items():
            new = new.replace(old, renamed)
        converted[new] = value
    return converted


def file_metadata_config(header: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """The checkpoint's `__metadata__["config"]` parsed (ltx-core's per-part configs), or None where it has none."""
    text = (header.get("__metadata__") or {}).get("config")
    if text is None:
        return None
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise VaeSpecError(f"{path}: its metadata's config is not JSON ({first_line(exc, 120)})") from None
    return config if isinstance(config, dict) else None


__all__ = ["AUDIO_PREFIX", "convert_ltx2_video_vae", "file_metadata_config", "is_ltx2_checkpoint",
           "video_config_name"]
