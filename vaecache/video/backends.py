"""Decoder backends: PyAV (VideoReader, the reference) and the ones whose frames are checked against it
(decord, torchcodec on CPU or NVDEC); which one --decoder picks, and opening a video with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from vaecache.errors import UsageError, VideoDecodeError, first_line
from vaecache.settings.parts import DECODER_CHOICES
from vaecache.storage import HeldObjects
from vaecache.urls import is_url
from vaecache.video.frames import FrameList, FrameSequence, is_image_source
from vaecache.video.members import member_of
from vaecache.video.reader import DECODER, VideoReader
from vaecache.video.spans import SpanReader, span_of
from vaecache.video.timeline import Timeline


def open_camera(source: str | FrameList, backend: Backend | None = None, max_pixels: int | None = None,
                fps: float | None = None, held: HeldObjects | None = None, timeline: Timeline | None = None,
                clip: tuple[int, int] | None = None) -> VideoReader | ForeignReader | FrameSequence:
    """A frame-exact reader of one camera: an image sequence (a FrameList, a folder, a glob; Pillow whatever the
    --decoder, at `fps` where its frames carry no times) or a video file (open_video)."""
    if is_image_source(source):
        return FrameSequence(source, fps, max_pixels)
    return open_video(source, backend, max_pixels, held, timeline,  # type: ignore[arg-type]  # not a FrameList
                      clip)


def open_video(path: str, backend: Backend | None = None, max_pixels: int | None = None,
               held: HeldObjects | None = None, timeline: Timeline | None = None,
               clip: tuple[int, int] | None = None) -> VideoReader | ForeignReader | SpanReader:
    """A frame-exact reader of `path` (PyAV unless `backend` says otherwise); every failure is a VideoDecodeError
    naming the file. With `max_pixels`, frames larger than that are refused before any is decoded. An object at a
    URL that `held` holds is read from its bytes (storage.HeldObjects). `timeline` (its probe's frame index) and
    `clip` (the first and last frame of the clip it is opened for) go to the PyAV reader (VideoReader): no packet is
    demuxed to seek, and an object at a URL is read in ranges."""
    span = span_of(path)
    if backend is None or backend.choice == "pyav":
        threads = backend.threads if backend is not None else 0
        return (SpanReader(span, threads, max_pixels, timeline) if span is not None
                else VideoReader(path, threads, max_pixels, held, timeline, clip))
    if member_of(path) is not None or span is not None or is_url(path):
        raise VideoDecodeError(path, f"--decoder {backend.choice} cannot read a video inside a tar, one episode of "
                                     "a file or an object at a URL; use --decoder pyav (what auto picks)")
    if backend.choice == "decord":
        return DecordReader(path, max_pixels, timeline)
    return TorchcodecReader(path, backend.device, max_pixels, timeline)


FOREIGN_COLOUR_TOLERANCE = 3.0
"""Mean |frame - PyAV's frame| in 0..255 levels a backend not byte-identical may show (another yuv->rgb rounding);
neighbouring frames of real footage differ by more, and a sideways frame by far more."""


IDENTICAL_TO_PYAV = frozenset({"pyav", "decord"})
"""Backends whose RGB frames were byte-identical to VideoReader's on every test video (tests/video/test_backends.py);
decord only in DECORD_PIXEL_FORMATS, and it refuses the others. torchcodec is not listed: never measured."""


AUTO_ORDER = ("pyav", "decord")
"""The backends --decoder auto may pick, fastest first (scripts/bench_decode.py on a 2-core EPYC VM: PyAV beats
decord's forward-only reading on every workload; scripts/gpu_check.py on a 16-core H200 host: 3x faster at 1080p
h264, 6x HEVC). Only backends whose RGB is byte-identical to PyAV's on the
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
        return f"{choice} cannot be imported ({first_line(exc, 200)})"
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
        extra = ("; it needs pip install 'vaecache[torchcodec]' and FFmpeg 4-8 shared libraries"
                 if choice == "torchcodec" else "")
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
    all come from a PyAV VideoReader of the same file (its packet index, or the probe's timeline of it; no frame is
    decoded by PyAV but the first), so every backend reads the same frame n and refuses the same clips. Subclasses
    fetch the pixels."""

    def __init__(self, path: str, max_pixels: int | None = None, timeline: Timeline | None = None) -> None:
        self.path = path
        self.index = VideoReader(path, max_pixels=max_pixels, timeline=timeline)  # with one: nothing demuxed

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

    def times_ns(self) -> list[int]:
        return self.index.times_ns()

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
    MPEG-4 AVI with B-frames, so a read behind the current position opens the file again instead.
    decord applies the display rotation itself, the same way as VideoReader (checked by shape here for 90 and
    270 degrees, and by the tests for all three)."""

    def __init__(self, path: str, max_pixels: int | None = None, timeline: Timeline | None = None) -> None:
        super().__init__(path, max_pixels, timeline)
        import decord

        try:
            count = len(decord.VideoReader(path, ctx=decord.cpu(0), num_threads=1))
        except Exception as exc:  # decord raises DECORDError (a RuntimeError) for anything it cannot open
            self.close()
            raise VideoDecodeError(path, f"decord cannot read it ({first_line(exc, 200)})") from None
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
                                              f"({first_line(exc, 200)})") from None
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

    def __init__(self, path: str, device: str = "cpu", max_pixels: int | None = None,
                 timeline: Timeline | None = None) -> None:
        super().__init__(path, max_pixels, timeline)
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
            raise VideoDecodeError(path, f"torchcodec cannot read it ({first_line(exc, 200)})") from None
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
                                              f"({first_line(exc, 200)})") from None
        expected = self.index.timestamps(frames)
        for index, want, got in zip(frames, expected, batch.pts_seconds.tolist()):
            if abs(got - self._offset - want) > self._tolerance:
                raise VideoDecodeError(self.path, f"torchcodec returned the frame at {got - self._offset:.3f} s "
                                                  f"for frame {index} (at {want:.3f} s)")
        return batch.data.cpu().numpy()

    def close(self) -> None:
        self._decoder = None
        super().close()
