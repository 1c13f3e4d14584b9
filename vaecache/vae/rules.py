"""Frame and pixel rules: how a VAE compresses time and space, and which clip shapes it accepts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from vaecache.errors import FrameRuleError


@dataclass(frozen=True)
class FrameRule:
    """How a VAE compresses time and space, and which input sizes it accepts."""

    temporal_factor: int = 1
    spatial_factor: int = 1
    causal: bool = False
    """Causal video VAEs take 1 + k*frame_step frames (the first frame is encoded alone)."""
    frame_step: int = 0
    """Granularity of valid frame counts; 0 means temporal_factor. CogVideoX encodes frames in batches
    of 8, so it takes 1 + 8k frames although it compresses time by 4."""
    label: str = "this VAE"
    """Names the VAE in error messages."""

    def __post_init__(self) -> None:
        if self.temporal_factor < 1 or self.spatial_factor < 1 or self.frame_step < 0:
            raise ValueError(f"FrameRule factors must be >= 1 and frame_step >= 0, got {self}")

    @property
    def step(self) -> int:
        return self.frame_step or self.temporal_factor

    @property
    def min_frames(self) -> int:
        return 1 if self.causal else self.step

    def frames_ok(self, num_frames: int) -> bool:
        if num_frames < self.min_frames:
            return False
        return (num_frames - 1) % self.step == 0 if self.causal else num_frames % self.step == 0

    def nearest_frames(self, num_frames: int) -> list[int]:
        """The valid frame counts just below and above num_frames (one value when below the minimum)."""
        if num_frames <= self.min_frames:
            return [self.min_frames]
        base = 1 if self.causal else 0
        low = base + (num_frames - base) // self.step * self.step
        return [low, low + self.step] if low >= self.min_frames else [low + self.step]

    def latent_frames(self, num_frames: int) -> int:
        if self.causal:
            return 1 + (num_frames - 1) // self.temporal_factor
        return num_frames // self.temporal_factor

    def describe(self) -> str:
        frames = (f"1 + {self.step}k frames" if self.causal else
                  "any number of frames" if self.step == 1 else f"a multiple of {self.step} frames")
        return f"{frames}, height and width multiples of {self.spatial_factor}"

    def problems(self, num_frames: int, height: int, width: int) -> list[str]:
        """One message per option the clip shape breaks (--size first, then --num-frames), each naming
        the nearest valid values; empty when the shape is accepted."""
        found = []
        sf = self.spatial_factor
        wrong = [(name, value) for name, value in (("height", height), ("width", width)) if value % sf]
        if wrong:
            stated = " and ".join(f"{name} {value}" for name, value in wrong)
            verb = "are not multiples" if len(wrong) > 1 else "is not a multiple"
            nearest = "; ".join(f"nearest valid {name}: {_nearest_multiples(value, sf)}" for name, value in wrong)
            found.append(f"--size {height}x{width}: {stated} {verb} of {sf} (the spatial factor of {self.label}); "
                         f"{nearest}")
        if not self.frames_ok(num_frames):
            near = " and ".join(map(str, self.nearest_frames(num_frames)))
            why = (f"it takes 1 + {self.step}k frames (the first frame is encoded alone, then groups of {self.step})"
                   if self.causal else f"it takes a multiple of {self.step} frames")
            found.append(f"--num-frames {num_frames} is not valid for {self.label}: {why}; nearest valid: {near}")
        return found

    def check(self, num_frames: int, height: int, width: int) -> None:
        """Raise one FrameRuleError naming every wrong value and the nearest valid ones."""
        found = self.problems(num_frames, height, width)
        if found:
            raise FrameRuleError("; ".join(found))

    def check_buckets(self, lengths: Sequence[int], sizes: Sequence[tuple[int, int]]) -> None:
        """Every frame bucket and size bucket at once: one FrameRuleError listing each bad value (before any work)."""
        sf = self.spatial_factor
        found = [problem for height, width in sizes for problem in self.problems(self.min_frames, height, width)]
        found += [problem for length in lengths for problem in self.problems(length, sf, sf)]
        if found:
            raise FrameRuleError("; ".join(found))

    def latent_shape(self, channels: int, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        return channels, self.latent_frames(num_frames), height // self.spatial_factor, width // self.spatial_factor

    def to_json(self) -> dict[str, Any]:
        return {"temporal_factor": self.temporal_factor, "spatial_factor": self.spatial_factor,
                "causal": self.causal, "frame_step": self.step}


def _nearest_multiples(value: int, factor: int) -> str:
    low = value // factor * factor
    return f"{low} and {low + factor}" if low else f"{factor}"


__all__ = ["FrameRule"]
