"""Qwen-Image (Alibaba Qwen): diffusers' AutoencoderKLQwenImage, Wan 2.1's VAE architecture with its own weights,
encoded untiled.

Its encoder is Wan 2.1's (`QwenImageEncoder3d`, diffusers 0.42.1 `autoencoder_kl_qwenimage.py`): `_encode` feeds the
first frame alone, then chunks of 4 frames through the causal feature cache, so a clip takes 1 + 4k frames (an image
is 1); each dim_mult step halves space, and the steps `temperal_downsample` marks also halve time.

Latents are normalized as `QwenImageImg2ImgPipeline._encode_vae_image` does (`pipeline_qwenimage_img2img.py:242-251`):
`(z - latents_mean) * (1 / latents_std)`, the constants in config.json; vaecache records it as Wan's formula,
`(z - latents_mean) / latents_std`, whose reader (`LatentCache.normalize`) multiplies by the float32 reciprocal as
that pipeline does."""

from __future__ import annotations

from typing import Any, Mapping

from vaecache.errors import VaeSpecError
from vaecache.models.base import Family, ReferenceEncode, VaeClass
from vaecache.models.rules import FrameRule
from vaecache.models.wan import normalization

VAE_CLASS = "AutoencoderKLQwenImage"


def frame_rule(config: Mapping[str, Any]) -> FrameRule:
    levels = len(config.get("dim_mult", [1, 2, 4, 4])) - 1
    temporal = 2 ** sum(bool(x) for x in config.get("temperal_downsample", [False, True, True])[:levels])
    if temporal > 4:
        raise VaeSpecError(f"AutoencoderKLQwenImage with temporal compression {temporal} is not supported "
                           "(diffusers encodes chunks of 4 frames)")
    return FrameRule(temporal, 2 ** levels, causal=True, frame_step=4, label=VAE_CLASS)


VAE = VaeClass(VAE_CLASS, frame_rule, "z_dim", normalization)
UNTILED = ReferenceEncode("untiled", "diffusers' encode with its tiling off",
                          "diffusers 0.42.1 autoencoder_kl_qwenimage.py _encode (use_tiling False); "
                          "pipeline_qwenimage_img2img.py:242-251 (the normalization)")

FAMILY = Family("qwen-image", "Qwen-Image", (VAE_CLASS,), UNTILED, default_for=(VAE_CLASS,), vaes=(VAE,),
                musubi_arch="qi")

__all__ = ["FAMILY", "UNTILED", "VAE", "VAE_CLASS", "frame_rule"]
