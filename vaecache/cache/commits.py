"""OUT as a run writes it and verify repairs it, chosen once from its store: on disk the append-only progress logs and
rename-based commits (outdir.DiskOut), in object storage one commit record per shard and a local work folder
(objects.ObjectOut). Both offer the same operations; what calls them does not know which it holds."""

from __future__ import annotations

from pathlib import Path

from vaecache.cache.objects import ObjectOut
from vaecache.cache.outdir import DiskOut
from vaecache.cache.store import LocalStore, ObjectStore, Store


def open_out(store: Store, work: Path | None = None) -> DiskOut | ObjectOut:
    """OUT's commit protocol over `store` (`work`: the work folder of an object store; default a new temp folder,
    removed by `close`)."""
    if isinstance(store, ObjectStore):
        return ObjectOut(store, work=work)
    assert isinstance(store, LocalStore)
    return DiskOut(store)


__all__ = ["open_out"]
