"""The report's pictures and sound as files a browser opens from disk: frame strips (PNG, Pillow) and a clip's
sound (16-bit PCM WAV, the standard library's `wave`)."""

from __future__ import annotations

import wave
from pathlib import Path
from typing import Sequence

import numpy as np

STRIP_HEIGHT = 128
"""Frames taller than this are scaled down in a strip (frames smaller are kept as they are: the page enlarges them
without smoothing, so each pixel stays visible)."""
GAP = 2
"""Pixels between the frames of a strip and between its rows."""


def frames_uint8(frames: np.ndarray) -> np.ndarray:
    """(T, 3, H, W) floats in [-1, 1] -> (T, H, W, 3) uint8 (round to nearest), as vaecache decode writes its mp4."""
    return np.clip(np.rint((frames.astype(np.float32) + 1.0) * 127.5), 0, 255).astype(np.uint8).transpose(0, 2, 3, 1)


def write_strip(path: Path, rows: Sequence[Sequence[np.ndarray]]) -> tuple[int, int]:
    """A PNG of `rows` (each a list of (H, W, 3) uint8 frames, all of one size), frames side by side with a GAP of
    white between them and between rows, every frame scaled to at most STRIP_HEIGHT pixels tall. Returns its
    (width, height)."""
    from PIL import Image

    height, width = rows[0][0].shape[:2]
    scale = min(1.0, STRIP_HEIGHT / height)
    cell_h, cell_w = max(1, round(height * scale)), max(1, round(width * scale))
    columns = max(len(row) for row in rows)
    canvas = Image.new("RGB", (columns * cell_w + (columns - 1) * GAP, len(rows) * cell_h + (len(rows) - 1) * GAP),
                       (255, 255, 255))
    for r, row in enumerate(rows):
        for c, frame in enumerate(row):
            image = Image.fromarray(frame, "RGB")
            if scale < 1.0:
                image = image.resize((cell_w, cell_h), Image.Resampling.LANCZOS)
            canvas.paste(image, (c * (cell_w + GAP), r * (cell_h + GAP)))
    canvas.save(path, format="PNG", optimize=True)
    return canvas.size


def write_wav(path: Path, samples: np.ndarray, rate: int) -> None:
    """(channels, n) float samples in [-1, 1] as 16-bit PCM WAV (what every browser's <audio> plays)."""
    pcm = np.clip(np.rint(np.asarray(samples, dtype=np.float64) * 32767.0), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as handle:
        handle.setnchannels(int(pcm.shape[0]))
        handle.setsampwidth(2)
        handle.setframerate(int(rate))
        handle.writeframes(np.ascontiguousarray(pcm.T).tobytes())


__all__ = ["STRIP_HEIGHT", "frames_uint8", "write_strip", "write_wav"]
