"""LTX-2 (Lightricks): diffusers' AutoencoderKLLTX2Video, untiled (use_tiling and use_framewise_encoding False), as its
trainer (ltx-trainer process_videos.py) encodes."""

from __future__ import annotations

from vaecache.models.base import Family, ReferenceEncode

VAE_CLASS = "AutoencoderKLLTX2Video"
UNTILED = ReferenceEncode("untiled", "diffusers' encode with its tiling off",
                          ('diffusers 0.42.1 autoencoder_kl_ltx2.py:1169-1173; Lightricks/LTX-2 400fd31 ltx-trainer '
                          'scripts/process_videos.py'))

FAMILY = Family("ltx-2", "LTX-2", (VAE_CLASS,), UNTILED, default_for=(VAE_CLASS,))

__all__ = ["FAMILY", "UNTILED", "VAE_CLASS"]
