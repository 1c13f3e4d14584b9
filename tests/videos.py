"""Small real video files that seeking decoders get wrong: open-GOP h264, HEVC and MPEG-4 Part 2 with
B-frames, an mp4 cut with an edit list, rotation metadata, a variable frame rate. Written with PyAV."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np

WIDTH, HEIGHT = 96, 64


def frame_image(index: int, width: int = WIDTH, height: int = HEIGHT) -> np.ndarray:
    """A frame whose content differs visibly from every other frame's (moving bars, a changing tint)."""
    image = np.zeros((height, width, 3), np.uint8)
    image[:, :, 0] = (index * 7) % 256
    image[:, :, 1] = (np.arange(width)[None, :] * 2) % 256
    image[(index * 3) % height, :, :] = 255
    image[:, (index * 5) % width, 2] = 255
    return image


def write_video(path: Path, codec: str, frames: int = 120, options: dict[str, str] | None = None,
                container_format: str | None = None, rate: int = 25, rotation: int = 0) -> Path:
    with av.open(str(path), "w", format=container_format) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        if options:
            stream.options = options
        if rotation:
            stream.set_display_rotation(rotation)
        for index in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame_image(index), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def open_gop_h264(path: Path) -> Path:
    return write_video(path, "libx264", options={
        "x264-params": "open-gop=1:bframes=3:b-pyramid=normal:keyint=24:min-keyint=24:scenecut=0", "crf": "18"})


def hevc_bframes(path: Path) -> Path:
    return write_video(path, "libx265", options={
        "x265-params": "bframes=4:keyint=24:min-keyint=24:open-gop=1:scenecut=0:log-level=error"})


def mpeg4_avi_bframes(path: Path) -> Path:
    return write_video(path, "mpeg4", container_format="avi", options={"bf": "2", "g": "24"})


def vp9_webm(path: Path) -> Path:
    return write_video(path, "libvpx-vp9", frames=60, options={"g": "20", "deadline": "realtime", "cpu-used": "8"})


def rotated_h264(path: Path, rotation: int = 90) -> Path:
    return write_video(path, "libx264", frames=30, rotation=rotation, options={"crf": "18", "g": "10"})


def edit_list_cut(source: Path, path: Path, first_frame: int) -> Path:
    """Remux `source` from the keyframe before `first_frame` with timestamps shifted so `first_frame` is
    at 0, as `ffmpeg -ss T -c copy` does: the frames before it stay in the file behind an edit list."""
    with av.open(str(source)) as src, av.open(str(path), "w") as out:
        stream = src.streams.video[0]
        target = out.add_stream_from_template(stream)
        shift = int(first_frame / float(stream.average_rate) / stream.time_base)
        src.seek(shift, stream=stream, backward=True)
        for packet in src.demux(stream):
            if packet.dts is None:
                continue
            packet.pts -= shift
            packet.dts -= shift
            packet.stream = target
            out.mux(packet)
    return path


def variable_rate_h264(path: Path, frames: int = 40, gap_after: int = 20, gap_s: float = 2.0) -> Path:
    """10 fps with one `gap_s` hole after frame `gap_after` (a camera that paused)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.codec_context.time_base = Fraction(1, 1000)
        stream.options = {"crf": "18", "g": "10", "bf": "0"}
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_image(index), format="rgb24")
            frame.pts = index * 100 + (int(gap_s * 1000) if index > gap_after else 0)
            frame.time_base = Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
