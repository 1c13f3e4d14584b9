"""Decode throughput: vaecache's frame-exact PyAV reader against the old decord path (which mis-seeks).

Workloads: the demo data (6 videos of 64x64, 17 frames) and one 250-frame 480x832 h264 file (x264 defaults:
B-frames, open GOP off) written here. Each is cut into consecutive clips of `--clip-frames` frames at stride 1
("sequential") and at stride 2; every clip of a file is read in order with one reader per file, as
`--workers 0` does; "fresh" opens a new reader per clip, as a DataLoader worker that gets every other clip does.
Prints JSON: decoded frames per second (median of --repeats runs), and the ratio new / decord, measured in
the same run. The load average is printed too: other jobs on the cores slow both paths.

    python scripts/bench_decode.py [--repeats 3] [--clip-frames 17]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchlib as bl  # noqa: E402


def write_big(path: Path, frames: int = 250, height: int = 480, width: int = 832) -> Path:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, size=(height, width, 3), dtype=np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=30, options={"preset": "veryfast"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(frames):
            frame = np.roll(base, shift=index * 4, axis=1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def clips_of(length: int, clip_frames: int, stride: int) -> list[list[int]]:
    span = (clip_frames - 1) * stride + 1
    return [list(range(start, start + span, stride)) for start in range(0, length - span + 1, span)]


def run_new(paths: list[Path], clips: dict[Path, list[list[int]]], fresh: bool) -> int:
    from vaecache.decode import decode_frames, open_video

    count = 0
    for path in paths:
        if fresh:
            for frames in clips[path]:
                count += len(decode_frames(str(path), frames))
        else:
            with open_video(str(path)) as reader:
                for frames in clips[path]:
                    count += len(reader.read(frames))
    return count


def run_decord(paths: list[Path], clips: dict[Path, list[list[int]]], fresh: bool) -> int:
    import decord

    count = 0
    for path in paths:
        reader = None
        for frames in clips[path]:
            if reader is None or fresh:
                reader = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=1)
            count += len(reader.get_batch(frames).asnumpy())
    return count


def frames_per_second(run: Callable[..., int], repeats: int, *args: object) -> float:
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        count = run(*args)
        rates.append(count / (time.perf_counter() - start))
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clip-frames", type=int, default=17)
    args = parser.parse_args(argv)
    try:
        import decord  # noqa: F401
        have_decord = True
    except ImportError:
        have_decord = False
    from vaecache.decode import open_video
    from vaecache.demodata import DemoDataSpec, write_demo_dataset

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workloads = {
            "demo 64x64x17 (6 files)": write_demo_dataset(Path(tmp) / "demo", DemoDataSpec()),
            "h264 480x832x250": [write_big(Path(tmp) / "big.mp4")],
        }
        for name, paths in workloads.items():
            lengths = {}
            for path in paths:
                with open_video(str(path)) as reader:
                    lengths[path] = len(reader)
            for stride in (1, 2):
                clip_frames = min(args.clip_frames, (min(lengths.values()) - 1) // stride + 1)
                clips = {p: clips_of(lengths[p], clip_frames, stride) for p in paths}
                for fresh in (False, True):
                    row = {"workload": name, "stride": stride, "clip_frames": clip_frames,
                           "reader": "fresh per clip" if fresh else "one per file, clips in order",
                           "new_fps": round(frames_per_second(run_new, args.repeats, paths, clips, fresh), 1)}
                    if have_decord:
                        row["decord_fps"] = round(frames_per_second(run_decord, args.repeats, paths, clips, fresh), 1)
                        row["new_over_decord"] = round(row["new_fps"] / row["decord_fps"], 2)
                    results.append(row)
    report = {"cpu": bl.cpu_model(), "load_avg": bl.load_avg(), "repeats": args.repeats, "decord": have_decord,
              "results": results}
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
