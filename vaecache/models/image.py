"""SD-style image VAEs (Stable Diffusion 1.x, SDXL, SD3, Flux): diffusers' AutoencoderKL applied to every frame,
untiled."""

from __future__ import annotations

from typing import Any, Mapping

from vaecache.models.base import Family, ReferenceEncode, VaeClass, scale_normalization
from vaecache.models.rules import FrameRule

VAE_CLASS = "AutoencoderKL"


def frame_rule(config: Mapping[str, Any]) -> FrameRule:
    # Encoder (2D): every block but the last halves space. Frames are encoded one by one: any count.
    return FrameRule(1, 2 ** (len(config.get("block_out_channels", (64,))) - 1), label="AutoencoderKL")


VAE = VaeClass(VAE_CLASS, frame_rule, "latent_channels", scale_normalization, per_frame=True, fp16="upcast",
               fp16_reason="the SD/SDXL VAEs overflow in fp16, and diffusers' pipelines run them in fp32 when "
                           "config.force_upcast is set")
UNTILED = ReferenceEncode("untiled", "diffusers' encode with its tiling off",
                          'diffusers 0.42.1 autoencoder_kl.py _encode (use_tiling False)')

FAMILY = Family("image", "SD-style image VAE", (VAE_CLASS,), UNTILED, default_for=(VAE_CLASS,), vaes=(VAE,))

__all__ = ["FAMILY", "UNTILED", "VAE", "VAE_CLASS", "frame_rule"]
