"""Image-sequence decoding: FrameSequence (what a decode worker runs per camera) against a plain Pillow loop over the
same JPEG files, frames/s in one process, the two measured alternately in one run (median of --repeats).

    python scripts/bench_frames.py [--frames 240] [--size 900x1600] [--repeats 5]

Prints a table (stderr) and JSON (stdout), the machine named. The target: FrameSequence >= 0.9x the plain loop.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _benchlib as bl  # noqa: E402

from vaecache.video.frames import FrameSequence  # noqa: E402


def write_jpegs(folder: Path, count: int, height: int, width: int) -> list[Path]:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, size=(height, width, 3), dtype=np.uint8)
    paths = []
    for index in range(count):
        path = folder / f"{index:06d}.jpg"
        Image.fromarray(np.roll(base, index * 7, axis=1)).save(path, quality=90)
        paths.append(path)
    return paths


def plain_loop(paths: list[Path]) -> float:
    started = time.perf_counter()
    for path in paths:
        with Image.open(path) as image:
            np.asarray(image.convert("RGB"))
    return len(paths) / (time.perf_counter() - started)


def frame_sequence(folder: Path, count: int, clip: int = 17) -> float:
    started = time.perf_counter()
    with FrameSequence(str(folder), fps=12) as images:
        for first in range(0, count - clip + 1, clip):
            images.read(range(first, first + clip))
    done = (count // clip) * clip
    return done / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=238)
    parser.add_argument("--size", default="900x1600", help="HxW of the JPEG frames (nuScenes: 900x1600)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    height, width = map(int, args.size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        paths = write_jpegs(folder, args.frames, height, width)
        plain, ours = [], []
        plain_loop(paths[:8])  # warm the page cache and Pillow
        for _ in range(args.repeats):
            plain.append(plain_loop(paths))
            ours.append(frame_sequence(folder, args.frames))
    result = {"machine": bl.machine_info("cpu"), "frames": args.frames, "size": args.size, "repeats": args.repeats,
              "plain_pillow_fps": statistics.median(plain), "frame_sequence_fps": statistics.median(ours)}
    result["ratio"] = result["frame_sequence_fps"] / result["plain_pillow_fps"]
    bl.emit(result, bl.table(f"JPEG {args.size}, {args.frames} frames: frames/s (median of {args.repeats})",
                             ["reader", "frames/s"],
                             [["plain Pillow loop", result["plain_pillow_fps"]],
                              ["FrameSequence (17-frame clips)", result["frame_sequence_fps"]],
                              ["ratio", result["ratio"]]]))
    return result


if __name__ == "__main__":
    main()
