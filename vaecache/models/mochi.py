"""Mochi 1 (Genmo): diffusers' AutoencoderKLMochi, 12 latent channels, 6x time and 8x space, encoded untiled.

Its encoder (diffusers 0.42.1 `autoencoder_kl_mochi.py`, `MochiEncoder3D`) runs the whole clip in one pass: each
`MochiDownBlock3D` opens with a causal convolution whose kernel and stride are (temporal_expansion, spatial_expansion,
spatial_expansion), padded by temporal_expansion - 1 frames in front, so it maps 1 + e*k frames to 1 + k (other counts
lose their last frames) and halves space exactly. With the release's expansions (1, 2, 3) and (2, 2, 2) a clip takes
1 + 6k frames (Mochi 1 makes 163 = 1 + 6*27) at multiples of 8 pixels. Its tiling is off by default and framewise
encoding is refused by diffusers (causal attention in the encoder).

Latents are normalized as the inverse of `MochiPipeline`'s decode (`latents * latents_std / scaling_factor +
latents_mean`, `pipeline_mochi.py:709`): `(z - latents_mean) * scaling_factor / latents_std`, the constants in
config.json."""

from __future__ import annotations

from functools import reduce
from typing import Any, Mapping

from vaecache.errors import VaeSpecError
from vaecache.models.base import Family, ReferenceEncode, VaeClass, scale_normalization
from vaecache.models.rules import FrameRule

VAE_CLASS = "AutoencoderKLMochi"


def frame_rule(config: Mapping[str, Any]) -> FrameRule:
    temporal_expansions = [int(e) for e in config.get("temporal_expansions", (1, 2, 3))]
    spatial_expansions = [int(e) for e in config.get("spatial_expansions", (2, 2, 2))]
    if min(temporal_expansions + spatial_expansions, default=1) < 1:
        raise VaeSpecError(f"AutoencoderKLMochi expansions must be >= 1, got temporal {temporal_expansions}, "
                           f"spatial {spatial_expansions}")
    if len(temporal_expansions) != len(spatial_expansions):
        raise VaeSpecError("AutoencoderKLMochi needs one temporal and one spatial expansion per down block")
    temporal = reduce(lambda a, b: a * b, temporal_expansions, 1)
    spatial = reduce(lambda a, b: a * b, spatial_expansions, 1)
    return FrameRule(temporal, spatial, causal=True, label=VAE_CLASS)


VAE = VaeClass(VAE_CLASS, frame_rule, "latent_channels", scale_normalization)
UNTILED = ReferenceEncode("untiled", "diffusers' encode with its tiling off",
                          "diffusers 0.42.1 autoencoder_kl_mochi.py _encode (use_tiling and use_framewise_encoding "
                          "False); pipeline_mochi.py:709 (the normalization it inverts)")

FAMILY = Family("mochi", "Mochi 1", (VAE_CLASS,), UNTILED, default_for=(VAE_CLASS,), vaes=(VAE,))

__all__ = ["FAMILY", "UNTILED", "VAE", "VAE_CLASS", "frame_rule"]
