"""The run: one rank's encode as one object, handed down instead of threaded arguments: the rank's context, OUT
(its commit protocol, over its store), what start-up found and resolved, the parts of the settings the encode loop
reads, the stop flag and whom to report to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from vaecache.cache.commits import CacheOut
    from vaecache.distributed.context import DistContext
    from vaecache.encode.startup import StartUp
    from vaecache.meter import Advance, MeterFactory
    from vaecache.settings.clip import ClipSettings
    from vaecache.settings.parts import OutConfig
    from vaecache.stop import StopRequest
    from vaecache.storage import HeldObjects


@dataclass(frozen=True)
class Reporting:
    """Whom an encode reports to: `on_progress(clips_done_now, clips_of_this_rank)` after each batch; `meter`
    shows the probing of this rank's scenes and then its clips; `on_failure(record)` gets each failure record (an
    input that produced no clip) this rank writes, as it writes it."""

    on_progress: Advance | None = None
    meter: MeterFactory | None = None
    on_failure: Callable[[dict[str, Any]], None] | None = None


@dataclass(frozen=True)
class EncodeRun:
    """One rank's encode, once start-up is done. `out` is OUT's commit protocol (vaecache.cache.commits.CacheOut:
    DiskOut or ObjectOut); the disk code runs in `out.folder` (OUT itself, or this rank's work folder for OUT in
    object storage)."""

    ctx: DistContext
    out: CacheOut
    start: StartUp
    stop: StopRequest
    started: float
    """time.perf_counter() when the command started."""
    writing: OutConfig
    """How shards are written and committed (size, interval, source hashing)."""
    on_error: str
    """--on-error: "fail" stops at the first input that cannot be used."""
    workers: int
    """Decode worker processes of this rank."""
    sp_mode: str
    held: HeldObjects | None
    """The small videos at URLs probing read whole, for the decode workers' first batches."""
    reporting: Reporting = Reporting()

    @property
    def clip(self) -> ClipSettings:
        """The clip settings this run encodes with and records: start-up's resolution of the ones asked."""
        return self.start.clip


__all__ = ["EncodeRun", "Reporting"]
