"""Image-to-video conditions, as the pipelines build them: pure tensor arithmetic, no I/O.

The reference is diffusers' `WanImageToVideoPipeline.prepare_latents` (diffusers/pipelines/wan/pipeline_wan_i2v.py,
0.42: lines 396-484; Wan 2.1 I2V, Wan 2.2 I2V A14B and FLF2V share it):
- `video_condition`: the first frame followed by num_frames - 1 zero frames (`first-frame`), or the first frame,
  num_frames - 2 zero frames and the last frame (`first-last`, its `last_image` branch), in [-1, 1];
- `latent_condition`: the VAE's posterior mean of that video (`retrieve_latents(..., sample_mode="argmax")`), cast
  to float32 and normalized `(z - latents_mean) * (1.0 / latents_std)` with both as float32 tensors;
- the frame mask: 1 on the conditioned frames (the first repeated to the VAE's temporal factor, as the causal VAE's
  first latent frame stands for one frame), folded into `temporal_factor` channels of the latent frame count;
- the condition the transformer sees: `cat([mask, latent_condition], dim=1)`.

A cache stores the posterior mean (the only input that depends on weights and frames); the mask and the
normalization are rebuilt from the recorded frame count, temporal factor and constants, bit for bit.
"""

from __future__ import annotations

import torch

from vaecache.errors import DatasetError, UsageError

CONDITION_KINDS = ("first-frame", "first-last", "image-features")
LATENT_KINDS = ("first-frame", "first-last")
"""The kinds encoded with the cache's VAE; image-features come from an image encoder (vaecache.conditions.images)."""
REFERENCE = "diffusers WanImageToVideoPipeline.prepare_latents (pipelines/wan/pipeline_wan_i2v.py)"
SUPPORTED_FAMILIES = ("AutoencoderKLWan",)
"""VAE families with an image-to-video pipeline vaecache reproduces."""


def parse_condition_kinds(text: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """`--condition KIND[,KIND]` -> the kinds in the documented order; unknown kinds refused, naming the known."""
    if not text:
        return ()
    parts = text.split(",") if isinstance(text, str) else list(text)
    kinds = {part.strip() for part in parts if part.strip()}
    unknown = sorted(kinds - set(CONDITION_KINDS))
    if unknown:
        raise UsageError(f"--condition: unknown kind {', '.join(unknown)}; the kinds are {', '.join(CONDITION_KINDS)}")
    return tuple(kind for kind in CONDITION_KINDS if kind in kinds)


def check_condition_vae(vae: dict, where: str) -> None:
    """Refuse a cache whose VAE has no image-to-video pipeline vaecache follows, naming the supported ones."""
    family = vae.get("family")
    if family not in SUPPORTED_FAMILIES:
        raise UsageError(f"{where}: its VAE is {family or 'unrecorded'}; image-to-video conditions follow "
                         f"{REFERENCE}, for the VAE families {', '.join(SUPPORTED_FAMILIES)}")
    config = vae.get("config") or {}
    if config.get("patch_size"):
        raise UsageError(f"{where}: a Wan 2.2 TI2V VAE (patch_size {config['patch_size']}): its pipeline conditions "
                         "on the first latent frame alone (expand_timesteps), which vaecache does not build; "
                         f"{', '.join(CONDITION_KINDS)} follow Wan 2.1 / Wan 2.2 A14B's prepare_latents")
    if not (vae.get("normalization") or {}).get("latents_std"):
        raise UsageError(f"{where}: records no latents_mean/latents_std for its VAE (needed to normalize the "
                         "condition as the pipeline does)")


def condition_video(frames: torch.Tensor, kind: str, clip: str = "") -> torch.Tensor:
    """(views, 3, T, H, W) frames as encode saw them -> the pipeline's `video_condition` for each view."""
    views, channels, count, height, width = frames.shape
    first = frames[:, :, :1]
    if kind == "first-frame":
        return torch.cat([first, first.new_zeros(views, channels, count - 1, height, width)], dim=2)
    if kind == "first-last":
        if count < 2:
            raise DatasetError(f"clip {clip}: first-last needs at least 2 frames, it has {count}")
        return torch.cat([first, first.new_zeros(views, channels, count - 2, height, width), frames[:, :, -1:]],
                         dim=2)
    raise UsageError(f"unknown condition kind {kind!r}; the kinds are {', '.join(CONDITION_KINDS)}")


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


def pipeline_condition(mean: torch.Tensor, kind: str, num_frames: int, temporal_factor: int,
                       latents_mean: list[float], latents_std: list[float]) -> torch.Tensor:
    """(views, C, F, H, W) stored posterior mean -> `cat([mask, latent_condition], dim=1)`: (views,
    temporal_factor + C, F, H, W) float32, the tensor prepare_latents returns for each view. image-features are
    stored as the pipeline uses them and returned unchanged."""
    if kind not in LATENT_KINDS:
        return mean
    latent = normalized_condition(mean, latents_mean, latents_std)
    views, _, _, height, width = latent.shape
    mask = condition_mask(kind, num_frames, temporal_factor, height, width).to(latent.device)
    return torch.concat([mask.unsqueeze(0).expand(views, -1, -1, -1, -1), latent], dim=1)


__all__ = ["CONDITION_KINDS", "LATENT_KINDS", "REFERENCE", "SUPPORTED_FAMILIES", "check_condition_vae",
           "condition_mask", "condition_video", "normalized_condition", "parse_condition_kinds", "pipeline_condition"]
