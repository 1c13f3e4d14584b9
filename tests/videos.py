"""Small real test videos in the stream layouts that broke seeking, and the reference decode they are checked against.

Every frame is distinct (a moving bar over seeded noise whose brightness steps with the frame index), so a
decode that returns a neighbour instead of the frame asked for differs by far more than rounding.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Sequence

import av
import numpy as np


@dataclass(frozen=True)
class VideoLayout:
    """How to write one test video: codec, container, GOP and B-frame options."""

    name: str
    codec: str
    suffix: str
    options: dict[str, str] = field(default_factory=dict)
    pix_fmt: str = "yuv420p"
    gop: int = 12
    max_b_frames: int | None = None


LAYOUTS = {
    "h264-open-gop": VideoLayout("h264-open-gop", "libx264", ".mp4",
                                 {"x264-params": "open-gop=1:bframes=3:b-pyramid=normal:keyint=12:min-keyint=12:"
                                                 "scenecut=0",
                                  "preset": "veryfast", "threads": "1"}),
    "hevc-bframes": VideoLayout("hevc-bframes", "libx265", ".mp4",
                                {"x265-params": "bframes=4:keyint=15:min-keyint=15:open-gop=1:scenecut=0:"
                                                "log-level=error:pools=1:frame-threads=1",
                                 "preset": "ultrafast"}),
    "mpeg4-avi-bframes": VideoLayout("mpeg4-avi-bframes", "mpeg4", ".avi", {}, gop=12, max_b_frames=2),
    "h264-mkv": VideoLayout("h264-mkv", "libx264", ".mkv",
                            {"x264-params": "bframes=2:keyint=12:min-keyint=12:scenecut=0", "preset": "veryfast",
                             "threads": "1"}),
    "vp9-webm": VideoLayout("vp9-webm", "libvpx-vp9", ".webm",
                            {"deadline": "realtime", "cpu-used": "8", "threads": "1"},
                            gop=15),
    # LeRobot's default encoding (src/lerobot/configs/video.py VideoEncoderConfig: libsvtav1, yuv420p, g=2, crf=30,
    # preset 12): decord cannot open it
    "av1-lerobot": VideoLayout("av1-lerobot", "libsvtav1", ".mp4", {"crf": "30", "preset": "12",
                                                                   "svtav1-params": "fast-decode=0:lp=1"}, gop=2),
}


def frame_pixels(index: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """(H, W, 3) uint8 frame `index`: distinct from every other index by a large margin."""
    rng = np.random.default_rng(seed)
    noise = rng.integers(0, 40, size=(height, width, 3), dtype=np.uint8)
    frame = noise + np.uint8((index * 37) % 180)
    left = (index * 5) % width
    frame[:, left:left + 6, :] = 255
    frame[: height // 4, :, index % 3] = 0
    return frame


def write_video(path: Path, layout: VideoLayout, frames: int = 72, height: int = 64, width: int = 96, fps: int = 24,
                rotate: int | None = None, pts: Sequence[int] | None = None, time_base: Fraction | None = None) -> Path:
    """Encode `frames` frames of `frame_pixels` with `layout`.

    `pts` sets each frame's timestamp by hand (in `time_base`, default 1/fps) for variable-frame-rate files;
    `rotate` writes the legacy 'rotate' tag, which the mov muxer turns into a display matrix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(layout.codec, rate=fps, options=dict(layout.options))
        stream.width, stream.height, stream.pix_fmt = width, height, layout.pix_fmt
        stream.codec_context.gop_size = layout.gop
        if layout.max_b_frames is not None:
            stream.codec_context.max_b_frames = layout.max_b_frames
        if time_base is not None or pts is not None:
            stream.time_base = time_base or Fraction(1, fps)
            stream.codec_context.time_base = stream.time_base
        if rotate is not None:
            stream.set_display_rotation(rotate)
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(index, height, width), format="rgb24")
            frame.pts = pts[index] if pts is not None else index
            if pts is not None or time_base is not None:
                frame.time_base = stream.time_base
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def random_windows(count: int, stride: int, rng: random.Random, how_many: int, longest: int = 8) -> list[list[int]]:
    """Random windows of 1..`longest` frames at `stride` in a video of `count` frames, in random order (so later
    windows jump backwards)."""
    windows = []
    for _ in range(how_many):
        length = rng.randint(1, longest)
        start = rng.randint(0, count - 1 - (length - 1) * stride)
        windows.append(list(range(start, start + (length - 1) * stride + 1, stride)))
    return windows


def sequential_frames(path: Path) -> list[np.ndarray]:
    """The reference: every frame of a straight PyAV decode from the start, in output order (frame n = the n-th)."""
    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def remux_to_raw_h264(source: Path, out: Path) -> Path:
    """Copy an h264 stream into a raw Annex B file: no container, so its packets and frames carry no pts."""
    with av.open(str(source)) as src, av.open(str(out), "w", format="h264") as dst:
        stream_in = src.streams.video[0]
        stream_out = dst.add_stream_from_template(stream_in)
        for packet in src.demux(stream_in):
            if packet.dts is None:
                continue
            packet.stream = stream_out
            dst.mux(packet)
    return out


def cut_with_edit_list(source: Path, out: Path, start_frame: int) -> bool:
    """Remux (no re-encode) from the keyframe before `start_frame`, with an edit list starting at it."""
    with av.open(str(source)) as src, av.open(str(out), "w") as dst:
        stream_in = src.streams.video[0]
        stream_out = dst.add_stream_from_template(stream_in)
        frame_ticks = int(1 / (stream_in.average_rate * stream_in.time_base))
        offset = start_frame * frame_ticks
        for packet in src.demux(stream_in):
            if packet.dts is None:
                continue
            packet.stream = stream_out
            packet.pts -= offset
            packet.dts -= offset
            dst.mux(packet)
    with av.open(str(out)) as check:
        return any(p.is_discard for p in check.demux(video=0) if p.size)
