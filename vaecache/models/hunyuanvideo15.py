"""HunyuanVideo 1.5 (Tencent): diffusers' AutoencoderKLHunyuanVideo15, untiled as its trainers run it (musubi-tuner
hv_1_5_cache_latents.py:41-44, vae.encode(...)[0].mode(), tiling off by default)."""

from __future__ import annotations

from vaecache.models.base import Family, ReferenceEncode

VAE_CLASS = "AutoencoderKLHunyuanVideo15"
UNTILED = ReferenceEncode("untiled", "diffusers' encode with its tiling off",
                          ('musubi-tuner 30c658c hv_1_5_cache_latents.py:41-44; diffusers 0.42.1 '
                          'autoencoder_kl_hunyuanvideo15.py _encode'))

FAMILY = Family("hunyuanvideo-1.5", "HunyuanVideo 1.5", (VAE_CLASS,), UNTILED, default_for=(VAE_CLASS,))

__all__ = ["FAMILY", "UNTILED", "VAE_CLASS"]
