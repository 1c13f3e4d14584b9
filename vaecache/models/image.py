"""SD-style image VAEs (Stable Diffusion 1.x, SDXL, SD3, Flux): diffusers' AutoencoderKL applied to every frame,
untiled."""

from __future__ import annotations

from vaecache.models.base import Family, ReferenceEncode

VAE_CLASS = "AutoencoderKL"
UNTILED = ReferenceEncode("untiled", "diffusers' encode with its tiling off",
                          'diffusers 0.42.1 autoencoder_kl.py _encode (use_tiling False)')

FAMILY = Family("image", "SD-style image VAE", (VAE_CLASS,), UNTILED, default_for=(VAE_CLASS,))

__all__ = ["FAMILY", "UNTILED", "VAE_CLASS"]
