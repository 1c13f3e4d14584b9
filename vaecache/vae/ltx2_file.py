"""LTX-2's checkpoint file, the way its authors release it (`ltx-2-19b-dev.safetensors`, `ltx-2.3-22b-dev.safetensors`:
the transformer, `vae.*` the video VAE, `audio_vae.*` the audio VAE, the vocoder and the text connectors in one
safetensors file whose `__metadata__["config"]` holds each part's config, as ltx-core's model configurators read it),
or its video VAE alone: both VAEs read from it into diffusers' classes, strictly.

- **Video VAE** (`AutoencoderKLLTX2Video`): ltx-core's names in diffusers' by the renaming of diffusers'
  `scripts/convert_ltx2_to_diffusers.py` (`LTX_2_3_VIDEO_VAE_RENAME_DICT`: 2.0's, plus 2.3's fourth decoder level;
  diffusers 0.42's single-file `convert_ltx2_vae_to_diffusers` has 2.0's only, so a 2.3 decoder would be left
  unmapped), the per-channel statistics' channel index and mean of stds dropped (`LTX_2_0_VAE_SPECIAL_KEYS_REMAP`).
  The config is the release's (`get_ltx2_video_vae_config`, shipped in vaecache/vae/configs/), told from the
  encoder's widths, or --vae-config.
- **Audio VAE** (`AutoencoderKLLTX2Audio`): diffusers' `convert_ltx2_audio_vae_to_diffusers` (the `audio_vae.` prefix
  and the statistics' names; its layers keep ltx-core's names). The config is the file's own
  (`config.audio_vae`: `model.params.ddconfig`, `preprocessing.stft`, read with ltx-core's defaults as
  `AudioEncoderConfigurator.from_metadata` reads them, ltx_core/model/audio_vae/model_configurator.py), else the
  release's (`get_ltx2_audio_vae_config`, the same for 2.0, 2.3 and 2.5); the STFT size (`preprocessing.stft.
  filter_length`) goes to the mel.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

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
    found = shapes.get(f"{VIDEO_PREFIX}{key}") or shapes.get(key)
    return tuple(found) if found else None


def video_config_name(shapes: dict[str, Any]) -> str | None:
    """The LTX-2 release whose video VAE the shapes are, or None. LTX-2.0's VAE has LTX-Video 0.9.5's encoder (its
    widths end at 2048) and a decoder of three levels without timestep conditioning (every LTX-Video VAE from 0.9.1
    on has it: `decoder.timestep_scale_multiplier`); LTX-2.3's encoder ends at 1024 and its decoder has a fourth
    level (`decoder.up_blocks.8`), which no LTX-Video VAE has with that encoder."""
    last = _shape(shapes, "encoder.conv_out.conv.weight")
    if not last or len(last) < 2:
        return None
    fourth = _shape(shapes, "decoder.up_blocks.8.res_blocks.0.conv1.conv.weight") is not None
    conditioned = _shape(shapes, "decoder.timestep_scale_multiplier") is not None or \
        f"{VIDEO_PREFIX}decoder.timestep_scale_multiplier" in shapes
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


AUDIO_RELEASE_CONFIG = "ltx-2_audio_vae.json"
LTX_CORE_AUDIO_DEFAULTS = {"ch": 128, "out_ch": 2, "ch_mult": [1, 2, 4], "num_res_blocks": 2,
                           "attn_resolutions": [8, 16, 32], "resolution": 256, "z_channels": 8, "double_z": True,
                           "dropout": 0.0, "in_channels": 2, "mid_block_add_attention": True, "norm_type": "pixel",
                           "causality_axis": "height"}
"""ltx-core's defaults for a key its checkpoint's ddconfig leaves out (AudioEncoderConfigurator.from_metadata)."""


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


def audio_config_from_metadata(audio: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """(AutoencoderKLLTX2Audio's config, the STFT size) of a checkpoint's `config.audio_vae`, read as ltx-core reads
    it."""
    params = (audio.get("model") or {}).get("params") or {}
    dd = {**LTX_CORE_AUDIO_DEFAULTS, **(params.get("ddconfig") or {})}
    preprocessing = audio.get("preprocessing") or {}
    stft, mel = preprocessing.get("stft") or {}, preprocessing.get("mel") or {}
    mel_bins = dd.get("mel_bins") or mel.get("n_mel_channels") or (audio.get("variables") or {}).get("mel_bins")
    attention = dd.get("attn_resolutions")
    config = {"_class_name": "AutoencoderKLLTX2Audio", "base_channels": dd["ch"], "output_channels": dd["out_ch"],
              "ch_mult": list(dd["ch_mult"]), "num_res_blocks": dd["num_res_blocks"],
              "attn_resolutions": sorted(attention) if attention else None, "in_channels": dd["in_channels"],
              "resolution": dd["resolution"], "latent_channels": dd["z_channels"], "norm_type": dd["norm_type"],
              "causality_axis": dd["causality_axis"], "dropout": dd["dropout"],
              "mid_block_add_attention": dd["mid_block_add_attention"],
              "sample_rate": params.get("sampling_rate", 16000), "mel_hop_length": stft.get("hop_length", 160),
              "is_causal": stft.get("causal", True), "mel_bins": mel_bins, "double_z": dd["double_z"]}
    return config, int(stft.get("filter_length", 1024))


class AudioFile(NamedTuple):
    module: Any
    n_fft: int
    sha256: str
    config_source: str


def load_audio_single_file(path: Path) -> AudioFile:
    """The audio VAE of an LTX-2 checkpoint file, strictly: each weight of the module its config builds from the
    file, every `audio_vae.` tensor used (the statistics' channel index and mean of stds aside), finite."""
    import diffusers
    import torch
    from diffusers.loaders.single_file_utils import convert_ltx2_audio_vae_to_diffusers
    from safetensors import safe_open

    from vaecache.vae.single_file import CONFIGS, SAFE_SUFFIXES, check_complete, file_sha256
    from vaecache.weights import check_finite, safetensors_header

    if path.suffix.lower() not in SAFE_SUFFIXES:
        raise VaeSpecError(f"{path}: an LTX-2 checkpoint file is read as safetensors only")
    header = safetensors_header(path)
    keys = [key for key in header if key.startswith(AUDIO_PREFIX)]
    if not keys:
        raise VaeSpecError(f"{path}: no audio_vae.* tensors: not an LTX-2 checkpoint holding its audio "
                           "VAE (a diffusers folder is --audio-vae diffusers:FOLDER)")
    metadata = (file_metadata_config(header, path) or {}).get("audio_vae")
    if isinstance(metadata, dict) and metadata:
        config, n_fft = audio_config_from_metadata(metadata)
        source = "the file's metadata (config.audio_vae)"
    else:
        config, n_fft = json.loads((CONFIGS / AUDIO_RELEASE_CONFIG).read_text()), 1024
        source = f"the shipped config {AUDIO_RELEASE_CONFIG} (the file has no config.audio_vae metadata)"
    try:
        with torch.random.fork_rng(devices=[]):
            module = diffusers.AutoencoderKLLTX2Audio.from_config(dict(config))
    except Exception as exc:  # noqa: BLE001  # diffusers raises many kinds for a config it cannot build
        raise VaeSpecError(f"{path}: {source} does not build an AutoencoderKLLTX2Audio "
                           f"({first_line(exc, 200)})") from None
    try:
        with safe_open(str(path), framework="pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in keys}
    except Exception as exc:  # noqa: BLE001  # safetensors raises its own kinds for a damaged file
        raise VaeSpecError(f"{path}: cannot read its tensors ({first_line(exc, 200)})") from None
    converted = convert_ltx2_audio_vae_to_diffusers(dict(tensors))
    kept = {key: value for key, value in converted.items()
            if not any(dropped in key for dropped in DROPPED_STATISTICS)}
    check_complete(path, "AutoencoderKLLTX2Audio", source, module.state_dict(), tensors, kept)
    module.load_state_dict(kept, strict=True)
    check_finite(module.state_dict(), str(path))
    return AudioFile(module.to(torch.float32).eval(), n_fft, file_sha256(path), source)


__all__ = ["AudioFile", "convert_ltx2_video_vae", "is_ltx2_checkpoint", "load_audio_single_file",
           "video_config_name"]
