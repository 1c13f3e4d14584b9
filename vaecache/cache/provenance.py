"""What a cache was made from: each source video's identity (size, mtime_ns, and sha256 with --hash-sources),
recorded in run.json for resume and in every clip record for `verify --dataset` (stale latents)."""

from __future__ import annotations

import datetime as _dt
import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from vaecache.cache.io import sha256_file


def source_identity(path: str, with_hash: bool) -> dict[str, Any] | None:
    """{size, mtime_ns[, sha256]} of a source video, or None when it cannot be read."""
    try:
        stat = os.stat(path)
        found: dict[str, Any] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        if with_hash:
            found["sha256"] = sha256_file(Path(path))
    except OSError:
        return None
    return found


def source_identities(paths: Sequence[str], with_hash: bool) -> dict[str, dict[str, Any]]:
    """Path -> {size, mtime_ns[, sha256]} of each source that exists (a missing one is a recorded failure)."""
    workers = min(8, max(1, len(paths))) if with_hash else 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        found = dict(zip(paths, pool.map(lambda path: source_identity(path, with_hash), paths)))
    return {path: value for path, value in found.items() if value is not None}


class IdentityMemo:
    """Source identities, each file looked at once while it is among the last `size` used (a rank's clips
    come scene after scene, so a scene's videos are stat'ed, or hashed, once). Bounded memory."""

    def __init__(self, with_hash: bool, size: int = 4096) -> None:
        self.with_hash, self.size = with_hash, size
        self._known: OrderedDict[str, dict[str, Any] | None] = OrderedDict()

    def get(self, path: str) -> dict[str, Any] | None:
        if path in self._known:
            self._known.move_to_end(path)
            return self._known[path]
        found = self._known[path] = source_identity(path, self.with_hash)
        if len(self._known) > self.size:
            self._known.popitem(last=False)
        return found

    def of_clip(self, paths: Sequence[str]) -> list[dict[str, Any]] | None:
        """One identity per camera, aligned with the clip's sources; None when one cannot be read."""
        found = [self.get(path) for path in paths]
        return None if any(item is None for item in found) else [dict(item) for item in found]  # type: ignore[arg-type]


def _when(mtime_ns: Any) -> str:
    try:
        return _dt.datetime.fromtimestamp(int(mtime_ns) / 1e9, _dt.timezone.utc).isoformat(timespec="seconds")
    except (TypeError, ValueError, OverflowError, OSError):
        return str(mtime_ns)


def identity_change(recorded: dict[str, Any], current: dict[str, Any] | None) -> str | None:
    """What changed between the identity recorded at encode time and the file now, or None when unchanged:
    gone, size, then the content hash where both have one, else the modification time."""
    if current is None:
        return "missing or unreadable"
    if recorded.get("size") != current.get("size"):
        return f"size {recorded.get('size')} -> {current.get('size')} bytes"
    if recorded.get("sha256") and current.get("sha256"):
        return "content differs (sha256)" if recorded["sha256"] != current["sha256"] else None
    if recorded.get("mtime_ns") != current.get("mtime_ns"):
        return f"modified (mtime {_when(recorded.get('mtime_ns'))} -> {_when(current.get('mtime_ns'))})"
    return None


__all__ = ["IdentityMemo", "identity_change", "source_identities", "source_identity"]
