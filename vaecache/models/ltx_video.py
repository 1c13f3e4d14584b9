"""LTX-Video (Lightricks): diffusers' AutoencoderKLLTXVideo, untiled (use_tiling and use_framewise_encoding False), as
its trainers run it."""

from __future__ import annotations

from vaecache.models.base import Family, ReferenceEncode

VAE_CLASS = "AutoencoderKLLTXVideo"
UNTILED = ReferenceEncode("untiled", "diffusers' encode with its tiling off",
                          ('diffusers 0.42.1 autoencoder_kl_ltx.py:1163-1167 (use_tiling, use_framewise_encoding '
                          'False)'))

FAMILY = Family("ltx-video", "LTX-Video", (VAE_CLASS,), UNTILED, default_for=(VAE_CLASS,))

__all__ = ["FAMILY", "UNTILED", "VAE_CLASS"]
