"""Image-sequence cameras: a folder of frames, a glob, or a list of frame files (an index's, a nuScenes camera's),
read by index with Pillow (libjpeg-turbo for JPEG), EXIF orientation applied.

FrameSequence answers like vaecache.video.reader.VideoReader (len, read, timestamps, fps, frame_size, check_probe),
so probing, planning and the DataLoader workers read either without asking which. Frame n is the n-th file in
natural name order (frame_2 before frame_10). A camera's frame times come, in this order, from its FrameList,
a `timestamps.txt` beside the frames, a trailing epoch timestamp in every file name (nuScenes, Argoverse), or
frame / --fps; without any of these the rate is unknown (fps 0) and only `--sync frames` can use the camera.
"""

from __future__ import annotations

import datetime as _dt
import functools
import glob
import os
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Sequence

import numpy as np

from vaecache.errors import FrameBudgetError, VideoDecodeError
from vaecache.settings.clip import DEFAULT_MAX_FRAME_PIXELS, frame_budget_problem
from vaecache.storage import location_stat, read_location, url_children, url_glob
from vaecache.urls import is_url

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")
VIDEO_EXTENSIONS = (".mp4", ".mov", ".mkv", ".avi", ".webm", ".m4v")
"""What names a video file (a folder layout's other entries are frame folders, or not cameras)."""
TIMESTAMPS_FILE = "timestamps.txt"
GLOB_CHARACTERS = frozenset("*?[")
_DIGITS = re.compile(r"(\d+)")
_TRAILING_INTEGER = re.compile(r"(\d+)\.[A-Za-z]+$")
_USABLE_MODES = frozenset({"RGB", "RGBA", "RGBX", "L", "LA", "P", "PA", "CMYK", "YCbCr", "1"})
"""8-bit modes Pillow converts to RGB without loss of range; 16-bit and float frames ("I;16", "I", "F") would be
clipped to 255 by that conversion and are refused."""
_EPOCH_UNITS = {10: 1_000_000_000, 13: 1_000_000, 16: 1_000, 19: 1}
"""Digits of an epoch timestamp in a file name -> nanoseconds per unit (s, ms, us, ns): only a number of one of
these lengths that falls in 2000-2100 is taken for a time (a frame number like 0000000042 is not)."""
_EPOCH_RANGE_NS = (946_684_800 * 10**9, 4_102_444_800 * 10**9)


def image_decoder_name() -> str:
    """The image decoder and its version, recorded in the run fingerprint beside the video decoder: another
    libjpeg (nvJPEG, a libjpeg-turbo with other IDCT code) gives other pixels."""
    import PIL
    from PIL import features

    return f"pillow-{PIL.__version__}+libjpeg-turbo-{features.version('libjpeg_turbo') or 'none'}/1"


@dataclass(frozen=True)
class FrameList:
    """An image-sequence camera given file by file (an index's "files", a nuScenes camera)."""

    key: str
    """What the camera is called in records and failure logs (its `sources` entry)."""
    files: tuple[str, ...]
    """Absolute paths of the frames, in time order."""
    times_ns: tuple[int, ...] | None = None
    """Each frame's time (ns, any epoch); None: from a timestamps.txt, the names, or the frame rate."""

    def __post_init__(self) -> None:
        if not self.files:
            raise ValueError(f"{self.key}: a frame list needs at least one file")
        if self.times_ns is not None and len(self.times_ns) != len(self.files):
            raise ValueError(f"{self.key}: {len(self.times_ns)} timestamps for {len(self.files)} frames")


def is_image_source(source: Any) -> bool:
    """Whether a camera source is an image sequence (a FrameList, a folder, a glob) rather than a video file."""
    if isinstance(source, FrameList):
        return True
    if not isinstance(source, str) or source.lower().endswith(VIDEO_EXTENSIONS):
        return False  # a folder named like a video is a broken camera file ("not a regular file"), not frames
    if GLOB_CHARACTERS & set(os.path.basename(source)):
        return True
    return _url_holds_frames(source) if is_url(source) else os.path.isdir(source)


@functools.lru_cache(maxsize=4096)
def _url_holds_frames(url: str) -> bool:
    """Whether the prefix `url` holds image frames (one listing per prefix and process; a video object's URL holds
    nothing under it). A tar member or an episode span is no prefix."""
    if "#" in url or url.lower().endswith(IMAGE_EXTENSIONS):
        return False
    try:
        return any(_is_image_name(name.rsplit("/", 1)[-1]) for name in url_children(url))
    except OSError:
        return False


def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key that orders frame_2 before frame_10 (and 0002 before 0010, as plain order does)."""
    return tuple(int(part) if part.isdigit() else part for part in _DIGITS.split(name))


def _is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".")


def list_frames(source: str) -> list[str]:
    """The frame files of a folder or glob source, in natural name order (absolute paths, or URLs for a prefix or a
    pattern in object storage)."""
    if is_url(source):
        try:
            found = (url_glob(source) if GLOB_CHARACTERS & set(os.path.basename(source))
                     else list(url_children(source)))
        except OSError as exc:
            raise VideoDecodeError(source, f"cannot list the frames ({exc})") from None
        return sorted((url for url in found if _is_image_name(url.rsplit("/", 1)[-1])),
                      key=lambda url: natural_key(url.rsplit("/", 1)[-1]))
    if os.path.isdir(source):
        try:
            names = [entry.name for entry in os.scandir(source) if _is_image_name(entry.name)]
        except OSError as exc:
            raise VideoDecodeError(source, f"cannot list the frames ({exc.strerror or exc})") from None
        return [os.path.join(source, name) for name in sorted(names, key=natural_key)]
    found = [path for path in glob.glob(source) if _is_image_name(os.path.basename(path))]
    return sorted(found, key=lambda path: natural_key(os.path.basename(path)))


def frame_files(source: str | FrameList) -> list[str]:
    files = list(source.files) if isinstance(source, FrameList) else list_frames(source)
    if not files:
        raise VideoDecodeError(_name(source), f"no image frames ({' '.join(IMAGE_EXTENSIONS)}) found")
    return files


def _name(source: str | FrameList) -> str:
    return source.key if isinstance(source, FrameList) else source


def files_identity(files: Sequence[str]) -> tuple[int, int]:
    """(total bytes, newest mtime_ns) of a camera's frame files: its identity for the probe cache and records (frames
    at URLs: from the run's listing of DATA, no request per frame)."""
    size = newest = 0
    for path in files:
        try:
            found_size, found_mtime = location_stat(path)
        except OSError as exc:
            raise VideoDecodeError(path, "file not found" if isinstance(exc, FileNotFoundError)
                                   else f"cannot read ({exc.strerror or exc})") from None
        size += found_size
        newest = max(newest, found_mtime)
    return size, newest


# --------------------------------------------------------------------------- frame times


def parse_timestamp(text: str, where: str) -> int:
    """One line of a timestamps.txt as nanoseconds: seconds as a decimal number, or a KITTI-style UTC date and time
    `YYYY-MM-DD HH:MM:SS[.fraction]`."""
    text = text.strip()
    try:
        return int(Decimal(text) * 10**9)
    except (InvalidOperation, ValueError):
        pass
    match = re.fullmatch(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?", text)
    if not match:
        raise VideoDecodeError(where, f"{text!r:.60} is not a timestamp (seconds, or YYYY-MM-DD HH:MM:SS.fraction)")
    moment = _dt.datetime.fromisoformat(f"{match.group(1)} {match.group(2)}").replace(tzinfo=_dt.timezone.utc)
    fraction = (match.group(3) or "").ljust(9, "0")
    return int(moment.timestamp()) * 10**9 + int(fraction or 0)


def timestamps_file(source: str) -> str | None:
    """The timestamps.txt of a folder source: inside it, or beside a KITTI-style `data` folder."""
    if is_url(source):
        if not _url_holds_frames(source):
            return None
        for candidate in (f"{source.rstrip('/')}/{TIMESTAMPS_FILE}",
                          f"{source.rstrip('/').rsplit('/', 1)[0]}/{TIMESTAMPS_FILE}"
                          if source.rstrip("/").rsplit("/", 1)[-1] == "data" else None):
            if candidate:
                try:
                    location_stat(candidate)
                    return candidate
                except OSError:
                    continue
        return None
    if not os.path.isdir(source):
        return None
    for candidate in (os.path.join(source, TIMESTAMPS_FILE),
                      os.path.join(os.path.dirname(source.rstrip("/")), TIMESTAMPS_FILE)
                      if os.path.basename(source.rstrip("/")) == "data" else None):
        if candidate and os.path.isfile(candidate):
            return candidate
    return None


def read_timestamps(path: str, count: int) -> list[int]:
    try:
        lines = [line for line in read_location(path).decode("utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise VideoDecodeError(path, f"cannot read the timestamps ({exc})") from None
    if len(lines) != count:
        raise VideoDecodeError(path, f"{len(lines)} timestamps for {count} frames")
    return [parse_timestamp(line, f"{path}:{number}") for number, line in enumerate(lines, 1)]


def times_from_names(files: Sequence[str]) -> list[int] | None:
    """Each frame's time from a trailing epoch timestamp in its name (s, ms, us or ns by digit count), or None when
    a name has none."""
    times = []
    for path in files:
        match = _TRAILING_INTEGER.search(os.path.basename(path))
        if match is None or len(match.group(1)) not in _EPOCH_UNITS:
            return None
        value = int(match.group(1)) * _EPOCH_UNITS[len(match.group(1))]
        if not _EPOCH_RANGE_NS[0] <= value < _EPOCH_RANGE_NS[1]:
            return None
        times.append(value)
    return times


def check_increasing(times: Sequence[int], files: Sequence[str]) -> None:
    for index in range(1, len(times)):
        if times[index] <= times[index - 1]:
            raise VideoDecodeError(files[index], f"its timestamp {times[index] / 1e9:.6f} s is not after the previous "
                                                 f"frame's ({times[index - 1] / 1e9:.6f} s)")


def checked_request(frames: Sequence[int], count: int, path: str) -> list[int]:
    """The frames asked of a camera of `count` frames as a list, refused unless ascending and in range (every
    reader, video or image sequence)."""
    frames = list(frames)
    if not frames:
        raise ValueError("no frames requested")
    if frames != sorted(frames) or frames[0] < 0:
        raise ValueError(f"frame numbers must be ascending and >= 0, got {frames[:5]}...")
    if frames[-1] >= count:
        raise VideoDecodeError(path, f"frame {frames[-1]} requested, the camera has {count}")
    return frames


def median_step(times: Sequence[int]) -> int:
    steps = sorted(b - a for a, b in zip(times, times[1:]))
    return steps[len(steps) // 2]


# --------------------------------------------------------------------------- the reader


def _image_file(path: str) -> Any:
    """What Pillow opens: a local path, or a frame at a URL read whole by one GET."""
    import io

    return io.BytesIO(read_location(path)) if is_url(path) else path


def _open_image(path: str) -> Any:
    """Pillow's lazy image of `path` (its header read, no pixel decoded), without Pillow's own decompression-bomb
    check: --max-frame-pixels is the budget, checked from the header before any pixel is decoded, so a frame over
    it is a recorded FrameBudgetError like a video's, never Pillow's DecompressionBombError aborting the run (and a
    budget raised past Pillow's 179 MP still decodes)."""
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = None
    return Image.open(_image_file(path))


class FrameSequence:
    """One image-sequence camera, read frame by frame with Pillow."""

    sequential = False
    rotation = 0
    """Frames are returned upright already (EXIF orientation applied): the size is the displayed one."""

    def __init__(self, source: str | FrameList, fps: float | None = None, max_pixels: int | None = None) -> None:
        self.path = _name(source)
        self.files = frame_files(source)
        self._max_pixels = max_pixels
        given = source.times_ns if isinstance(source, FrameList) else None
        stamped = timestamps_file(source) if isinstance(source, str) else None
        if given is not None:
            times: list[int] | None = list(given)
        elif stamped is not None:
            times = read_timestamps(stamped, len(self.files))
        else:
            times = times_from_names(self.files)
        if times is None and fps:
            times = [round(index * 1e9 / fps) for index in range(len(self.files))]
        if times is not None:
            check_increasing(times, self.files)
        self._times = times
        self._fps = float(fps) if fps else (1e9 / median_step(times) if times and len(times) > 1 else 0.0)
        self.codec, self._size = self._header(self.files[0], max_pixels)

    @staticmethod
    def _header(path: str, max_pixels: int | None) -> tuple[str, tuple[int, int]]:
        """(format, displayed (width, height)) from the file's header alone; a FrameBudgetError when the frame is
        over `max_pixels` (None: a probe, whose size planning judges under the run's budget)."""
        from PIL import UnidentifiedImageError

        try:
            with _open_image(path) as image:
                width, height = image.size
                fmt = (image.format or "unknown").lower()
                problem = frame_budget_problem(width, height, max_pixels or DEFAULT_MAX_FRAME_PIXELS)
                if problem and max_pixels is not None:
                    raise FrameBudgetError(path, problem)
                # getexif() on a PNG whose EXIF chunk is not before its pixels decodes them all to look past them:
                # never for a frame over the budget (its orientation does not change its pixel count)
                orientation = (1 if problem and "exif" not in image.info and fmt == "png"
                               else image.getexif().get(0x0112, 1))
        except FileNotFoundError:
            raise VideoDecodeError(path, "file not found") from None
        except PermissionError:
            raise VideoDecodeError(path, "permission denied") from None
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise VideoDecodeError(path, f"not a readable image ({exc})") from None
        return fmt, ((height, width) if orientation in (5, 6, 7, 8) else (width, height))

    def __len__(self) -> int:
        return len(self.files)

    def __enter__(self) -> FrameSequence:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        pass

    @property
    def frame_size(self) -> tuple[int, int]:
        """(width, height) of the upright frames."""
        return self._size

    @property
    def pixel_format(self) -> str | None:
        return None

    def fps(self) -> float:
        """--fps or the index's rate; else 1 / the median step of the frame times; 0.0 when unknown."""
        return self._fps

    def times_ns(self) -> list[int] | None:
        """Every frame's time in ns (its own epoch), None when the camera has no times and no rate."""
        return self._times

    def timestamps(self, frames: Sequence[int]) -> list[float] | None:
        """Seconds of each frame from the camera's first frame; None when the rate is unknown."""
        if self._times is None:
            return None
        first = self._times[0]
        return [(self._times[index] - first) / 1e9 for index in frames]

    def frame_names(self, frames: Sequence[int]) -> list[str]:
        return [self.files[index] for index in frames]

    def check_probe(self, frames: int, width: int, height: int) -> None:
        if (len(self), *self.frame_size) != (frames, width, height):
            raise VideoDecodeError(self.path, f"the index says {frames} frames of {width}x{height}, the camera has "
                                              f"{len(self)} frames of {self._size[0]}x{self._size[1]} (it changed "
                                              "since it was probed; run `vaecache index` again)")

    def check_request(self, frames: Sequence[int]) -> list[int]:
        return checked_request(frames, len(self), self.path)

    def read(self, frames: Sequence[int]) -> np.ndarray:
        """(T, H, W, 3) uint8 RGB of the given frames, upright; a frame that does not decode, or has another size
        than the first, is a VideoDecodeError naming its file."""
        frames = self.check_request(frames)
        width, height = self._size
        clip = np.empty((len(frames), height, width, 3), dtype=np.uint8)
        for slot, index in enumerate(frames):
            self._decode_into(self.files[index], clip[slot])
        return clip

    def _decode_into(self, path: str, target: np.ndarray) -> None:
        """Decode one frame straight into its slot of the clip: the frame's own bytes are freed at once, so the
        allocator reuses them and the clip's memory is written once (holding every frame's bytes until a stack
        cost 20% at 450x800)."""
        from PIL import ImageOps, UnidentifiedImageError

        try:
            with _open_image(path) as image:
                problem = frame_budget_problem(*image.size, self._max_pixels or DEFAULT_MAX_FRAME_PIXELS)
                if problem:
                    raise FrameBudgetError(path, problem)
                # exif_transpose copies even an upright frame: only a frame that says otherwise is transposed
                upright = (ImageOps.exif_transpose(image) if image.getexif().get(0x0112, 1) not in (0, 1)
                           else image)
                if upright.mode not in _USABLE_MODES:
                    raise VideoDecodeError(path, f"{upright.mode} frames (16-bit or float) are not supported; "
                                                 "convert them to 8-bit RGB")
                if upright.size != self._size:
                    raise VideoDecodeError(path, f"frame is {upright.size[0]}x{upright.size[1]}, the camera's "
                                                 f"first frame {os.path.basename(self.files[0])} is "
                                                 f"{self._size[0]}x{self._size[1]} (mixed sizes)")
                target[...] = np.asarray(upright if upright.mode == "RGB" else upright.convert("RGB"))
        except VideoDecodeError:
            raise
        except FileNotFoundError:
            raise VideoDecodeError(path, "file not found") from None
        except PermissionError:
            raise VideoDecodeError(path, "permission denied") from None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
            raise VideoDecodeError(path, f"not a readable image ({exc})") from None


__all__ = ["FrameList", "FrameSequence", "IMAGE_EXTENSIONS", "files_identity", "frame_files", "image_decoder_name",
           "is_image_source", "list_frames", "natural_key", "parse_timestamp", "times_from_names"]
