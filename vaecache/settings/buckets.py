"""Size and length buckets: presets, the nearest-aspect assignment and the geometry of each fit mode.

Pure and light (no torch): the CLI parses presets at help time, planning assigns buckets, decoding and the
shard writer share `fit_geometry`, so the recorded crop box is the one the pixels were cut with.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

from vaecache.errors import UsageError

FIT_CHOICES = ("cover", "contain", "stretch")
FRAMES_POLICY_CHOICES = ("longest", "all")
PAD_PIXEL = 127.5
"""What --fit contain pads with, in [0, 255] pixels: 0.0 in the model's [-1, 1] range (mid grey)."""
TIE_TOLERANCE = 1e-9
"""Aspect distances closer than this are a tie (log(a/b) and -log(b/a) differ in the last bit)."""

SIZE_PRESETS: dict[str, tuple[tuple[int, int], ...]] = {
    "wan-480p": ((480, 832), (832, 480), (624, 624)),
    "wan-720p": ((720, 1280), (1280, 720), (960, 960)),
}
"""--size names for the resolutions common models train at, as (height, width) in the order listed."""


@dataclass(frozen=True)
class Bucket:
    """One latent shape of a cache: the pixel size and frame count every clip in it is encoded at."""

    height: int
    width: int
    num_frames: int

    def __post_init__(self) -> None:
        if min(self.height, self.width, self.num_frames) < 1:
            raise UsageError(f"bucket {self.height}x{self.width}x{self.num_frames} must be positive")

    @property
    def name(self) -> str:
        """Short name, `HxWxF` (e.g. 480x832x17): the key of the manifest's `buckets` and of each clip record."""
        return f"{self.height}x{self.width}x{self.num_frames}"

    def to_record(self) -> dict[str, Any]:
        return {"name": self.name, "height": self.height, "width": self.width, "num_frames": self.num_frames}


def aspect_distance(width: float, height: float, size: tuple[int, int]) -> float:
    """|log(w/h) - log(W/H)| between a source of width x height and a bucket size (H, W)."""
    return abs(math.log(width / height) - math.log(size[1] / size[0]))


def displayed_size(width: int, height: int, rotation: int) -> tuple[int, int]:
    """(width, height) as decoded (upright): a 90 or 270 degree display rotation swaps them."""
    return (height, width) if rotation % 180 == 90 else (width, height)


def nearest_size(displayed: Sequence[tuple[int, int]], sizes: Sequence[tuple[int, int]]) -> int:
    """Index into `sizes` ((H, W) each) of the bucket nearest in log aspect to a scene's cameras (their
    displayed (width, height)): the distance is taken from the mean log aspect of all cameras, so a rig of
    equal cameras uses their one aspect. Ties (within TIE_TOLERANCE) go to the larger area, then to the size
    listed first."""
    if len(sizes) == 1:
        return 0
    log_aspect = sum(math.log(w / h) for w, h in displayed) / len(displayed)
    distances = [abs(log_aspect - math.log(w / h)) for h, w in sizes]
    best = min(distances)
    tied = [i for i, d in enumerate(distances) if d <= best + TIE_TOLERANCE]
    return min(tied, key=lambda i: (-sizes[i][0] * sizes[i][1], i))


@dataclass(frozen=True)
class FitGeometry:
    """How a source frame (displayed width x height) maps into a bucket of height x width pixels."""

    resize: tuple[int, int]
    """(height, width) the source is resized to (the source's own size: no resize)."""
    crop: tuple[int, int, int, int]
    """(top, left, height, width) cut from the resized frame (cover; else the whole resized frame)."""
    pad: tuple[int, int, int, int]
    """(left, top, right, bottom) bucket pixels of padding around it (contain; else zeros)."""
    box: tuple[float, float, float, float]
    """(x0, y0, x1, y1) of the source pixels kept, in source pixel units (edges, not centres)."""

    def to_record(self, source: tuple[int, int]) -> dict[str, Any]:
        """The clip record's per-camera `crop` entry (see docs/buckets.md)."""
        return {"source": list(source), "box": [round(v, 4) for v in self.box], "pad": list(self.pad)}


def fit_geometry(src_w: int, src_h: int, height: int, width: int, fit: str) -> FitGeometry:
    """Pure: the resize, crop and padding `fit` applies to a src_w x src_h frame to make height x width.

    cover: scale so both sides cover the bucket, centre-crop (what a one-size run always did);
    contain: scale so the frame fits inside, centre it and pad (PAD_PIXEL); stretch: resize to the bucket."""
    if fit == "stretch":
        return FitGeometry((height, width), (0, 0, height, width), (0, 0, 0, 0), (0.0, 0.0, float(src_w), float(src_h)))
    if fit == "contain":
        scale = min(height / src_h, width / src_w)
        new_h, new_w = min(height, max(1, round(src_h * scale))), min(width, max(1, round(src_w * scale)))
        top, left = (height - new_h) // 2, (width - new_w) // 2
        return FitGeometry((new_h, new_w), (0, 0, new_h, new_w),
                           (left, top, width - new_w - left, height - new_h - top),
                           (0.0, 0.0, float(src_w), float(src_h)))
    if fit != "cover":
        raise UsageError(f"--fit must be one of {', '.join(FIT_CHOICES)}, got {fit!r}")
    if (src_h, src_w) == (height, width):
        return FitGeometry((height, width), (0, 0, height, width), (0, 0, 0, 0), (0.0, 0.0, float(src_w), float(src_h)))
    # the arithmetic of decode.resize_cover_crop (one-size caches were cut exactly so)
    scale = max(height / src_h, width / src_w)
    new_h, new_w = max(height, round(src_h * scale)), max(width, round(src_w * scale))
    top, left = (new_h - height) // 2, (new_w - width) // 2
    sx, sy = src_w / new_w, src_h / new_h
    return FitGeometry((new_h, new_w), (top, left, height, width), (0, 0, 0, 0),
                       (left * sx, top * sy, (left + width) * sx, (top + height) * sy))


def kept_share(geometry: FitGeometry, src_w: int, src_h: int) -> float:
    """Share of the source's pixels that reach the latent (1.0 for contain and stretch)."""
    x0, y0, x1, y1 = geometry.box
    return (x1 - x0) * (y1 - y0) / (src_w * src_h)


def parse_size(text: str, option: str = "--size") -> tuple[int, int]:
    """'64x96' -> (64, 96) as (height, width)."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match:
        raise UsageError(f"{option} must look like HxW (e.g. 480x832; a comma separates several sizes), got "
                         f"{text!r}")
    height, width = int(match.group(1)), int(match.group(2))
    if height < 1 or width < 1:
        raise UsageError(f"{option} must be positive, got {text!r}")
    return height, width


def parse_sizes(value: Any, option: str = "--size") -> tuple[tuple[int, int], ...]:
    """'480x832', '480x832,832x480', a preset name, or a list of them (TOML) -> ((H, W), ...) in order."""
    if isinstance(value, str) and re.fullmatch(r"\s*\d+\s*,\s*\d+\s*", value):
        raise UsageError(f"{option} takes HxW (e.g. 128x128), got {value!r} (a comma separates several sizes)")
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    sizes: list[tuple[int, int]] = []
    for item in items:
        text = str(item).strip()
        if text.lower() in SIZE_PRESETS:
            sizes.extend(SIZE_PRESETS[text.lower()])
        elif text:
            if re.fullmatch(r"[A-Za-z][\w.-]*", text):
                raise UsageError(f"{option}: unknown preset {text!r} (presets: {', '.join(SIZE_PRESETS)}; or HxW)")
            sizes.append(parse_size(text, option))
    if not sizes:
        raise UsageError(f"{option} must name at least one HxW size or preset, got {value!r}")
    repeated = sorted({f"{h}x{w}" for h, w in sizes if sizes.count((h, w)) > 1})
    if repeated:
        raise UsageError(f"{option} lists {', '.join(repeated)} more than once")
    return tuple(sizes)


def parse_lengths(value: Any, option: str = "--num-frames") -> tuple[int, ...]:
    """17, '17,33,49' or [17, 33] -> (17, 33, 49) in order."""
    items = value if isinstance(value, (list, tuple)) else [value] if isinstance(value, int) else str(value).split(",")
    lengths = []
    for item in items:
        text = str(item).strip()
        if isinstance(item, bool) or not text.lstrip("-").isdigit():
            raise UsageError(f"{option} must be a frame count or a comma-separated list of them, got {value!r}")
        lengths.append(int(text))
    if not lengths:
        raise UsageError(f"{option} must give at least one frame count")
    repeated = sorted({n for n in lengths if lengths.count(n) > 1})
    if repeated:
        raise UsageError(f"{option} lists {', '.join(map(str, repeated))} more than once")
    return tuple(lengths)
