"""Frame-exact video decoding (PyAV), resize/crop, and the DataLoader dataset of views.

Frame n of a video is the n-th frame a straight decode from the start returns. The reader finds it by
timestamp, never by counting after a seek: it lists the video stream's presentation timestamps by
demuxing packets (no decoding), seeks to a keyframe at or before the first wanted frame, decodes forward
and keeps the frames whose pts it asked for. Counting after a seek is what decord does, and on open-GOP
h264, HEVC or MPEG-4 with B-frames, AVI, or an mp4 with an edit list it returned neighbouring frames
without an error (issue 12). A file whose timestamps cannot identify frames (missing or repeated pts) is
read by a straight decode from the start that counts frames.

Other backends (--decoder decord|torchcodec; ForeignReader) take the frame numbering, count, times, even-spacing
check and rotation from this reader's index and fetch only the pixels; each records its own name in the run
fingerprint. `auto` picks PyAV: decord is byte-identical but slower (scripts/bench_decode.py), torchcodec unmeasured.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import os
from collections import OrderedDict
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterator, Sequence

import av
from av.video.reformatter import VideoReformatter
import numpy as np
import torch

from vaecache.settings.buckets import PAD_PIXEL, fit_geometry
from vaecache.settings.clip import DECODER_CHOICES, DEFAULT_MAX_FRAME_PIXELS, frame_budget_problem
from vaecache.errors import UsageError, VideoDecodeError

DECODER = "pyav-pts/1"
"""Names this way of decoding in the run fingerprint (vaecache 0.1.0 caches decoded with decord)."""
EVEN_SPACING_TOLERANCE = 0.5
"""A clip's frame intervals may differ from their mean by at most this fraction of the video's frame duration."""


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


@dataclass(frozen=True)
class _Keyframe:
    position: int
    """Index of the keyframe in presentation order (its frame number)."""
    seek_ts: int
    """Timestamp to seek to (dts where known: the demuxers index by it)."""
    pts: int


class VideoReader:
    """One video file, read frame-exactly with PyAV; consecutive reads continue forward without seeking."""

    def __init__(self, path: str, threads: int = 0, max_pixels: int | None = None) -> None:
        """`max_pixels`: refuse (VideoDecodeError) a stream of larger frames before decoding anything; None checks
        only where opening must decode (a file without timestamps is counted frame by frame) against the
        default budget: probing a file reads its packets, never its pixels."""
        self.path = path
        self._threads = threads
        self._max_pixels = max_pixels
        _check_file(path)
        try:
            self._container = av.open(path)
        except PermissionError:
            raise VideoDecodeError(path, "permission denied") from None
        except (av.FFmpegError, UnicodeDecodeError, ValueError) as exc:
            raise VideoDecodeError(path, f"not a readable video ({_short(exc)})") from None
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
        try:
            self._pts, self._keyframes = self._index()
            self.sequential = self._pts is None
            if self.sequential:
                self._count_sequentially()
            if len(self) == 0:
                raise VideoDecodeError(path, "video has no frames")
            self.rotation = self._read_rotation()
        except av.FFmpegError as exc:
            self.close()
            raise VideoDecodeError(path, f"not a readable video ({_short(exc)})") from None
        except VideoDecodeError:
            self.close()
            raise

    # ------------------------------------------------------------------ index

    def _index(self) -> tuple[list[int] | None, list[_Keyframe]]:
        """Presentation-ordered pts of every shown frame and the keyframes, from packets alone.

        Packets flagged discard (before an edit list's start) are never shown, so they are not frames."""
        entries = []
        for packet in self._container.demux(self._stream):
            if packet.size == 0 or packet.is_discard:
                continue
            entries.append((packet.pts, packet.dts, packet.is_keyframe))
        pts = [entry[0] for entry in entries]
        if any(p is None for p in pts) or len(set(pts)) != len(pts):
            return None, []
        ordered = sorted(pts)
        position = {p: i for i, p in enumerate(ordered)}
        keyframes = sorted((_Keyframe(position[p], d if d is not None else p, p) for p, d, key in entries if key),
                           key=lambda k: k.position)
        return ordered, keyframes

    def _check_budget(self, max_pixels: int) -> None:
        problem = frame_budget_problem(*self.frame_size, max_pixels)
        if problem:
            self.close()
            raise VideoDecodeError(self.path, problem)

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

    def _restart(self) -> None:
        """Decode from the very start again (a fresh container: no seek involved)."""
        self._container.close()
        self._container = av.open(self.path)
        self._stream = self._container.streams.video[0]
        self._set_threads()
        self._frames = None
        self._last_pts = None
        self._next_index = 0
        self._from_start = True

    def _rgb(self, frame: Any) -> np.ndarray:
        return self._to_rgb.reformat(frame, format="rgb24").to_ndarray()

    def _decoded(self) -> Iterator[Any]:
        for packet in self._container.demux(self._stream):
            yield from packet.decode()

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
                f"{frames[worst + 1]}, {float(step * self._median_step() * self.time_base):.3f} s at the video's frame rate (variable frame rate)")

    def check_request(self, frames: Sequence[int]) -> list[int]:
        """The frames as a list, refused unless ascending, in range and evenly spaced in time (every backend)."""
        frames = list(frames)
        if not frames:
            raise ValueError("no frames requested")
        if frames != sorted(frames) or frames[0] < 0:
            raise ValueError(f"frame numbers must be ascending and >= 0, got {frames[:5]}...")
        if frames[-1] >= len(self):
            raise VideoDecodeError(self.path, f"frame {frames[-1]} requested, video has {len(self)}")
        self.check_even(frames)
        return frames

    def read(self, frames: Sequence[int]) -> np.ndarray:
        """(T, H, W, 3) uint8 RGB of the given frame numbers (ascending), upright."""
        frames = self.check_request(frames)
        try:
            array = self._read_sequential(frames) if self.sequential else self._read_by_pts(frames)
        except av.FFmpegError as exc:
            self._frames = None
            raise VideoDecodeError(self.path, f"decoding frames {frames[0]}..{frames[-1]} failed ({_short(exc)})") from None
        if self.rotation:
            array = np.ascontiguousarray(np.rot90(array, k=self.rotation // 90, axes=(1, 2)))
        return array

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
        return any(current < key.position <= index for key in self._keyframes)

    def _seek_before(self, index: int) -> None:
        """Position the decoder on a keyframe at or before frame `index`, checked on the first packet it reads.

        Demuxers seek by their own index (dts, cues, or a faulty AVI index) and may land after the target;
        then an earlier keyframe is tried, and in the end a fresh decode from the start."""
        candidates = [key for key in self._keyframes if key.position <= index]
        for key in reversed(candidates[-3:]):
            try:
                self._container.seek(key.seek_ts, stream=self._stream, backward=True)
            except av.FFmpegError:
                break
            self._stream.codec_context.flush_buffers()
            packets = self._container.demux(self._stream)
            first = next((p for p in packets if p.size and not p.is_discard), None)
            if first is None or first.pts is None or not first.is_keyframe:
                continue
            landed = bisect.bisect_left(self._pts, first.pts)  # type: ignore[arg-type]
            if landed < len(self._pts) and self._pts[landed] == first.pts and landed <= key.position:  # type: ignore[index]
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

    def __enter__(self) -> VideoReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_file(path: str) -> None:
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


def open_video(path: str, backend: Backend | None = None, max_pixels: int | None = None) -> VideoReader | ForeignReader:
    """A frame-exact reader of `path` (PyAV unless `backend` says otherwise); every failure is a VideoDecodeError
    naming the file. With `max_pixels`, frames larger than that are refused before any is decoded."""
    if backend is None or backend.choice == "pyav":
        return VideoReader(path, backend.threads if backend is not None else 0, max_pixels)
    if backend.choice == "decord":
        return DecordReader(path, max_pixels)
    return TorchcodecReader(path, backend.device, max_pixels)


def decode_frames(path: str, frames: Sequence[int], backend: Backend | None = None) -> np.ndarray:
    """(T, H, W, 3) uint8 RGB of `frames` of `path`, with a reader of its own."""
    with open_video(path, backend) as reader:
        return reader.read(frames)


# --------------------------------------------------------------------------- decode backends


FOREIGN_COLOUR_TOLERANCE = 3.0
"""Mean |frame - PyAV's frame| in 0..255 levels a backend not byte-identical may show (another yuv->rgb rounding);
neighbouring frames of real footage differ by more, and a sideways frame by far more."""
IDENTICAL_TO_PYAV = frozenset({"pyav", "decord"})
"""Backends whose RGB frames were byte-identical to VideoReader's on every test video (tests/test_decoders.py);
decord only in DECORD_PIXEL_FORMATS, and it refuses the others. torchcodec is not listed: never measured."""
AUTO_ORDER = ("pyav", "decord")
"""The backends --decoder auto may pick, fastest first (scripts/bench_decode.py on a 2-core EPYC VM: PyAV beats
decord's forward-only reading on every workload). Only backends whose RGB is byte-identical to PyAV's on the
test videos are listed: torchcodec was not measured (no FFmpeg shared libraries there), so it is never picked."""
DECORD_DECODER = "decord-seq/1"
DECORD_PIXEL_FORMATS = frozenset({"yuv420p", "yuvj420p", "yuv422p", "yuv444p", "yuv444p10le", "gray"})
"""Pixel formats whose RGB decord gave byte-identical to PyAV's (h264, HEVC, MPEG-4, VP9). Not yuv420p10le
(10-bit phone HEVC, h264 High 10): 0.57-0.67 levels off on average; untested formats are refused too."""
TORCHCODEC_DECODER = "torchcodec-{device}/1"


@dataclass(frozen=True)
class Backend:
    """A resolved --decoder: which library reads the frames, and the name the run fingerprint records for it.

    Every backend has its own recorded name, so one cache never mixes decoders (a resume with another one is
    refused); pyav keeps DECODER, the name caches had before there was a choice."""

    choice: str
    """pyav, decord or torchcodec."""
    name: str
    """Recorded in the run fingerprint and the manifest settings ("decoder")."""
    device: str = "cpu"
    """Where torchcodec decodes: cpu, or cuda[:N] (NVDEC)."""
    threads: int = 0
    """FFmpeg threads per open video with pyav (0: FFmpeg's choice, about one per core of the machine, which
    oversubscribes it when several processes decode beside an encode). decord and torchcodec decode with one.
    Not recorded: every thread count gives the same frames."""

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ValueError(f"decode threads must be >= 0, got {self.threads}")


PYAV = Backend("pyav", DECODER)


def backend_unavailable(choice: str) -> str | None:
    """Why `choice` cannot be used in this environment (None: it can)."""
    if choice == "pyav":
        return None
    module = {"decord": "decord", "torchcodec": "torchcodec.decoders"}[choice]
    try:
        __import__(module)
    except Exception as exc:  # torchcodec raises RuntimeError/OSError when FFmpeg's shared libraries are missing
        return f"{choice} cannot be imported ({_short(exc)})"
    return None


def resolve_decoder(choice: str, device: Any = "cpu", workers: int = 0) -> Backend:
    """The backend --decoder `choice` means for a run on `device` with `workers` decode processes."""
    if choice == "auto":
        choice = next(name for name in AUTO_ORDER if name in IDENTICAL_TO_PYAV and backend_unavailable(name) is None)
    if choice not in DECODER_CHOICES:
        raise UsageError(f"--decoder must be one of {', '.join(DECODER_CHOICES)}, got {choice!r}")
    if choice == "pyav":
        return PYAV
    reason = backend_unavailable(choice)
    if reason is not None:
        extra = "; it needs pip install 'vaecache[torchcodec]' and FFmpeg 4-8 shared libraries" if choice == "torchcodec" else ""
        raise UsageError(f"--decoder {choice}: {reason}{extra}")
    if choice == "decord":
        return Backend("decord", DECORD_DECODER)
    where = str(torch.device(device)) if torch.device(device).type == "cuda" else "cpu"
    if where != "cpu" and workers:
        raise UsageError("--decoder torchcodec on CUDA (NVDEC) decodes in the main process: use --workers 0 "
                         "(CUDA cannot start in forked DataLoader workers)")
    return Backend("torchcodec", TORCHCODEC_DECODER.format(device=where.split(":")[0]), where)


def backend_for_record(name: str | None) -> Backend:
    """The backend that wrote a cache, from the decoder name its manifest records (none recorded: pyav)."""
    if name in (None, DECODER):
        return PYAV
    if name == DECORD_DECODER:
        return resolve_decoder("decord")
    for where in ("cpu", "cuda"):
        if name == TORCHCODEC_DECODER.format(device=where):
            return resolve_decoder("torchcodec", where)
    raise UsageError(f"the cache was decoded with {name!r}, which this vaecache does not know")


class ForeignReader:
    """A backend other than PyAV: frame numbering, frame count, times, the even-spacing check and the rotation
    all come from a PyAV VideoReader of the same file (its packet index; no frame is decoded by PyAV but the
    first), so every backend reads the same frame n and refuses the same clips. Subclasses fetch the pixels."""

    def __init__(self, path: str, max_pixels: int | None = None) -> None:
        self.path = path
        self.index = VideoReader(path, max_pixels=max_pixels)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def rotation(self) -> int:
        return self.index.rotation

    @property
    def frame_size(self) -> tuple[int, int]:
        return self.index.frame_size

    @property
    def codec(self) -> str:
        return self.index.codec

    def timestamps(self, frames: Sequence[int]) -> list[float]:
        return self.index.timestamps(frames)

    def fps(self) -> float:
        return self.index.fps()

    def check_probe(self, frames: int, width: int, height: int) -> None:
        self.index.check_probe(frames, width, height)

    def read(self, frames: Sequence[int]) -> np.ndarray:
        """(T, H, W, 3) uint8 RGB of the given frame numbers (ascending), upright, as VideoReader.read."""
        frames = self.index.check_request(frames)
        array = self._pixels(frames)
        width, height = self.frame_size
        upright = (width, height) if self.rotation in (90, 270) else (height, width)
        if array.shape[1:] != (*upright, 3):
            raise VideoDecodeError(self.path, f"{type(self).__name__} gave frames of shape {tuple(array.shape[1:])}, "
                                              f"the video shows {upright[1]}x{upright[0]} RGB (use --decoder pyav)")
        return array

    def _pixels(self, frames: list[int]) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        self.index.close()

    def __enter__(self) -> ForeignReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DecordReader(ForeignReader):
    """decord, reading forward only: frame n is the n-th frame decord decodes from the start of a fresh reader.

    decord's own seeking (get_batch, seek, even seek(0)) returned neighbouring frames on open-GOP h264, HEVC and
    MPEG-4 AVI with B-frames (issue 12), so a read behind the current position opens the file again instead.
    decord applies the display rotation itself, the same way as VideoReader (checked by shape here for 90 and
    270 degrees, and by the tests for all three)."""

    def __init__(self, path: str, max_pixels: int | None = None) -> None:
        super().__init__(path, max_pixels)
        import decord

        try:
            count = len(decord.VideoReader(path, ctx=decord.cpu(0), num_threads=1))
        except Exception as exc:  # decord raises DECORDError (a RuntimeError) for anything it cannot open
            self.close()
            raise VideoDecodeError(path, f"decord cannot read it ({_short(exc)})") from None
        if count != len(self):
            self.close()
            raise VideoDecodeError(path, f"decord counts {count} frames, a straight decode gives {len(self)} "
                                         "(use --decoder pyav)")
        if self.index.pixel_format not in DECORD_PIXEL_FORMATS:
            self.close()
            raise VideoDecodeError(path, f"pixel format {self.index.pixel_format}: decord's RGB is not known to be "
                                         "byte-identical to PyAV's for it (use --decoder pyav)")
        self._decord: Any = None
        self._next = 0
        width, height = self.frame_size
        self._shown = (width, height) if self.rotation in (90, 270) else (height, width)

    def _restart(self) -> None:
        import decord

        self._decord = decord.VideoReader(self.path, ctx=decord.cpu(0), num_threads=1)
        self._next = 0

    def _pixels(self, frames: list[int]) -> np.ndarray:
        if self._decord is None or self._next > frames[0]:
            self._restart()
        out = []
        try:
            for index in frames:
                for _ in range(index - self._next):  # skip_frames() mis-steps like seeking: decode each one
                    self._decord.next()
                out.append(self._unpadded(self._decord.next().asnumpy()))
                self._next = index + 1
        except Exception as exc:  # DECORDError, StopIteration at a short stream
            self._decord = None
            raise VideoDecodeError(self.path, f"decord failed at frames {frames[0]}..{frames[-1]} "
                                              f"({_short(exc) or type(exc).__name__})") from None
        return np.stack(out)

    def _unpadded(self, frame: np.ndarray) -> np.ndarray:
        """decord hands back rows padded to its line size at widths not a multiple of 32 (a 48-wide frame came
        as 48x4 bytes a row): keep the first width x 3 bytes of each row (byte-identical to PyAV, tested)."""
        height, width = self._shown
        if frame.shape == (height, width, 3) or frame.shape[0] != height or frame.shape[1] * frame.shape[2] < width * 3:
            return frame  # right already, or something else: read() refuses a wrong shape
        return np.ascontiguousarray(frame.reshape(height, -1)[:, :width * 3].reshape(height, width, 3))

    def close(self) -> None:
        self._decord = None
        super().close()


class TorchcodecReader(ForeignReader):
    """torchcodec's VideoDecoder (exact seek mode) on CPU or CUDA (NVDEC). Every frame it returns is checked
    by its timestamp against the one PyAV's index gives frame n: a wrong frame is an error, never a neighbour.

    torchcodec applies the display rotation itself; on opening, its frame 0 must have PyAV's upright shape and
    lie within FOREIGN_COLOUR_TOLERANCE of PyAV's frame 0, or the file is refused (sideways, or other colours)."""

    def __init__(self, path: str, device: str = "cpu", max_pixels: int | None = None) -> None:
        super().__init__(path, max_pixels)
        if self.index.sequential:
            self.close()
            raise VideoDecodeError(path, "no usable timestamps: --decoder torchcodec cannot identify frames "
                                         "(use --decoder pyav)")
        from torchcodec.decoders import VideoDecoder as TorchcodecDecoder

        try:
            self._decoder = TorchcodecDecoder(path, device=device, seek_mode="exact", dimension_order="NHWC")
            first = self._decoder.get_frame_at(0)
            mine = first.data.cpu().numpy()
        except Exception as exc:  # torchcodec raises RuntimeError/ValueError for files it cannot read
            self.close()
            raise VideoDecodeError(path, f"torchcodec cannot read it ({_short(exc)})") from None
        reference = self.index.read([0])[0]
        off = (float(np.abs(mine.astype(np.int16) - reference).mean()) if mine.shape == reference.shape
               else float("inf"))
        if off > FOREIGN_COLOUR_TOLERANCE:
            self.close()
            raise VideoDecodeError(path, f"torchcodec's frame 0 ({mine.shape[1]}x{mine.shape[0]}) is not PyAV's "
                                         f"({reference.shape[1]}x{reference.shape[0]}, display rotation "
                                         f"{self.rotation}): mean difference {off:.1f} levels (use --decoder pyav)")
        self._offset = float(first.pts_seconds)  # frame 0's time on torchcodec's clock
        pts = self.index._pts
        assert pts is not None
        self._tolerance = float(self.index._median_step() * self.index.time_base) / 2 if len(pts) > 1 else 1e-3

    def _pixels(self, frames: list[int]) -> np.ndarray:
        try:
            batch = self._decoder.get_frames_at(indices=frames)
        except Exception as exc:
            raise VideoDecodeError(self.path, f"torchcodec failed at frames {frames[0]}..{frames[-1]} "
                                              f"({_short(exc)})") from None
        expected = self.index.timestamps(frames)
        for index, want, got in zip(frames, expected, batch.pts_seconds.tolist()):
            if abs(got - self._offset - want) > self._tolerance:
                raise VideoDecodeError(self.path, f"torchcodec returned the frame at {got - self._offset:.3f} s "
                                                  f"for frame {index} (at {want:.3f} s)")
        return batch.data.cpu().numpy()

    def close(self) -> None:
        self._decoder = None
        super().close()


# --------------------------------------------------------------------------- resize, crop, range


def resize_cover_crop(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(T, C, h, w) uint8 -> (T, C, height, width) float: scale to cover, then center-crop."""
    _, _, src_h, src_w = frames.shape
    frames = frames.float()
    if (src_h, src_w) != (height, width):
        scale = max(height / src_h, width / src_w)
        new_h, new_w = max(height, round(src_h * scale)), max(width, round(src_w * scale))
        if (new_h, new_w) != (src_h, src_w):
            frames = torch.nn.functional.interpolate(frames, size=(new_h, new_w), mode="bilinear",
                                                     align_corners=False, antialias=True)
        top, left = (new_h - height) // 2, (new_w - width) // 2
        frames = frames[:, :, top:top + height, left:left + width]
    return frames


def resize_fit(frames: torch.Tensor, height: int, width: int, fit: str = "cover") -> torch.Tensor:
    """(T, C, h, w) uint8 -> (T, C, height, width) float by --fit: cover (resize_cover_crop), contain (resize
    to fit inside, centred, padded with PAD_PIXEL: 0.0 in model range), stretch (resize, aspect not kept).
    The geometry is buckets.fit_geometry's, which the clip record's `crop` reports."""
    if fit == "cover":
        return resize_cover_crop(frames, height, width)
    _, _, src_h, src_w = frames.shape
    geometry = fit_geometry(src_w, src_h, height, width, fit)
    frames = frames.float()
    if geometry.resize != (src_h, src_w):
        frames = torch.nn.functional.interpolate(frames, size=geometry.resize, mode="bilinear", align_corners=False,
                                                 antialias=True)
    left, top, right, bottom = geometry.pad
    if left or top or right or bottom:
        frames = torch.nn.functional.pad(frames, (left, right, top, bottom), value=PAD_PIXEL)
    return frames


def to_model_range(frames: torch.Tensor) -> torch.Tensor:
    """[0, 255] -> [-1, 1], clamped (resampling can overshoot)."""
    return (frames / 127.5 - 1.0).clamp_(-1.0, 1.0)


# --------------------------------------------------------------------------- views


class ViewDecoder:
    """Decodes one camera of one clip. Keeps a few readers open: a batch often reads one file twice, and
    the next clip of a file continues where the last one stopped."""

    def __init__(self, height: int, width: int, cache_size: int = 8, fit: str = "cover",
                 backend: Backend = PYAV, max_pixels: int = DEFAULT_MAX_FRAME_PIXELS) -> None:
        self.height, self.width, self.fit, self.backend, self.max_pixels = height, width, fit, backend, max_pixels
        self._readers: OrderedDict[str, VideoReader | ForeignReader] = OrderedDict()
        self._cache_size = cache_size

    def _reader(self, path: str) -> VideoReader | ForeignReader:
        reader = self._readers.pop(path, None)
        if reader is None:
            reader = open_video(path, self.backend, self.max_pixels)
        self._readers[path] = reader
        while len(self._readers) > self._cache_size:
            self._readers.popitem(last=False)[1].close()
        return reader

    def close(self) -> None:
        while self._readers:
            self._readers.popitem()[1].close()

    def timestamps(self, path: str, frames: Sequence[int]) -> list[float]:
        """Presentation time (seconds from the first frame) of each frame of `path`."""
        return self._reader(path).timestamps(frames)

    def frames(self, path: str, frames: Sequence[int]) -> np.ndarray:
        """(T, H, W, 3) uint8 RGB, upright, exactly the frames asked for."""
        try:
            return self._reader(path).read(frames)
        except VideoDecodeError:
            stale = self._readers.pop(path, None)
            if stale is not None:
                stale.close()
            raise

    def check(self, path: str, expect: tuple[int, int, int] | None = None,
              identity: tuple[int, int] | None = None) -> None:
        """Open `path` (VideoDecodeError when it cannot be, or its frames exceed the budget), and refuse it unless
        it has `expect` = (frames, width, height) as planned and, where an index recorded it, `identity` =
        (size, mtime_ns): a file rewritten since it was probed is refused before it is opened, even with the same
        frame count and size."""
        if identity is not None and path not in self._readers:
            check_identity(path, *identity)
        try:
            reader = self._reader(path)
            if expect is not None:
                reader.check_probe(*expect)
        except VideoDecodeError:
            stale = self._readers.pop(path, None)
            if stale is not None:
                stale.close()
            raise

    def decode(self, path: str, frames: Sequence[int], size: tuple[int, int] | None = None) -> torch.Tensor:
        """(C, T, H, W) float in [-1, 1], at `size` (H, W; default the decoder's own)."""
        height, width = size or (self.height, self.width)
        array = self.frames(path, frames)
        tensor = torch.from_numpy(np.ascontiguousarray(array)).permute(0, 3, 1, 2)
        tensor = to_model_range(resize_fit(tensor, height, width, self.fit))
        return tensor.permute(1, 0, 2, 3).contiguous()


def check_identity(path: str, size: int, mtime_ns: int) -> None:
    """VideoDecodeError naming both values unless `path` still has the size and mtime its probe recorded."""
    import datetime as _dt

    try:
        stat = os.stat(path)
    except OSError:
        return  # opening it names the problem
    if (stat.st_size, stat.st_mtime_ns) == (size, mtime_ns):
        return
    when = lambda ns: _dt.datetime.fromtimestamp(ns / 1e9, _dt.timezone.utc).isoformat(timespec="microseconds")
    changes = []
    if stat.st_size != size:
        changes.append(f"size {size} -> {stat.st_size} bytes")
    if stat.st_mtime_ns != mtime_ns:
        changes.append(f"modified {when(mtime_ns)} -> {when(stat.st_mtime_ns)}")
    raise VideoDecodeError(path, f"changed since it was probed ({', '.join(changes)}): its frames may not be the "
                                 "ones indexed; run `vaecache index` again")


class ViewBatchDataset(torch.utils.data.Dataset):
    """Item i decodes the views this rank encodes for batch i; failures are reported, not raised.

    An item is {"index", "views" (V, C, T, H, W), "errors": {clip: (path, reason, whole_file)}, "times": {clip:
    seconds of each frame in its first decoded camera, from that video's first frame}} (times: for the clip
    record). `whole_file`: the file itself failed (it does not open, its frames exceed the budget, it is not what
    its probe says: ViewDecoder.check), whatever frames a clip asks for; every later clip of it then fails at once,
    without opening it again, and the caller records its scene once."""

    def __init__(self, batches: Sequence[Sequence[Any]], view_indices: Sequence[Sequence[int]], height: int, width: int,
                 fit: str = "cover", backend: Backend = PYAV, max_pixels: int = DEFAULT_MAX_FRAME_PIXELS) -> None:
        self.batches = [list(b) for b in batches]
        self.view_indices = [list(v) for v in view_indices]
        self.height, self.width, self.fit, self.backend, self.max_pixels = height, width, fit, backend, max_pixels
        self._decoder: ViewDecoder | None = None
        self._condemned: dict[str, str] = {}
        """Path -> why the whole file failed (in this process)."""

    def __len__(self) -> int:
        return len(self.batches)

    def close(self) -> None:
        """Close the videos this process keeps open (decoding with workers 0 opens them here)."""
        if self._decoder is not None:
            self._decoder.close()
            self._decoder = None

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self._decoder is None:
            self._decoder = ViewDecoder(self.height, self.width, fit=self.fit, backend=self.backend,
                                        max_pixels=self.max_pixels)
        batch = self.batches[index]
        bucket = getattr(batch[0], "bucket", None)  # a batch never mixes buckets (planning.batched)
        size = (bucket.height, bucket.width) if bucket is not None else (self.height, self.width)
        # clip-major, camera-minor, as planning.batch_views lays a batch out (not imported: planning -> sources -> here)
        views = [(clip_index, camera) for clip_index, clip in enumerate(batch) for camera in range(len(clip.cameras))]
        decoded: dict[int, torch.Tensor] = {}
        errors: dict[int, tuple[str, str, bool]] = {}
        times: dict[int, list[float]] = {}
        out = []
        for view_index in self.view_indices[index]:
            clip_index, camera = views[view_index]
            clip = batch[clip_index]
            path = clip.paths[camera]
            if clip_index in errors:
                tensor = None
            elif view_index in decoded:
                tensor = decoded[view_index]
            elif path in self._condemned:
                errors[clip_index] = (path, self._condemned[path], True)
                tensor = None
            else:
                expect, identity = getattr(clip, "expect", ()), getattr(clip, "identity", ())
                tensor = None
                try:
                    self._decoder.check(path, expect[camera] if expect else None, identity[camera] if identity else None)
                except VideoDecodeError as exc:
                    self._condemned[path] = exc.reason
                    errors[clip_index] = (exc.path, exc.reason, True)
                else:
                    try:
                        tensor = self._decoder.decode(path, clip.frames, size)
                        decoded[view_index] = tensor
                        if clip_index not in times:
                            times[clip_index] = self._decoder.timestamps(path, clip.frames)
                    except VideoDecodeError as exc:
                        errors[clip_index] = (exc.path, exc.reason, False)
                        tensor = None
            out.append(tensor)
        template = next((t for t in out if t is not None), None)
        if template is None:
            template = torch.zeros(3, len(batch[0].frames), *size)
        stacked = torch.stack([t if t is not None else torch.zeros_like(template) for t in out])
        for clip_index in errors:
            times.pop(clip_index, None)
        return {"index": index, "views": stacked, "errors": errors, "times": times}
