"""What an encode did, summed over ranks: printed by rank 0, written by --json."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vaecache.errors import EXIT_OK, EXIT_PARTIAL, EXIT_STOPPED


@dataclass
class EncodeSummary:
    """What a finished encode did, summed over ranks (filled on every rank, printed by rank 0)."""

    out: Path
    clips: int = 0
    views: int = 0
    frames: int = 0
    resumed_clips: int = 0
    planned_clips: int = 0
    scenes: int = 0
    skipped: list[dict[str, Any]] = field(default_factory=list)
    latent_shape: dict[str, list[int]] = field(default_factory=dict)
    bytes_written: int = 0
    shards: int = 0
    wall_s: float = 0.0
    startup_s: float = 0.0
    """This rank's time from the start to its first batch: discovery, probing, planning, VAE load, OUT."""
    encode_s: float = 0.0
    """This rank's encode loop: decoding, encoding and committing its clips (not the wait for other ranks)."""
    finalize_s: float = 0.0
    """Waiting for the other ranks, and rank 0 merging the progress logs into the manifest."""
    world_size: int = 1
    sp_size: int = 1
    untrained_vae: bool = False
    backoffs: list[str] = field(default_factory=list)
    stopped: str | None = None
    """The signal that stopped this rank early (the cache is resumable, not complete)."""
    repaired: list[str] = field(default_factory=list)
    """Committed shards found damaged at start-up ("file: problem"), dropped and their clips encoded again."""
    rewritten: list[str] = field(default_factory=list)
    """Objects of OUT's commit protocol written again from the commit records ("object: why")."""
    left_out_cameras: dict[str, int] = field(default_factory=dict)
    """Cameras some scenes have that the chosen camera set does not encode -> how many scenes have each."""
    already_complete: bool = False
    """OUT already held every planned clip: nothing was encoded and no file in OUT was rewritten."""
    buckets: list[dict[str, Any]] = field(default_factory=list)
    """A bucketed run's buckets as planned: name, height, width, num_frames, clips, views (empty ones too)."""

    @property
    def empty_buckets(self) -> list[str]:
        return [bucket["name"] for bucket in self.buckets if not bucket["clips"]]

    @property
    def views_per_s(self) -> float:
        return self.views / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def exit_code(self) -> int:
        if self.stopped:
            return EXIT_STOPPED
        return EXIT_PARTIAL if self.skipped else EXIT_OK


@dataclass
class RankCounters:
    """What one rank's encode loop did; the ranks' counters are summed into the EncodeSummary."""

    clips: int = 0
    views: int = 0
    frames: int = 0
    bytes_written: int = 0
    shards: int = 0
    backoffs: list[str] = field(default_factory=list)
    stopped: str | None = None
    """The signal that ended this rank's loop early, if one did."""

    def add_to(self, summary: EncodeSummary) -> None:
        summary.clips += self.clips
        summary.views += self.views
        summary.frames += self.frames
        summary.bytes_written += self.bytes_written
        summary.shards += self.shards
        summary.backoffs.extend(self.backoffs)
        if self.stopped and not summary.stopped:
            summary.stopped = self.stopped
