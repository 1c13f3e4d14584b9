"""Is the cache scaled the way its model expects? Per latent channel, the mean and std of the normalized latents
over the cache, beside what the recorded normalization makes of its own published statistics, and the channels
outside a stated band flagged in words.

A wrong `latents_mean`/`latents_std` or scaling factor fails nowhere: the cache loads, trains, and trains wrong. What
shows it is the normalized latents' moments: a right normalization brings each channel near the mean and std its
published statistics give (vaecache.cache.normalization: 0 and 1 for every recorded formula but LTX's, whose std is
its scaling factor). The band around them (BAND) is wide on purpose, and lower on the std side: the cache stores the
posterior mean, whose variance is a sample's less the posterior's own (var z = var mean + E[sigma^2]), so its std sits
below the published one even when the constants are right, and footage other than the data the constants were
measured on moves each channel's moments by tens of percent. What it catches is a factor of two or more: no
normalization at all, a scaling factor of another model, a std used where its reciprocal was meant, another VAE's
channel means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from vaecache.cache.normalization import NormalizationConstants


@dataclass(frozen=True)
class Band:
    """Where a channel's normalized moments may sit around the reference (mean_ref, std_ref) unflagged."""

    mean: float = 0.5
    """|mean - mean_ref| at most this many reference stds."""
    std_low: float = 0.5
    std_high: float = 1.5
    """std / std_ref within [std_low, std_high]."""

    def words(self) -> str:
        return (f"mean within ±{self.mean:g} of the reference (in units of the reference std), std within "
                f"{self.std_low:g}x to {self.std_high:g}x the reference")


BAND = Band()


class MomentSum:
    """Running per-channel count, mean and sum of squared deviations (M2), merged from per-clip (count, mean, std)
    by Chan et al.'s pairwise update: exact (a clip's population std and count give its M2), stable, in O(channels)
    memory whatever the number of clips."""

    def __init__(self, channels: int) -> None:
        self.channels = channels
        self.count = 0.0
        self.mean = np.zeros(channels)
        self.m2 = np.zeros(channels)

    def add_clips(self, counts: np.ndarray, means: np.ndarray, stds: np.ndarray) -> None:
        """`counts` (k,) values per channel of each clip, `means` and `stds` (k, channels) their moments."""
        total = float(counts.sum())
        if total <= 0:
            return
        weights = counts[:, None]
        batch_mean = (weights * means).sum(0) / total
        batch_m2 = (weights * (stds ** 2 + (means - batch_mean) ** 2)).sum(0)
        merged = self.count + total
        delta = batch_mean - self.mean
        self.mean = self.mean + delta * (total / merged)
        self.m2 = self.m2 + batch_m2 + delta ** 2 * (self.count * total / merged)
        self.count = merged

    def moments(self) -> tuple[list[float], list[float]]:
        """Per channel, (mean, population std) of every value added."""
        if self.count <= 0:
            return [math.nan] * self.channels, [math.nan] * self.channels
        return self.mean.tolist(), np.sqrt(np.maximum(self.m2, 0.0) / self.count).tolist()


@dataclass(frozen=True)
class ChannelScale:
    """One channel of the normalized latents against its reference."""

    channel: int
    mean: float
    std: float
    reference_mean: float | None
    """None where the normalization publishes no mean (`z * scaling_factor`): the mean is not judged."""
    reference_std: float
    problems: tuple[str, ...] = ()
    """In words; empty: inside the band."""


@dataclass(frozen=True)
class ScaleReport:
    """The scale section: where the moments come from, the normalization, every channel, the flagged ones."""

    source: str
    """How the moments were measured: every clip's recorded statistics, or a sample of clips' tensors."""
    exact: bool
    """True: over every clip of the cache; False: from a sample of clips (said in `source`)."""
    latent_key: str
    formula: str
    band: str
    channels: list[ChannelScale] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)
    """Sentences a person reads first: how many channels are off and what that suggests."""

    @property
    def flagged(self) -> list[ChannelScale]:
        return [channel for channel in self.channels if channel.problems]

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "exact": self.exact, "latent_key": self.latent_key, "formula": self.formula,
                "band": self.band, "flagged": [c.channel for c in self.flagged], "summary": self.summary,
                "channels": [{"channel": c.channel, "mean": _finite(c.mean), "std": _finite(c.std),
                              "reference_mean": c.reference_mean, "reference_std": c.reference_std,
                              "problems": list(c.problems)} for c in self.channels]}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def judge_scale(raw_mean: list[float], raw_std: list[float], constants: NormalizationConstants, *, source: str,
                exact: bool, latent_key: str, band: Band = BAND) -> ScaleReport:
    """The raw latents' per-channel moments normalized by the recorded constants, each channel judged against the
    band around what the normalization makes of its own published statistics. Pure."""
    mean, std = constants.normalized_moments(raw_mean, raw_std)
    reference_mean, reference_std = constants.reference()
    channels = []
    for c, (m, s) in enumerate(zip(mean, std)):
        ref_m = reference_mean[c] if reference_mean is not None else None
        ref_s = reference_std[c]
        problems = []
        if not (math.isfinite(m) and math.isfinite(s)):
            problems.append("no finite statistics")
        else:
            if ref_m is not None and abs(m - ref_m) > band.mean * ref_s:
                problems.append(f"mean {m:+.2f}, outside {ref_m - band.mean * ref_s:+.2f} to "
                                f"{ref_m + band.mean * ref_s:+.2f}")
            if s < band.std_low * ref_s:
                problems.append(f"std {s:.2f}, below {band.std_low * ref_s:.2f}")
            elif s > band.std_high * ref_s:
                problems.append(f"std {s:.2f}, above {band.std_high * ref_s:.2f}")
        channels.append(ChannelScale(c, m, s, ref_m, ref_s, tuple(problems)))
    return ScaleReport(source, exact, latent_key, constants.formula, band.words(), channels,
                       _summary(channels, constants))


def _summary(channels: list[ChannelScale], constants: NormalizationConstants) -> list[str]:
    flagged, total = [c for c in channels if c.problems], len(channels)
    if not total:
        return ["no channel statistics"]
    if not flagged:
        return [f"every channel of the {total} is inside the band: the recorded normalization "
                f"({constants.formula}) scales these latents as its published statistics say."]
    names = ", ".join(str(c.channel) for c in flagged[:24]) + (", ..." if len(flagged) > 24 else "")
    lines = [f"{len(flagged)} of {total} channels outside the band: {names}. A model trained on these latents with "
             f"this normalization ({constants.formula}) sees them off the scale it expects."]
    ratios = [c.std / c.reference_std for c in channels if math.isfinite(c.std) and c.reference_std]
    low = [c for c in flagged if any(p.startswith("std") and "below" in p for p in c.problems)]
    high = [c for c in flagged if any(p.startswith("std") and "above" in p for p in c.problems)]
    shifted = [c for c in flagged if any(p.startswith("mean") for p in c.problems)]
    if ratios and (len(low) == total or len(high) == total):
        median = float(np.median(ratios))
        lines.append(f"every channel's std is about {median:.2f}x the reference: a scaling factor or latents_std "
                     "of another model, or latents left unnormalized, would do this.")
    else:
        if low or high:
            lines.append(f"{len(low) + len(high)} channel(s) with their std outside the band: a wrong latents_std "
                         "(or scaling factor) for them.")
        if shifted:
            lines.append(f"{len(shifted)} channel(s) with their mean shifted: a wrong latents_mean (or shift) for "
                         "them, or constants of another VAE.")
    return lines


def tensor_moments(tensors: Iterable[Any]) -> tuple[list[float], list[float]]:
    """Per-channel (mean, std) over stored tensors (cameras, C, t, h, w), one at a time (none is kept), from each
    one's channel statistics (vaecache.cache.writer.channel_stats), merged as MomentSum merges records'."""
    from vaecache.cache.writer import channel_stats

    moments: MomentSum | None = None
    for tensor in tensors:
        stats = channel_stats(tensor)
        if moments is None:
            moments = MomentSum(int(tensor.shape[1]))
        moments.add_clips(np.asarray([tensor.numel() / tensor.shape[1]], dtype=np.float64),
                          np.asarray([stats["mean"]]), np.asarray([stats["std"]]))
    return moments.moments() if moments is not None else ([], [])


__all__ = ["BAND", "Band", "ChannelScale", "MomentSum", "ScaleReport", "judge_scale", "tensor_moments"]
