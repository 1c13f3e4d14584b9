"""The VAE configurations and the test video the GPU scripts share (scripts/gpu_check.py,
scripts/bench_wan_encoder.py): each family's published config (real compute and memory, random weights), a tiny
one of the same architecture for --smoke, and a smooth seeded random clip."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SEED = 20261126
WAN21_CONFIG = json.loads((Path(__file__).resolve().parents[1] / "vaecache" / "models" / "configs" /
                           "wan2.1_vae.json").read_text())
# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json as diffusers' scripts/convert_wan_to_diffusers.py writes it
# (vae22_diffusers_config); the 48 latents_mean/std are normalization constants that change no compute, so they are
# zeros and ones here.
WAN22_TI2V_CONFIG = {"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4],
                     "num_res_blocks": 2, "attn_scales": [], "temperal_downsample": [False, True, True],
                     "dropout": 0.0, "is_residual": True, "in_channels": 12, "out_channels": 12, "patch_size": 2,
                     "scale_factor_spatial": 16, "scale_factor_temporal": 4,
                     "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48}
PUBLISHED: dict[str, tuple[str, dict[str, Any]]] = {
    "wan2.1": ("AutoencoderKLWan", {k: v for k, v in WAN21_CONFIG.items() if not k.startswith("_")}),
    "wan2.2-ti2v": ("AutoencoderKLWan", WAN22_TI2V_CONFIG),
    # The class defaults of the pinned diffusers are the published configs: hunyuanvideo-community/HunyuanVideo
    # vae/config.json, Lightricks/LTX-Video 0.9.0/0.9.1 vae/config.json, THUDM/CogVideoX-2b vae/config.json.
    "hunyuanvideo": ("AutoencoderKLHunyuanVideo", {}),
    "ltx-video": ("AutoencoderKLLTXVideo", {}),
    "cogvideox": ("AutoencoderKLCogVideoX", {}),
}
TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "wan2.1": ("AutoencoderKLWan", dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                                        temperal_downsample=[False, True])),
    "wan2.2-ti2v": ("AutoencoderKLWan", dict(base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 2, 2],
                                             num_res_blocks=1, temperal_downsample=[False, True], is_residual=True,
                                             in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=8,
                                             scale_factor_temporal=2, latents_mean=[0.0] * 4,
                                             latents_std=[1.0] * 4)),
    "hunyuanvideo": ("AutoencoderKLHunyuanVideo", dict(
        block_out_channels=(8, 8, 8), down_block_types=("HunyuanVideoDownBlock3D",) * 3,
        up_block_types=("HunyuanVideoUpBlock3D",) * 3, latent_channels=4, layers_per_block=1, norm_num_groups=4,
        spatial_compression_ratio=4, temporal_compression_ratio=4)),
    "ltx-video": ("AutoencoderKLLTXVideo", dict(
        latent_channels=8, block_out_channels=(8, 16, 32, 64), decoder_block_out_channels=(8, 16, 32, 64),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1), patch_size=2)),
    "cogvideox": ("AutoencoderKLCogVideoX", dict(
        block_out_channels=(8, 8, 8), down_block_types=("CogVideoXDownBlock3D",) * 3,
        up_block_types=("CogVideoXUpBlock3D",) * 3, latent_channels=4, layers_per_block=1, norm_num_groups=4,
        temporal_compression_ratio=4)),
}


def smooth_clip(views: int, frames: int, height: int, width: int) -> Any:
    """(views, 3, frames, height, width) in [-1, 1] on the CPU: a seeded random field at 1/16 resolution,
    upsampled (trilinear), plus a little noise. The same for the same arguments in every process."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(SEED)
    coarse = torch.rand(views, 3, max(2, frames // 4), max(2, height // 16), max(2, width // 16), generator=gen)
    field = F.interpolate(coarse, size=(frames, height, width), mode="trilinear", align_corners=False)
    noise = torch.rand(views, 3, frames, height, width, generator=gen)
    return (0.9 * field + 0.1 * noise) * 2 - 1
