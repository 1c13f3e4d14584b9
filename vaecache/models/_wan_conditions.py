"""Wan's image-to-video conditions (`ConditionPipeline.arithmetic` of models/wan.py): pure tensor arithmetic.

Wan 2.1 I2V, Wan 2.2 I2V A14B and FLF2V: diffusers' `WanImageToVideoPipeline.prepare_latents`
(diffusers/pipelines/wan/pipeline_wan_i2v.py, 0.42: lines 396-484):
- `video_condition`: the first frame followed by num_frames - 1 zero frames (`first-frame`), or the first frame,
  num_frames - 2 zero frames and the last frame (`first-last`, its `last_image` branch), in [-1, 1];
- `latent_condition`: the VAE's posterior mean of that video (`retrieve_latents(..., sample_mode="argmax")`), cast
  to float32 and normalized `(z - latents_mean) * (1.0 / latents_std)` with both as float32 tensors;
- the frame mask: 1 on the conditioned frames (the first repeated to the VAE's temporal factor, as the causal VAE's
  first latent frame stands for one frame), folded into `temporal_factor` channels of the latent frame count;
- the condition the transformer sees: `cat([mask, latent_condition], dim=1)`.

Wan 2.2 TI2V's (a Wan VAE with `patch_size`, the TI2V-5B one) is the same function's `expand_timesteps` branch
(lines 428-470): `video_condition` is the image alone (one frame), `latent_condition` its posterior mean normalized
as above, and the mask `first_frame_mask` is 1 everywhere but 0 on latent frame 0 (inverted from Wan 2.1's): the
pipeline writes the condition over the first latent frame, `(1 - mask) * condition + mask * latents`. `LatentCache`
gives `condition/<kind>` the normalized one-frame latent and `condition_mask/<kind>` that mask. first-frame only (the
branch takes no last image)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from vaecache.errors import DatasetError, UsageError

LATENT_KINDS = ("first-frame", "first-last")


def condition_mask(kind: str, num_frames: int, temporal_factor: int, height: int, width: int) -> torch.Tensor:
    """The pipeline's frame mask for one view: (temporal_factor, latent frames, height, width) float32."""
    if kind not in LATENT_KINDS:
        raise UsageError(f"no frame mask for condition kind {kind!r}; the kinds with one are {', '.join(LATENT_KINDS)}")
    if (num_frames - 1) % temporal_factor:
        raise DatasetError(f"{num_frames} frames: the image-to-video mask needs 1 + {temporal_factor}k frames")
    mask = torch.ones(1, 1, num_frames, height, width)
    if kind == "first-frame":
        mask[:, :, list(range(1, num_frames))] = 0
    else:
        mask[:, :, list(range(1, num_frames - 1))] = 0
    first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=temporal_factor)
    mask = torch.concat([first, mask[:, :, 1:, :]], dim=2)
    mask = mask.view(1, -1, temporal_factor, height, width).transpose(1, 2)
    return mask[0]


def normalized_condition(mean: torch.Tensor, latents_mean: list[float], latents_std: list[float]) -> torch.Tensor:
    """(views, C, F, H, W) stored posterior mean -> the pipeline's normalized `latent_condition`, float32."""
    channels = mean.shape[1]
    shift = torch.tensor(latents_mean).view(1, channels, 1, 1, 1).to(mean.device, torch.float32)
    reciprocal = 1.0 / torch.tensor(latents_std).view(1, channels, 1, 1, 1).to(mean.device, torch.float32)
    return (mean.to(torch.float32) - shift) * reciprocal


class I2V:
    """Wan 2.1 I2V, Wan 2.2 I2V A14B, FLF2V."""

    @staticmethod
    def condition_video(frames: torch.Tensor, kind: str, clip: str) -> torch.Tensor:
        views, channels, count, height, width = frames.shape
        first = frames[:, :, :1]
        if kind == "first-frame":
            return torch.cat([first, first.new_zeros(views, channels, count - 1, height, width)], dim=2)
        if kind == "first-last":
            if count < 2:
                raise DatasetError(f"clip {clip}: first-last needs at least 2 frames, it has {count}")
            return torch.cat([first, first.new_zeros(views, channels, count - 2, height, width), frames[:, :, -1:]],
                             dim=2)
        raise UsageError(f"unknown condition kind {kind!r}; the kinds are first-frame, first-last, image-features")

    @staticmethod
    def condition(mean: torch.Tensor, kind: str, num_frames: int, temporal_factor: int,
                  normalization: Mapping[str, Any]) -> torch.Tensor:
        """`cat([mask, latent_condition], dim=1)`: (views, temporal_factor + C, F, H, W) float32."""
        latent = normalized_condition(mean, normalization["latents_mean"], normalization["latents_std"])
        views, _, _, height, width = latent.shape
        mask = condition_mask(kind, num_frames, temporal_factor, height, width).to(latent.device)
        return torch.concat([mask.unsqueeze(0).expand(views, -1, -1, -1, -1), latent], dim=1)

    @staticmethod
    def masks(mean: torch.Tensor, kind: str, num_frames: int, temporal_factor: int) -> dict[str, torch.Tensor]:
        return {}


def ti2v_mask(num_frames: int, temporal_factor: int, height: int, width: int) -> torch.Tensor:
    """Wan 2.2 TI2V's `first_frame_mask` for one view: (1, latent frames, height, width) float32, 0 on latent frame 0
    and 1 elsewhere."""
    mask = torch.ones(1, (num_frames - 1) // temporal_factor + 1, height, width)
    mask[:, 0] = 0
    return mask


class TI2V:
    """Wan 2.2 TI2V-5B: the first frame alone, normalized; its mask returned apart."""

    @staticmethod
    def condition_video(frames: torch.Tensor, kind: str, clip: str) -> torch.Tensor:
        if kind != "first-frame":
            raise UsageError(f"the wan-ti2v image-to-video pipeline has no {kind} condition")
        return frames[:, :, :1]

    @staticmethod
    def condition(mean: torch.Tensor, kind: str, num_frames: int, temporal_factor: int,
                  normalization: Mapping[str, Any]) -> torch.Tensor:
        return normalized_condition(mean, normalization["latents_mean"], normalization["latents_std"])

    @staticmethod
    def masks(mean: torch.Tensor, kind: str, num_frames: int, temporal_factor: int) -> dict[str, torch.Tensor]:
        views, _, _, height, width = mean.shape
        mask = ti2v_mask(num_frames, temporal_factor, height, width).to(mean.device)
        return {f"condition_mask/{kind}": mask.unsqueeze(0).expand(views, -1, -1, -1, -1).contiguous()}
