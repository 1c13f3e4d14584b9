"""CogVideoX (Zhipu AI): diffusers' AutoencoderKLCogVideoX, whose encode runs frames in batches of 8 through its causal
cache (that is the model, not a tiling), untiled as diffusers' CogVideoX pipelines and finetrainers run it."""

from __future__ import annotations

from vaecache.models.base import Family, ReferenceEncode

VAE_CLASS = "AutoencoderKLCogVideoX"
UNTILED = ReferenceEncode("untiled", "diffusers' encode with its tiling off",
                          ('diffusers 0.42.1 autoencoder_kl_cogvideox.py _encode (num_sample_frames_batch_size 8, '
                          'use_tiling False)'))

FAMILY = Family("cogvideox", "CogVideoX", (VAE_CLASS,), UNTILED, default_for=(VAE_CLASS,))

__all__ = ["FAMILY", "UNTILED", "VAE_CLASS"]
