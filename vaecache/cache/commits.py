"""OUT as a run writes it and verify repairs it, chosen once from its store: on disk the append-only progress logs and
rename-based commits (outdir.DiskOut), in object storage one commit record per shard and a local work folder
(objects.ObjectOut). Both offer the operations `CacheOut` names; what calls them holds a `CacheOut` and does not know
which protocol it is."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from vaecache.cache.objects import ObjectOut
from vaecache.cache.outdir import DiskOut
from vaecache.cache.store import LocalStore, ObjectStore, Store

if TYPE_CHECKING:
    from vaecache.cache.io import AppendLog
    from vaecache.cache.outdir import PreparedOut
    from vaecache.cache.progress import CommittedIds
    from vaecache.cache.reader import CacheReader


class CacheOut(Protocol):
    """What a run and the shard writer ask of OUT. The disk code runs in `folder` (OUT itself, or the work folder of
    an OUT at a URL); `mirror` says how a file written there reaches OUT."""

    store: Store
    folder: Path

    def where(self, name: str = "") -> Any:
        """OUT (or OUT/name) as the user named it, for messages."""

    # --- before the run's fingerprint is known
    def pull_start(self) -> None:
        """What can be told about OUT without the run fingerprint; an object store's records fetched."""

    def recorded_encoder_impl(self) -> str | None:
        """The encoder implementation the run record names (a resume with `auto` takes it)."""

    def recorded_cpu_threads(self) -> int | None:
        """The CPU thread count the run record names (a CPU resume computes with it)."""

    def looked_empty(self) -> bool:
        """OUT held no run, no manifest and no commit when this process looked: a guess that nothing in it is done,
        which a run may act on early (`prepare` decides)."""

    def probes_folder(self) -> Path:
        """The folder of per-rank probe-cache files."""

    # --- rank 0 takes OUT
    def prepare(self, fingerprint: dict[str, Any], overwrite: bool, job_id: str | None,
                sources: dict[str, dict[str, Any]] | None, committed: CommittedIds | None,
                allow_other_numerics: bool = False, extra_numerics: Sequence[dict[str, Any]] = ()) -> PreparedOut:
        """OUT prepared for this run under its lock (held until `end_run`)."""

    def begin_again(self, attempt: int, fingerprint: dict[str, Any], sources: dict[str, dict[str, Any]] | None,
                    committed: CommittedIds | None, extra_numerics: Sequence[dict[str, Any]] = ()) -> PreparedOut:
        """A finished cache about to change (the dataset grew)."""

    # --- every rank writes
    def probes_file(self, rank: int) -> Path:
        """This rank's probe-cache file in `folder`."""

    def log_file(self, rank: int) -> Path:
        """This rank's log in `folder` (its folder made)."""

    def failure_log_file(self, rank: int) -> Path:
        """This rank's failure log in `folder`."""

    def progress_log(self, rank: int) -> AppendLog:
        """This rank's fsynced append-only progress log in `folder`."""

    def mirror(self, path: Path) -> Callable[[], None] | None:
        """A function that publishes the local file `path` to OUT (None: it is in OUT already)."""

    def write_shard(self, file: str, data: bytes) -> None:
        """A shard's bytes, whole or not at all."""

    def commit(self, file: str, line: str) -> None:
        """A written shard committed (`line`: its progress line); in object storage the commit record's PUT may still
        be under way when this returns (`settle`)."""

    def settle(self) -> None:
        """Every commit this process made is there (finalize settles before the manifest)."""

    def leave_torn_shard(self, file: str, data: bytes) -> None:
        """Fault injection: what a write cut short leaves."""

    # --- rank 0 ends the run
    def finished(self) -> CacheReader:
        """The finished cache as prepare found it."""

    def numerics_history(self) -> list[dict[str, Any]]:
        """The numerics earlier runs of this cache recorded."""

    def finalize(self, header: dict[str, Any],
                 only_writer: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The committed shards made into the tables and the manifest (last), published; the manifest and the
        failure records."""

    def end_run(self, rank: int, attempt: int, log_file: Path, holds_lock: bool) -> None:
        """The end of a rank's run: its log published; the lock released by its holder."""

    def close(self) -> None:
        """What this process made for OUT (an object store's work folder) removed."""


def open_out(store: Store, work: Path | None = None) -> DiskOut | ObjectOut:
    """OUT's commit protocol over `store` (`work`: the work folder of an object store; default a new temp folder,
    removed by `close`)."""
    if isinstance(store, ObjectStore):
        return ObjectOut(store, work=work)
    assert isinstance(store, LocalStore)
    return DiskOut(store)


__all__ = ["CacheOut", "open_out"]
