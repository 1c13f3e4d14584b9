"""Frame-exact video decoding (PyAV), resize/crop to the clip size, and the DataLoader dataset of views.

Frame n of a video is the n-th frame a straight sequential decode of its first video stream returns.
Seeking decoders (decord, and any "seek to a keyframe, then count") get this wrong on open-GOP h264,
HEVC and MPEG-4 Part 2 with B-frames and on mp4 edit lists, because the frames a decoder returns right
after a seek are not the frames that follow the keyframe in presentation order. So a reader here:

* builds a :class:`VideoIndex` by demuxing the stream once (no decoding): the presentation timestamp
  of every frame the decoder will return (packets marked discard, as an edit list does, return none),
  sorted, so frame n is the n-th timestamp;
* seeks to the keyframe at or before the first wanted timestamp, decodes forward and **identifies each
  decoded frame by its timestamp**, never by counting after a seek; it keeps its position, so the next
  clip of the same file goes on decoding forward without a seek;
* where a stream has no usable timestamps (some AVI files), decodes from the start and counts.

A frame that is asked for and never produced is a :class:`VideoDecodeError`, not a wrong frame.
Rotation metadata (phone video) is applied, so frames come out upright; clips whose frames are not
evenly spaced in time (variable frame rate) are refused by :func:`check_even_spacing`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from vaecache.errors import VideoDecodeError

SPACING_TOLERANCE = 0.5
"""A clip's frame intervals may differ from their median by at most this fraction of it."""


def short_reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


def check_file(path: str) -> None:
    """Raise VideoDecodeError for what is not a readable regular, non-empty file, naming the problem."""
    file = Path(path)
    try:
        if not file.is_file():
            if file.is_symlink() and not file.exists():
                raise VideoDecodeError(path, "broken symlink")
            raise VideoDecodeError(path, "file not found" if not file.exists() else "not a regular file")
        size = file.stat().st_size
        with open(file, "rb"):
            pass
    except PermissionError:
        raise VideoDecodeError(path, "permission denied") from None
    except OSError as exc:
        raise VideoDecodeError(path, f"cannot open ({exc.strerror or exc})") from None
    if size == 0:
        raise VideoDecodeError(path, "empty file (0 bytes)")


@dataclass(frozen=True)
class VideoIndex:
    """What demuxing a video's first video stream found: every frame's timestamp, in presentation order."""

    path: str
    pts: tuple[int, ...] | None
    """Presentation timestamps (stream time base) of the frames a sequential decode returns, sorted;
    None when the stream's packets carry no usable timestamps (frames are then counted by decoding)."""
    keyframe_pts: tuple[int, ...]
    """Timestamps of keyframe packets, sorted (seek targets)."""
    num_frames: int
    time_base: float
    fps: float
    """Average frame rate as the container states it."""
    width: int
    height: int
    rotation: int
    """Counter-clockwise degrees (0, 90, 180, 270) that frames are rotated by to come out upright."""
    codec: str

    def seconds(self, index: int) -> float | None:
        """Presentation time of frame `index` in seconds (None without timestamps)."""
        if self.pts is None:
            return None
        return (self.pts[index] - self.pts[0]) * self.time_base

    @property
    def upright_size(self) -> tuple[int, int]:
        """(height, width) of frames after rotation."""
        return (self.width, self.height) if self.rotation in (90, 270) else (self.height, self.width)


def build_index(path: str) -> VideoIndex:
    """Demux the first video stream (no decoding) and list its frames' timestamps.

    Raises VideoDecodeError naming the file for anything that is not a readable video."""
    import av

    check_file(path)
    try:
        container = av.open(path)
    except av.FFmpegError as exc:
        raise VideoDecodeError(path, f"not a readable video ({short_reason(exc)})") from None
    with container:
        if not container.streams.video:
            kinds = sorted({s.type for s in container.streams}) or ["no streams"]
            raise VideoDecodeError(path, f"no video stream (holds {', '.join(kinds)})")
        stream = container.streams.video[0]
        pts: list[int] = []
        keyframes: list[int] = []
        packets = 0
        usable = True
        try:
            for packet in container.demux(stream):
                if packet.size == 0:
                    continue
                packets += 1
                if packet.is_discard:
                    continue
                if packet.pts is None:
                    usable = False
                    continue
                pts.append(packet.pts)
                if packet.is_keyframe:
                    keyframes.append(packet.pts)
        except av.FFmpegError as exc:
            raise VideoDecodeError(path, f"not a readable video ({short_reason(exc)})") from None
        time_base = float(stream.time_base) if stream.time_base else 0.0
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else 0.0
        codec = stream.codec_context.name if stream.codec_context else "unknown"
        width, height = stream.codec_context.width, stream.codec_context.height
    pts.sort()
    if usable and (len(set(pts)) != len(pts) or not keyframes or time_base <= 0):
        usable = False
    rotation = _first_frame_rotation(path) if packets else 0
    if usable:
        count = len(pts)
    else:
        count = _count_frames(path)
    if count == 0:
        raise VideoDecodeError(path, "video has no frames")
    return VideoIndex(path, tuple(pts) if usable else None, tuple(sorted(keyframes)) if usable else (), count,
                      time_base, fps, width, height, rotation, codec)


def _first_frame_rotation(path: str) -> int:
    """The display rotation of the first decoded frame (PyAV exposes the display matrix per frame)."""
    import av

    try:
        with av.open(path) as container:
            for frame in container.decode(video=0):
                return int(round(float(getattr(frame, "rotation", 0) or 0) / 90.0)) * 90 % 360
    except av.FFmpegError as exc:
        raise VideoDecodeError(path, f"not a readable video ({short_reason(exc)})") from None
    return 0


def _count_frames(path: str) -> int:
    import av

    try:
        with av.open(path) as container:
            return sum(1 for _ in container.decode(video=0))
    except av.FFmpegError as exc:
        raise VideoDecodeError(path, f"not a readable video ({short_reason(exc)})") from None


def upright(array: np.ndarray, rotation: int) -> np.ndarray:
    """Rotate an (H, W, 3) frame counter-clockwise by `rotation` degrees (a multiple of 90)."""
    turns = (rotation // 90) % 4
    return np.ascontiguousarray(np.rot90(array, k=turns)) if turns else array


class FrameReader:
    """Reads frames of one video by index, exactly (see the module docstring). Not thread-safe."""

    def __init__(self, path: str, index: VideoIndex | None = None) -> None:
        self.path = path
        self.index = index if index is not None else build_index(path)
        self._container: Any = None
        self._frames: Any = None
        self._position: int | None = None
        """Timestamp (or, without timestamps, the frame number) of the last frame decoded."""
        self.seeks = 0

    def __len__(self) -> int:
        return self.index.num_frames

    def close(self) -> None:
        if self._container is not None:
            self._container.close()
        self._container = self._frames = self._position = None

    def _restart(self, target: int | None) -> None:
        """Start decoding at the keyframe at or before timestamp `target`; None: from the start, afresh."""
        import av

        if target is None:
            self.close()
        if self._container is None:
            self._container = av.open(self.path)
        stream = self._container.streams.video[0]
        if target is not None:
            self._container.seek(target, stream=stream, backward=True, any_frame=False)  # also flushes the decoder
            self.seeks += 1
        self._frames = self._container.decode(stream)
        self._position = None

    def read(self, frames: Sequence[int]) -> np.ndarray:
        """(T, H, W, 3) uint8 RGB of `frames` (ascending source frame indices), upright."""
        if not frames:
            raise ValueError("no frames requested")
        if list(frames) != sorted(set(frames)):
            raise ValueError(f"frames must be strictly ascending, got {list(frames)[:8]}")
        if frames[0] < 0 or frames[-1] >= self.index.num_frames:
            raise VideoDecodeError(self.path, f"frame {frames[-1]} requested, video has {self.index.num_frames}")
        import av

        try:
            if self.index.pts is None:
                out = self._read_counting(frames)
            else:
                out = self._read_by_pts(frames)
        except av.FFmpegError as exc:
            self.close()
            raise VideoDecodeError(self.path, f"decoding frames {frames[0]}..{frames[-1]} failed "
                                              f"({short_reason(exc)})") from None
        return np.stack([upright(frame, self.index.rotation) for frame in out])

    def _read_by_pts(self, frames: Sequence[int]) -> list[np.ndarray]:
        pts = self.index.pts
        assert pts is not None
        wanted = {pts[i]: k for k, i in enumerate(frames)}
        first, last = pts[frames[0]], pts[frames[-1]]
        keyframe = _floor(self.index.keyframe_pts, first)
        # Decoding on from where the reader stands beats a seek unless a keyframe lies in between.
        carry_on = (self._frames is not None and self._position is not None and self._position < first
                    and (keyframe is None or keyframe <= self._position))
        out: list[np.ndarray | None] = []
        for attempt in range(2):
            if attempt == 1:
                self._restart(None)  # a seek landed after a frame we need: decode from the very start
            elif not carry_on:
                self._restart(first)
            out = [None] * len(frames)
            for frame in self._frames:
                if frame.pts is None:
                    continue
                self._position = frame.pts
                position = wanted.get(frame.pts)
                if position is not None:
                    out[position] = frame.to_ndarray(format="rgb24")
                if frame.pts >= last:
                    break
            if all(frame is not None for frame in out):
                return out  # type: ignore[return-value]
        missing = [frames[k] for k, frame in enumerate(out) if frame is None]
        self.close()
        raise VideoDecodeError(self.path, f"the decoder never produced frame(s) {missing[:5]}")

    def _read_counting(self, frames: Sequence[int]) -> list[np.ndarray]:
        if self._frames is None or self._position is None or self._position >= frames[0]:
            self._restart(None)
            self._position = -1
        wanted = {index: k for k, index in enumerate(frames)}
        out: list[np.ndarray | None] = [None] * len(frames)
        for frame in self._frames:
            self._position += 1
            position = wanted.get(self._position)
            if position is not None:
                out[position] = frame.to_ndarray(format="rgb24")
            if self._position >= frames[-1]:
                break
        if any(frame is None for frame in out):
            self.close()
            raise VideoDecodeError(self.path, f"video ended before frame {frames[-1]}")
        return out  # type: ignore[return-value]


def _floor(values: Sequence[int], target: int) -> int | None:
    """Largest value <= target in a sorted sequence, or None."""
    import bisect

    position = bisect.bisect_right(values, target)
    return values[position - 1] if position else None


def frame_times(index: VideoIndex, frames: Sequence[int]) -> list[float] | None:
    """Seconds from the video's first frame to each of `frames` (None without timestamps)."""
    if index.pts is None:
        return None
    return [round(index.seconds(i), 6) for i in frames]  # type: ignore[arg-type]


def check_even_spacing(index: VideoIndex, frames: Sequence[int]) -> str | None:
    """Why `frames` are not evenly spaced in time (a variable-frame-rate gap), or None when they are."""
    if index.pts is None or len(frames) < 3:
        return None
    stamps = [index.pts[i] for i in frames]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    typical = sorted(gaps)[len(gaps) // 2]
    worst = max(gaps, key=lambda gap: abs(gap - typical))
    if typical <= 0 or abs(worst - typical) > SPACING_TOLERANCE * typical:
        at = gaps.index(worst)
        return (f"frames are not evenly spaced in time (variable frame rate): {worst * index.time_base:.3f} s "
                f"between frames {frames[at]} and {frames[at + 1]}, {typical * index.time_base:.3f} s typical")
    return None


# --------------------------------------------------------------------------- resize and range


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


def to_model_range(frames: torch.Tensor) -> torch.Tensor:
    """[0, 255] -> [-1, 1], clamped (resampling can overshoot)."""
    return (frames / 127.5 - 1.0).clamp_(-1.0, 1.0)


# --------------------------------------------------------------------------- views


class ViewDecoder:
    """Decodes one camera of one clip. Keeps a few readers open: consecutive clips of a file carry on."""

    def __init__(self, height: int, width: int, cache_size: int = 8) -> None:
        self.height, self.width = height, width
        self._readers: OrderedDict[str, FrameReader] = OrderedDict()
        self._cache_size = cache_size

    def reader(self, path: str) -> FrameReader:
        reader = self._readers.pop(path, None)
        if reader is None:
            reader = FrameReader(path)
        self._readers[path] = reader
        while len(self._readers) > self._cache_size:
            self._readers.popitem(last=False)[1].close()
        return reader

    def frames(self, path: str, frames: Sequence[int]) -> np.ndarray:
        """(T, H, W, 3) uint8 source frames, exact and upright; refuses unevenly spaced clips."""
        reader = self.reader(path)
        uneven = check_even_spacing(reader.index, frames)
        if uneven is not None:
            raise VideoDecodeError(path, uneven)
        try:
            return reader.read(frames)
        except VideoDecodeError:
            self._readers.pop(path, None)
            raise

    def decode(self, path: str, frames: Sequence[int]) -> torch.Tensor:
        """(C, T, H, W) float in [-1, 1] at the clip size."""
        array = self.frames(path, frames)
        tensor = torch.from_numpy(array).permute(0, 3, 1, 2)
        tensor = to_model_range(resize_cover_crop(tensor, self.height, self.width))
        return tensor.permute(1, 0, 2, 3).contiguous()

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()


def decode_sequential(path: str, frames: Sequence[int] | None = None) -> np.ndarray:
    """Reference decode: every frame (or `frames`) of a straight sequential PyAV decode, upright.

    Slow (decodes from the start); used by tests and by nothing on the encode path."""
    import av

    index = build_index(path)
    wanted = set(frames) if frames is not None else None
    out = []
    with av.open(path) as container:
        for number, frame in enumerate(container.decode(video=0)):
            if wanted is None or number in wanted:
                out.append(upright(frame.to_ndarray(format="rgb24"), index.rotation))
            if frames is not None and number >= max(frames):
                break
    return np.stack(out)
