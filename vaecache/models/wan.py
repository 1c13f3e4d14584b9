"""Wan (Wan 2.1, and Wan 2.2: its A14B models on Wan 2.1's VAE, TI2V-5B on its own): diffusers' AutoencoderKLWan.
Its encode is causal in time by construction (the first frame alone, then 4-frame chunks through a feature cache);
its trainers run it untiled (musubi-tuner wan/modules/vae.py WanVAE.encode; diffusers' pipelines)."""

from __future__ import annotations

from vaecache.models.base import Family, ReferenceEncode

VAE_CLASS = "AutoencoderKLWan"
UNTILED = ReferenceEncode("untiled", "diffusers' encode with its tiling off",
                          "musubi-tuner 30c658c wan_cache_latents.py and wan/modules/vae.py (WanVAE.encode, no "
                          "tiling); diffusers 0.42.1 autoencoder_kl_wan.py _encode")

FAMILY = Family("wan", "Wan", (VAE_CLASS,), UNTILED, default_for=(VAE_CLASS,))

__all__ = ["FAMILY", "UNTILED", "VAE_CLASS"]
