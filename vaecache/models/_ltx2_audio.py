"""LTX-2's audio latents' normalization (`AudioVaeClass.normalization` of models/ltx2.py).

LTX-2 normalizes over the packed features, not per latent channel: (batch, C, T, F) -> (batch, T, C * F), then
(x - mean) / std with the VAE's `latents_mean` / `latents_std` of C * F entries (ltx-core's
`AudioEncoder._normalize_latents` through its `AudioPatchifier`, and diffusers' `LTX2Pipeline._pack_audio_latents` +
`_normalize_audio_latents`), then back."""

from __future__ import annotations

import torch


def normalize(mean: torch.Tensor, latents_mean: torch.Tensor, latents_std: torch.Tensor) -> torch.Tensor:
    """LTX-2's normalization of (batch, C, T, F) audio latents over the C * F packed features."""
    batch, channels, frames, bins = mean.shape
    if latents_mean.numel() != channels * bins or latents_std.numel() != channels * bins:
        raise ValueError(f"LTX-2 normalizes audio latents over channels x mel bins = {channels} x {bins} features; "
                         f"the VAE records {latents_mean.numel()} means and {latents_std.numel()} deviations")
    packed = mean.transpose(1, 2).flatten(2, 3)
    packed = (packed - latents_mean.to(packed)) / latents_std.to(packed)
    return packed.unflatten(2, (channels, bins)).transpose(1, 2)


def denormalize(latents: torch.Tensor, latents_mean: torch.Tensor, latents_std: torch.Tensor) -> torch.Tensor:
    """The inverse of normalize (what LTX-2's decode path applies)."""
    batch, channels, frames, bins = latents.shape
    packed = latents.transpose(1, 2).flatten(2, 3)
    packed = packed * latents_std.to(packed) + latents_mean.to(packed)
    return packed.unflatten(2, (channels, bins)).transpose(1, 2)
