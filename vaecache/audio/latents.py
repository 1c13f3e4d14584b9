"""Audio latents: what an audio VAE makes of a clip's mel.

A cache stores the posterior mean of the VAE's `encode(mel)` (diffusers' `latent_dist.mode()`, the first half of the
encoder's channels: what LTX-2's ltx-core `AudioEncoder` takes before it normalizes). How the latents are normalized
is the declaring family's (`AudioVaeClass.normalization`, e.g. models/_ltx2_audio.py)."""

from __future__ import annotations

from typing import Any

import torch


def audio_posterior_mean(vae: Any, mel: torch.Tensor) -> torch.Tensor:
    """(batch, channels, frames, mel bins) log-mel -> (batch, C, T, F) posterior mean, in the VAE's dtype."""
    parameter = next(vae.parameters())
    with torch.inference_mode():
        return vae.encode(mel.to(device=parameter.device, dtype=parameter.dtype)).latent_dist.mode()

