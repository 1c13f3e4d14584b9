"""Whether `vaecache report` decodes a cache's clips here, and the time budget that holds every decoder to bounded
time.

Two rules, in this order:

1. A VAE class whose family declares `VaeClass.not_decoded_here` (vaecache.models) is never decoded by the report
   (its clips show their source frames and the reason): a decoder that is not a plain `decode(z)` in bounded time,
   such as a diffusion decoder (many denoising steps per frame) or a large ViT decoder without a device to run it on.
   The class is the manifest's `vae.family`; the declaration says why, as the page will. No family vaecache encodes
   today declares it: each decodes with `decode(z)` (vaecache.vae.latent_decode).
2. Every other decoder is measured: before the first clip, one latent frame of 8x8 latent pixels is decoded and
   timed, and each sampled clip is decoded only while the estimate for its frames (that time per output pixel,
   times its cameras x frames x height x width) keeps the report within `decode_budget_s`. On a CPU a real video
   VAE's decoder is slow (Wan 2.1's decodes about 2,000 pixels a second on the 2-core VM the tests run on: nine
   256x256 frames take over four minutes), so a real cache's report decodes on a GPU, and on a CPU says, clip by
   clip, that its estimate did not fit; builtin:small's demo cache decodes in a second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

PROBE_LATENT = (1, 8, 8)
"""(latent frames, height, width) of the latent decoded to time a decoder."""


def family_refusal(manifest: dict[str, Any]) -> str | None:
    """Why the cache's VAE family is not decoded by the report (rule 1), or None."""
    from vaecache.models import vae_class

    family = str((manifest.get("vae") or {}).get("family") or "")
    declared = vae_class(family)
    reason = declared.not_decoded_here if declared is not None else None
    return f"{family}'s decoder is not run by the report: {reason}" if reason else None


@dataclass
class DecodeBudget:
    """The report's decoding time: what it may spend, what it has, and the measured cost of a pixel."""

    budget_s: float
    seconds_per_pixel: float
    device: str
    spent_s: float = 0.0

    def estimate_s(self, pixels: int) -> float:
        return pixels * self.seconds_per_pixel

    def refusal(self, pixels: int) -> str | None:
        """Why a clip of `pixels` decoded pixels (cameras x frames x height x width) is not decoded, or None."""
        estimate = self.estimate_s(pixels)
        if self.spent_s + estimate <= self.budget_s:
            return None
        return (f"not decoded: its {pixels / 1e6:.2f} million pixels would take about {estimate:.0f} s on "
                f"{self.device} (measured on one latent frame), past the report's decode budget of "
                f"{self.budget_s:g} s ({self.spent_s:.0f} s spent); rerun with --device cuda or a larger "
                "--decode-budget")

    def spend(self, seconds: float) -> None:
        self.spent_s += seconds


def measure_decoder(model: Any, channels: int, dtype: Any = None) -> float:
    """Seconds per decoded output pixel of `model` (a vaecache VaeModel): a latent of PROBE_LATENT (zeros, with
    `channels` channels) decoded twice, the second timed where the first (which loads kernels) was quick."""
    import torch

    from vaecache.vae.latent_decode import iter_decoded

    frames, height, width = PROBE_LATENT
    z = torch.zeros(1, channels, frames, height, width, dtype=dtype or torch.float32)

    def once() -> tuple[float, int]:
        started = time.perf_counter()
        pixels = 0
        for piece in iter_decoded(model, z, frames):
            pixels += piece.shape[2] * piece.shape[3] * piece.shape[4]
        if getattr(model.device, "type", "cpu") == "cuda":  # the kernels have run, not only been queued
            torch.cuda.synchronize(model.device)
        return time.perf_counter() - started, max(1, pixels)

    seconds, pixels = once()
    if seconds < 1.0:
        seconds, pixels = once()
    return seconds / pixels


__all__ = ["PROBE_LATENT", "DecodeBudget", "family_refusal", "measure_decoder"]
