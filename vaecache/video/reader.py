"""Frame-exact video decoding with PyAV: VideoReader, the reference every other backend is checked against.

Frame n of a video is the n-th frame a straight decode from the start returns. The reader finds it by
timestamp, never by counting after a seek: it lists the video stream's presentation timestamps by
demuxing packets (no decoding), seeks to a keyframe at or before the first wanted frame, decodes forward
and keeps the frames whose pts it asked for. Counting after a seek is what decord does, and on open-GOP
h264, HEVC or MPEG-4 with B-frames, AVI, or an mp4 with an edit list it returned neighbouring frames
without an error. A file whose timestamps cannot identify frames (missing or repeated pts) is
read by a straight decode from the start that counts frames.

Other backends (--decoder decord|torchcodec; ForeignReader) take the frame numbering, count, times, even-spacing
check and rotation from this reader's index and fetch only the pixels; each records its own name in the run
fingerprint. `auto` picks PyAV: decord is byte-identical but slower (scripts/bench_decode.py), torchcodec unmeasured.

The module is one class past 400 lines on purpose: the timestamp index, the seek plan and the fallback
straight decode share the reader's state, and splitting them would hand that state between modules.
"""

from __future__ import annotations

import bisect
import itertools
from fractions import Fraction
from typing import Any, Iterator, Sequence

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from vaecache.errors import FrameBudgetError, VideoDecodeError, first_line
from vaecache.settings.clip import DEFAULT_MAX_FRAME_PIXELS, frame_budget_problem
from vaecache.storage import HeldObjects, mtime_ns, whole_object
from vaecache.urls import is_url
from vaecache.video.frames import checked_request
from vaecache.video.members import member_of, open_member
from vaecache.video.opening import URL_IO_BUFFER, RecordingReads, check_file, open_object, read_problem
from vaecache.video.planned_reads import PLANNED_READ_AHEAD, PlannedReads
from vaecache.video.timeline import Keyframe, Timeline, gop_bytes, merged

DECODER = "pyav-pts/1"
"""Names this way of decoding in the run fingerprint (vaecache 0.1.0 caches decoded with decord)."""
EVEN_SPACING_TOLERANCE = 0.5
"""A clip's frame intervals may differ from their mean by at most this fraction of the video's frame duration."""


class VideoReader:
    """One video file, read frame-exactly with PyAV; consecutive reads continue forward without seeking."""

    def __init__(self, path: str, threads: int = 0, max_pixels: int | None = None,
                 held: HeldObjects | None = None, timeline: Timeline | None = None,
                 clip: tuple[int, int] | None = None) -> None:
        """`max_pixels`: refuse (VideoDecodeError) a stream of larger frames before decoding anything; None checks
        only where opening must decode (a file without timestamps is counted frame by frame) against the
        default budget: probing a file reads its packets, never its pixels. An object at a URL that `held` holds is
        read from its bytes (storage.HeldObjects).

        `timeline`: the video's frame index as its probe recorded it (vaecache.video.timeline): no packet is demuxed
        to find the frames, and an object at a URL is read in ranges, its container's header and index and then
        each clip's GOPs, where it is larger than one read-ahead block or holds RANGED_MIN_CLIPS clips as long as
        `clip`, the first and last frame of the clip it is opened for (a smaller one is read whole by its first GET,
        as without a timeline). That clip's GOPs are fetched beside the header and index: one round trip."""
        self.path = path
        self._threads = threads
        self._max_pixels = max_pixels
        self._member = member_of(path)  # a video inside a tar (a WebDataset shard), read in place
        self._member_file: Any = None
        self._url_file: Any = None
        self._head: list[tuple[int, int]] = []
        self._ranged = False
        self._span_end: int | None = None
        self._seek_by_pts = True
        if self._member is None and is_url(path):
            self._url_file = open_object(path, held, timeline, clip)  # its size comes with it
            self._ranged = isinstance(getattr(self._url_file, "cache", None), PlannedReads)
            if self._ranged:
                assert timeline is not None
                self._fetch_first(timeline, clip)
        elif self._member is None:
            check_file(path)
        try:
            self._container = self._open(record=self._url_file is not None and timeline is None)
        except PermissionError:
            self.close()
            raise VideoDecodeError(path, "permission denied") from None
        except (av.FFmpegError, UnicodeDecodeError, ValueError) as exc:
            self.close()
            raise VideoDecodeError(path, f"not a readable video ({first_line(exc, 200)})") from None
        except OSError as exc:  # an object at a URL that cannot be read, or changed while it was read
            self.close()
            raise VideoDecodeError(path, read_problem(exc, "cannot read")) from None
        if not self._container.streams.video:
            self.close()
            raise VideoDecodeError(path, "not a readable video (no video stream)")
        self._stream = self._container.streams.video[0]
        if max_pixels is not None:
            self._check_budget(max_pixels)
        self._set_threads()
        # One converter per reader: frame.to_ndarray(format=...) builds a new swscale context for every frame,
        # which cost 1.7-5 ms per 32x32 frame (PyAV 18), more than everything else vaecache does per clip.
        self._to_rgb = VideoReformatter()
        self.time_base: Fraction = self._stream.time_base or Fraction(1, 1)
        self._frames: Iterator[Any] | None = None
        self._last_pts: int | None = None
        self._next_index = 0
        self._from_start = True
        self._count = 0
        self._timeline = self._given_timeline = timeline
        try:
            if timeline is not None:
                if not self._ranged:  # a ranged reader took it before opening
                    self._from_timeline(timeline)
            else:
                self._pts, self._keyframes = self._index()
                self.sequential = self._pts is None
                if self.sequential:
                    self._count_sequentially()
                if len(self) == 0:
                    raise VideoDecodeError(path, "video has no frames")
                self.rotation = self._read_rotation()
        except av.FFmpegError as exc:
            self.close()
            raise VideoDecodeError(path, f"not a readable video ({first_line(exc, 200)})") from None
        except VideoDecodeError:
            self.close()
            raise

    # ------------------------------------------------------------------ index

    def _from_timeline(self, timeline: Timeline) -> None:
        """The frame index from the probe's timeline: nothing demuxed, nothing decoded."""
        try:
            self._pts, self._keyframes = timeline.pts(), timeline.keyframes()
        except ValueError as exc:
            raise VideoDecodeError(self.path, f"its recorded frame index is damaged ({exc}); run `vaecache index` "
                                              "again") from None
        self.sequential = False
        self.rotation = timeline.rotation

    def _fetch_first(self, timeline: Timeline, clip: tuple[int, int] | None) -> None:
        """Before the container is opened: the read-ahead past a clip (about 8 frames' bytes, the decoder's look-ahead),
        and the container's header and index and the first clip's bytes fetched side by side."""
        try:
            self._from_timeline(timeline)
            cache = self._url_file.cache
            cache.read_ahead = min(cache.blocksize, max(PLANNED_READ_AHEAD, 8 * cache.size // len(self._pts)))
            if clip is not None and 0 <= clip[0] <= clip[1] < len(self._pts):
                self._plan_bytes(list(clip))
            cache.fetch_planned()
        except VideoDecodeError:
            self.close()
            raise
        except OSError as exc:
            self.close()
            raise VideoDecodeError(self.path, read_problem(exc, "cannot read")) from None

    def _index(self) -> tuple[list[int] | None, list[Keyframe]]:
        """Presentation-ordered pts of every shown frame and the keyframes, from packets alone; each keyframe with
        its GOP's bytes where the container gives packet positions (timeline.Keyframe).

        Packets flagged discard (before an edit list's start) are never shown, so they are not frames."""
        entries = []
        for packet in self._container.demux(self._stream):
            if packet.size == 0 or packet.is_discard:
                continue
            entries.append((packet.pts, packet.dts, packet.is_keyframe, packet.pos, packet.size))
        pts = [entry[0] for entry in entries]
        if any(p is None for p in pts) or len(set(pts)) != len(pts):
            return None, []
        ordered = sorted(pts)
        position = {p: i for i, p in enumerate(ordered)}
        starts = sorted((position[p], d if d is not None else p, p, pos if pos is not None and pos >= 0 else -1)
                        for p, d, key, pos, _ in entries if key)
        frames = [start[0] for start in starts]
        ends = [-1] * len(starts)
        if frames and all(start[3] >= 0 for start in starts) and all(e[3] is not None and e[3] >= 0 for e in entries):
            for p, _, _, pos, size in entries:  # a frame's bytes belong to the GOP it is shown in
                gop = bisect.bisect_right(frames, position[p]) - 1
                if gop >= 0:
                    ends[gop] = max(ends[gop], pos + size)
        keyframes = [Keyframe(frame, seek_ts, p, pos if ends[i] > pos >= 0 else -1, ends[i] if ends[i] > pos >= 0
                              else -1) for i, (frame, seek_ts, p, pos) in enumerate(starts)]
        return ordered, keyframes

    @property
    def timeline(self) -> Timeline | None:
        """This video's frame index for its probe (vaecache.video.timeline), with the byte ranges opening it read
        (an object at a URL); None for a video read by a straight decode (no usable timestamps) or without a packet
        flagged keyframe."""
        if self.sequential or not self._keyframes:  # no keyframe to seek to: a reader decodes from the start
            return None
        if self._timeline is None and self._pts is not None:
            self._timeline = Timeline.build(self._pts, self._keyframes, self._head, self.rotation)
        return self._timeline

    @property
    def given_timeline(self) -> Timeline | None:
        """The timeline this reader was opened with (None: it indexed the video itself)."""
        return self._given_timeline

    def _check_budget(self, max_pixels: int) -> None:
        problem = frame_budget_problem(*self.frame_size, max_pixels)
        if problem:
            self.close()
            raise FrameBudgetError(self.path, problem)

    def _count_sequentially(self) -> None:
        self._check_budget(self._max_pixels or DEFAULT_MAX_FRAME_PIXELS)
        self._restart()
        self._count = sum(1 for _ in self._decoded())
        self._restart()

    def __len__(self) -> int:
        return len(self._pts) if self._pts is not None else self._count

    def timestamps(self, frames: Sequence[int]) -> list[float]:
        """Presentation time in seconds of each frame (evenly spaced 0, 1/fps, ... when read sequentially)."""
        if self._pts is None:
            return [float(index / self._nominal_rate()) for index in frames]
        first = self._pts[0]
        return [float((self._pts[index] - first) * self.time_base) for index in frames]

    def frame_time(self, index: int) -> Fraction:
        """Frame `index`'s presentation time in seconds, exact, the stream's start offset included (on the
        container's clock: a clip's audio is cut from it); index / the nominal rate when read sequentially."""
        if self._pts is None:
            return Fraction(index) / self._nominal_rate()
        return Fraction(self._pts[index]) * self.time_base

    def times_ns(self) -> list[int]:
        """Every frame's presentation time in ns, the stream's start offset included (a camera that started later
        says so here); evenly spaced from 0 when read sequentially. Timestamp sync matches cameras by these."""
        if self._pts is None:
            rate = self._nominal_rate()
            return [round(index * 10**9 / rate) for index in range(len(self))]
        base = self.time_base * 10**9
        return [round(p * base) for p in self._pts]

    def fps(self) -> float:
        """Frames per second of the even stretches: 1 / the mean frame duration, leaving out steps more than half
        a frame from the median (the gaps of a variable-frame-rate file; millisecond rounding stays in)."""
        if self._pts is None or len(self._pts) < 2:
            return float(self._nominal_rate())
        median = self._median_step()
        steps = [b - a for a, b in zip(self._pts, self._pts[1:]) if abs(b - a - median) <= median / 2]
        return float(len(steps) / (sum(steps) * self.time_base))

    def _median_step(self) -> int:
        assert self._pts is not None
        steps = sorted(b - a for a, b in zip(self._pts, self._pts[1:]))
        return steps[len(steps) // 2]

    @property
    def frame_size(self) -> tuple[int, int]:
        """(width, height) of the stored frames, before the display rotation."""
        return int(self._stream.codec_context.width), int(self._stream.codec_context.height)

    @property
    def codec(self) -> str:
        return str(self._stream.codec_context.name)

    @property
    def pixel_format(self) -> str | None:
        """The decoded pixel format (yuv420p, yuv420p10le, ...), None where the stream does not say."""
        return self._stream.codec_context.pix_fmt

    @property
    def opened_identity(self) -> tuple[int, int] | None:
        """(size, mtime_ns) of the object at a URL as it was opened, from the request that opened it (every read
        of it is conditional on that version's ETag); None for a file on disk or in a tar."""
        if self._url_file is None:
            return None
        details = self._url_file.details
        return int(details.get("size") or 0), mtime_ns(details)

    def whole_object(self) -> bytes | None:
        """The whole object at a URL where this reader has read all of it ahead (one read-ahead block holds it),
        without a request; None for a larger object and for a file on disk or in a tar."""
        return whole_object(self._url_file) if self._url_file is not None else None

    def check_probe(self, frames: int, width: int, height: int) -> None:
        """Refuse a video that is not what its probe (an index, the probe cache) says: it changed since."""
        if (len(self), *self.frame_size) != (frames, width, height):
            found_w, found_h = self.frame_size
            raise VideoDecodeError(self.path, f"the index says {frames} frames of {width}x{height}, the video has "
                                              f"{len(self)} frames of {found_w}x{found_h} (it changed since it was "
                                              "probed; run `vaecache index` again)")

    def _nominal_rate(self) -> Fraction:
        rate = self._stream.average_rate or self._stream.guessed_rate or self._stream.base_rate
        return Fraction(rate) if rate else Fraction(1)

    def _read_rotation(self) -> int:
        """Counter-clockwise degrees from the display matrix (a multiple of 90), read from the first frame.

        The decoder is left at the start with that frame pending, so a first read from frame 0 needs no seek."""
        self._restart()
        frames = self._decoded()
        frame = next(frames, None)
        self._frames = itertools.chain([frame], frames) if frame is not None else None
        degrees = int(round(getattr(frame, "rotation", 0) or 0)) % 360
        if degrees % 90:
            raise VideoDecodeError(self.path, f"display rotation of {degrees} degrees is not a multiple of 90")
        return degrees

    # ------------------------------------------------------------------ decoding

    def _set_threads(self) -> None:
        # FFmpeg's decoders give the same pixels for any thread count; the count only decides whose cores they take.
        self._stream.thread_type = "AUTO"
        self._stream.thread_count = self._threads

    def _open(self, record: bool = False) -> Any:
        """A new container on the file (or the tar member's bytes). With `record` (an object at a URL), the byte
        ranges opening it reads are kept for its timeline."""
        if self._member is None and is_url(self.path):
            self._url_file.seek(0)  # a restart reads the object again from its start: the read-ahead may hold it
            if not record:  # ranged reads ask for what the probe's open asked for
                return av.open(self._url_file, buffer_size=URL_IO_BUFFER) if self._ranged else av.open(self._url_file)
            recorder = RecordingReads(self._url_file)
            container = av.open(recorder, buffer_size=URL_IO_BUFFER)
            recorder.recording = False
            self._head = merged(recorder.ranges)
            return container
        if self._member is None:
            return av.open(self.path)
        if self._member_file is not None:
            self._member_file.close()
        self._member_file = open_member(self._member)
        return av.open(self._member_file)

    def _restart(self) -> None:
        """Decode from the very start again (a fresh container: no seek involved)."""
        self._container.close()
        self._container = self._open()
        self._stream = self._container.streams.video[0]
        self._set_threads()
        self._frames = None
        self._last_pts = None
        self._next_index = 0
        self._from_start = True

    def _rgb(self, frame: Any) -> np.ndarray:
        return self._to_rgb.reformat(frame, format="rgb24").to_ndarray()

    def _decoded(self) -> Iterator[Any]:
        checked = self._given_timeline is None or self._pts is None
        for packet in self._container.demux(self._stream):
            if not checked and packet.size and not packet.is_discard and packet.pts is not None and packet.is_keyframe:
                self._check_landing(packet.pts)  # where a decode from the start begins
                checked = True
            yield from packet.decode()

    def _check_landing(self, pts: int) -> None:
        """A given frame index is checked against the file where that costs nothing: the keyframe a decode begins at
        (after a seek, or from the start) must be one of the frames the index lists, and where it lies among the
        index's keyframes, one of them. A mismatch (an index of another file, a frame rule shifted) is a decode
        failure naming the video, so that no frame is taken by a wrong timestamp."""
        if self._given_timeline is None or self._pts is None or not self._keyframes:
            return
        at = bisect.bisect_left(self._pts, pts)
        listed = at < len(self._pts) and self._pts[at] == pts
        keys = self._keyframes
        if listed and (at < keys[0].frame or at > keys[-1].frame or any(key.frame == at for key in keys)):
            return
        said = (f"frame {at}, which the index does not list as a keyframe" if listed else
                "a time the index gives no frame")
        raise VideoDecodeError(self.path, f"its recorded frame index does not match the file: a keyframe decodes at "
                                          f"pts {pts}, {said} (an index of another file, or altered); run `vaecache "
                                          "index` again")

    def check_even(self, frames: Sequence[int]) -> None:
        """Refuse frames whose times do not follow their frame numbers evenly (a variable-frame-rate stretch):
        each step may differ from (frame-number step x the mean time per frame) by half a frame duration."""
        if self._pts is None or len(frames) < 3:
            return
        times = [self._pts[i] for i in frames]
        per_frame = (times[-1] - times[0]) / (frames[-1] - frames[0])
        errors = [abs((t1 - t0) - (i1 - i0) * per_frame)
                  for t0, t1, i0, i1 in zip(times, times[1:], frames, frames[1:])]
        worst = max(range(len(errors)), key=errors.__getitem__)
        if errors[worst] > EVEN_SPACING_TOLERANCE * self._median_step():
            step = frames[worst + 1] - frames[worst]
            raise VideoDecodeError(
                self.path,
                f"frames {frames[0]}..{frames[-1]} are not evenly spaced in time: "
                f"{float((times[worst + 1] - times[worst]) * self.time_base):.3f} s between frames {frames[worst]} and "
                f"{frames[worst + 1]}, {float(step * self._median_step() * self.time_base):.3f} s at the video's "
                "frame rate (variable frame rate)")

    def check_request(self, frames: Sequence[int]) -> list[int]:
        """The frames as a list, refused unless ascending, in range and evenly spaced in time (every backend)."""
        frames = checked_request(frames, len(self), self.path)
        self.check_even(frames)
        return frames

    def read(self, frames: Sequence[int]) -> np.ndarray:
        """(T, H, W, 3) uint8 RGB of the given frame numbers (ascending), upright."""
        frames = self.check_request(frames)
        if self._ranged:
            self._plan_bytes(frames)
        try:
            array = self._read_sequential(frames) if self.sequential else self._read_by_pts(frames)
        except av.FFmpegError as exc:
            self._frames = None
            raise VideoDecodeError(self.path, f"decoding frames {frames[0]}..{frames[-1]} failed "
                                              f"({first_line(exc, 200)})") from None
        except OSError as exc:  # an object at a URL: a read that failed after retries, or one changed since listed
            self._frames = None
            raise VideoDecodeError(self.path, read_problem(exc, f"reading frames {frames[0]}..{frames[-1]} "
                                                                 "failed")) from None
        if self.rotation:
            array = np.ascontiguousarray(np.rot90(array, k=self.rotation // 90, axes=(1, 2)))
        return array

    def _plan_bytes(self, frames: list[int]) -> None:
        """Tell the ranged reads of an object at a URL the bytes this read decodes (timeline.gop_bytes) and the
        decoder's look-ahead past them (PlannedReads.read_ahead): fetched by GETs of up to a read block."""
        span = gop_bytes(self._keyframes, frames[0], frames[-1])
        cache = self._url_file.cache
        self._span_end = span[1] + cache.read_ahead if span is not None else None  # and the decoder's look-ahead
        if span is not None:
            cache.plan(span[0], self._span_end)

    def _read_by_pts(self, frames: list[int]) -> np.ndarray:
        assert self._pts is not None
        first = self._pts[frames[0]]
        # _last_pts None with a live decoder: it is at a keyframe (or the start) and no frame was taken yet.
        behind = self._last_pts is not None and self._last_pts >= first
        if self._frames is None or behind or self._far_behind(frames[0]):
            self._seek_before(frames[0])
        out = self._take_by_pts(frames)
        if out is None and not self._from_start:
            # A decoder that holds back frames after a seek (no recovery point): decode from the start instead.
            self._restart()
            self._frames = self._decoded()
            out = self._take_by_pts(frames)
        if out is None:
            return self._switch_to_sequential(frames)
        return out

    def _take_by_pts(self, frames: list[int]) -> np.ndarray | None:
        """Decode forward, keeping the frames whose pts are wanted; None if a frame carries no pts."""
        assert self._pts is not None and self._frames is not None
        wanted = {self._pts[index]: position for position, index in enumerate(frames)}
        last = self._pts[frames[-1]]
        out: list[np.ndarray | None] = [None] * len(frames)
        for frame in self._frames:
            if frame.pts is None:
                return None
            self._last_pts = frame.pts
            if frame.pts in wanted:
                out[wanted[frame.pts]] = self._rgb(frame)
            if frame.pts >= last:
                break
        else:
            self._frames = None
        missing = [frames[i] for i, array in enumerate(out) if array is None]
        if missing:
            self._frames = None
            if self._from_start:
                raise VideoDecodeError(self.path, f"the decoder never produced frame {missing[0]} "
                                                  f"(of {frames[0]}..{frames[-1]})")
            return None
        return np.stack(out)  # type: ignore[arg-type]

    def _far_behind(self, index: int) -> bool:
        """Whether a keyframe lies between the decoder's position and frame `index` (seeking is then cheaper)."""
        assert self._pts is not None
        current = 0 if self._last_pts is None else bisect.bisect_right(self._pts, self._last_pts)
        return any(current < key.frame <= index for key in self._keyframes)

    def _seek_before(self, index: int) -> None:
        """Position the decoder on a keyframe at or before frame `index`, checked on the first packet it reads.

        A keyframe is sought by its pts, where mp4, mkv, webm, HEVC and AV1 land on it exactly, then (or, once pts
        overshot in this file, only) by its dts, where an AVI index lands (by pts it landed 3 frames late); by dts
        the others land a GOP early, decoding it for nothing. Demuxers may still land after the target; then an
        earlier keyframe is tried, and in the end a fresh decode from the start."""
        candidates = [key for key in self._keyframes if key.frame <= index]
        for key in reversed(candidates[-3:]):
            targets = [key.pts, key.seek_ts] if self._seek_by_pts and key.pts != key.seek_ts else [key.seek_ts]
            for target in targets:
                try:
                    self._container.seek(target, stream=self._stream, backward=True)
                except av.FFmpegError:
                    self._restart()
                    self._frames = self._decoded()
                    return
                self._stream.codec_context.flush_buffers()
                packets = self._container.demux(self._stream)
                first = next((p for p in packets if p.size and not p.is_discard), None)
                if first is None or first.pts is None or not first.is_keyframe:
                    continue
                self._check_landing(first.pts)
                landed = bisect.bisect_left(self._pts, first.pts)  # type: ignore[arg-type]
                if landed >= len(self._pts) or self._pts[landed] != first.pts or landed > key.frame:  # type: ignore[index]
                    if target == key.pts and target != key.seek_ts:
                        self._seek_by_pts = False  # this demuxer overshoots by pts: by dts from now on
                    continue
                if self._ranged and first.pos is not None and first.pos >= 0 and self._span_end is not None:
                    self._url_file.cache.plan(first.pos, self._span_end)  # landed before the keyframe planned
                self._frames = self._decode_packets(first, packets)
                self._last_pts = None
                self._from_start = False
                return
        self._restart()
        self._frames = self._decoded()

    def _decode_packets(self, first: Any, rest: Iterator[Any]) -> Iterator[Any]:
        yield from first.decode()
        for packet in rest:
            yield from packet.decode()

    def _switch_to_sequential(self, frames: list[int]) -> np.ndarray:
        """A decoder that returns frames without pts cannot be read by timestamp: count from the start instead."""
        self.sequential = True
        self._pts, self._keyframes = None, []
        self._count_sequentially()
        if frames[-1] >= len(self):
            raise VideoDecodeError(self.path, f"frame {frames[-1]} requested, a straight decode gives {len(self)}")
        return self._read_sequential(frames)

    def _read_sequential(self, frames: list[int]) -> np.ndarray:
        if self._frames is None or self._next_index > frames[0]:
            self._restart()
            self._frames = self._decoded()
        wanted = {index: position for position, index in enumerate(frames)}
        out: list[np.ndarray | None] = [None] * len(frames)
        for frame in self._frames:
            index = self._next_index
            self._next_index += 1
            if index in wanted:
                out[wanted[index]] = self._rgb(frame)
            if index >= frames[-1]:
                break
        else:
            self._frames = None
        if any(array is None for array in out):
            self._frames = None
            raise VideoDecodeError(self.path, f"video ended before frame {frames[-1]}")
        return np.stack(out)  # type: ignore[arg-type]

    def close(self) -> None:
        self._frames = None
        container = getattr(self, "_container", None)
        if container is not None:
            container.close()
        for name in ("_member_file", "_url_file"):
            handle = getattr(self, name, None)
            if handle is not None:
                handle.close()

    def __enter__(self) -> VideoReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
