"""A video's frame index as its probe keeps it (Timeline): what frame-exact seeking needs, so that a reader opened
with it demuxes no packet to find its frames and, for an object at a URL, reads only a clip's bytes.

It holds every frame's presentation timestamp, as an affine rule (start, step, count) where the stream is constant
frame rate, the packed list where it is not; the keyframes (frame number, the timestamp a seek asks for, and the
byte range from the keyframe's packet to the end of the last packet of a frame shown before the next keyframe: its
GOP's bytes); and the byte ranges opening the container read (its header and index: an mp4's `ftyp` and `moov`).
Lists are packed as base64 of zlib-compressed little-endian int64 deltas: a one-hour 30 fps video with a keyframe
every two seconds keeps about 9 KB (scripts/bench_read.py --timeline-only). The packed text is kept as read and
unpacked only by the reader that uses it, so an index of ten million clips costs its planner the strings.

A Timeline belongs to one version of one file: the probe that carries it has the file's size and mtime (an object's
reads are conditional on its ETag), and a changed file is refused before its timeline is used. Pure: no I/O.
"""

from __future__ import annotations

import base64
import bisect
import functools
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from vaecache.errors import DatasetError

TIMELINE_VERSION = 1
"""The layout of a probe's `timeline` (its "v"); a reader refuses a version it does not know and probes again."""
KEY_COLUMNS = ("frame", "seek_ts", "byte_start", "byte_end")
"""Per keyframe, packed in this order; byte_start / byte_end -1: the container gave no byte positions."""


def pack(values: np.ndarray) -> str:
    """int64 values (any shape, C order) as base64 of zlib-compressed little-endian deltas along axis 0."""
    array = np.asarray(values, dtype=np.int64)
    deltas = np.diff(array, axis=0, prepend=np.zeros_like(array[:1])) if len(array) else array
    return base64.b64encode(zlib.compress(deltas.astype("<i8").tobytes(), 9)).decode("ascii")


def unpack(text: str, columns: int = 1) -> np.ndarray:
    """The int64 array `pack` packed, shaped (n, columns) (or (n,) for one column); ValueError when damaged."""
    try:
        raw = zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True))
    except (ValueError, zlib.error) as exc:
        raise ValueError(f"not packed int64 deltas ({exc})") from None
    if len(raw) % (8 * columns):
        raise ValueError(f"{len(raw)} bytes are not whole rows of {columns} int64")
    deltas = np.frombuffer(raw, dtype="<i8").reshape(-1, columns) if columns > 1 else np.frombuffer(raw, dtype="<i8")
    return np.cumsum(deltas, axis=0, dtype=np.int64)


@dataclass(frozen=True)
class Keyframe:
    frame: int
    """The keyframe's frame number (its index in presentation order)."""
    seek_ts: int
    """Timestamp to seek to (its dts where known: demuxers index by it)."""
    pts: int
    byte_start: int = -1
    """Offset of its packet in the file; -1 unknown."""
    byte_end: int = -1
    """End of the last packet of a frame shown from it to the next keyframe; -1 unknown."""


@dataclass(frozen=True)
class Timeline:
    """One video's frame index (see the module docstring). Build with `Timeline.build`, read with `from_json`."""

    pts_rule: tuple[int, int, int] | None
    """(first pts, step, frame count) of a constant-frame-rate stream; None where `pts_packed` lists them."""
    pts_packed: str | None
    keys_packed: str
    head: tuple[tuple[int, int], ...] = ()
    """Byte ranges [start, end) opening the container read (recorded for objects at URLs; empty otherwise)."""
    rotation: int = 0
    """Counter-clockwise display rotation in degrees, as the reader found it on the first frame."""

    def __post_init__(self) -> None:
        if (self.pts_rule is None) == (self.pts_packed is None):
            raise DatasetError("a timeline has a pts rule or a pts list, exactly one")
        if self.pts_rule is not None and (self.pts_rule[2] < 1 or (self.pts_rule[2] > 1 and self.pts_rule[1] < 1)):
            raise DatasetError(f"timeline pts rule {self.pts_rule}: needs a frame count >= 1 and a positive step")
        if self.rotation % 90 or any(not 0 <= a < b for a, b in self.head):
            raise DatasetError("a timeline's rotation is a multiple of 90 and its head ranges [start, end) ascending")

    @classmethod
    def build(cls, pts: Sequence[int], keyframes: Sequence[Keyframe], head: Sequence[tuple[int, int]] = (),
              rotation: int = 0) -> Timeline:
        """From the ascending pts of every shown frame and the keyframes in frame order."""
        values = np.asarray(pts, dtype=np.int64)
        rule: tuple[int, int, int] | None = None
        if len(values) == 1:
            rule = (int(values[0]), 0, 1)
        elif len(values) > 1:
            step = int(values[1] - values[0])
            if step > 0 and np.array_equal(values, values[0] + step * np.arange(len(values), dtype=np.int64)):
                rule = (int(values[0]), step, len(values))
        keys = np.array([(k.frame, k.seek_ts, k.byte_start, k.byte_end) for k in keyframes],
                        dtype=np.int64).reshape(-1, len(KEY_COLUMNS))
        return cls(rule, None if rule is not None else pack(values), pack(keys), tuple(merged(head)), rotation)

    # ------------------------------------------------------------------ unpacked on use

    @functools.cached_property
    def _pts(self) -> list[int]:
        if self.pts_rule is not None:
            first, step, count = self.pts_rule
            return list(range(first, first + step * count, step)) if count > 1 else [first]
        return unpack(self.pts_packed).tolist()  # type: ignore[arg-type]

    def pts(self) -> list[int]:
        """Every shown frame's pts, ascending (ValueError when the packed list is damaged or not ascending)."""
        found = self._pts
        if not found or any(b <= a for a, b in zip(found, found[1:])):
            raise ValueError("the frame times are not strictly ascending")
        return found

    def frame_count(self) -> int | None:
        """How many frames the video has (None where the packed list is damaged)."""
        if self.pts_rule is not None:
            return self.pts_rule[2]
        try:
            return len(self._pts)
        except ValueError:
            return None

    def keyframes(self) -> list[Keyframe]:
        """The keyframes in frame order (ValueError when damaged: out of range, unordered)."""
        pts = self.pts()
        keys = unpack(self.keys_packed, len(KEY_COLUMNS)).tolist()
        if not keys or any(not 0 <= row[0] < len(pts) for row in keys) or any(
                b[0] <= a[0] for a, b in zip(keys, keys[1:])):
            raise ValueError("the keyframes are not frame numbers of the video in ascending order")
        return [Keyframe(frame, seek_ts, pts[frame], start, end) for frame, seek_ts, start, end in keys]

    @property
    def has_bytes(self) -> bool:
        """Whether the keyframes carry byte ranges (a container that gives packet positions)."""
        return all(row[2] >= 0 and row[3] > row[2] for row in unpack(self.keys_packed, len(KEY_COLUMNS)).tolist())

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> dict[str, Any]:
        found: dict[str, Any] = {"v": TIMELINE_VERSION}
        found["pts"] = list(self.pts_rule) if self.pts_rule is not None else self.pts_packed
        found["keys"] = self.keys_packed
        if self.head:
            found["head"] = [list(part) for part in self.head]
        if self.rotation:
            found["rotation"] = self.rotation
        return found

    @classmethod
    def from_json(cls, raw: Any, where: str) -> Timeline:
        """Check one probe's `timeline` by its shape (the packed lists are unpacked only where used); a wrong one is a
        DatasetError naming `where`."""
        try:
            if not isinstance(raw, dict) or raw.get("v") != TIMELINE_VERSION or set(raw) - {"v", "pts", "keys",
                                                                                               "head", "rotation"}:
                raise ValueError(f"version {TIMELINE_VERSION} with v, pts, keys and optionally head, rotation")
            pts, keys = raw["pts"], raw["keys"]
            head = raw.get("head", [])
            rotation = raw.get("rotation", 0)
            rule = None
            if isinstance(pts, list):
                if len(pts) != 3 or not all(type(value) is int for value in pts):
                    raise ValueError("pts is [first, step, count] or a packed list")
                rule = (pts[0], pts[1], pts[2])
            elif not isinstance(pts, str):
                raise ValueError("pts is [first, step, count] or a packed list")
            if not isinstance(keys, str) or type(rotation) is not int or not isinstance(head, list) or not all(
                    isinstance(part, list) and len(part) == 2 and all(type(v) is int for v in part) for part in head):
                raise ValueError("keys is a packed list, head a list of [start, end], rotation an integer")
            return cls(rule, None if rule is not None else pts, keys, tuple((a, b) for a, b in head), rotation)
        except (ValueError, KeyError, DatasetError) as exc:
            raise DatasetError(f"{where}: probe field \"timeline\" is not a frame index ({exc})") from None


def merged(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges [start, end) sorted, the overlapping and touching ones joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def gop_bytes(keyframes: Sequence[Keyframe], first: int, last: int) -> tuple[int, int] | None:
    """The bytes [start, end) a decode of frames `first`..`last` reads from the keyframe at or before `first`: from
    its packet to the end of the last GOP it passes (None where the keyframes carry no byte ranges)."""
    frames = [key.frame for key in keyframes]
    lo = max(0, bisect.bisect_right(frames, first) - 1)
    hi = max(lo, bisect.bisect_right(frames, last) - 1)
    span = keyframes[lo:hi + 1]
    if any(key.byte_start < 0 or key.byte_end <= key.byte_start for key in span):
        return None
    return span[0].byte_start, max(key.byte_end for key in span)
