"""Near-zero-cost VAEs for benchmarks (`--vae python:_null_vae:FACTORY` with scripts/ on PYTHONPATH).

* ``factory``: Wan-like shape rule (time /4 causal, space /8), 3 latent channels, mean only: every 4th
  frame average-pooled 8x8. What is left of an encode with it is decode, coordination and writing.
* ``identity``: stores the pixels themselves as the "latent" (factors 1, mean only), so a modest
  dataset makes a cache of hundreds of MB through the real encode path (for hashing benchmarks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class NullVae(torch.nn.Module):
    """encode(x): (B, 3, 1+4k, H, W) -> (B, 3, 1+k, H/8, W/8), cheaply and deterministically."""

    vaecache_temporal_factor = 4
    vaecache_spatial_factor = 8
    vaecache_causal = True
    vaecache_has_logvar = False
    vaecache_latent_channels = 3

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool3d(x[:, :, ::4], kernel_size=(1, 8, 8))


class IdentityVae(torch.nn.Module):
    """encode(x) = x: one float per input pixel and channel (the largest cache a clip can make)."""

    vaecache_temporal_factor = 1
    vaecache_spatial_factor = 1
    vaecache_causal = False
    vaecache_has_logvar = False
    vaecache_latent_channels = 3

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


def factory() -> NullVae:
    return NullVae()


def identity() -> IdentityVae:
    return IdentityVae()
