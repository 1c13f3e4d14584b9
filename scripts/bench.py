#!/usr/bin/env python
"""Throughput of vaecache against its ceiling and against a naive loop, on the same clips in one run.

Three ways to encode the same clips, interleaved in every repeat (the order rotates between repeats):

* encode_only: ``load_vae(spec).encode_views`` on batches decoded into memory beforehand: the ceiling;
* vaecache: ``vaecache.encode.command.run_encode`` in ``vaecache.distributed.distributed()`` (one process) into a
  fresh OUT, decoding in ``--workers`` DataLoader processes, shards written by the writer thread;
* naive: what a user writes first: decord VideoReader (Pillow for --input jpeg) per camera, ``F.interpolate``, one
  ``vae.model.module.encode(x).latent_dist`` per clip with all its cameras as one batch, ``torch.save``
  per clip, one process.

Each figure is the median over --repeats; ratios come from medians measured in this same run.
JSON goes to stdout, a table to stderr. ``--overhead`` adds per-rank-count costs of the pipeline itself,
with a near-zero-cost VAE (scripts/_null_vae.py) under torchrun. ``--s3`` adds a fourth mode, vaecache_s3: the
same run with DATA and OUT in object storage (moto's S3 server as a local process, the data uploaded once), its
views/s against vaecache's on disk (``s3_vs_disk``) and the server's requests per clip by kind. ``--s3-latency-ms``
puts a proxy (scripts/_s3_latency.py) between the vaecache run and moto that holds every request that long, as a
real store's round trip would (moto alone answers from memory on loopback); the upload before the timing goes direct.

    python scripts/bench.py --repeats 3 --workers 1
    python scripts/bench.py --repeats 3 --workers 1 --input jpeg    # image-sequence cameras
    python scripts/bench.py --overhead --overhead-ranks 1,2,4
    python scripts/bench.py --repeats 3 --workers 1 --s3                # object storage
    python scripts/bench.py --repeats 3 --workers 1 --s3 --s3-latency-ms 30   # ... 30 ms per request
    python scripts/bench.py --repeats 3 --workers 1 --s3 --s3-latency-ms 30 --s3-store-nice 19  # ... the store
        # at the lowest CPU priority: it shares this machine's cores with the run, which a remote store does not
    python scripts/bench.py --repeats 3 --workers 1 --s3 --s3-latency-ms 30 --s3-index --scenes 2 --cameras 1 \
        --frames 3400 --num-frames 17          # 200-clip videos, from an index with and without timelines

``--s3-index``: vaecache_s3 encodes from a `vaecache index` of DATA's URL written before the timing (how a large
dataset is run: nothing probed), whose probes carry each video's frame index (`timeline`: a decode worker reads a
clip's GOPs, not the object); a fifth mode, vaecache_s3_old, from the same index with the timelines removed (an
index written before them: each video indexed by demuxing it, the object read whole). With a proxy, GET body bytes
per clip are reported too (``s3_get_bytes_per_clip``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _benchlib as bl  # noqa: E402

MODES = ("encode_only", "vaecache", "naive")

TIMED = {
    "steady": "per mode, from the end of its first batch (warm-up) to the end of its work, over the views of the "
              "other batches. encode_only: encode_views calls only. vaecache: first on_progress callback to "
              "run_encode's return (includes the writer thread's last shard, fsyncs and the manifest). naive: end "
              "of the first clip to the end of the last clip's torch.save. views_per_s, efficiency and "
              "speedup_vs_naive use these figures.",
    "wall": "the whole call. encode_only: encode_views over every batch, VAE already loaded. vaecache: run_encode "
            "(load_vae, probing, DataLoader worker start, encode, writer, manifest). naive: load_vae (the same "
            "module), every clip, every torch.save. Process start and imports are in none of them.",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vae", default="builtin:tiny", help="--vae spec for all three modes (default builtin:tiny)")
    p.add_argument("--scenes", type=int, default=4)
    p.add_argument("--cameras", type=int, default=4)
    p.add_argument("--frames", type=int, default=34, help="frames per source video (clips do not overlap)")
    p.add_argument("--num-frames", type=int, default=17, help="frames per clip")
    p.add_argument("--size", default="64x64", help="HxW the clips are resized and cropped to")
    p.add_argument("--source-size", default="96x128",
                   help="HxW of the generated videos (bigger: resizing is real work)")
    p.add_argument("--input", default="video", choices=("video", "jpeg"),
                   help="video: one mp4 per camera; jpeg: the same frames as a folder of JPEG files per camera "
                        "(quality 90), decoded with Pillow by vaecache and by the naive loop")
    p.add_argument("--batch-size", type=int, default=1, help="clips per batch (vaecache and encode_only)")
    p.add_argument("--workers", type=int, default=1, help="vaecache DataLoader decode workers")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for this process, all modes alike (default: torch's default)")
    p.add_argument("--store", default="mean-logvar", choices=("mean-logvar", "mean"))
    p.add_argument("--shard-size", default="256MiB")
    p.add_argument("--views-per-forward", default="all",
                   help="K | all: views of a clip per forward, for vaecache and encode_only alike (default all: "
                        "every camera, as the naive loop does)")
    p.add_argument("--tmp", default=None, help="folder for data and outputs (default: a new temp folder, removed)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one vaecache run with torch.profiler and print the top ops to stderr")
    p.add_argument("--overhead", action="store_true", help="also measure pipeline overhead per rank count")
    p.add_argument("--s3", action="store_true", help="also run vaecache with DATA and OUT on a local S3 server "
                   "(moto[server] and s3fs, in the test extras)")
    p.add_argument("--s3-latency-ms", type=float, default=0.0, metavar="MS",
                   help="with --s3: the vaecache run talks to moto through a proxy that holds every request MS ms "
                        "before forwarding it (a real store adds ~10-50 ms per request; default 0: no proxy)")
    p.add_argument("--s3-store-nice", type=int, default=0, metavar="N",
                   help="with --s3: run moto and the proxy at nice N (1-19; default 0: the run's priority). They share "
                        "this machine's cores with the run, which a remote store does not: at a low priority they "
                        "take only what the run leaves idle (their answers then wait for it)")
    p.add_argument("--s3-index", action="store_true",
                   help="with --s3: encode DATA's URL from an index written before the timing, with (vaecache_s3) and "
                        "without (vaecache_s3_old) its frame-index timelines")
    p.add_argument("--overhead-ranks", default="1,2,4")
    p.add_argument("--overhead-scenes", type=int, default=16)
    p.add_argument("--overhead-workers", type=int, default=0)
    args = p.parse_args(argv)
    if args.s3_latency_ms < 0 or args.s3_latency_ms != args.s3_latency_ms:
        p.error("--s3-latency-ms must be a number >= 0")
    if args.s3_latency_ms and not args.s3:
        p.error("--s3-latency-ms needs --s3")
    if not 0 <= args.s3_store_nice <= 19:
        p.error("--s3-store-nice must be 0 to 19")
    if args.s3_store_nice and not args.s3:
        p.error("--s3-store-nice needs --s3")
    if args.s3_index and not args.s3:
        p.error("--s3-index needs --s3")
    return args


# --------------------------------------------------------------------------- setup


def resolve_device(spec: str):
    import torch

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_data(root: Path, args: argparse.Namespace, scenes: int) -> Path:
    from vaecache.demodata import DemoDataSpec, write_demo_dataset
    from vaecache.settings.buckets import parse_size

    src_h, src_w = parse_size(args.source_size)
    write_demo_dataset(root, DemoDataSpec(scenes=scenes, cameras=args.cameras, frames=args.frames,
                                          height=src_h, width=src_w, seed=0))
    if args.input == "jpeg":
        for video in sorted(root.glob("*/*.mp4")):
            video_to_jpegs(video, video.with_suffix(""))
            video.unlink()
    return root


def video_to_jpegs(video: Path, folder: Path) -> None:
    """Every frame of `video` as folder/000000.jpg, ...: a camera of the image-sequence layout."""
    import av

    folder.mkdir()
    with av.open(str(video)) as container:
        for index, frame in enumerate(container.decode(video=0)):
            frame.to_image().save(folder / f"{index:06d}.jpg", quality=90)


def camera_frames(camera: Path, frames: list[int]):
    """(T, H, W, 3) uint8 of one camera, as the naive loop reads it: decord for a video, Pillow for JPEGs."""
    import numpy as np
    import torch

    if camera.is_dir():
        from PIL import Image

        files = sorted(camera.glob("*.jpg"))
        return torch.from_numpy(np.stack([np.asarray(Image.open(files[i]).convert("RGB")) for i in frames]))
    import decord

    return torch.from_numpy(decord.VideoReader(str(camera)).get_batch(frames).asnumpy())


def plan_batches(data: Path, args: argparse.Namespace) -> list[list[Any]]:
    """vaecache's own plan of the clips (so all modes encode exactly the same windows)."""
    from vaecache.planning.clips import plan_clips
    from vaecache.planning.jobs import batched
    from vaecache.settings.clip import SamplingConfig
    from vaecache.sources.discover import discover_scenes
    from vaecache.sources.probing import probe_scene

    scenes = discover_scenes(data)
    probes = {scene.scene_id: probe_scene(scene) for scene in scenes}
    clips, skipped = plan_clips(scenes, probes, SamplingConfig(num_frames=args.num_frames))
    if skipped or not clips:
        raise SystemExit(f"dataset problem: {skipped or 'no clips'}")
    return batched(clips, args.batch_size)


def load(args: argparse.Namespace, device):
    from vaecache.vae import load_vae

    return load_vae(args.vae, device, args.dtype, views_per_forward=views_per_forward(args))


def views_per_forward(args: argparse.Namespace) -> int:
    return args.cameras if args.views_per_forward == "all" else int(args.views_per_forward)


def mean_logvar(out: Any):
    """encode_views returns (mean, logvar) in older versions and an EncodeResult in newer ones."""
    if isinstance(out, tuple):
        return out[0], out[1]
    return out.mean, getattr(out, "logvar", None)


# --------------------------------------------------------------------------- the three modes


def steady(marks: list[tuple[float, int]], start: float) -> dict[str, float]:
    """From per-batch (time done, views) marks: whole-call and post-first-batch figures."""
    views = sum(v for _, v in marks)
    wall = marks[-1][0] - start
    if len(marks) < 2:
        return {"views": views, "wall_s": wall, "steady_views": views, "steady_s": wall}
    return {"views": views, "wall_s": wall, "steady_views": views - marks[0][1], "steady_s": marks[-1][0] - marks[0][0]}


def run_encode_only(vae, decoded: list[Any], device) -> dict[str, float]:
    marks = []
    start = time.perf_counter()
    for views in decoded:
        mean, _ = mean_logvar(vae.encode_views(views))
        sync(device)
        marks.append((time.perf_counter(), views.shape[0]))
    return steady(marks, start)


def run_vaecache(args: argparse.Namespace, data: Path, out: Path, height: int, width: int,
                 first_views: int) -> dict[str, Any]:
    import vaecache.encode.startup as startup
    from vaecache.distributed.context import distributed
    from vaecache.encode.command import run_encode
    from vaecache.settings.clip import ClipSettings, SamplingConfig
    from vaecache.settings.commands import EncodeConfig
    from vaecache.settings.options import parse_bytes
    from vaecache.settings.parts import DecodeConfig, OutConfig, ParallelConfig, SourceConfig, VaeConfig

    clip = ClipSettings(SamplingConfig(num_frames=args.num_frames), height, width, dtype=args.dtype, store=args.store,
                        views_per_forward=views_per_forward(args))
    cfg = EncodeConfig(SourceConfig(data), VaeConfig(args.vae), clip,
                       OutConfig(out, shard_size=parse_bytes(args.shard_size), overwrite=True, commit_every_s=0.0),
                       decode=DecodeConfig(workers=args.workers),
                       parallel=ParallelConfig(device=args.device, batch_size=args.batch_size), progress=False)
    marks: list[float] = []
    encodes: list[tuple[float, float]] = []
    start = time.perf_counter()
    with _timed_encoder(startup, encodes), distributed(sp_size=1, device=args.device, environ={}) as ctx:
        summary = run_encode(cfg, ctx, lambda done, total: marks.append(time.perf_counter()))
    end = time.perf_counter()
    if summary.exit_code != 0:
        raise SystemExit(f"vaecache run failed: exit {summary.exit_code}, skipped {summary.skipped}")
    views = summary.views
    from vaecache.cache.manifest import read_manifest
    from vaecache.cache.store import open_store

    manifest = read_manifest(open_store(out))
    result = {"views": views, "wall_s": end - start, "steady_views": views, "steady_s": end - start,
              "run_encode_wall_s": summary.wall_s,
              "views_per_forward_used": manifest.get("vae", {}).get("views_per_forward")}
    if len(marks) >= 2:
        result.update(steady_views=views - first_views, steady_s=end - marks[0])
    result.update(_stages(start, marks, encodes, end))
    return result


@contextlib.contextmanager
def _timed_encoder(startup: Any, encodes: list[tuple[float, float]]) -> Iterator[None]:
    """Instrumentation only: record (start, end) of every encode_views call that run_encode makes.

    run_encode loads its own VAE, so the loader it calls is wrapped for the duration of one run; the
    wrapper calls the real encode_views and changes nothing else.
    """
    original = startup.load_vae

    def load_and_time(*args: Any, **kwargs: Any) -> Any:
        vae = original(*args, **kwargs)
        encode = vae.encode_views

        def timed(views: Any) -> Any:
            begin = time.perf_counter()
            out = encode(views)
            sync(vae.model.device)
            encodes.append((begin, time.perf_counter()))
            return out

        vae.encode_views = timed
        return vae

    startup.load_vae = load_and_time
    try:
        yield
    finally:
        startup.load_vae = original


def _stages(start: float, marks: list[float], encodes: list[tuple[float, float]], end: float) -> dict[str, float]:
    """Where run_encode's main thread spends a batch: waiting for the DataLoader, in encode_views, and from
    the end of encode_views to the progress callback (gather, clip tensors, handing them to the writer).
    Per-batch medians over batches 2..N in ms, plus the setup before the first encode and the tail after
    the last batch (writer.close: the last shard, then the manifest)."""
    if not encodes or len(encodes) != len(marks):
        return {}
    waits = [b - m for (b, _), m in zip(encodes[1:], marks[:-1])]
    encode = [e - b for b, e in encodes[1:]] or [encodes[0][1] - encodes[0][0]]
    after = [m - e for (_, e), m in zip(encodes[1:], marks[1:])] or [marks[0] - encodes[0][1]]
    steady = end - marks[0] if len(marks) > 1 else end - start
    return {
        "stage_wait_for_data_ms": 1000 * bl.median(waits) if waits else 0.0,
        "stage_encode_ms": 1000 * bl.median(encode),
        "stage_after_encode_ms": 1000 * bl.median(after),
        "stage_setup_s": encodes[0][0] - start,
        "stage_tail_s": end - marks[-1],
        "encoder_busy": sum(e - b for b, e in encodes[1:]) / steady if len(marks) > 1 else float("nan"),
    }


def _upload_to_s3(stack: contextlib.ExitStack, data: Path, tmp: Path,
                  latency_ms: float = 0.0, nice: int = 0) -> tuple[Any, Path, int, Any, int]:
    """Start the S3 server (kept running by `stack`; at nice `nice`, as the proxy) and upload DATA once, straight to
    the server; with `latency_ms` > 0 then start the delaying proxy in front of it and point the AWS environment at
    the proxy, so the runs that follow (DATA and OUT) go through it. Returns DATA's URL, the server's log, the log's
    end and the proxy (None without one) and the server's pid."""
    from vaecache.storage import open_filesystem
    from vaecache.urls import Url

    log = tmp / "s3-server.log"
    endpoint = stack.enter_context(bl.s3_server(log, nice))
    fs, _ = open_filesystem("s3://bench")
    fs.mkdir("bench")
    fs.put(str(data), "bench/data", recursive=True)
    proxy = None
    if latency_ms > 0:
        from _s3_latency import delaying_proxy

        proxy = stack.enter_context(delaying_proxy(endpoint, latency_ms, nice))
        stack.enter_context(_environ(AWS_ENDPOINT_URL_S3=proxy.endpoint))
    return Url("s3://bench/data"), log, log.stat().st_size, proxy, endpoint.pid  # Url: run_vaecache reads by URL


def _indexes(data_url: Any, tmp: Path) -> tuple[Path, Path]:
    """`vaecache index` of DATA's URL (through the proxy, if any), and a copy of it with every probe's timeline
    removed (an index written before timelines)."""
    import subprocess

    index, old = tmp / "index-s3.jsonl", tmp / "index-s3-old.jsonl"
    subprocess.run([sys.executable, "-m", "vaecache", "index", str(data_url), "-o", str(index), "--no-progress"],
                   check=True, stdout=subprocess.DEVNULL)
    with open(old, "w") as out:
        for line in index.read_text().splitlines():
            record = json.loads(line)
            probes = record.get("probe", {})
            for probe in (probes.values() if "frames" not in probes else [probes]):
                probe.pop("timeline", None)
            out.write(json.dumps(record) + "\n")
    return index, old


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """os.environ with `values` set while the block runs, restored afterwards."""
    import os

    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_naive(args: argparse.Namespace, data: Path, out: Path, height: int, width: int, device) -> dict[str, float]:
    """The loop a user writes: no workers, no overlap, one forward per clip with all its cameras."""
    import torch
    import torch.nn.functional as F

    start = time.perf_counter()
    vae = load(args, device)  # the same module vaecache loads; its load time counts here as it does there
    model, dtype = vae.model.module, (vae.model.compute_dtype or vae.model.dtype)
    out.mkdir(parents=True, exist_ok=True)
    marks = []
    for scene_dir in sorted(p for p in data.iterdir() if p.is_dir()):
        cameras = sorted(scene_dir.iterdir())
        length = args.frames
        for first in range(0, length - args.num_frames + 1, args.num_frames):
            index = list(range(first, first + args.num_frames))
            views = []
            for camera in cameras:
                frames = camera_frames(camera, index)  # (T, H, W, 3) uint8
                frames = frames.permute(0, 3, 1, 2).float() / 127.5 - 1.0  # (T, 3, H, W)
                frames = F.interpolate(frames, size=(height, width), mode="bilinear", align_corners=False)
                views.append(frames.permute(1, 0, 2, 3))  # (3, T, H, W)
            x = torch.stack(views).to(device, dtype)
            with torch.no_grad():
                dist = model.encode(x).latent_dist
            torch.save({"mean": dist.mean.cpu(), "logvar": dist.logvar.cpu()}, out / f"{scene_dir.name}_{first:06d}.pt")
            marks.append((time.perf_counter(), len(cameras)))
    return steady(marks, start)


# --------------------------------------------------------------------------- overhead (torchrun, null VAE)


def run_overhead(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Per rank count N: the same null-VAE encode on S and 2S scenes under torchrun; the difference between
    the two sizes is the cost of the extra clips alone (process start, imports, rendezvous, VAE load and
    the manifest cancel out)."""
    ranks = [int(x) for x in args.overhead_ranks.split(",") if x.strip()]
    sizes = (args.overhead_scenes, 2 * args.overhead_scenes)
    datasets = {scenes: make_data(tmp / f"overhead-data-{scenes}", args, scenes) for scenes in sizes}
    env = bl.child_env(threads=1, pythonpath=[bl.SCRIPTS])
    decode_ms = _decode_ms_per_clip(datasets[sizes[0]], args)
    runs: dict[tuple[int, int], list[dict[str, float]]] = {(n, s): [] for n in ranks for s in sizes}
    jobs = list(runs)
    for repeat in range(args.repeats):
        shift = repeat % len(jobs)
        for n, scenes in jobs[shift:] + jobs[:shift]:
            out = tmp / f"overhead-out-{n}-{scenes}"
            bl.progress(f"overhead: {n} rank(s), {scenes} scenes, repeat {repeat + 1}/{args.repeats}")
            result = bl.run_timed(bl.torchrun_cmd(
                n, "-m", "vaecache", "encode", str(datasets[scenes]), "--out", str(out),
                "--vae", "python:_null_vae:factory", "--num-frames", str(args.num_frames), "--size", args.size,
                "--store", "mean", "--device", "cpu", "--workers", str(args.overhead_workers),
                "--batch-size", str(args.batch_size), "--no-progress", "--overwrite"), env=env)
            bl.check(result, f"torchrun --nproc-per-node {n} vaecache encode (null VAE)")
            clips = json.loads((out / "manifest.json").read_text())["counts"]["clips"]
            loop = bl.log_span_s(out / "logs" / "rank-00000.log")
            runs[(n, scenes)].append({"clips": clips, "wall_s": result.wall_s, "cpu_s": result.cpu_s,
                                      "loop_s": loop if loop is not None else float("nan")})
            shutil.rmtree(out, ignore_errors=True)
    per_n: dict[str, Any] = {}
    for n in ranks:
        small, big = ({k: bl.median([r[k] for r in runs[(n, s)]]) for k in ("clips", "wall_s", "cpu_s", "loop_s")}
                      for s in sizes)
        extra = big["clips"] - small["clips"]
        row = {
            "clips": [int(small["clips"]), int(big["clips"])],
            "wall_s": [bl.rnd(small["wall_s"]), bl.rnd(big["wall_s"])],
            "cpu_s": [bl.rnd(small["cpu_s"]), bl.rnd(big["cpu_s"])],
            "loop_s": [bl.rnd(small["loop_s"]), bl.rnd(big["loop_s"])],
            "wall_ms_per_clip": bl.rnd(1000 * (big["wall_s"] - small["wall_s"]) / extra),
            "cpu_ms_per_clip": bl.rnd(1000 * (big["cpu_s"] - small["cpu_s"]) / extra),
            "rank_ms_per_clip": bl.rnd(1000 * n * (big["loop_s"] - small["loop_s"]) / extra),
            "fixed_wall_s": bl.rnd(small["wall_s"] - small["clips"] * (big["wall_s"] - small["wall_s"]) / extra),
            "fixed_cpu_s": bl.rnd(small["cpu_s"] - small["clips"] * (big["cpu_s"] - small["cpu_s"]) / extra),
        }
        per_n[str(n)] = row
    if 1 in ranks:
        base = per_n["1"]
        for n in ranks:
            row = per_n[str(n)]
            row["overhead_cpu_ms_per_clip"] = bl.rnd(row["cpu_ms_per_clip"] - base["cpu_ms_per_clip"])
            row["overhead_rank_ms_per_clip"] = bl.rnd(row["rank_ms_per_clip"] - base["rank_ms_per_clip"])
    return {
        "vae": "python:_null_vae:factory (every 4th frame avg-pooled 8x8: ~0 cost)",
        "scenes": list(sizes), "cameras": args.cameras, "workers": args.overhead_workers, "omp_threads": 1,
        "decode_ms_per_clip_1proc": bl.rnd(decode_ms),
        "ranks": per_n,
        "definitions": {
            "method": "every rank count runs the same encode on S and 2S scenes; per-clip figures are the "
                      "difference between the two sizes divided by the extra clips, so fixed costs (process "
                      "start, python/torch imports, rendezvous, VAE load, OUT preparation, manifest) cancel",
            "wall_ms_per_clip": "marginal wall time per clip of the whole torchrun command",
            "cpu_ms_per_clip": "marginal user+sys CPU per clip of torchrun, all ranks and their workers",
            "rank_ms_per_clip": "marginal rank-time per clip: N * (rank 0's log span, first line to 'done')",
            "overhead_cpu_ms_per_clip": "cpu_ms_per_clip(N) - cpu_ms_per_clip(1): CPU that N ranks spend per clip "
                                        "beyond one rank (collectives, per-rank files, duplicated per-rank work); "
                                        "the coordination cost, least disturbed by other jobs",
            "overhead_rank_ms_per_clip": "rank_ms_per_clip(N) - rank_ms_per_clip(1): also counts ranks waiting for "
                                         "a core (N > cores, or other jobs) and for slower peers",
            "fixed_wall_s, fixed_cpu_s": "intercept at 0 clips: what the run costs before and after its clips",
            "decode_ms_per_clip_1proc": "in-process decord decode + resize of one clip (all cameras), for scale",
        },
    }


def _decode_ms_per_clip(data: Path, args: argparse.Namespace) -> float:
    from vaecache.settings.buckets import parse_size
    from vaecache.video.dataset import ViewDecoder

    height, width = parse_size(args.size)
    clips = [clip for batch in plan_batches(data, args) for clip in batch]
    decoder = ViewDecoder(height, width)
    start = time.perf_counter()
    for clip in clips:
        for path in clip.paths:
            decoder.decode(path, clip.frames)
    return 1000 * (time.perf_counter() - start) / len(clips)


# --------------------------------------------------------------------------- profiling


def profile_vaecache(args: argparse.Namespace, data: Path, out: Path, height: int, width: int,
                     first_views: int) -> None:
    """One vaecache run under torch.profiler: where the main process spends its time (workers not included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_vaecache(args, data, out, height, width, first_views)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), file=sys.stderr)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    from vaecache.settings.buckets import parse_size

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    device = resolve_device(args.device)
    height, width = parse_size(args.size)
    machine = bl.machine_info(str(device))
    own_tmp = args.tmp is None
    tmp = Path(tempfile.mkdtemp(prefix="vaecache-bench-")) if own_tmp else Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        bl.progress(f"writing {args.scenes} scenes x {args.cameras} cameras of {args.frames} frames "
                    f"at {args.source_size} ({args.input})")
        data = make_data(tmp / "data", args, args.scenes)
        batches = plan_batches(data, args)

        from vaecache.planning.jobs import batch_views
        from vaecache.video.dataset import ViewBatchDataset

        predecode = ViewBatchDataset(batches, [list(range(len(batch_views(b)))) for b in batches], height, width)
        decode_start = time.perf_counter()
        decoded = [predecode[i]["views"] for i in range(len(batches))]
        decode_ms = 1000 * (time.perf_counter() - decode_start) / len(batches)  # decode + resize, this process
        vae = load(args, device)
        mean_logvar(vae.encode_views(decoded[0]))  # warm-up outside every measurement (allocator, kernels)

        first_views = decoded[0].shape[0]
        s3_modes = ("vaecache_s3", "vaecache_s3_old") if args.s3_index else ("vaecache_s3",)
        modes = MODES + (s3_modes if args.s3 else ())
        s3 = contextlib.ExitStack()
        if args.s3:
            data_url, s3_log, log_at, proxy, s3_pid = _upload_to_s3(s3, data, tmp, args.s3_latency_ms,
                                                                    args.s3_store_nice)
            sources = {"vaecache_s3": data_url}
            if args.s3_index:
                bl.progress("indexing DATA's URL (before the timing)")
                sources["vaecache_s3"], sources["vaecache_s3_old"] = _indexes(data_url, tmp)
        runners: dict[str, Callable[[int], dict[str, Any]]] = {
            "encode_only": lambda r: run_encode_only(vae, decoded, device),
            "vaecache": lambda r: run_vaecache(args, data, tmp / f"out-vaecache-{r}", height, width, first_views),
            "naive": lambda r: run_naive(args, data, tmp / f"out-naive-{r}", height, width, device),
        }
        if args.s3:
            def run_s3(repeat: int, mode: str) -> dict[str, Any]:
                nonlocal log_at
                _, log_at = bl.s3_requests(s3_log, log_at)
                proxied, fetched = (proxy.requests, proxy.get_bytes) if proxy else (0, 0)
                store_pids = [s3_pid, *([proxy.pid] if proxy else [])]
                store_cpu = sum(bl.pid_cpu_seconds(pid) for pid in store_pids)
                found = run_vaecache(args, sources[mode], data_url.replace("/data", f"/out-{mode}-{repeat}"), height,
                                     width, first_views)
                found["store_cpu_s"] = bl.rnd(sum(bl.pid_cpu_seconds(pid) for pid in store_pids) - store_cpu, 4)
                found["requests"], log_at = bl.s3_requests(s3_log, log_at)
                if proxy:
                    found["requests_via_proxy"] = proxy.requests - proxied
                    found["get_bytes"] = proxy.get_bytes - fetched
                return found

            for mode in s3_modes:
                runners[mode] = functools.partial(run_s3, mode=mode)
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        for repeat in range(args.repeats):
            order = modes[repeat % len(modes):] + modes[:repeat % len(modes)]
            for mode in order:
                bl.progress(f"repeat {repeat + 1}/{args.repeats}: {mode}")
                gc.collect()
                cpu_before = bl.cpu_seconds()
                with bl.RssSampler(interval=0.1) as rss:
                    result = runners[mode](repeat)
                result["cpu_s"] = bl.cpu_seconds() - cpu_before
                result["peak_rss_mb"], result["peak_pss_mb"] = rss.peak_mb, rss.peak_pss_mb
                runs[mode].append(result)
                shutil.rmtree(tmp / f"out-{mode}-{repeat}", ignore_errors=True)
        s3.close()
        if args.profile:
            profile_vaecache(args, data, tmp / "out-profile", height, width, first_views)

        med = {mode: {key: bl.median([r[key] for r in runs[mode]])
                      for key in ("steady_s", "steady_views", "wall_s", "views", "cpu_s", "peak_rss_mb", "peak_pss_mb")}
               for mode in modes}
        stage_keys = [k for k in runs["vaecache"][0] if k.startswith("stage_") or k == "encoder_busy"]
        stages = {k: bl.rnd(bl.median([r[k] for r in runs["vaecache"]]), 4) for k in stage_keys}
        vps = {mode: med[mode]["steady_views"] / med[mode]["steady_s"] for mode in modes}
        wall_vps = {mode: med[mode]["views"] / med[mode]["wall_s"] for mode in modes}
        result: dict[str, Any] = {
            "views_per_s": {mode: bl.rnd(v, 4) for mode, v in vps.items()},
            "efficiency": bl.rnd(vps["vaecache"] / vps["encode_only"], 3),
            "speedup_vs_naive": bl.rnd(vps["vaecache"] / vps["naive"], 3),
            "wall_views_per_s": {mode: bl.rnd(v, 4) for mode, v in wall_vps.items()},
            "wall_efficiency": bl.rnd(wall_vps["vaecache"] / wall_vps["encode_only"], 3),
            "wall_speedup_vs_naive": bl.rnd(wall_vps["vaecache"] / wall_vps["naive"], 3),
            "ms_per_view": {mode: bl.rnd(1000 / v, 4) for mode, v in vps.items()},
            "cpu_ms_per_view": {mode: bl.rnd(1000 * med[mode]["cpu_s"] / med[mode]["views"], 4) for mode in modes},
            "cpu_efficiency": bl.rnd(med["encode_only"]["cpu_s"] / med["vaecache"]["cpu_s"], 3),
            "vaecache_stages": {**stages, "encode_only_batch_ms": bl.rnd(
                1000 * med["encode_only"]["steady_s"] * len(batches[0]) * args.cameras
                / med["encode_only"]["steady_views"], 4),
                "decode_batch_ms_1proc": bl.rnd(decode_ms, 4)},
            "encode_slowdown_in_vaecache": bl.rnd(stages.get("stage_encode_ms", float("nan")) / (
                1000 * med["encode_only"]["steady_s"] * len(batches[0]) * args.cameras
                / med["encode_only"]["steady_views"]), 3),
            "peak_rss_mb": bl.rnd(max(med[m]["peak_rss_mb"] for m in MODES), 4),
            "peak_rss_mb_by_mode": {mode: bl.rnd(med[mode]["peak_rss_mb"], 4) for mode in modes},
            "peak_pss_mb_by_mode": {mode: bl.rnd(med[mode]["peak_pss_mb"], 4) for mode in modes},
            "maxrss_mb_main_process": bl.rnd(bl.maxrss_mb(), 4),
            "runs": {mode: [{k: bl.rnd(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in runs[mode]]
                     for mode in modes},
            "timed": TIMED,
            "machine": {**machine, "load_avg_at_end": bl.load_avg()},
            "config": {
                "vae": args.vae, "scenes": args.scenes, "cameras": args.cameras, "frames": args.frames,
                "num_frames": args.num_frames, "size": args.size, "source_size": args.source_size,
                "input": args.input,
                "clips": sum(len(b) for b in batches), "views": int(med["vaecache"]["views"]),
                "batch_size": args.batch_size, "workers": args.workers, "repeats": args.repeats,
                "device": str(device), "dtype": args.dtype, "torch_threads": torch.get_num_threads(),
                "store": args.store, "shard_size": args.shard_size,
                "views_per_forward": {"encode_only": getattr(vae, "views_per_forward", None),
                                          "vaecache": runs["vaecache"][0].get("views_per_forward_used"),
                                          "naive": "all cameras of a clip"},
            },
            "notes": [
                "peak_rss_mb: sampled every 100 ms over this process and its children (DataLoader workers) while a "
                "mode runs; the largest median over modes. Summed RSS counts pages a forked worker shares with "
                "the main process twice; peak_pss_mb_by_mode counts them once. maxrss_mb_main_process is the "
                "exact lifetime peak of this process.",
                "cpu_ms_per_view: user+sys CPU of this process (all threads) and of reaped children (DataLoader "
                "workers) over the whole call, per view; cpu_efficiency = encode_only CPU / vaecache CPU. Less "
                "sensitive than wall time to other jobs on the cores (but OpenMP spin-waiting counts as CPU).",
                "naive resizes with plain bilinear F.interpolate (no antialias, no crop); vaecache does antialiased "
                "resize-to-cover + center crop, so vaecache does slightly more pixel work.",
                "naive encodes all cameras of a clip in one forward; vaecache and encode_only run "
                "views_per_forward views of a clip per forward (default all: the same forwards as naive).",
                "vaecache_stages: run_encode's main thread per batch (medians over batches 2..N and repeats, ms): "
                "stage_wait_for_data (progress callback of the previous batch to encode_views start: DataLoader "
                "not ready), stage_encode (encode_views), stage_after_encode (encode_views end to the progress "
                "callback: clip tensors, writer.add, writer back-pressure); encoder_busy = share of the steady "
                "window spent in encode_views; encode_slowdown_in_vaecache = stage_encode / encode_only_batch_ms "
                "(> 1: the same forward ran slower inside vaecache, e.g. sharing cores with the decode worker). "
                "Timed by wrapping the encode_views of the VAE run_encode loads "
                "(instrumentation only). encode_only_batch_ms is the same encode on pre-decoded tensors; "
                "decode_batch_ms_1proc is decode + resize of one batch in this process (done by the worker in "
                "vaecache).",
            ],
        }
        if args.s3:
            clips = result["config"]["clips"]
            kinds = sorted({kind for run in runs["vaecache_s3"] for kind in run["requests"]})
            result["s3_latency_ms"] = args.s3_latency_ms
            result["s3_store_nice"] = args.s3_store_nice
            result["s3_vs_disk"] = bl.rnd(vps["vaecache_s3"] / vps["vaecache"], 3)
            result["s3_wall_vs_disk"] = bl.rnd(wall_vps["vaecache_s3"] / wall_vps["vaecache"], 3)
            pairs = list(zip(runs["vaecache"], runs["vaecache_s3"]))  # the two runs of one repeat, back to back
            result["s3_vs_disk_paired"] = bl.rnd(bl.median(
                [(s3["steady_views"] / s3["steady_s"]) / (disk["steady_views"] / disk["steady_s"])
                 for disk, s3 in pairs]), 3)
            result["s3_wall_vs_disk_paired"] = bl.rnd(bl.median(
                [(s3["views"] / s3["wall_s"]) / (disk["views"] / disk["wall_s"]) for disk, s3 in pairs]), 3)
            result["s3_efficiency"] = bl.rnd(vps["vaecache_s3"] / vps["encode_only"], 3)
            result["s3_store_cpu_ms_per_view"] = bl.rnd(
                1000 * bl.median([run["store_cpu_s"] / run["views"] for run in runs["vaecache_s3"]]), 3)
            result["s3_requests_per_clip"] = {
                kind: bl.rnd(bl.median([run["requests"].get(kind, 0) for run in runs["vaecache_s3"]]) / clips, 3)
                for kind in kinds}
            if proxy:
                result["s3_get_bytes_per_clip"] = {mode: round(bl.median([run["get_bytes"] for run in runs[mode]])
                                                               / clips) for mode in s3_modes}
            if args.s3_index:
                result["s3_old_vs_disk"] = bl.rnd(vps["vaecache_s3_old"] / vps["vaecache"], 3)
                result["s3_vs_s3_old"] = bl.rnd(vps["vaecache_s3"] / vps["vaecache_s3_old"], 3)
                result["s3_old_requests_per_clip"] = {
                    kind: bl.rnd(bl.median([run["requests"].get(kind, 0) for run in runs["vaecache_s3_old"]])
                                 / clips, 3)
                    for kind in sorted({kind for run in runs["vaecache_s3_old"] for kind in run["requests"]})}
                result["notes"].append(
                    "--s3-index: vaecache_s3 encoded from a `vaecache index` of DATA's URL written before the timing "
                    "(its probes carry each video's frame index: a decode worker reads a clip's GOPs, not the "
                    "object), vaecache_s3_old from the same index with the timelines removed (each video indexed by "
                    "demuxing it: the object read whole); s3_old_vs_disk and s3_vs_s3_old as s3_vs_disk.")
            result["notes"].append(
                "vaecache_s3: run_encode with DATA and OUT at s3:// URLs on moto's S3 server (a local process, "
                "loopback); s3_vs_disk = its steady views/s over vaecache's on disk, measured in the same repeats "
                "(s3_wall_vs_disk: wall views/s); the _paired figures are the median over repeats of each repeat's "
                "own ratio (its two runs ran back to back), which a slow spell of the machine moves less. "
                "s3_requests_per_clip: the server's logged requests of a whole run (listing, probing, decoding, "
                "shards, commit records, lock, tables, manifest, logs) by method, median over repeats, per clip; "
                "LIST is a GET with a listing query. moto answers from memory: a real store's latency is not in it, "
                "unless s3_latency_ms > 0: then the run's requests went through a proxy that held each one that "
                "many ms before forwarding it (runs' requests_via_proxy: how many; the upload before went direct). "
                "s3_store_cpu_ms_per_view: the CPU the server and the proxy (local processes here, on the same "
                "cores as the run; a real store's is not the client's) spent during a run, per view, median; it is "
                "not in the run's own CPU ms/view, but it took cores from it. s3_store_nice > 0: the server and "
                "the proxy ran at that nice value, so they took mostly what the run left idle.")
        if args.overhead:
            result["overhead"] = run_overhead(args, tmp)
    finally:
        if own_tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    rows = [(mode, result["views_per_s"][mode], result["ms_per_view"][mode], result["cpu_ms_per_view"][mode],
             result["wall_views_per_s"][mode], result["peak_pss_mb_by_mode"][mode]) for mode in modes]
    human = bl.table(f"bench.py: {result['config']['views']} views, {args.repeats} repeats, medians "
                     f"(load avg {machine['load_avg_at_start']} -> {bl.load_avg()})",
                     ("mode", "views/s (steady)", "ms/view", "CPU ms/view", "views/s (wall)", "peak PSS MB"), rows)
    human += (f"\nefficiency (vaecache / encode_only) = {result['efficiency']}   "
              f"speedup vs naive = {result['speedup_vs_naive']}")
    if "s3_vs_s3_old" in result:
        human += (f"\nfrom an index: with timelines / without = {result['s3_vs_s3_old']} steady; without / disk = "
                  f"{result['s3_old_vs_disk']}; GET bytes per clip "
                  + ", ".join(f"{mode} {count}" for mode, count in result.get("s3_get_bytes_per_clip", {}).items())
                  + "; requests per clip without: "
                  + ", ".join(f"{kind} {count}" for kind, count in result["s3_old_requests_per_clip"].items()))
    if "s3_vs_disk" in result:
        human += (f"\nS3 (vaecache_s3 / vaecache on disk) = {result['s3_vs_disk']} steady, "
                  f"{result['s3_wall_vs_disk']} wall (per repeat, median: {result['s3_vs_disk_paired']}, "
                  f"{result['s3_wall_vs_disk_paired']})   "
                  f"added latency {result['s3_latency_ms']:g} ms/request   server+proxy at nice "
                  f"{result['s3_store_nice']}, CPU "
                  f"{result['s3_store_cpu_ms_per_view']} ms/view   requests per clip: "
                  + ", ".join(f"{kind} {count}" for kind, count in result["s3_requests_per_clip"].items()))
    if "overhead" in result:
        human += "\n\n" + bl.table(
            "pipeline cost per clip with the null VAE under torchrun (marginal: S vs 2S scenes; see 'definitions')",
            ("ranks", "clips", "wall ms/clip", "CPU ms/clip", "CPU overhead ms/clip", "rank-ms/clip", "fixed CPU s"),
            [(n, "/".join(map(str, r["clips"])), r["wall_ms_per_clip"], r["cpu_ms_per_clip"],
              r.get("overhead_cpu_ms_per_clip", "-"), r["rank_ms_per_clip"], r["fixed_cpu_s"])
             for n, r in result["overhead"]["ranks"].items()])
    bl.emit(result, human)
    return result


if __name__ == "__main__":
    main()
