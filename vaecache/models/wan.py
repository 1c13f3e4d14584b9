"""Wan (Wan 2.1, and Wan 2.2: its A14B models on Wan 2.1's VAE, TI2V-5B on its own): diffusers' AutoencoderKLWan.
Its encode is causal in time by construction (the first frame alone, then 4-frame chunks through a feature cache);
its trainers run it untiled (musubi-tuner wan/modules/vae.py WanVAE.encode; diffusers' pipelines)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Mapping

from vaecache.errors import VaeSpecError
from vaecache.models.base import Family, FastEncoder, ReferenceEncode, VaeClass, config_constants
from vaecache.models.rules import FrameRule

VAE_CLASS = "AutoencoderKLWan"


def frame_rule(config: Mapping[str, Any]) -> FrameRule:
    # WanEncoder3d downsamples once per dim_mult step; temperal_downsample says which steps also halve
    # time. _encode feeds the first frame alone, then chunks of 4 frames: 1 + 4k frames.
    levels = len(config.get("dim_mult", [1, 2, 4, 4])) - 1
    temporal = 2 ** sum(bool(x) for x in config.get("temperal_downsample", [False, True, True])[:levels])
    if temporal > 4:
        raise VaeSpecError(f"AutoencoderKLWan with temporal compression {temporal} is not supported "
                           "(diffusers encodes chunks of 4 frames)")
    spatial = 2 ** levels * int(config.get("patch_size") or 1)
    return FrameRule(temporal, spatial, causal=True, frame_step=4, label="AutoencoderKLWan")


def normalization(config: Mapping[str, Any], module: Any) -> dict[str, Any]:
    out = config_constants(config, ("latents_mean", "latents_std"))
    out["formula"] = "(z - latents_mean) / latents_std"
    return out


def fast_encoder_module() -> ModuleType:
    return importlib.import_module("vaecache.models._wan_fast")


FAST = FastEncoder(
    "Wan 2.1, Wan 2.2", fast_encoder_module,
    frozenset({("cuda", "bfloat16", (9, 0), 96), ("cuda", "bfloat16", (9, 0), 160)}))
"""Validated where measured on an H200 at 2.16x (Wan 2.1: first width 96) and 1.72x (Wan 2.2 TI2V: 160) diffusers'
encode, closer to an fp32 encode than diffusers' bf16 one, at no more memory, and bitwise equal across repeats and
in a second process (docs/gpu.md)."""

VAE = VaeClass(VAE_CLASS, frame_rule, "z_dim", normalization, spatial_bands=True, causal_chunk_decode=True,
               fast_encoder=FAST)
UNTILED = ReferenceEncode("untiled", "diffusers' encode with its tiling off",
                          "musubi-tuner 30c658c wan_cache_latents.py and wan/modules/vae.py (WanVAE.encode, no "
                          "tiling); diffusers 0.42.1 autoencoder_kl_wan.py _encode")

FAMILY = Family("wan", "Wan", (VAE_CLASS,), UNTILED, default_for=(VAE_CLASS,), vaes=(VAE,))

__all__ = ["FAMILY", "FAST", "UNTILED", "VAE", "VAE_CLASS", "fast_encoder_module", "frame_rule", "normalization"]
