"""The settings of encode, plan and verify, frozen and validated: encode's and plan's built from the parts of
vaecache.settings.parts (index's are sources/indexing.py:IndexConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vaecache.distributed.mesh import make_mesh
from vaecache.errors import UsageError
from vaecache.settings.clip import ClipSettings
from vaecache.settings.parts import (
    AudioConfig,
    ConditionsConfig,
    DecodeConfig,
    OutConfig,
    ParallelConfig,
    SourceConfig,
    TextConfig,
    VaeConfig,
)


@dataclass(frozen=True)
class EncodeConfig:
    """Everything `vaecache encode` needs, in parts (vaecache.settings.parts), each handed to the stage that uses
    it: DATA and how it is read, the VAE, the clip settings (what changes the stored latents), the decode, the
    ranks, OUT, and the sets added once the cache is finished."""

    source: SourceConfig
    vae: VaeConfig
    clip: ClipSettings
    out: OutConfig
    decode: DecodeConfig = DecodeConfig()
    parallel: ParallelConfig = ParallelConfig()
    text: TextConfig = TextConfig()
    conditions: ConditionsConfig = ConditionsConfig()
    audio: AudioConfig = AudioConfig()
    progress: bool = True
    """A progress display on rank 0 (the CLI's)."""


@dataclass(frozen=True)
class VerifyOptions:
    """What `vaecache verify` checks beyond integrity."""

    quick: bool = False
    """Sizes and headers only: no hashing, no value checks."""
    threads: int | None = None
    dataset: Path | None = None
    """Re-plan clips from this source with the recorded settings and compare coverage."""
    reencode: int = 0
    """Re-encode this many clips (chosen by `seed`) and compare with what is stored."""
    vae: str | None = None
    """VAE for --reencode; default: the spec recorded in the manifest. Must match the fingerprint."""
    seed: int = 0
    device: str = "auto"
    allow_pickle_weights: bool = False
    tolerance: float | None = None
    """--reencode: max abs difference over max abs stored value; None: REENCODE_TOLERANCE of the stored dtype."""
    repair: bool = False
    """Delete stray shards (files or objects) first, under OUT's lock."""
    storage_options: tuple[tuple[str, Any], ...] = ()
    """fsspec options for a URL OUT (and a URL --dataset)."""

    def __post_init__(self) -> None:
        if self.reencode < 0:
            raise UsageError(f"--reencode must be >= 0, got {self.reencode}")
        if self.threads is not None and self.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {self.threads}")
        if self.tolerance is not None and not 0 <= self.tolerance < float("inf"):
            raise UsageError(f"--tolerance must be a fraction >= 0, got {self.tolerance}")


@dataclass(frozen=True)
class PlanConfig:
    """What `vaecache plan` is asked: the parts an encode would start from (DATA, the VAE, the clip settings, the
    decode, the ranks), and the cluster shape and report to plan for."""

    source: SourceConfig
    vae: VaeConfig
    clip: ClipSettings
    decode: DecodeConfig = DecodeConfig()
    """As for encode: the decoder backend is resolved for its workers."""
    parallel: ParallelConfig = ParallelConfig()
    """As for encode: "spatial" plans one view per forward and checks the VAE can be split into bands."""
    world_size: int = 1
    memory_budget: int | None = None
    """Bytes of device memory one rank may use; the report then gives the largest micro-batch that fits."""
    measure: bool = True
    """Encode one real clip to measure time and memory (off: planning only)."""
    clip_ids: bool = True
    """List every DP group's clip ids in the report (--json); off, the groups are only counted (fast at 10M)."""

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise UsageError(f"--world-size must be an integer >= 1, got {self.world_size!r}")
        if self.memory_budget is not None and self.memory_budget < 1:
            raise UsageError(f"--memory-budget must be positive, got {self.memory_budget}")
        make_mesh(0, self.world_size, self.parallel.sp_size)  # sp_size must divide world_size
