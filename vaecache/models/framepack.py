"""FramePack (lllyasviel): trains on HunyuanVideo's VAE latents, encoded whole as HunyuanVideo's trainers encode them.

musubi-tuner's FramePack caching (commit 30c658c, `fpack_cache_latents.py:85`: `hunyuan.vae_encode`, then
`frame_pack/hunyuan.py:131-134`) loads HunyuanVideo's AutoencoderKLCausal3D with tiling off unless `--vae_tiling`
(`frame_pack/framepack_utils.py:28-60`): the latents are HunyuanVideo's untiled ones, cut into sections at export."""

from __future__ import annotations

from vaecache.models.base import Family
from vaecache.models.hunyuanvideo import VAE_CLASS, WHOLE

FAMILY = Family("framepack", "FramePack", (VAE_CLASS,), WHOLE, musubi_arch="fp")

__all__ = ["FAMILY"]
