"""HunyuanVideo 1.5 (Tencent): diffusers' AutoencoderKLHunyuanVideo15, untiled as its trainers run it (musubi-tuner
hv_1_5_cache_latents.py:41-44, vae.encode(...)[0].mode(), tiling off by default)."""

from __future__ import annotations

from typing import Any, Mapping

from vaecache.errors import VaeSpecError
from vaecache.models.base import (
    ConditionPipeline,
    Family,
    ReferenceEncode,
    SingleFileLayout,
    VaeClass,
    scale_normalization,
)
from vaecache.models.rules import FrameRule

VAE_CLASS = "AutoencoderKLHunyuanVideo15"


def frame_rule(config: Mapping[str, Any]) -> FrameRule:
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


VAE = VaeClass(VAE_CLASS, frame_rule, "latent_channels", scale_normalization,
               one_view_per_forward="diffusers' HunyuanVideo15 causal attention (autoencoder_kl_hunyuanvideo15.py, "
                                    "0.42) builds its mask for a batch it cannot broadcast: a forward of 2 or more "
                                    "views fails")
RELEASE_FILE = SingleFileLayout(
    "HunyuanVideo 1.5's release VAE", lambda found, keys, shapes: "encoder.down.0.block.0.norm1.gamma" in found,
    refusal="a HunyuanVideo 1.5 VAE in its release layout (tencent/HunyuanVideo-1.5): diffusers has no single-file "
            "loader for it; convert it with diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py and pass --vae "
            "diffusers:FOLDER")
"""Its RMS norms' `gamma` tell it from an SD VAE's layout."""
I2V = ConditionPipeline("hunyuanvideo-1.5",
                        "diffusers HunyuanVideo15ImageToVideoPipeline.prepare_cond_latents_and_mask "
                        "(pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5_image2video.py)", ("first-frame",))
UNTILED = ReferenceEncode("untiled", "diffusers' encode with its tiling off",
                          ('musubi-tuner 30c658c hv_1_5_cache_latents.py:41-44; diffusers 0.42.1 '
                          'autoencoder_kl_hunyuanvideo15.py _encode'))

FAMILY = Family("hunyuanvideo-1.5", "HunyuanVideo 1.5", (VAE_CLASS,), UNTILED, default_for=(VAE_CLASS,),
                vaes=(VAE,), single_files=(RELEASE_FILE,), musubi_arch="hv15",
                conditions=(I2V,))

__all__ = ["FAMILY", "UNTILED", "VAE", "VAE_CLASS", "frame_rule"]
