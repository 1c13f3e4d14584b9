"""HunyuanVideo 1.5's image-to-video condition (`ConditionPipeline.arithmetic` of models/hunyuanvideo15.py).

diffusers' `HunyuanVideo15ImageToVideoPipeline.prepare_cond_latents_and_mask`
(pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5_image2video.py, 0.42: `_get_image_latents` and lines 594-632):
the first frame encoded alone (one frame: `image_tensor.unsqueeze(2)`, `retrieve_latents(..., "argmax")`), times the
VAE's scaling_factor, at latent frame 0 of the clip's latent frames and zeros after (`latent_condition`), and a
one-channel mask, 1 on latent frame 0 (`latent_mask`); the transformer takes `cat([latents, latent_condition,
latent_mask], dim=1)`, so the condition is `cat([latent_condition, latent_mask], dim=1)`. first-frame only (the
pipeline takes no last image)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from vaecache.errors import UsageError


def condition_video(frames: torch.Tensor, kind: str, clip: str) -> torch.Tensor:
    if kind != "first-frame":
        raise UsageError(f"the hunyuanvideo-1.5 image-to-video pipeline has no {kind} condition")
    return frames[:, :, :1]


def hunyuan15_condition(mean: torch.Tensor, num_frames: int, temporal_factor: int,
                        scaling_factor: float) -> torch.Tensor:
    """(views, C, 1, h, w) stored posterior mean of the first frame -> `cat([latent_condition, latent_mask], dim=1)`,
    (views, C + 1, latent frames, h, w) float32: the image latent times scaling_factor (in the stored dtype, as the
    pipeline scales it in the VAE's) at latent frame 0 and zeros after, the mask 1 on latent frame 0."""
    views, channels, _, height, width = mean.shape
    frames = (num_frames - 1) // temporal_factor + 1
    condition = torch.zeros(views, channels, frames, height, width, dtype=torch.float32, device=mean.device)
    condition[:, :, :1] = (mean[:, :, :1] * scaling_factor).to(torch.float32)
    mask = torch.zeros(views, 1, frames, height, width, dtype=torch.float32, device=mean.device)
    mask[:, :, 0] = 1.0
    return torch.concat([condition, mask], dim=1)


def condition(mean: torch.Tensor, kind: str, num_frames: int, temporal_factor: int,
              normalization: Mapping[str, Any]) -> torch.Tensor:
    return hunyuan15_condition(mean, num_frames, temporal_factor, normalization["scaling_factor"])


def masks(mean: torch.Tensor, kind: str, num_frames: int, temporal_factor: int) -> dict[str, torch.Tensor]:
    return {}
