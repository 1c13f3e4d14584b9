"""Kandinsky 5's image-to-video condition (`ConditionPipeline.arithmetic` of models/kandinsky5.py).

`Kandinsky5I2VPipeline.prepare_latents`'s image latent (pipelines/kandinsky5/pipeline_kandinsky_i2v.py, 0.42: lines
695-703): the first frame encoded alone times the VAE's scaling_factor, which the pipeline writes over the first
latent frame. The pipeline draws a posterior sample; a cache stores the mean, and `LatentCache` gives the mean times
scaling_factor, (cameras, C, 1, h, w) float32, channels first (the pipeline's latents are channels last)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from vaecache.errors import UsageError


def condition_video(frames: torch.Tensor, kind: str, clip: str) -> torch.Tensor:
    if kind != "first-frame":
        raise UsageError(f"the kandinsky5 image-to-video pipeline has no {kind} condition")
    return frames[:, :, :1]


def condition(mean: torch.Tensor, kind: str, num_frames: int, temporal_factor: int,
              normalization: Mapping[str, Any]) -> torch.Tensor:
    """image_latents * scaling_factor, in the VAE's dtype, then the latents' (float32)."""
    return (mean * normalization["scaling_factor"]).to(torch.float32)


def masks(mean: torch.Tensor, kind: str, num_frames: int, temporal_factor: int) -> dict[str, torch.Tensor]:
    return {}
