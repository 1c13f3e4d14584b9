"""A video's frame index as its probe keeps it (Timeline): what frame-exact seeking needs, so that a reader opened
with it demuxes no packet to find its frames and, for an object at a URL, reads only a clip's bytes.

It holds every frame's presentation timestamp, as an affine rule (start, step, count) where the stream is constant
frame rate, the packed list where it is not; the keyframes (frame number, the timestamp a seek asks for, and the
byte range from the keyframe's packet to the end of the last packet of a frame shown before the next keyframe: its
GOP's bytes); the byte ranges opening the container read (its header and index: an mp4's `ftyp` and `moov`); and
the display rotation. A probe records it as one text, `v1|PTS|KEYS|HEAD|ROTATION`: PTS `FIRST,STEP,COUNT` or
`*PACKED`, KEYS `PACKED` (rows of KEY_COLUMNS), HEAD `START,END,START,END...` (empty: none recorded), ROTATION
degrees. PACKED is base64 of zlib-compressed little-endian int64 deltas, row by row: a one-hour 30 fps video with a
keyframe every two seconds keeps about 15 KB (scripts/bench_read.py --workload clips). The text is kept as read and
checked and unpacked only by the reader that uses it, so a planner of a million probed videos holds a million short
strings, and an index line's timeline costs its parse one JSON string.

A Timeline belongs to one version of one file: the probe that carries it has the file's size and mtime (an object's
reads are conditional on its ETag), and a changed file is refused before its timeline is used. Pure: no I/O.
"""

from __future__ import annotations

import base64
import bisect
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from vaecache.errors import DatasetError

TIMELINE_VERSION = 1
"""The layout of a probe's `timeline` (its `v1|` prefix): an index line with another is refused naming the line, a
probe-cache record with another is probed again."""
KEY_COLUMNS = ("frame", "seek_ts", "byte_start", "byte_end")
"""Per keyframe, packed in this order; byte_start / byte_end -1: the container gave no byte positions."""
MAX_FRAMES = 1 << 24
"""The most frames a timeline may claim where nothing tells how many the video has (16.7 M: 77 hours at 60 fps); a
probe's frame count, and the file's size in bytes (a frame takes at least one), bound it more tightly."""


def pack(values: np.ndarray) -> str:
    """int64 values (any shape, C order) as base64 of zlib-compressed little-endian deltas along axis 0."""
    array = np.asarray(values, dtype=np.int64)
    deltas = np.diff(array, axis=0, prepend=np.zeros_like(array[:1])) if len(array) else array
    return base64.b64encode(zlib.compress(deltas.astype("<i8").tobytes(), 9)).decode("ascii")


def unpack(text: str, columns: int = 1, max_rows: int = MAX_FRAMES) -> np.ndarray:
    """The int64 array `pack` packed, shaped (n, columns) (or (n,) for one column); ValueError when damaged or when it
    would hold more than `max_rows` rows (checked while inflating: nothing larger is ever allocated)."""
    limit = 8 * columns * max_rows
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(base64.b64decode(text.encode("ascii"), validate=True), limit + 1)
    except (ValueError, zlib.error) as exc:
        raise ValueError(f"not packed int64 deltas ({exc})") from None
    if len(raw) > limit:
        raise ValueError(f"its packed list holds more than {max_rows} rows, more than the video can have")
    if not inflater.eof:
        raise ValueError("not packed int64 deltas (the compressed stream is cut short)")
    if len(raw) % (8 * columns):
        raise ValueError(f"{len(raw)} bytes are not whole rows of {columns} int64")
    deltas = np.frombuffer(raw, dtype="<i8").reshape(-1, columns) if columns > 1 else np.frombuffer(raw, dtype="<i8")
    return np.cumsum(deltas, axis=0, dtype=np.int64)


@dataclass(frozen=True)
class Keyframe:
    frame: int
    """The keyframe's frame number (its index in presentation order)."""
    seek_ts: int
    """Its dts where known (else its pts): what the reader seeks to where seeking by pts overshoots (an AVI index)."""
    pts: int
    byte_start: int = -1
    """Offset of its packet in the file; -1 unknown."""
    byte_end: int = -1
    """End of the last packet of a frame shown from it to the next keyframe; -1 unknown."""


class Timeline:
    """One video's frame index (see the module docstring). Build with `Timeline.build`, read with `from_json`.

    Held as one short text (`text`: the pts rule or packed list, the packed keyframes, the head ranges, the
    rotation), its parts unpacked on first use: a planner of a million probed videos holds a million of these."""

    __slots__ = ("text", "_parts", "_limit")

    def __init__(self, pts_rule: tuple[int, int, int] | None, pts_packed: str | None, keys_packed: str,
                 head: Sequence[tuple[int, int]] = (), rotation: int = 0) -> None:
        if (pts_rule is None) == (pts_packed is None):
            raise DatasetError("a timeline has a pts rule or a pts list, exactly one")
        if pts_rule is not None and (pts_rule[2] < 1 or (pts_rule[2] > 1 and pts_rule[1] < 1)):
            raise DatasetError(f"timeline pts rule {tuple(pts_rule)}: needs a frame count >= 1 and a positive step")
        if rotation % 90 or any(not 0 <= a < b for a, b in head) or "|" in keys_packed + (pts_packed or ""):
            raise DatasetError("a timeline's rotation is a multiple of 90 and its head ranges [start, end) ascending")
        pts = ",".join(map(str, pts_rule)) if pts_rule is not None else f"*{pts_packed}"
        ranges = ",".join(str(value) for part in head for value in part)
        self.text = f"v{TIMELINE_VERSION}|{pts}|{keys_packed}|{ranges}|{rotation}"
        self._parts: tuple[Any, ...] | None = None
        self._limit = MAX_FRAMES

    @classmethod
    def _of_text(cls, text: str, limit: int = MAX_FRAMES) -> Timeline:
        found = object.__new__(cls)
        found.text, found._parts, found._limit = text, None, limit
        return found

    def bounded(self, frames: int) -> Timeline:
        """This timeline, allowed to claim at most `frames` frames (what its probe says the video has, or the file's
        size in bytes): a claim past it is damage, found before anything of its size is allocated."""
        if frames >= self._limit:
            return self
        return Timeline._of_text(self.text, max(1, frames))

    @property
    def limit(self) -> int:
        """The most frames this timeline may claim (see `bounded`)."""
        return self._limit
    def _unpacked(self) -> tuple[Any, ...]:
        """(rule, packed pts, packed keys, head, rotation), checked; ValueError naming what is wrong."""
        if self._parts is None:
            _, pts, keys, head, rotation = self.text.split("|")
            try:
                rule = tuple(int(v) for v in pts.split(",")) if not pts.startswith("*") else None
                flat = [int(v) for v in head.split(",")] if head else []
                turn = int(rotation)
            except ValueError:
                raise ValueError("pts, head and rotation are integers") from None
            if rule is not None and (len(rule) != 3 or rule[2] < 1 or (rule[2] > 1 and rule[1] < 1)):
                raise ValueError(f"pts rule {rule}: [first, step, count] with a count >= 1 and a positive step")
            if rule is not None and rule[2] > self._limit:
                raise ValueError(f"its frame rule claims {rule[2]} frames, more than the video can have "
                                 f"({self._limit})")
            ranges = tuple(zip(flat[::2], flat[1::2]))
            if len(flat) % 2 or turn % 90 or any(not 0 <= a < b for a, b in ranges):
                raise ValueError("head is pairs [start, end) and rotation a multiple of 90")
            self._parts = (rule, pts[1:] if rule is None else None, keys, ranges, turn)
        return self._parts

    @property
    def pts_rule(self) -> tuple[int, int, int] | None:
        """(first pts, step, frame count) of a constant-frame-rate stream; None where `pts_packed` lists them."""
        return self._unpacked()[0]

    @property
    def pts_packed(self) -> str | None:
        return self._unpacked()[1]

    @property
    def keys_packed(self) -> str:
        return self._unpacked()[2]

    @property
    def head(self) -> tuple[tuple[int, int], ...]:
        """Byte ranges [start, end) opening the container read (recorded for objects at URLs; empty otherwise)."""
        return self._unpacked()[3]

    @property
    def rotation(self) -> int:
        """Counter-clockwise display rotation in degrees, as the reader found it on the first frame."""
        return self._unpacked()[4]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Timeline) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return f"Timeline({self.text[:80]!r})"

    def __getstate__(self) -> tuple[str, int]:
        return self.text, self._limit

    def __setstate__(self, state: str | tuple[str, int]) -> None:
        self.text, self._limit = state if isinstance(state, tuple) else (state, MAX_FRAMES)
        self._parts = None

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
        return cls(rule, None if rule is not None else pack(values), pack(keys), merged(head), rotation)

    # ------------------------------------------------------------------ unpacked on use

    def _pts(self) -> list[int]:
        """ValueError where a part is damaged."""
        if self.pts_rule is not None:
            first, step, count = self.pts_rule
            return list(range(first, first + step * count, step)) if count > 1 else [first]
        return unpack(self.pts_packed, 1, self._limit).tolist()  # type: ignore[arg-type]

    def pts(self) -> list[int]:
        """Every shown frame's pts, ascending (ValueError when the packed list is damaged or not ascending)."""
        if self.pts_rule is not None:
            return self._pts()  # a checked rule ascends
        values = unpack(self.pts_packed, 1, self._limit)  # type: ignore[arg-type]
        if not len(values) or (np.diff(values) <= 0).any():
            raise ValueError("the frame times are not strictly ascending")
        return values.tolist()

    def frame_count(self) -> int | None:
        """How many frames the video has (None where the timeline is damaged)."""
        try:
            return self.pts_rule[2] if self.pts_rule is not None else len(self._pts())
        except ValueError:
            return None

    def _key_rows(self, count: int) -> np.ndarray:
        """The packed keyframes as rows of KEY_COLUMNS, checked against a video of `count` frames."""
        rows = unpack(self.keys_packed, len(KEY_COLUMNS), count).reshape(-1, len(KEY_COLUMNS))
        if not len(rows) or rows[0, 0] < 0 or rows[-1, 0] >= count or (np.diff(rows[:, 0]) <= 0).any():
            raise ValueError("the keyframes are not frame numbers of the video in ascending order")
        return rows

    def check(self) -> None:
        """ValueError where a part is damaged, without listing a frame rule's times (what a reader's use would find)."""
        count = self.pts_rule[2] if self.pts_rule is not None else len(self.pts())
        self._key_rows(count)

    def keyframes(self) -> list[Keyframe]:
        """The keyframes in frame order (ValueError when damaged: out of range, unordered)."""
        pts = self.pts()
        return [Keyframe(frame, seek_ts, pts[frame], start, end)
                for frame, seek_ts, start, end in self._key_rows(len(pts)).tolist()]

    def for_frames(self, first: int, last: int) -> Timeline:
        """This timeline with only the keyframes a read of frames `first`..`last` seeks to (the one at or before
        `first`, the two before it, as the reader may step back, through the last at or before `last`): what a clip
        record keeps, the video's full index being its probe's. ValueError where it is damaged. With a frame rule it
        unpacks the keyframes only (no frame list): a writer cuts one per clip."""
        count = self.frame_count()
        if count is None:
            raise ValueError("the frame times are damaged")
        rows = self._key_rows(count)
        lo = max(0, int(np.searchsorted(rows[:, 0], first, side="right")) - 3)
        hi = max(lo + 1, int(np.searchsorted(rows[:, 0], last, side="right")))
        rule, packed, _, head, rotation = self._unpacked()
        return Timeline(rule, packed, pack(rows[lo:hi]), head, rotation).bounded(self._limit)

    @property
    def has_bytes(self) -> bool:
        """Whether the keyframes carry byte ranges (a container that gives packet positions)."""
        try:
            rows = unpack(self.keys_packed, len(KEY_COLUMNS), self._limit).tolist()
        except ValueError:
            return False
        return bool(rows) and all(row[2] >= 0 and row[3] > row[2] for row in rows)

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> str:
        """The timeline as a probe records it: `v1|PTS|KEYS|HEAD|ROTATION` (see the module docstring)."""
        return self.text

    @classmethod
    def from_json(cls, raw: Any, where: str, frames: int = MAX_FRAMES) -> Timeline:
        """A probe's `timeline`, checked by its form only (its parts are checked, and its packed lists unpacked, where
        a reader uses it: a damaged one is then a decode failure naming the video); a wrong form is a DatasetError
        naming `where`. `frames`: the most frames it may claim (its probe's count)."""
        if type(raw) is not str or not raw.startswith(_PREFIX) or raw.count("|") != 4:
            raise DatasetError(f"{where}: probe field \"timeline\" is not a frame index (version {TIMELINE_VERSION} "
                               f"is the text \"v{TIMELINE_VERSION}|PTS|KEYS|HEAD|ROTATION\"), got {raw!r:.80}")
        return cls._of_text(raw, max(1, min(frames, MAX_FRAMES)))

    def claimed_frames(self) -> int | None:
        """The frame count a frame rule claims, read from the text alone (None: a packed list, or damaged)."""
        pts = self.text.split("|", 2)[1]
        parts = pts.split(",")
        if pts.startswith("*") or len(parts) != 3:
            return None
        try:
            return int(parts[2])
        except ValueError:
            return None


_PREFIX = f"v{TIMELINE_VERSION}|"


def checked_form(raw: Any, where: str) -> str:
    """`raw` as a probe's `timeline` text, checked by its form only (Timeline.from_json's check, no Timeline built);
    a wrong form is a DatasetError naming `where`."""
    if type(raw) is not str or not raw.startswith(_PREFIX) or raw.count("|") != 4:
        Timeline.from_json(raw, where)  # names the problem
    return raw


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
    if not span or any(key.byte_start < 0 or key.byte_end <= key.byte_start for key in span):
        return None
    return span[0].byte_start, max(key.byte_end for key in span)
