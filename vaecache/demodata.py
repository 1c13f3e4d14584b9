"""Deterministic synthetic multi-camera dataset written as real h264 mp4 files.

Layout: ``root/scene_000/cam_0.mp4``, ``root/scene_000/cam_1.mp4``, ... Each video is a smooth
colour gradient whose phase drifts over time, a faint fixed texture, and a few moving circles and
rectangles. Colours, phases and velocities are drawn from a generator seeded by (seed, scene,
camera), so frames move over time and differ per camera, per scene and per seed.

Encoding is lossless libx264 (qp 0), single-threaded, yuv420p, with timestamps derived from the
frame index only. Lossy settings (crf 18) were not reproducible: libx264 driven through PyAV now and
then made other decisions for the same input (decoded frames differed by ~2.6/255 on average from
run to run). Lossless, every decoder returns exactly the encoded yuv420p frames, so the same spec
always decodes to the same pixels, and the same PyAV/libx264 build writes byte-identical files
(checked by the tests). The price is size: ~60 KB per 64x64x17 video instead of ~18 KB.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from vaecache.cache.io import fsync_dir
from vaecache.errors import OutputError, UsageError

__all__ = ["DemoDataSpec", "render_clip", "write_demo_dataset"]

_N_CIRCLES = 3
_N_RECTS = 2
_PRESET = "veryfast"


@dataclass(frozen=True)
class DemoDataSpec:
    """What ``write_demo_dataset`` writes; validated on construction."""

    scenes: int = 3
    """Number of scene folders (``scene_000`` ...)."""
    cameras: int = 2
    """Videos per scene (``cam_0.mp4`` ...)."""
    frames: int = 17
    """Frames per video."""
    height: int = 64
    """Frame height in pixels; even and >= 16 (h264 yuv420p needs even sizes)."""
    width: int = 64
    """Frame width in pixels; even and >= 16."""
    fps: int = 10
    """Frame rate stored in the container."""
    seed: int = 0
    """Seed for colours, phases and motion; a different seed gives different videos."""

    def __post_init__(self) -> None:
        for name in ("scenes", "cameras", "frames", "height", "width", "fps", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise UsageError(f"demo data {name} must be an integer, got {value!r}")
        for name in ("scenes", "cameras", "frames", "fps"):
            if getattr(self, name) < 1:
                raise UsageError(f"demo data {name} must be >= 1, got {getattr(self, name)}")
        for name in ("height", "width"):
            value = getattr(self, name)
            if value < 16 or value % 2:
                raise UsageError(
                    f"demo data {name} must be even and >= 16 (h264 yuv420p), got {value}"
                )
        if self.seed < 0:
            raise UsageError(f"demo data seed must be >= 0, got {self.seed}")


def render_clip(spec: DemoDataSpec, scene: int, camera: int) -> np.ndarray:
    """Render one camera's frames as uint8 RGB of shape (frames, height, width, 3)."""
    rng = np.random.default_rng([spec.seed, scene, camera])
    t_count, h, w = spec.frames, spec.height, spec.width
    t = np.arange(t_count, dtype=np.float32)[:, None, None, None]
    y = np.linspace(0.0, 1.0, h, dtype=np.float32)[None, :, None, None]
    x = np.linspace(0.0, 1.0, w, dtype=np.float32)[None, None, :, None]

    # Background: per-channel sinusoidal gradient along a random direction, phase drifting in time.
    angle = rng.uniform(0.0, 2.0 * np.pi, size=3).astype(np.float32)
    freq = rng.uniform(1.5, 4.0, size=3).astype(np.float32)
    phase = rng.uniform(0.0, 2.0 * np.pi, size=3).astype(np.float32)
    drift = rng.uniform(0.15, 0.45, size=3).astype(np.float32) * rng.choice([-1.0, 1.0], size=3)
    base = rng.uniform(70.0, 150.0, size=3).astype(np.float32)
    amp = rng.uniform(40.0, 80.0, size=3).astype(np.float32)
    wave = freq * (x * np.cos(angle) + y * np.sin(angle)) * 2.0 * np.pi + phase + drift * t
    frames = base + amp * np.sin(wave)  # (T, H, W, 3)

    # Faint fixed texture so the encoder and the VAE see some high-frequency detail.
    texture = rng.normal(0.0, 6.0, size=(1, h, w, 1)).astype(np.float32)
    frames = frames + texture

    # Moving shapes, in normalised coordinates, wrapping around the frame edges.
    yy, xx = y[..., 0], x[..., 0]  # (1, H, 1), (1, 1, W)
    tt = t[..., 0]  # (T, 1, 1)
    for _ in range(_N_CIRCLES):
        centre = rng.uniform(0.0, 1.0, size=2).astype(np.float32)
        velocity = rng.uniform(0.03, 0.08, size=2).astype(np.float32) * rng.choice([-1.0, 1.0], 2)
        radius = np.float32(rng.uniform(0.08, 0.2))
        colour = rng.uniform(0.0, 255.0, size=3).astype(np.float32)
        cy = (centre[0] + velocity[0] * tt) % 1.0
        cx = (centre[1] + velocity[1] * tt) % 1.0
        dy = np.abs(yy - cy)
        dx = np.abs(xx - cx)
        dy = np.minimum(dy, 1.0 - dy)  # torus distance so shapes wrap smoothly
        dx = np.minimum(dx, 1.0 - dx)
        mask = (dy * dy + dx * dx) <= radius * radius
        frames = np.where(mask[..., None], colour, frames)
    for _ in range(_N_RECTS):
        corner = rng.uniform(0.0, 1.0, size=2).astype(np.float32)
        velocity = rng.uniform(0.03, 0.08, size=2).astype(np.float32) * rng.choice([-1.0, 1.0], 2)
        size = rng.uniform(0.12, 0.3, size=2).astype(np.float32)
        colour = rng.uniform(0.0, 255.0, size=3).astype(np.float32)
        ry = (yy - (corner[0] + velocity[0] * tt)) % 1.0
        rx = (xx - (corner[1] + velocity[1] * tt)) % 1.0
        mask = (ry < size[0]) & (rx < size[1])
        frames = np.where(mask[..., None], colour, frames)

    return np.clip(np.rint(frames), 0, 255).astype(np.uint8)


def _encode_mp4(path: Path, frames: np.ndarray, fps: int) -> None:
    """Encode RGB frames to ``path`` as h264 mp4, atomically (temp name, fsync, replace)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with av.open(str(tmp), mode="w", format="mp4") as container:
            stream = container.add_stream(
                "libx264", rate=fps,
                options={"qp": "0", "preset": _PRESET, "x264-params": "threads=1:lookahead-threads=1"}
            )
            stream.width = frames.shape[2]
            stream.height = frames.shape[1]
            stream.pix_fmt = "yuv420p"
            stream.thread_count = 1  # multi-threaded x264 is not bit-reproducible
            time_base = Fraction(1, fps)
            stream.codec_context.time_base = time_base
            for index, rgb in enumerate(frames):
                frame = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p")
                frame.pts = index
                frame.time_base = time_base
                container.mux(stream.encode(frame))
            container.mux(stream.encode(None))
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_demo_dataset(root: Path, spec: DemoDataSpec) -> list[Path]:
    """Write ``root/scene_XXX/cam_J.mp4`` for every scene and camera; return the paths sorted.

    Creates ``root`` if missing and overwrites videos of the same name; other files are left alone.
    """
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise UsageError(f"demo data root {root} exists and is not a directory")
    written: list[Path] = []
    try:
        for scene in range(spec.scenes):
            scene_dir = root / f"scene_{scene:03d}"
            scene_dir.mkdir(parents=True, exist_ok=True)
            for camera in range(spec.cameras):
                path = scene_dir / f"cam_{camera}.mp4"
                _encode_mp4(path, render_clip(spec, scene, camera), spec.fps)
                written.append(path)
            fsync_dir(scene_dir)
    except OSError as exc:
        raise OutputError(f"cannot write demo data under {root}: {exc}") from exc
    return sorted(written)
