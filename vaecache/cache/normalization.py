"""The latent normalization a manifest records (`vae.normalization`), read as numbers: per channel, the offset it
subtracts and the factor it multiplies by, and what it makes of the statistics it was published with.

Every formula vaecache records is affine per channel, normalize(z)_c = (z_c - shift_c) * scale / divisor_c:

| formula | shift | divisor | scale |
|---|---|---|---|
| `(z - latents_mean) / latents_std` | latents_mean | latents_std | 1 |
| `(z - latents_mean) * scaling_factor / latents_std` | latents_mean | latents_std | scaling_factor |
| `(z - shift_factor) * scaling_factor` | shift_factor | 1 | scaling_factor |
| `z * scaling_factor` | 0 | 1 | scaling_factor |

`LatentCache.normalize` computes with these constants (in its own arithmetic); `vaecache report` applies them to
per-channel statistics. Pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vaecache.errors import NormalizationError


@dataclass(frozen=True)
class NormalizationConstants:
    """One recorded normalization: normalize(z)_c = (z_c - shift[c]) * scale / divisor[c]."""

    formula: str
    shift: tuple[float, ...]
    divisor: tuple[float, ...]
    scale: float
    per_channel: bool
    """The formula names per-channel constants (latents_mean, latents_std); otherwise one value for every channel."""

    def factor(self, channel: int) -> float:
        """What normalize multiplies channel `channel` by, after subtracting its shift."""
        return self.scale / self.divisor[channel]

    def normalized_moments(self, mean: list[float], std: list[float]) -> tuple[list[float], list[float]]:
        """Per channel, the mean and std that raw latents of mean `mean` and std `std` have once normalized."""
        return ([(m - self.shift[c]) * self.factor(c) for c, m in enumerate(mean)],
                [s * abs(self.factor(c)) for c, s in enumerate(std)])

    def published_moments(self) -> tuple[list[float] | None, list[float]]:
        """The raw latent statistics the constants were published as: the mean is the offset the formula subtracts
        (None where it subtracts none: `z * scaling_factor` publishes no mean), the std is latents_std where the
        formula divides by it, else 1 / scaling_factor (a scaling factor is published as the reciprocal of the
        latents' std over the data it was measured on)."""
        channels = len(self.shift)
        mean = list(self.shift) if "latents_mean" in self.formula or "shift_factor" in self.formula else None
        std = list(self.divisor) if self.per_channel else [1.0 / self.scale] * channels
        return mean, std

    def reference(self) -> tuple[list[float] | None, list[float]]:
        """What the normalization makes of its own published statistics, per channel: the (mean, std) normalized
        latents have when the constants are right for the data (mean None where none is published)."""
        mean, std = self.published_moments()
        normalized_mean, normalized_std = self.normalized_moments(mean or [0.0] * len(std), std)
        return (normalized_mean if mean is not None else None), normalized_std


def normalization_constants(norm: dict[str, Any], channels: int, where: Any) -> NormalizationConstants:
    """The recorded normalization `norm` (a manifest's `vae.normalization`) for latents of `channels` channels;
    NormalizationError naming `where` when it records none, or not the constants its formula needs, or a formula
    vaecache does not know; ValueError when per-channel constants do not have `channels` values."""
    formula = norm.get("formula")
    if not formula:
        raise NormalizationError(f"{where}: records no latent normalization for its VAE (vae.normalization)")

    def listed(name: str) -> tuple[float, ...]:
        if name not in norm:
            raise NormalizationError(f"{where}: normalization {formula!r} needs {name}, which is not recorded")
        values = tuple(float(v) for v in norm[name])
        if len(values) != channels:
            raise ValueError(f"{name} has {len(values)} channels; the latents have {channels}")
        return values

    scale = float(norm.get("scaling_factor", 1.0))
    if "latents_mean" in formula:
        return NormalizationConstants(formula, listed("latents_mean"), listed("latents_std"), scale, True)
    if "shift_factor" in formula:
        return NormalizationConstants(formula, (float(norm["shift_factor"]),) * channels, (1.0,) * channels, scale,
                                      False)
    if "scaling_factor" in formula:
        if "scaling_factor" not in norm:
            raise NormalizationError(f"{where}: normalization {formula!r} needs scaling_factor, which is not recorded")
        return NormalizationConstants(formula, (0.0,) * channels, (1.0,) * channels, scale, False)
    raise NormalizationError(f"{where}: unknown normalization formula {formula!r}")


__all__ = ["NormalizationConstants", "normalization_constants"]
