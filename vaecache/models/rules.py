"""Frame and pixel rules: how a VAE compresses time and space, and which clip shapes it accepts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

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
    long_above: int = 0
    """Above this many frames a count must also be a multiple of `long_step` past the base (0: no such limit):
    a model family whose reference encode tiles time covers only some longer counts whole (Kandinsky 5)."""
    long_step: int = 0
    long_reason: str = ""
    """Why, in the refusal of a count the long step rules out."""
    size_problem: Callable[[int, int, int], str | None] | None = field(default=None, compare=False, repr=False)
    """(height, width, spatial factor) -> why a model family's reference encode cannot encode a frame of this size
    whole, naming the nearest sizes it can (Kandinsky 5's space tiles), or None."""

    def __post_init__(self) -> None:
        if self.temporal_factor < 1 or self.spatial_factor < 1 or self.frame_step < 0:
            raise ValueError(f"FrameRule factors must be >= 1 and frame_step >= 0, got {self}")
        if self.long_above < 0 or self.long_step < 0 or bool(self.long_above) != bool(self.long_step):
            raise ValueError(f"FrameRule long_above and long_step go together and are >= 0, got {self}")

    @property
    def step(self) -> int:
        return self.frame_step or self.temporal_factor

    @property
    def min_frames(self) -> int:
        return 1 if self.causal else self.step

    def frames_ok(self, num_frames: int) -> bool:
        return self._base_ok(num_frames) and self._long_ok(num_frames)

    def _base_ok(self, num_frames: int) -> bool:
        if num_frames < self.min_frames:
            return False
        return (num_frames - 1) % self.step == 0 if self.causal else num_frames % self.step == 0

    def _long_ok(self, num_frames: int) -> bool:
        base = 1 if self.causal else 0
        return not self.long_step or num_frames <= self.long_above or (num_frames - base) % self.long_step == 0

    def nearest_frames(self, num_frames: int) -> list[int]:
        """The valid frame counts just below and above num_frames (one value when below the minimum)."""
        if num_frames <= self.min_frames:
            return [self.min_frames]
        reach = max(self.step, self.long_step) + 1  # a valid count lies within one of the larger steps
        low = next((n for n in range(num_frames, max(self.min_frames, num_frames - reach) - 1, -1)
                    if self.frames_ok(n)), None)
        after = num_frames if low is None else low
        high = next(n for n in range(after + 1, after + 2 * reach + 1) if self.frames_ok(n))
        return [low, high] if low is not None else [high]

    def latent_frames(self, num_frames: int) -> int:
        if self.causal:
            return 1 + (num_frames - 1) // self.temporal_factor
        return num_frames // self.temporal_factor

    def describe(self) -> str:
        frames = (f"1 + {self.step}k frames" if self.causal else
                  "any number of frames" if self.step == 1 else f"a multiple of {self.step} frames")
        if self.long_step:
            frames += f" up to {self.long_above}, then {'1 + ' if self.causal else ''}{self.long_step}k"
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
        elif self.size_problem is not None:
            problem = self.size_problem(height, width, sf)
            if problem:
                found.append(f"--size {height}x{width} is not valid for {self.label}: {problem}")
        if not self.frames_ok(num_frames):
            near = " and ".join(map(str, self.nearest_frames(num_frames)))
            why = (f"it takes 1 + {self.step}k frames (the first frame is encoded alone, then groups of {self.step})"
                   if self.causal else f"it takes a multiple of {self.step} frames")
            if self._base_ok(num_frames):
                why = self.long_reason or f"above {self.long_above} frames it takes steps of {self.long_step}"
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
                "causal": self.causal, "frame_step": self.step,
                **({"long_above": self.long_above, "long_step": self.long_step} if self.long_step else {})}


def _nearest_multiples(value: int, factor: int) -> str:
    low = value // factor * factor
    return f"{low} and {low + factor}" if low else f"{factor}"


__all__ = ["FrameRule"]
