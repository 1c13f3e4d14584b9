"""Reading a video from object storage: the next block's GET under way while the reader decodes this one.

One high-bitrate h264 video (`--frames` frames of `--size`, half of each frame seeded noise, so x264 cannot squeeze
it: several read blocks), on disk and at an s3:// URL on moto's S3 server behind a proxy that holds every request
`--latency-ms` ms (scripts/_s3_latency.py, in a process of its own). vaecache's reader opens it as a decode worker
does: the index pass over every packet, then every frame, in consecutive clips of `--clip-frames`. Three ways, each
repeat running them in a rotated order:

- disk: the local file;
- s3_prefetch: the URL as vaecache reads it: the next block's GET under way while this one is read, and the blocks
  the index pass fetched kept for the decode (vaecache.storage.BLOCKS_KEPT);
- s3_foreground: the URL read ahead in the foreground (BLOCKS_KEPT = 0, as before): every block waits for its GET,
  and the decode fetches again what the index pass read.

Frames per second: the median over --repeats (index pass and decode together); `vs_disk`: each way's over the
disk's, in the same run. `gets_per_read`: ranged GETs the server logged per read of the video. Every way's frames
are compared with the disk read's (`identical`). Blocks are --block-mb (vaecache.storage.READ_BLOCK); moto streams
bodies at loopback speed, so what the proxy models is each request's round trip, not a bandwidth.

    python scripts/bench_read.py [--repeats 5] [--frames 150] [--size 480x640] [--latency-ms 30] [--block-mb 4]

`--workload clips`: one video holding --clips clips of --clip-frames frames (the same half-noise h264, a keyframe
every --gop frames), and a decode worker's view of it: each of --sample clips spread over the video read by a
fresh reader (open, read the clip, close), four ways: `disk` and `s3` without a timeline (the reader demuxes every
packet to index the video, so at a URL it reads the object whole: before vaecache 0.6), `disk_timeline` and
`s3_timeline` with the probe's timeline (vaecache.video.timeline: nothing demuxed; at a URL the container's header
and index, the clip's GOPs and one read-ahead block). Per clip: seconds (median over clips and --repeats), GETs and
bytes fetched; `s3_vs_disk` the wall-clock ratio of each pair, measured side by side. The timeline's own size is
reported as index bytes per clip, with a one-hour 30 fps video (a keyframe every 2 s) for scale.

    python scripts/bench_read.py --workload clips [--clips 200] [--clip-frames 16] [--size 144x192] [--gop 30]
        [--sample 20] [--latency-ms 30]
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


def write_video(path: Path, frames: int, height: int, width: int, gop: int = 30) -> Path:
    """h264 at CRF 10, a keyframe every `gop` frames; the right half of every frame seeded noise (megabytes a
    second), the left a level that steps with the frame index (every frame distinct)."""
    rng = np.random.default_rng(0)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=30, options={"crf": "10", "preset": "veryfast"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = gop
        for index in range(frames):
            frame = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
            frame[:, : width // 2] = (index * 7) % 256
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def serve_video(stack: contextlib.ExitStack, video: Path, tmp: Path, latency_ms: float) -> Path:
    """`video` as s3://bench/video.mp4 on moto's server (kept running by `stack`), behind the latency proxy where
    `latency_ms` > 0, DATA's filesystem made afresh towards it; returns the server's request log."""
    import vaecache.storage as storage

    log = tmp / "s3-server.log"
    endpoint = stack.enter_context(bl.s3_server(log))
    fs, _ = storage.open_filesystem("s3://bench")
    fs.mkdir("bench")
    fs.put(str(video), "bench/video.mp4")
    if latency_ms > 0:
        from _s3_latency import delaying_proxy

        proxy = stack.enter_context(delaying_proxy(endpoint, latency_ms))
        saved = os.environ["AWS_ENDPOINT_URL_S3"]
        os.environ["AWS_ENDPOINT_URL_S3"] = proxy.endpoint
        stack.callback(os.environ.__setitem__, "AWS_ENDPOINT_URL_S3", saved)
    storage.set_data_storage_options({})
    stack.callback(storage.set_data_storage_options, {})
    return log


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
    parser.add_argument("--workload", choices=("stream", "clips"), default="stream")
    parser.add_argument("--repeats", type=int, default=None, help="default 5 (stream), 1 (clips)")
    parser.add_argument("--frames", type=int, default=150)
    parser.add_argument("--size", default=None, help="HxW of the video (default 480x640; clips: 144x192)")
    parser.add_argument("--clip-frames", type=int, default=None, help="default 17 (stream), 16 (clips)")
    parser.add_argument("--clips", type=int, default=200, help="clips: clips the video holds")
    parser.add_argument("--gop", type=int, default=30, help="clips: frames per GOP")
    parser.add_argument("--sample", type=int, default=20, help="clips: clips read, each by a fresh reader")
    parser.add_argument("--latency-ms", type=float, default=30.0)
    parser.add_argument("--block-mb", type=float, default=4.0, help="bytes per ranged GET (storage.READ_BLOCK)")
    parser.add_argument("--tmp", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.workload == "clips":
        return clips_main(args)
    args.repeats = args.repeats or 5
    args.clip_frames = args.clip_frames or 17
    height, width = (int(v) for v in (args.size or "480x640").lower().split("x"))

    import vaecache.storage as storage

    read_frames = (args.frames // args.clip_frames) * args.clip_frames
    with contextlib.ExitStack() as stack:
        stack.callback(setattr, storage, "READ_BLOCK", storage.READ_BLOCK)  # main() runs in-process in the tests
        stack.callback(setattr, storage, "BLOCKS_KEPT", storage.BLOCKS_KEPT)
        storage.READ_BLOCK = max(1 << 16, int(args.block_mb * (1 << 20)))
        block = storage.READ_BLOCK
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=args.tmp)))
        bl.progress(f"writing {args.frames} frames of {width}x{height} (h264, CRF 10, half noise)")
        video = write_video(tmp / "video.mp4", args.frames, height, width)
        size = video.stat().st_size
        log = serve_video(stack, video, tmp, args.latency_ms)
        where = {"disk": str(video), "s3_prefetch": "s3://bench/video.mp4", "s3_foreground": "s3://bench/video.mp4"}
        prefetch = {"disk": storage.BLOCKS_KEPT, "s3_prefetch": storage.BLOCKS_KEPT, "s3_foreground": 0}

        def one(way: str) -> tuple[float, str, int]:
            storage.BLOCKS_KEPT = prefetch[way]
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


WAYS_BY_CLIP = ("disk", "disk_timeline", "s3", "s3_timeline")


def hour_timeline_bytes() -> int:
    """JSON bytes of the timeline of a one-hour 30 fps video with a keyframe every 2 s (GOPs of uneven bytes)."""
    import json

    from vaecache.video.timeline import Keyframe, Timeline

    rng = np.random.default_rng(0)
    frames, gop = 108_000, 60
    starts = np.cumsum(rng.integers(200_000, 400_000, size=frames // gop)) + 48
    keys = [Keyframe(i * gop, i * gop * 512 - 1024, i * gop * 512, int(start), int(start) + 300_000)
            for i, start in enumerate(starts)]
    timeline = Timeline.build([512 * i for i in range(frames)], keys, [(0, 4144), (int(starts[-1]) + 400_000,
                                                                                  int(starts[-1]) + 2_400_000)])
    return len(json.dumps(timeline.to_json(), separators=(",", ":")))


def read_clip(location: str, frames: list[int], timeline: Any) -> tuple[float, str, int]:
    """(seconds, sha256 of the frames, bytes fetched): a fresh reader opens the video and reads one clip."""
    from vaecache.video.backends import open_video

    started = time.perf_counter()
    with open_video(location, timeline=timeline, clip=(frames[0], frames[-1])) as reader:
        digest = hashlib.sha256(reader.read(frames).tobytes()).hexdigest()
        cache = getattr(reader._url_file, "cache", None)
        fetched = getattr(cache, "fetched_bytes", None) if cache is not None else 0
        if fetched is None:
            fetched = cache.total_requested_bytes
    return time.perf_counter() - started, digest, fetched


def clips_main(args: argparse.Namespace) -> dict[str, Any]:
    import json

    import vaecache.storage as storage

    repeats = args.repeats or 1
    clip_frames = args.clip_frames or 16
    height, width = (int(v) for v in (args.size or "144x192").lower().split("x"))
    frames = args.clips * clip_frames
    step = max(1, args.clips // args.sample)
    sampled = [list(range(c * clip_frames, (c + 1) * clip_frames)) for c in range(0, args.clips, step)][:args.sample]
    with contextlib.ExitStack() as stack:
        stack.callback(setattr, storage, "READ_BLOCK", storage.READ_BLOCK)  # main() runs in-process in the tests
        storage.READ_BLOCK = max(1 << 16, int(args.block_mb * (1 << 20)))
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=args.tmp)))
        bl.progress(f"writing {frames} frames of {width}x{height} (h264, CRF 10, half noise, GOP {args.gop})")
        video = write_video(tmp / "video.mp4", frames, height, width, args.gop)
        size = video.stat().st_size
        log = serve_video(stack, video, tmp, args.latency_ms)
        from vaecache.video.backends import open_video

        with open_video("s3://bench/video.mp4") as probing:  # as `vaecache index` records it
            timeline = probing.timeline
        where = {"disk": str(video), "disk_timeline": str(video), "s3": "s3://bench/video.mp4",
                 "s3_timeline": "s3://bench/video.mp4"}
        given = {"disk": None, "disk_timeline": timeline, "s3": None, "s3_timeline": timeline}
        reference = {tuple(clip): read_clip(str(video), clip, None)[1] for clip in sampled}
        times: dict[str, list[float]] = {way: [] for way in WAYS_BY_CLIP}
        gets: dict[str, list[int]] = {way: [] for way in WAYS_BY_CLIP}
        fetched: dict[str, list[int]] = {way: [] for way in WAYS_BY_CLIP}
        identical = dict.fromkeys(WAYS_BY_CLIP, True)
        for repeat in range(repeats):
            order = WAYS_BY_CLIP[repeat % 4:] + WAYS_BY_CLIP[:repeat % 4]
            for number, clip in enumerate(sampled):
                bl.progress(f"repeat {repeat + 1}/{repeats}, clip {number + 1}/{len(sampled)}: {', '.join(order)}")
                for way in order:
                    start = bl.s3_requests(log, 0)[1]
                    seconds, digest, count = read_clip(where[way], clip, given[way])
                    times[way].append(seconds)
                    fetched[way].append(count)
                    gets[way].append(bl.s3_requests(log, start)[0].get("GET range", 0) if way.startswith("s3") else 0)
                    identical[way] = identical[way] and digest == reference[tuple(clip)]
    per_clip_s = {way: bl.median(times[way]) for way in WAYS_BY_CLIP}
    timeline_bytes = len(json.dumps(timeline.to_json(), separators=(",", ":")))
    hour = hour_timeline_bytes()
    result = {
        "seconds_per_clip": {way: bl.rnd(per_clip_s[way], 4) for way in WAYS_BY_CLIP},
        "s3_vs_disk": {"without_timeline": bl.rnd(per_clip_s["s3"] / per_clip_s["disk"]),
                       "with_timeline": bl.rnd(per_clip_s["s3_timeline"] / per_clip_s["disk_timeline"])},
        "timeline_speedup": {"disk": bl.rnd(per_clip_s["disk"] / per_clip_s["disk_timeline"]),
                             "s3": bl.rnd(per_clip_s["s3"] / per_clip_s["s3_timeline"])},
        "gets_per_clip": {way: bl.median(gets[way]) for way in ("s3", "s3_timeline")},
        "bytes_per_clip": {way: int(bl.median(fetched[way])) for way in ("s3", "s3_timeline")},
        "identical": identical,
        "video": {"bytes": size, "frames": frames, "clips": args.clips, "clip_frames": clip_frames, "gop": args.gop,
                  "size": [height, width], "gop_bytes_mean": int(size / max(1, frames // args.gop)),
                  "head_bytes": sum(end - start for start, end in timeline.head)},
        "index_bytes_per_clip": {"this_video": bl.rnd(timeline_bytes / args.clips),
                                 "one_hour_30fps_200_clips": bl.rnd(hour / 200), "one_hour_timeline": hour,
                                 "at_10m_clips_mb": bl.rnd(hour / 200 * 10_000_000 / 1e6)},
        "sampled_clips": len(sampled),
        "latency_ms": args.latency_ms,
        "block_bytes": storage.READ_BLOCK,
        "repeats": repeats,
        "machine": bl.machine_info(),
        "timed": "per sampled clip and way, a fresh reader: open, read the clip's frames, close; the median",
    }
    rows = [(way, result["seconds_per_clip"][way], result["gets_per_clip"].get(way, "-"),
             result["bytes_per_clip"].get(way, "-"), identical[way]) for way in WAYS_BY_CLIP]
    human = bl.table(f"one {size / 1e6:.1f} MB video of {args.clips} clips x {clip_frames} frames, a fresh reader per "
                     f"clip, {args.latency_ms:g} ms per request (s3/disk: {result['s3_vs_disk']['without_timeline']}x "
                     f"before, {result['s3_vs_disk']['with_timeline']}x with timelines)",
                     ("way", "s per clip", "GETs per clip", "bytes per clip", "identical"), rows)
    bl.emit(result, human)
    return result


if __name__ == "__main__":
    main()
