"""LTX-2's audio VAE (`AutoencoderKLLTX2Audio`) from its release file (`--audio-vae PATH.safetensors`: the file
vaecache.models._ltx2_file reads the video VAE of, whose `audio_vae.*` tensors are the audio VAE): diffusers'
`convert_ltx2_audio_vae_to_diffusers` (the `audio_vae.` prefix and the statistics' names; its layers keep ltx-core's
names). The config is the file's own (`config.audio_vae`: `model.params.ddconfig`, `preprocessing.stft`, read with
ltx-core's defaults as `AudioEncoderConfigurator.from_metadata` reads them, ltx_core/model/audio_vae/
model_configurator.py), else the release's (diffusers' scripts/convert_ltx2_to_diffusers.py
`get_ltx2_audio_vae_config`, the same for 2.0, 2.3 and 2.5); the STFT size (`preprocessing.stft.filter_length`) goes
to the mel."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from vaecache.errors import VaeSpecError, first_line
from vaecache.models._ltx2_file import AUDIO_PREFIX, DROPPED_STATISTICS, file_metadata_config

AUDIO_RELEASE_CONFIG = "ltx-2_audio_vae.json"
LTX_CORE_AUDIO_DEFAULTS = {"ch": 128, "out_ch": 2, "ch_mult": [1, 2, 4], "num_res_blocks": 2,
                           "attn_resolutions": [8, 16, 32], "resolution": 256, "z_channels": 8, "double_z": True,
                           "dropout": 0.0, "in_channels": 2, "mid_block_add_attention": True, "norm_type": "pixel",
                           "causality_axis": "height"}
"""ltx-core's defaults for a key its checkpoint's ddconfig leaves out (AudioEncoderConfigurator.from_metadata)."""


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
    check_complete(path, "AutoencoderKLLTX2Audio", source, module.state_dict(), tensors, kept,
                   ("per_channel_statistics.",))
    module.load_state_dict(kept, strict=True)
    check_finite(module.state_dict(), str(path))
    return AudioFile(module.to(torch.float32).eval(), n_fft, file_sha256(path), source)


__all__ = ["AudioFile", "audio_config_from_metadata", "load_audio_single_file"]
