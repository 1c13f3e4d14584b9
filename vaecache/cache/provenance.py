"""What a cache was made from: each source video's identity (size, mtime_ns, and sha256 with --hash-sources),
recorded in run.json for resume and in every clip record for `verify --dataset` (stale latents)."""

from __future__ import annotations

import datetime as _dt
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from vaecache.cache.io import sha256_file


def source_identity(path: Any, with_hash: bool) -> dict[str, Any] | None:
    """{size, mtime_ns[, sha256]} of a source video, or of an image sequence's frames together (a FrameList, a frame
    folder or glob), or None when it cannot be read."""
    from vaecache.errors import VideoDecodeError
    from vaecache.storage import url_sha256
    from vaecache.urls import is_url
    from vaecache.video.frames import frame_files, is_image_source
    from vaecache.video.identity import source_stat
    from vaecache.video.members import member_of, member_sha256
    from vaecache.video.spans import file_of

    try:
        if is_image_source(path):  # the frames' bytes, in order, are hashed together
            return frames_identity(frame_files(path), with_hash)
        size, mtime_ns = source_stat(path)
        found: dict[str, Any] = {"size": size, "mtime_ns": mtime_ns}
        if with_hash:  # a tar member's own bytes; an episode's whole file
            member = member_of(path)
            if member is not None:
                found["sha256"] = member_sha256(member)
            elif is_url(path):
                found["sha256"] = url_sha256(path)
            else:
                found["sha256"] = sha256_file(Path(file_of(path)))
    except (OSError, VideoDecodeError):
        return None
    return found


def source_identities(paths: Sequence[Any], with_hash: bool) -> dict[str, dict[str, Any]]:
    """Path (a FrameList's key) -> {size, mtime_ns[, sha256]} of each source that exists (a missing one is a
    recorded failure)."""
    workers = min(8, max(1, len(paths))) if with_hash else 1
    names = [getattr(path, "key", path) for path in paths]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        found = dict(zip(names, pool.map(lambda path: source_identity(path, with_hash), paths)))
    return {path: value for path, value in found.items() if value is not None}


class IdentityMemo:
    """Source identities, each file looked at once while it is among the last `size` used (a rank's clips
    come scene after scene, so a scene's videos are stat'ed, or hashed, once). Bounded memory."""

    def __init__(self, with_hash: bool, size: int = 4096) -> None:
        self.with_hash, self.size = with_hash, size
        self._known: OrderedDict[str, dict[str, Any] | None] = OrderedDict()

    def get(self, path: str) -> dict[str, Any] | None:
        from vaecache.video.spans import file_of

        path = file_of(path) if isinstance(path, str) else path  # the episodes of one file: the file, looked at once
        if path in self._known:
            self._known.move_to_end(path)
            return self._known[path]
        found = self._known[path] = source_identity(path, self.with_hash)
        if len(self._known) > self.size:
            self._known.popitem(last=False)
        return found

    def of_clip(self, paths: Sequence[str], read: dict[int, dict[str, Any]] | None = None,
                frame_files: dict[str, list[str]] | None = None,
                cameras: Sequence[str] = ()) -> list[dict[str, Any]] | None:
        """One identity per camera, aligned with the clip's sources; None when one cannot be read. `read`: the
        identity of image-sequence cameras (by camera index) over the clip's frame files, as they were decoded;
        with hash_sources their sha256 is that of the files' bytes in order (`frame_files`, by camera name)."""
        found = []
        for camera, path in enumerate(paths):
            if read and camera in read:
                item = dict(read[camera])
                if self.with_hash and frame_files and camera < len(cameras):
                    try:
                        item["sha256"] = frames_sha256(frame_files[cameras[camera]])
                    except OSError:
                        return None
                found.append(item)
            else:
                known = self.get(path)
                if known is None:
                    return None
                found.append(dict(known))
        return found


def frames_sha256(files: Sequence[str]) -> str:
    """sha256 over an image sequence's frame files' bytes, in order."""
    import hashlib

    from vaecache.storage import open_location

    digest = hashlib.sha256()
    for file in files:
        with open_location(file) as handle:  # a local file, or a frame at a URL
            for block in iter(lambda: handle.read(1 << 20), b""):  # noqa: B023 (used at once)
                digest.update(block)
    return digest.hexdigest()


def frames_identity(files: Sequence[str], with_hash: bool) -> dict[str, Any] | None:
    """{size, mtime_ns[, sha256]} over an image-sequence clip's frame files (see of_clip), None when one is gone."""
    from vaecache.errors import VideoDecodeError
    from vaecache.video.frames import files_identity

    try:
        size, newest = files_identity(files)  # local files, or frames at URLs (listed where there are many)
        return {"size": size, "mtime_ns": newest, **({"sha256": frames_sha256(files)} if with_hash else {})}
    except (OSError, VideoDecodeError):
        return None


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


__all__ = ["IdentityMemo", "changed_source", "frames_identity", "frames_sha256", "identity_change", "source_identities",
           "source_identity"]


def changed_source(record: dict[str, Any]) -> tuple[str, str, str] | None:
    """(source, camera, what changed) for the first camera of a clip record whose source's size, mtime (or sha256,
    where recorded) differs from its recorded identity: the clip's latents no longer match it. None: all as
    recorded (or nothing recorded)."""
    files = record.get("frame_files") if isinstance(record.get("frame_files"), dict) else {}
    for camera, path, recorded in zip(record["cameras"], record["sources"], record.get("source_identity") or []):
        with_hash = bool(recorded.get("sha256"))
        now = frames_identity(files[camera], with_hash) if files.get(camera) else source_identity(path, with_hash)
        change = identity_change(recorded, now)
        if change is not None:
            return path, camera, change
    return None
