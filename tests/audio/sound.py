"""Test videos with sound, written by PyAV (an H.264 picture and an audio stream of seeded noise), and the samples
FFmpeg's own command line decodes from them (`ffmpeg -i X -map 0:a -c:a pcm_f32le`, the binary imageio-ffmpeg
ships): the reference a clip's audio is cut against."""

from __future__ import annotations

import fractions
import subprocess
from pathlib import Path

import av
import numpy as np


def write_video_with_sound(path: Path, *, rate: int = 44100, layout: str = "stereo", codec: str = "aac",
                           audio_offset: int = 0, seconds: float = 2.0, fps: int = 25, sound: bool = True,
                           seed: int = 0) -> Path:
    """An mp4 (a mov for PCM) of `seconds` of video at `fps` and, with `sound`, an audio stream whose first sample
    is written at `audio_offset` samples (the muxer may move it by the codec's priming)."""
    out = av.open(str(path), "w")
    video = out.add_stream("libx264", rate=fps)
    video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
    audio = out.add_stream(codec, rate=rate, layout=layout) if sound else None
    for index in range(round(seconds * fps)):
        image = np.full((48, 64, 3), index * 5 % 255, np.uint8)
        for packet in video.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
            out.mux(packet)
    if audio is not None:
        channels = len(audio.layout.channels)
        total = round(seconds * rate)
        noise = (np.random.default_rng(seed).standard_normal((channels, total)) * 0.2).astype(np.float32)
        sample_format = audio.codec_context.format.name
        chunk = audio.codec_context.frame_size or 1024
        for position in range(0, total, chunk):
            block = noise[:, position:position + chunk]
            if sample_format.startswith("s16"):
                block = (np.clip(block, -1, 1) * 32767).astype(np.int16)
            data = block if sample_format.endswith("p") else block.T.reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data), format=sample_format, layout=layout)
            frame.sample_rate, frame.pts = rate, position + audio_offset
            frame.time_base = fractions.Fraction(1, rate)
            for packet in audio.encode(frame):
                out.mux(packet)
        for packet in audio.encode():
            out.mux(packet)
    for packet in video.encode():
        out.mux(packet)
    out.close()
    return path


def ffmpeg_samples(path: Path) -> tuple[np.ndarray, int, float]:
    """(samples (channels, n) float32, rate, start seconds) of the video's first audio stream as FFmpeg's command
    line writes it out (`-c:a pcm_f32le`); the start is the stream's as the container states it."""
    import imageio_ffmpeg

    raw = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", str(path), "-map", "0:a",
                          "-c:a", "pcm_f32le", "-f", "f32le", "-"], capture_output=True, check=True).stdout
    with av.open(str(path)) as container:
        stream = container.streams.audio[0]
        channels, rate = len(stream.layout.channels), int(stream.rate)
        start = float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0
    return np.frombuffer(raw, np.float32).reshape(-1, channels).T.copy(), rate, start
