"""What vaecache knows about each diffusers VAE class: its frame rule (read from the config), the key
holding its latent channels, its latent normalization constants, and its fp16 policy.

Each rule mirrors the family's encoder in diffusers (models/autoencoders/autoencoder_kl_*.py), so a
config with fewer or other down blocks than the released model still gets the right factors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from vaecache.errors import VaeSpecError
from vaecache.vae.rules import FrameRule

if TYPE_CHECKING:
    import torch


def _log2(value: Any, what: str) -> int:
    number = int(value)
    if number < 1 or number & (number - 1):
        raise VaeSpecError(f"{what} must be a power of two, got {value!r}")
    return number.bit_length() - 1


def _wan_rule(config: dict[str, Any]) -> FrameRule:
    # WanEncoder3d downsamples once per dim_mult step; temperal_downsample says which steps also halve
    # time. _encode feeds the first frame alone, then chunks of 4 frames: 1 + 4k frames.
    levels = len(config.get("dim_mult", [1, 2, 4, 4])) - 1
    temporal = 2 ** sum(bool(x) for x in config.get("temperal_downsample", [False, True, True])[:levels])
    if temporal > 4:
        raise VaeSpecError(f"AutoencoderKLWan with temporal compression {temporal} is not supported "
                           "(diffusers encodes chunks of 4 frames)")
    spatial = 2 ** levels * int(config.get("patch_size") or 1)
    return FrameRule(temporal, spatial, causal=True, frame_step=4, label="AutoencoderKLWan")


def _cogvideox_rule(config: dict[str, Any]) -> FrameRule:
    # CogVideoXEncoder3D: block i < log2(temporal_compression_ratio) also halves time, and only
    # blocks that downsample at all (every block but the last) can. _encode runs frames in batches of
    # 8 with the odd first frame kept alone: 1 + 8k frames (CogVideoX trains on 49 = 1 + 8*6).
    blocks = len(config.get("block_out_channels", (128, 256, 256, 512)))
    levels = min(_log2(config.get("temporal_compression_ratio", 4), "temporal_compression_ratio"), blocks - 1)
    temporal = 2 ** levels
    if 8 % temporal:
        raise VaeSpecError(f"AutoencoderKLCogVideoX with temporal compression {temporal} is not supported "
                           "(diffusers encodes batches of 8 frames)")
    return FrameRule(temporal, 2 ** (blocks - 1), causal=True, frame_step=8, label="AutoencoderKLCogVideoX")


def _hunyuan_rule(config: dict[str, Any]) -> FrameRule:
    # HunyuanVideoEncoder3D: block i halves space while i < log2(spatial ratio); time is halved by the
    # last log2(4) non-final blocks (ratio 4) or the first log2(8) blocks (ratio 8). Causal: 1 + tk frames.
    blocks = len(config.get("block_out_channels", (128, 256, 512, 512)))
    spatial_levels = _log2(config.get("spatial_compression_ratio", 8), "spatial_compression_ratio")
    ratio = int(config.get("temporal_compression_ratio", 4))
    time_levels = _log2(ratio, "temporal_compression_ratio")
    if ratio == 4:
        temporal = sum(1 for i in range(blocks) if blocks - 1 - time_levels <= i < blocks - 1)
    elif ratio == 8:
        temporal = sum(1 for i in range(blocks) if i < time_levels)
    else:
        raise VaeSpecError(f"AutoencoderKLHunyuanVideo temporal_compression_ratio {ratio} is not supported (4 or 8)")
    spatial = sum(1 for i in range(blocks) if i < spatial_levels)
    return FrameRule(2 ** temporal, 2 ** spatial, causal=True, label="AutoencoderKLHunyuanVideo")


def _hunyuan15_rule(config: dict[str, Any]) -> FrameRule:
    # HunyuanVideo15Encoder3D builds log2(spatial_compression_ratio) spatial downsamples, the last
    # log2(temporal_compression_ratio) of them temporal too (causal: 1 + tk frames map to 1 + k); HunyuanVideo 1.5:
    # 16x space, 4x time, read from the config as the encoder reads them.
    temporal = int(config.get("temporal_compression_ratio", 4))
    spatial = int(config.get("spatial_compression_ratio", 16))
    blocks = len(config.get("block_out_channels", (128, 256, 512, 1024, 1024)))
    if spatial < 1 or spatial & (spatial - 1) or temporal < 1 or temporal & (temporal - 1) or temporal > spatial:
        raise VaeSpecError(f"AutoencoderKLHunyuanVideo15 compression {spatial}x space, {temporal}x time: both must be "
                           "powers of 2, time at most space")
    widest, latent = int(config.get("block_out_channels", (1024,))[-1]), int(config.get("latent_channels", 32))
    if widest < 2 * latent:  # the encoder's output groups its last block's channels by 2 x latent_channels
        raise VaeSpecError(f"AutoencoderKLHunyuanVideo15: its last block's {widest} channels cannot hold "
                           f"2 x {latent} latent channels (the encoder fails on every input)")
    if spatial.bit_length() - 1 > blocks:
        raise VaeSpecError(f"AutoencoderKLHunyuanVideo15 spatial_compression_ratio {spatial} needs "
                           f"{spatial.bit_length() - 1} encoder blocks, the config has {blocks}")
    return FrameRule(temporal, spatial, causal=True, label="AutoencoderKLHunyuanVideo15")


def _ltx_rule(config: dict[str, Any]) -> FrameRule:
    # LTXVideoEncoder3d: patchify by patch_size (space) and patch_size_t (time), then each scaling
    # block halves space and/or time: LTXVideoDownBlock3D both; LTXVideo095DownBlock3D per
    # downsample_type (conv/spatiotemporal both, spatial, temporal). Strided causal convs map 1 + 2k
    # frames to 1 + k, so the clip takes 1 + temporal_factor*k frames (LTX-Video: 32x spatial, 8x time).
    if int(config.get("patch_size_t", 1)) != 1:
        raise VaeSpecError("AutoencoderKLLTXVideo with patch_size_t != 1 is not supported")
    block_types = list(config.get("down_block_types", ["LTXVideoDownBlock3D"] * 4))
    is_095 = bool(block_types) and block_types[-1] == "LTXVideo095DownBlock3D"
    count = len(config.get("block_out_channels", (128, 256, 512, 512))) - (1 if is_095 else 0)
    scaling = list(config.get("spatio_temporal_scaling", (True, True, True, False)))
    kinds = list(config.get("downsample_type", ["conv"] * count))
    spatial = temporal = 0
    for i in range(count):
        if not scaling[i]:
            continue
        block = block_types[min(i, len(block_types) - 1)]
        kind = kinds[min(i, len(kinds) - 1)] if block == "LTXVideo095DownBlock3D" else "conv"
        spatial += kind in ("conv", "spatiotemporal", "spatial")
        temporal += kind in ("conv", "spatiotemporal", "temporal")
    patch = int(config.get("patch_size", 4))
    return FrameRule(2 ** temporal, patch * 2 ** spatial, causal=True, label="AutoencoderKLLTXVideo")


def _ltx2_rule(config: dict[str, Any]) -> FrameRule:
    # LTX2VideoEncoder3d: patchify by patch_size (space) and patch_size_t (time), then each LTX2VideoDownBlock3D with
    # spatio_temporal_scaling halves space and/or time by its downsample_type (conv and spatiotemporal both, spatial,
    # temporal): LTX-2's (spatial, temporal, spatiotemporal, spatiotemporal) give 32x space and 8x time.
    if int(config.get("patch_size_t", 1)) != 1:
        raise VaeSpecError("AutoencoderKLLTX2Video with patch_size_t != 1 is not supported")
    count = len(config.get("block_out_channels", (256, 512, 1024, 2048)))
    scaling = config.get("spatio_temporal_scaling", (True,) * count)
    scaling = [scaling] * count if isinstance(scaling, bool) else list(scaling)
    kinds = list(config.get("downsample_type", ("spatial", "temporal", "spatiotemporal", "spatiotemporal")))
    spatial = sum(1 for i in range(count) if scaling[i] and kinds[i] in ("conv", "spatiotemporal", "spatial"))
    temporal = sum(1 for i in range(count) if scaling[i] and kinds[i] in ("conv", "spatiotemporal", "temporal"))
    return FrameRule(2 ** temporal, int(config.get("patch_size", 4)) * 2 ** spatial, causal=True,
                     label="AutoencoderKLLTX2Video")


def _image_rule(config: dict[str, Any]) -> FrameRule:
    # Encoder (2D): every block but the last halves space. Frames are encoded one by one: any count.
    return FrameRule(1, 2 ** (len(config.get("block_out_channels", (64,))) - 1), label="AutoencoderKL")


def _config_constants(config: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {key: config[key] for key in keys if config.get(key) is not None}


def _wan_normalization(config: dict[str, Any], module: torch.nn.Module | None) -> dict[str, Any]:
    out = _config_constants(config, ("latents_mean", "latents_std"))
    out["formula"] = "(z - latents_mean) / latents_std"
    return out


def _ltx_normalization(config: dict[str, Any], module: torch.nn.Module | None) -> dict[str, Any]:
    # LTX keeps latents_mean/std as buffers in the weights, not in config.json.
    import torch

    out: dict[str, Any] = {"scaling_factor": config.get("scaling_factor", 1.0)}
    for name in ("latents_mean", "latents_std"):
        buffer = getattr(module, name, None)
        if isinstance(buffer, torch.Tensor):
            out[name] = [float(x) for x in buffer.detach().float().cpu().tolist()]
    out["formula"] = "(z - latents_mean) * scaling_factor / latents_std"
    return out


def _scale_normalization(config: dict[str, Any], module: torch.nn.Module | None) -> dict[str, Any]:
    out = _config_constants(config, ("scaling_factor", "shift_factor", "latents_mean", "latents_std"))
    if config.get("invert_scale_latents"):
        out["invert_scale_latents"] = True  # CogVideoX 1.5 I2V: image latents are divided by scaling_factor
    if "shift_factor" in out:
        out["formula"] = "(z - shift_factor) * scaling_factor"
    elif "latents_mean" in out and "latents_std" in out:
        out["formula"] = "(z - latents_mean) * scaling_factor / latents_std"
    else:
        out["formula"] = "z * scaling_factor"
    return out


@dataclass(frozen=True)
class Family:
    """What vaecache knows about one diffusers VAE class."""

    name: str
    rule: Callable[[dict[str, Any]], FrameRule]
    channels_key: str
    normalization: Callable[[dict[str, Any], torch.nn.Module | None], dict[str, Any]]
    per_frame: bool = False
    fp16: str = "ok"
    """"ok"; "upcast": compute in fp32 when config.force_upcast is set; "refuse"."""
    fp16_reason: str = ""
    one_view_per_forward: str = ""
    """Why the family encodes one view per forward whatever --views-per-forward asks (empty: it batches views)."""


FAMILIES: dict[str, Family] = {
    family.name: family for family in (
        Family("AutoencoderKLWan", _wan_rule, "z_dim", _wan_normalization),
        Family("AutoencoderKLHunyuanVideo", _hunyuan_rule, "latent_channels", _scale_normalization),
        Family("AutoencoderKLHunyuanVideo15", _hunyuan15_rule, "latent_channels", _scale_normalization,
               one_view_per_forward="diffusers' HunyuanVideo15 causal attention (autoencoder_kl_hunyuanvideo15.py, "
                                    "0.42) builds its mask for a batch it cannot broadcast: a forward of 2 or more "
                                    "views fails"),
        Family("AutoencoderKLCogVideoX", _cogvideox_rule, "latent_channels", _scale_normalization, fp16="upcast",
               fp16_reason="CogVideoX models other than 2B were trained in bf16 and give NaNs in fp16 "
                           "(zai-org/CogVideo#559, #637); its config sets force_upcast"),
        Family("AutoencoderKLLTXVideo", _ltx_rule, "latent_channels", _ltx_normalization, fp16="refuse",
               fp16_reason="LTX-Video's VAE gives corrupted output in fp16 (Lightricks/LTX-Video#126); "
                           "use --dtype bf16 (the dtype it was trained in) or fp32"),
        Family("AutoencoderKLLTX2Video", _ltx2_rule, "latent_channels", _ltx_normalization, fp16="refuse",
               fp16_reason="LTX-2's video VAE runs in bf16 or fp32 (its pipeline's dtype); fp16 is untested there: "
                           "use --dtype bf16 or fp32"),
        Family("AutoencoderKL", _image_rule, "latent_channels", _scale_normalization, per_frame=True, fp16="upcast",
               fp16_reason="the SD/SDXL VAEs overflow in fp16, and diffusers' pipelines run them in fp32 when "
                           "config.force_upcast is set"),
    )
}
SUPPORTED = ", ".join(FAMILIES)


__all__ = ["FAMILIES", "SUPPORTED", "Family"]
