"""Decoded frames to the clip's size (cover, contain, stretch) and the model's value range."""

from __future__ import annotations

import torch

from vaecache.settings.buckets import PAD_PIXEL, fit_geometry


def resize_cover_crop(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(T, C, h, w) uint8 -> (T, C, height, width) float: scale to cover, then center-crop."""
    _, _, src_h, src_w = frames.shape
    frames = frames.float()
    if (src_h, src_w) != (height, width):
        scale = max(height / src_h, width / src_w)
        new_h, new_w = max(height, round(src_h * scale)), max(width, round(src_w * scale))
        if (new_h, new_w) != (src_h, src_w):
            frames = torch.nn.functional.interpolate(frames, size=(new_h, new_w), mode="bilinear",
                                                     align_corners=False, antialias=True)
        top, left = (new_h - height) // 2, (new_w - width) // 2
        frames = frames[:, :, top:top + height, left:left + width]
    return frames


def resize_fit(frames: torch.Tensor, height: int, width: int, fit: str = "cover") -> torch.Tensor:
    """(T, C, h, w) uint8 -> (T, C, height, width) float by --fit: cover (resize_cover_crop), contain (resize
    to fit inside, centred, padded with PAD_PIXEL: 0.0 in model range), stretch (resize, aspect not kept).
    The geometry is buckets.fit_geometry's, which the clip record's `crop` reports."""
    if fit == "cover":
        return resize_cover_crop(frames, height, width)
    _, _, src_h, src_w = frames.shape
    geometry = fit_geometry(src_w, src_h, height, width, fit)
    frames = frames.float()
    if geometry.resize != (src_h, src_w):
        frames = torch.nn.functional.interpolate(frames, size=geometry.resize, mode="bilinear", align_corners=False,
                                                 antialias=True)
    left, top, right, bottom = geometry.pad
    if left or top or right or bottom:
        frames = torch.nn.functional.pad(frames, (left, right, top, bottom), value=PAD_PIXEL)
    return frames


def to_model_range(frames: torch.Tensor) -> torch.Tensor:
    """[0, 255] -> [-1, 1], clamped (resampling can overshoot)."""
    return (frames / 127.5 - 1.0).clamp_(-1.0, 1.0)
