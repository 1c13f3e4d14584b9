"""One episode of a video file that holds many one after another (a LeRobot v3.0 camera file), read by time.

An episode's camera is named by one string, `FILE#from_ns=F&frames=N&fps=R`: its frame i is the file's frame whose
presentation time is nearest F + i/R (the episode starts F ns into the file), within LEROBOT_TOLERANCE_S, as
LeRobotDataset picks it (src/lerobot/datasets/lerobot_dataset.py: `shifted_query_ts = [from_timestamp + ts ...]`,
`tolerance_s = 1e-4`; its decoders take the frame of nearest pts and refuse one farther than the tolerance). The
reader renumbers those frames 0..N-1 and gives their times on the episode's clock (i/R), so every stage that reads a
camera by frame index (planning, --sync, the decode workers) sees the episode as a video of its own.
"""

from __future__ import annotations

import bisect
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from vaecache.errors import VideoDecodeError
from vaecache.storage import location_stat
from vaecache.video.frames import checked_request

_REFERENCE = re.compile(r"^(?P<path>.+)#from_ns=(?P<from_ns>\d+)&frames=(?P<frames>\d+)&fps=(?P<fps>[0-9.eE+-]+)$",
                        re.DOTALL)
LEROBOT_TOLERANCE_S = 1e-4
"""LeRobotDataset's default tolerance_s: how far a frame's time may lie from the time asked for."""
_SHARED_READERS = 8


@dataclass(frozen=True, slots=True)
class EpisodeSpan:
    path: str
    from_ns: int
    frames: int
    fps: float

    @property
    def reference(self) -> str:
        return f"{self.path}#from_ns={self.from_ns}&frames={self.frames}&fps={self.fps!r}"

    def query_ns(self) -> list[int]:
        """The time in the file of each of the episode's frames."""
        return [self.from_ns + round(index * 1e9 / self.fps) for index in range(self.frames)]


def span_of(source: object) -> EpisodeSpan | None:
    """The EpisodeSpan a camera source names, or None for any other source."""
    if not isinstance(source, str) or "#from_ns=" not in source:
        return None
    found = _REFERENCE.match(source)
    if found is None:
        return None
    try:
        fps = float(found["fps"])
    except ValueError:
        return None
    if not 0 < fps < float("inf"):
        return None
    return EpisodeSpan(found["path"], int(found["from_ns"]), int(found["frames"]), fps)


_readers: dict[tuple[int, int], OrderedDict[str, Any]] = {}
"""(process, thread) -> its shared readers: a forked worker never uses a reader (and file offset) it inherited."""


def _shared_reader(path: str, threads: int, max_pixels: int | None, timeline: Any = None) -> Any:
    """One VideoReader per file and thread, among the last few: the episodes of one file are read by one reader, which
    continues forward from one episode to the next without re-indexing the file or seeking. With `timeline` (the file's
    frame index cut to an episode's frames, as its probe keeps it) a reader opened with another episode's cut is
    opened again with this one: nothing demuxed, and a file at a URL read in the episode's ranges."""
    from vaecache.video.reader import VideoReader

    mine = _readers.setdefault((os.getpid(), threading.get_ident()), OrderedDict())
    reader = mine.get(path)
    if reader is not None and timeline is not None and reader.given_timeline != timeline:
        mine.pop(path).close()
        reader = None
    if reader is None:
        reader = mine[path] = VideoReader(path, threads, max_pixels, timeline=timeline)
        while len(mine) > _SHARED_READERS:
            mine.popitem(last=False)[1].close()
    mine.move_to_end(path)
    return reader


def adopt_readers(threads: Sequence[int]) -> None:
    """Take over the shared readers that `threads` left, ended threads of this process that opened episodes ahead
    for this one (vaecache.video.dataset.ViewDecoder.open_ahead): this thread reads on with them, where no one else
    would and nothing would close them. Of a file it holds a reader of already, the other one is closed."""
    mine = _readers.setdefault((os.getpid(), threading.get_ident()), OrderedDict())
    for thread in threads:
        if thread == threading.get_ident():
            continue
        for path, reader in _readers.pop((os.getpid(), thread), OrderedDict()).items():
            if path in mine:
                reader.close()
            else:
                mine[path] = reader
    while len(mine) > _SHARED_READERS:
        mine.popitem(last=False)[1].close()


def _evict(path: str) -> None:
    """Close this thread's shared reader of `path` (after it failed: the next episode opens the file afresh)."""
    reader = _readers.get((os.getpid(), threading.get_ident()), OrderedDict()).pop(path, None)
    if reader is not None:
        reader.close()


class SpanReader:
    """One episode of a file as a video of its own (see the module docstring). It takes the file's shared reader
    afresh for every read, so a reader closed since (pushed out of the last few, or dropped after a failure) is
    reopened, never used closed."""

    sequential = False

    def __init__(self, span: EpisodeSpan, threads: int = 0, max_pixels: int | None = None,
                 timeline: Any = None) -> None:
        self.span = span
        self.path = span.reference
        self._open_args = (threads, max_pixels, timeline)
        inner = self._inner()
        times = inner.times_ns()
        tolerance = round(LEROBOT_TOLERANCE_S * 1e9)
        chosen: list[int] = []
        for index, wanted in enumerate(span.query_ns()):
            at = bisect.bisect_left(times, wanted)
            near = min((i for i in (at - 1, at) if 0 <= i < len(times)), key=lambda i: abs(times[i] - wanted))
            if abs(times[near] - wanted) > tolerance:
                raise VideoDecodeError(self.path, f"frame {index} of the episode (time {wanted / 1e9:.6f} s in the "
                                                  f"file) has no frame within {LEROBOT_TOLERANCE_S:g} s: the nearest "
                                                  f"is at {times[near] / 1e9:.6f} s")
            if chosen and near <= chosen[-1]:
                raise VideoDecodeError(self.path, f"frames {index - 1} and {index} of the episode are one frame of "
                                                  "the file (its rate is lower than the episode's)")
            chosen.append(near)
        self._frames = chosen
        self.rotation = inner.rotation
        self.codec = inner.codec
        self._size = inner.frame_size
        self._pixel_format = inner.pixel_format

    def _inner(self) -> Any:
        try:
            return _shared_reader(self.span.path, *self._open_args)
        except VideoDecodeError as exc:
            raise VideoDecodeError(self.path, exc.reason) from None

    def __len__(self) -> int:
        return len(self._frames)

    def __enter__(self) -> SpanReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        pass  # the file's reader is shared by its episodes: closed when it leaves the last few, or fails

    @property
    def frame_size(self) -> tuple[int, int]:
        return self._size

    @property
    def pixel_format(self) -> str | None:
        return self._pixel_format

    def fps(self) -> float:
        return self.span.fps

    def times_ns(self) -> list[int]:
        """Every frame's time on the episode's clock (frame i at i/fps, as LeRobot's data table gives it)."""
        return [round(index * 1e9 / self.span.fps) for index in range(len(self))]

    def timestamps(self, frames: Sequence[int]) -> list[float]:
        return [index / self.span.fps for index in frames]

    def check_probe(self, frames: int, width: int, height: int) -> None:
        if (len(self), *self.frame_size) != (frames, width, height):
            raise VideoDecodeError(self.path, f"the dataset says {frames} frames of {width}x{height}, the episode has "
                                              f"{len(self)} frames of {self.frame_size[0]}x{self.frame_size[1]}")

    def check_request(self, frames: Sequence[int]) -> list[int]:
        return checked_request(frames, len(self), self.path)

    def file_frames(self) -> list[int]:
        """The frame of the file each of the episode's frames is."""
        return list(self._frames)

    @property
    def timeline(self) -> Any:
        """The file's frame index cut to this episode's frames (file frame numbers, vaecache.video.timeline), what
        its probe keeps: a decode worker opens the file with it, demuxing nothing. None where the file has a packed
        frame list (a cut would repeat it whole for each episode) or no index."""
        whole = getattr(self._inner(), "timeline", None)
        if whole is None or whole.pts_rule is None:
            return None
        try:
            return whole.for_frames(self._frames[0], self._frames[-1])
        except ValueError:
            return None

    @property
    def given_timeline(self) -> Any:
        return self._open_args[2]

    def read(self, frames: Sequence[int]) -> np.ndarray:
        frames = self.check_request(frames)
        try:
            return self._inner().read([self._frames[index] for index in frames])
        except VideoDecodeError as exc:
            _evict(self.span.path)
            raise VideoDecodeError(self.path, exc.reason) from None


def file_of(source: str) -> str:
    """The file a video source lives in: a span's file, else the source itself."""
    span = span_of(source)
    return span.path if span is not None else source


def span_identity(span: EpisodeSpan) -> tuple[int, int]:
    return location_stat(span.path)  # a local file, or an object at a URL
