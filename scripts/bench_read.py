"""Reading a video from object storage: the next block's GET under way while the reader decodes this one.

One high-bitrate h264 video (`--frames` frames of `--size`, half of each frame seeded noise, so x264 cannot squeeze
it: several read blocks), on disk and at an s3:// URL on moto's S3 server behind a proxy that holds every request
`--latency-ms` ms (scripts/_s3_latency.py, in a process of its own). vaecache's reader opens it as a decode worker
does: the index pass over every packet, then every frame, in consecutive clips of `--clip-frames`. Three ways, each
repeat running them in a rotated order:

- disk: the local file;
- s3_prefetch: the URL as vaecache reads it: the next block's GET under way while this one is read, and the blocks
  the index pass fetched kept for the decode (vaecache.urls.BLOCKS_KEPT);
- s3_foreground: the URL read ahead in the foreground (BLOCKS_KEPT = 0, as before): every block waits for its GET,
  and the decode fetches again what the index pass read.

Frames per second: the median over --repeats (index pass and decode together); `vs_disk`: each way's over the
disk's, in the same run. `gets_per_read`: ranged GETs the server logged per read of the video. Every way's frames
are compared with the disk read's (`identical`). Blocks are --block-mb (vaecache.urls.READ_BLOCK); moto streams
bodies at loopback speed, so what the proxy models is each request's round trip, not a bandwidth.

    python scripts/bench_read.py [--repeats 5] [--frames 150] [--size 480x640] [--latency-ms 30] [--block-mb 4]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchlib as bl  # noqa: E402

WAYS = ("disk", "s3_prefetch", "s3_foreground")


def write_video(path: Path, frames: int, height: int, width: int) -> Path:
    """h264 at CRF 10, GOP 30; the right half of every frame seeded noise (megabytes a second), the left a level
    that steps with the frame index (every frame distinct)."""
    rng = np.random.default_rng(0)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=30, options={"crf": "10", "preset": "veryfast"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = 30
        for index in range(frames):
            frame = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
            frame[:, : width // 2] = (index * 7) % 256
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def read_all(location: str, frames: int, clip_frames: int) -> tuple[float, str]:
    """(seconds, sha256 of every frame read): one reader, the index pass, then consecutive clips to the end."""
    from vaecache.video.backends import open_video

    digest = hashlib.sha256()
    started = time.perf_counter()
    with open_video(location) as reader:
        for first in range(0, frames - clip_frames + 1, clip_frames):
            digest.update(reader.read(list(range(first, first + clip_frames))).tobytes())
    return time.perf_counter() - started, digest.hexdigest()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--frames", type=int, default=150)
    parser.add_argument("--size", default="480x640", help="HxW of the video")
    parser.add_argument("--clip-frames", type=int, default=17)
    parser.add_argument("--latency-ms", type=float, default=30.0)
    parser.add_argument("--block-mb", type=float, default=4.0, help="bytes per ranged GET (vaecache.urls.READ_BLOCK)")
    parser.add_argument("--tmp", type=Path, default=None)
    args = parser.parse_args(argv)
    height, width = (int(v) for v in args.size.lower().split("x"))

    import vaecache.urls as urls

    read_frames = (args.frames // args.clip_frames) * args.clip_frames
    with contextlib.ExitStack() as stack:
        stack.callback(setattr, urls, "READ_BLOCK", urls.READ_BLOCK)  # main() runs in-process in the tests
        stack.callback(setattr, urls, "BLOCKS_KEPT", urls.BLOCKS_KEPT)
        urls.READ_BLOCK = max(1 << 16, int(args.block_mb * (1 << 20)))
        block = urls.READ_BLOCK
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=args.tmp)))
        bl.progress(f"writing {args.frames} frames of {width}x{height} (h264, CRF 10, half noise)")
        video = write_video(tmp / "video.mp4", args.frames, height, width)
        size = video.stat().st_size
        log = tmp / "s3-server.log"
        endpoint = stack.enter_context(bl.s3_server(log))
        fs, _ = urls.open_filesystem("s3://bench")
        fs.mkdir("bench")
        fs.put(str(video), "bench/video.mp4")
        if args.latency_ms > 0:
            from _s3_latency import delaying_proxy

            proxy = stack.enter_context(delaying_proxy(endpoint, args.latency_ms))
            saved = os.environ["AWS_ENDPOINT_URL_S3"]
            os.environ["AWS_ENDPOINT_URL_S3"] = proxy.endpoint
            stack.callback(os.environ.__setitem__, "AWS_ENDPOINT_URL_S3", saved)
        urls.set_data_storage_options({})  # DATA's filesystem made afresh, towards the proxy
        stack.callback(urls.set_data_storage_options, {})
        where = {"disk": str(video), "s3_prefetch": "s3://bench/video.mp4", "s3_foreground": "s3://bench/video.mp4"}
        prefetch = {"disk": urls.BLOCKS_KEPT, "s3_prefetch": urls.BLOCKS_KEPT, "s3_foreground": 0}

        def one(way: str) -> tuple[float, str, int]:
            urls.BLOCKS_KEPT = prefetch[way]
            start = bl.s3_requests(log, 0)[1]
            seconds, digest = read_all(where[way], args.frames, args.clip_frames)
            gets = bl.s3_requests(log, start)[0].get("GET range", 0)
            return seconds, digest, gets

        reference = one("disk")[1]  # and warm-ups (the S3 client, the listing): every read is checked against it
        identical = {way: one(way)[1] == reference for way in WAYS}
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        gets: dict[str, list[int]] = {way: [] for way in WAYS}
        load_start = bl.load_avg()
        for repeat in range(args.repeats):
            order = WAYS[repeat % len(WAYS):] + WAYS[:repeat % len(WAYS)]
            bl.progress(f"repeat {repeat + 1}/{args.repeats}: {', '.join(order)}")
            for way in order:
                seconds, digest, count = one(way)
                times[way].append(seconds)
                gets[way].append(count)
                identical[way] = identical[way] and digest == reference

    fps = {way: read_frames / bl.median(times[way]) for way in WAYS}
    result = {
        "frames_per_s": {way: bl.rnd(fps[way], 2) for way in WAYS},
        "vs_disk": {way: bl.rnd(fps[way] / fps["disk"]) for way in WAYS},
        "prefetch_vs_foreground": bl.rnd(fps["s3_prefetch"] / fps["s3_foreground"]),
        "gets_per_read": {way: bl.median(gets[way]) for way in WAYS if way != "disk"},
        "identical": identical,
        "runs_s": {way: [bl.rnd(t) for t in times[way]] for way in WAYS},
        "video": {"bytes": size, "frames": args.frames, "frames_read": read_frames, "size": [height, width],
                  "blocks": -(-size // block), "block_bytes": block},
        "latency_ms": args.latency_ms,
        "repeats": args.repeats,
        "machine": {**bl.machine_info(), "load_avg_at_start": load_start, "load_avg_at_end": bl.load_avg()},
        "timed": "one reader per way and repeat: open, the index pass over every packet, every frame in "
                 "consecutive clips of --clip-frames; the median over repeats",
    }
    rows = [(way, result["frames_per_s"][way], result["vs_disk"][way], result["gets_per_read"].get(way, "-"),
             result["identical"][way]) for way in WAYS]
    human = bl.table(f"one {size / 1e6:.1f} MB video ({result['video']['blocks']} blocks of "
                     f"{block / (1 << 20):g} MiB), {args.latency_ms:g} ms per request",
                     ("way", "frames/s", "vs disk", "GETs per read", "identical"), rows)
    bl.emit(result, human)
    return result


if __name__ == "__main__":
    main()
