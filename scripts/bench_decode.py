"""Decode throughput and frame identity of every --decoder backend, against the old decord path (which mis-seeks).

Backends: vaecache's PyAV reader ("pyav", the reference), its forward-only decord reader ("decord"), its
torchcodec reader where torchcodec imports ("torchcodec", CPU here), and decord's own get_batch as vaecache
0.1.0 called it ("decord get_batch", for scale: it returns neighbouring frames on B-frame streams).

Workloads: the demo data (6 videos of 64x64, 17 frames), one `--frames`-frame `--size` h264 file with x264
defaults (B-frames, closed GOP) and one with open GOP, written here. Each is cut into consecutive clips of
`--clip-frames` frames at stride 1 and at stride 2; every clip of a file is read in order with one reader per
file, as `--workers 0` does; "fresh" opens a new reader per clip, as a DataLoader worker that gets every other
clip does. Frames per second is the median of --repeats runs; the ratio is against pyav in the same run.

Identity (untimed, stride 2, both reader modes): every frame a backend returned is compared with frame n of a
straight PyAV decode from the start: "wrong" counts frames whose nearest reference frame (mean abs difference,
every 2nd pixel) is another one, "not_bytes" frames that are the right one but not byte-identical, "max_mad" the
largest mean abs difference (0..255) of a right frame. The load average is printed: other jobs slow every path.

    python scripts/bench_decode.py [--repeats 3] [--clip-frames 17] [--frames 250] [--size 480x832]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchlib as bl  # noqa: E402

OPEN_GOP = "open-gop=1:bframes=3:b-pyramid=normal:keyint=30:min-keyint=30:scenecut=0"


def write_big(path: Path, frames: int = 250, height: int = 480, width: int = 832, x264_params: str = "") -> Path:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, size=(height, width, 3), dtype=np.uint8)
    options = {"preset": "veryfast", **({"x264-params": x264_params} if x264_params else {})}
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=30, options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(frames):
            frame = np.roll(base, shift=index * 4, axis=1)
            frame[: height // 8] = (index * 23) % 256  # every frame distinct beyond a shift: a bar that steps
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def clips_of(length: int, clip_frames: int, stride: int) -> list[list[int]]:
    span = (clip_frames - 1) * stride + 1
    return [list(range(start, start + span, stride)) for start in range(0, length - span + 1, span)]


def vaecache_reader(choice: str) -> Callable[[Path], Any]:
    """A read function for one of vaecache's backends: open(path) -> reader with .read(frames)."""
    from vaecache.video.backends import open_video, resolve_decoder

    backend = resolve_decoder(choice)
    return lambda path: open_video(str(path), backend)


class _DecordGetBatch:
    """decord as vaecache 0.1.0 used it: get_batch on one VideoReader (seeks by its own frame count)."""

    def __init__(self, path: Path) -> None:
        import decord

        self._reader = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=1)

    def read(self, frames: list[int]) -> np.ndarray:
        return self._reader.get_batch(frames).asnumpy()

    def close(self) -> None:
        self._reader = None


def run(opener: Callable[[Path], Any], paths: list[Path], clips: dict[Path, list[list[int]]], fresh: bool,
        keep: list | None = None) -> int:
    count = 0
    for path in paths:
        reader = None
        for frames in clips[path]:
            if reader is None or fresh:
                if reader is not None:
                    reader.close()
                reader = opener(path)
            got = reader.read(frames)
            count += len(got)
            if keep is not None:
                keep.extend((path, index, array) for index, array in zip(frames, got))
        if reader is not None:
            reader.close()
    return count


def frames_per_second(repeats: int, *args: Any) -> float:
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        count = run(*args)
        rates.append(count / (time.perf_counter() - start))
    return statistics.median(rates)


def references(paths: list[Path]) -> dict[Path, list[np.ndarray]]:
    """Every frame of a straight decode from the start (frame n = the n-th), as full arrays."""
    out = {}
    for path in paths:
        with av.open(str(path)) as container:
            out[path] = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    return out


def identity(opener: Callable[[Path], Any], paths: list[Path], clips: dict[Path, list[list[int]]],
             reference: dict[Path, list[np.ndarray]]) -> dict[str, Any]:
    got: list = []
    for fresh in (False, True):
        run(opener, paths, clips, fresh, keep=got)
    wrong = not_bytes = 0
    max_mad = 0.0
    small = {path: np.stack([ref[::2, ::2] for ref in refs]).astype(np.int16) for path, refs in reference.items()}
    for path, index, array in got:
        if np.array_equal(array, reference[path][index]):
            continue
        errors = np.abs(small[path] - array[::2, ::2].astype(np.int16)).mean(axis=(1, 2, 3))
        if int(np.argmin(errors)) != index:
            wrong += 1
            continue
        not_bytes += 1
        max_mad = max(max_mad, float(np.abs(array.astype(np.int16) - reference[path][index]).mean()))
    return {"frames_checked": len(got), "wrong": wrong, "not_bytes": not_bytes, "max_mad": round(max_mad, 3),
            "byte_identical": wrong == 0 and not_bytes == 0}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clip-frames", type=int, default=17)
    parser.add_argument("--frames", type=int, default=250, help="Frames of each written h264 file.")
    parser.add_argument("--size", default="480x832", help="HxW of the written h264 files.")
    args = parser.parse_args(argv)
    height, width = (int(v) for v in args.size.lower().split("x"))
    from vaecache.demodata import DemoDataSpec, write_demo_dataset
    from vaecache.video.backends import backend_unavailable, open_video

    backends: dict[str, Callable[[Path], Any]] = {}
    unavailable = {}
    for choice in ("pyav", "decord", "torchcodec"):
        reason = backend_unavailable(choice)
        if reason is None:
            backends[choice] = vaecache_reader(choice)
        else:
            unavailable[choice] = reason
    if "decord" in backends:
        backends["decord get_batch"] = _DecordGetBatch
    machine = bl.machine_info("cpu")
    results, identities = [], []
    with tempfile.TemporaryDirectory() as tmp:
        size = f"{height}x{width}x{args.frames}"
        workloads = {
            "demo 64x64x17 (6 files)": write_demo_dataset(Path(tmp) / "demo", DemoDataSpec()),
            f"h264 {size}": [write_big(Path(tmp) / "big.mp4", args.frames, height, width)],
            f"h264 open-GOP {size}": [write_big(Path(tmp) / "open.mp4", args.frames, height, width, OPEN_GOP)],
        }
        for name, paths in workloads.items():
            bl.progress(name)
            lengths = {}
            for path in paths:
                with open_video(str(path)) as reader:
                    lengths[path] = len(reader)
            reference = references(paths)
            for stride in (1, 2):
                clip_frames = min(args.clip_frames, (min(lengths.values()) - 1) // stride + 1)
                clips = {p: clips_of(lengths[p], clip_frames, stride) for p in paths}
                if stride == 2:
                    for backend, opener in backends.items():
                        identities.append({"workload": name, "backend": backend,
                                           **identity(opener, paths, clips, reference)})
                for fresh in (False, True):
                    row: dict[str, Any] = {"workload": name, "stride": stride, "clip_frames": clip_frames,
                                           "reader": "fresh per clip" if fresh else "one per file, clips in order"}
                    for backend, opener in backends.items():
                        row[f"{backend} fps"] = round(frames_per_second(args.repeats, opener, paths, clips, fresh), 1)
                    for backend in backends:
                        if backend != "pyav":
                            row[f"{backend} / pyav"] = round(row[f"{backend} fps"] / row["pyav fps"], 2)
                    results.append(row)
    identical = {b: all(i["byte_identical"] for i in identities if i["backend"] == b) for b in backends}
    report = {"machine": machine, "load_avg_at_end": bl.load_avg(), "repeats": args.repeats,
              "unavailable": unavailable, "byte_identical_to_pyav": identical, "identity": identities,
              "results": results}
    header = ["workload", "stride", "reader", *[f"{b} fps" for b in backends]]
    human = bl.table(f"decoded frames/s ({machine['cpu_model']}, {machine['cores_usable']} cores usable, load "
                     f"{machine['load_avg_at_start']} -> {report['load_avg_at_end']})", header,
                     [[r[h] for h in header] for r in results])
    human += "\n\n" + bl.table("identity against a straight PyAV decode (stride 2, both reader modes)",
                               ["workload", "backend", "frames_checked", "wrong", "not_bytes", "max_mad"],
                               [[i[k] for k in ("workload", "backend", "frames_checked", "wrong", "not_bytes",
                                                "max_mad")] for i in identities])
    if unavailable:
        human += "\n\nnot measured: " + "; ".join(unavailable.values())
    bl.emit(report, human)
    return report


if __name__ == "__main__":
    main()
