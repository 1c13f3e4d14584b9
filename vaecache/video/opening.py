"""Where a VideoReader's bytes come from besides a plain read of a local file: a local file checked before FFmpeg opens
it, an object in object storage opened for ranged reads (planned by its timeline, or read ahead front to back), the
byte ranges opening a container reads (a timeline's `head`), and what a failed read of an object says."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

from vaecache.errors import VideoDecodeError, first_line
from vaecache.storage import HeldObjects, open_url
from vaecache.video.planned_reads import planned_reads
from vaecache.video.timeline import Timeline


def read_problem(exc: OSError, doing: str) -> str:
    """Why a read of an object at a URL failed: changed since it was listed (every read is conditional on the
    listed ETag, and the store refused it: s3fs's FileExpired), or `doing` and the error."""
    if type(exc).__name__ == "FileExpired":
        return ("changed since it was listed (the store no longer has the version it was planned from): its frames "
                "may not be the ones planned; run again")
    return f"{doing} ({first_line(exc, 200)})"


URL_IO_BUFFER = 4 << 10
"""Bytes FFmpeg asks per read of an object at a URL that a probe opens (recording what opening it reads: its
timeline's `head`) or that is read in planned ranges: the head and how far a seek may be read through instead of
jumped over are multiples of it (PyAV's default, 32 KiB, read eight times as much of a clip's surroundings; the
bytes come from vaecache's read cache, not one GET each)."""
RANGED_MIN_CLIPS = 8
"""A video at a URL with a timeline that holds at least this many clips is read in ranges however small it is (a
decode worker reads its clip's GOPs, not the object); a smaller one with fewer is read whole by its first GET."""


def open_object(path: str, held: HeldObjects | None = None, timeline: Timeline | None = None,
                 clip: tuple[int, int] | None = None) -> Any:
    """An object in object storage opened for ranged reads, checked there and not empty (VideoDecodeError naming it
    otherwise). With a timeline that has byte ranges, its reads are planned (planned_reads.py: the container's
    header and index, then each clip's GOPs); without, read ahead from front to back."""
    plan: list[tuple[int, int]] | None = None
    whole_if_small = True
    if timeline is not None and timeline.has_bytes:
        plan = list(timeline.head)
        count = timeline.frame_count()
        whole_if_small = not (clip and count and count >= RANGED_MIN_CLIPS * (clip[1] - clip[0] + 1))
    try:
        handle = open_url(path, held=held, sequential=plan is None,
                          read_cache=planned_reads(plan) if plan is not None else None, whole_if_small=whole_if_small)
    except FileNotFoundError:
        raise VideoDecodeError(path, "no such object") from None
    except IsADirectoryError:
        raise VideoDecodeError(path, "not an object (a prefix)") from None
    except OSError as exc:
        raise VideoDecodeError(path, f"cannot read ({first_line(exc, 200)})") from None
    if not getattr(handle, "size", 1):
        handle.close()
        raise VideoDecodeError(path, "empty object (0 bytes)")
    return handle


class RecordingReads:
    """A file whose reads are kept as byte ranges while `recording` (what opening a container reads)."""

    def __init__(self, file: Any) -> None:
        self._file = file
        self.recording = True
        self.ranges: list[tuple[int, int]] = []

    def read(self, size: int = -1) -> bytes:
        start = self._file.tell()
        data = self._file.read(size)
        if self.recording and data:
            self.ranges.append((start, start + len(data)))
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True


def check_file(path: str) -> None:
    file = Path(path)
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        raise VideoDecodeError(path, "broken symlink" if file.is_symlink() else "file not found") from None
    except PermissionError:
        raise VideoDecodeError(path, "permission denied") from None
    except OSError as exc:
        reason = "symlink loop" if exc.errno == errno.ELOOP else f"cannot read ({exc.strerror or exc})"
        raise VideoDecodeError(path, reason) from None
    if not file.is_file():
        raise VideoDecodeError(path, "not a regular file")
    if size == 0:
        raise VideoDecodeError(path, "empty file (0 bytes)")
    try:
        with open(file, "rb"):
            pass
    except PermissionError:
        raise VideoDecodeError(path, "permission denied") from None


__all__ = ["RANGED_MIN_CLIPS", "URL_IO_BUFFER", "RecordingReads", "check_file", "open_object", "read_problem"]
