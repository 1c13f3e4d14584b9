#!/usr/bin/env python
"""Hashing throughput of `vaecache verify` against `sha256sum` on the same shard files, in one run.

Builds a cache of about --target-mb through the real encode path (``run_encode``; by default with a
pass-through plugin VAE that stores pixels as latents, so hundreds of MB take seconds instead of the
20+ minutes builtin:tiny would need on 2 cores), then times, repeats interleaved:

* verify_full: ``vaecache.verify.integrity.verify_cache(OUT)``: sha256 of every shard + headers + value checks;
* verify_quick: ``verify_cache(OUT, quick=True)``: sizes and headers only;
* sha256sum: ``sha256sum SHARDS...`` (one process, one file after another);
* python_sha256: ``hashlib.sha256`` streamed in 8 MiB blocks, one thread (vaecache.cache.io.sha256_file);

and splits verify's per-shard work into read / hash / safetensors load / value checks (one thread,
one shard at a time) to show where its time goes. Every figure is MB/s of shard bytes (10^6 B/s).

Page cache: nothing can be dropped here, so the shards (just written) are read once before timing and
every tool runs on a warm cache; the figures compare CPU cost, not disks.

    python scripts/bench_verify.py --target-mb 512 --repeats 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _benchlib as bl  # noqa: E402

TOOLS = ("verify_full", "verify_quick", "sha256sum", "python_sha256")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vae", default="python:_null_vae:identity",
                   help="VAE for building the cache (default: pixels stored as latents; builtin:tiny works, slowly)")
    p.add_argument("--target-mb", type=float, default=512, help="approximate cache size in MB")
    p.add_argument("--cameras", type=int, default=4)
    p.add_argument("--num-frames", type=int, default=9)
    p.add_argument("--size", default="256x256")
    p.add_argument("--shard-size", default="64MiB")
    p.add_argument("--threads", type=int, default=None, help="verify_cache threads (default: its own, min(8, cores))")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="benchmark an existing cache instead of building one")
    p.add_argument("--tmp", default=None)
    return p.parse_args(argv)


def view_bytes(args: argparse.Namespace) -> int:
    """Stored bytes per view for the identity VAE (fp32 pixels); a guess for other VAEs is not needed."""
    from vaecache.settings.buckets import parse_size

    height, width = parse_size(args.size)
    return 3 * args.num_frames * height * width * 4


def build_cache(args: argparse.Namespace, tmp: Path) -> Path:
    from vaecache.demodata import DemoDataSpec, write_demo_dataset
    from vaecache.distributed.context import distributed
    from vaecache.encode.command import run_encode
    from vaecache.settings.buckets import parse_size
    from vaecache.settings.clip import ClipSettings, SamplingConfig
    from vaecache.settings.commands import EncodeConfig
    from vaecache.settings.options import parse_bytes
    from vaecache.settings.parts import DecodeConfig, OutConfig, ParallelConfig, SourceConfig, VaeConfig

    height, width = parse_size(args.size)
    scenes = max(1, math.ceil(args.target_mb * 1e6 / (view_bytes(args) * args.cameras)))
    bl.progress(f"building a ~{args.target_mb:.0f} MB cache: {scenes} scenes x {args.cameras} cameras, "
                f"{args.num_frames} frames at {args.size}, --vae {args.vae}")
    data, out = tmp / "data", tmp / "cache"
    write_demo_dataset(data, DemoDataSpec(scenes=scenes, cameras=args.cameras, frames=args.num_frames,
                                          height=height, width=width, seed=0))
    store = "mean" if args.vae.startswith("python:_null_vae") else "mean-logvar"
    clip = ClipSettings(SamplingConfig(num_frames=args.num_frames), height, width, store=store)
    cfg = EncodeConfig(SourceConfig(data), VaeConfig(args.vae), clip,
                       OutConfig(out, shard_size=parse_bytes(args.shard_size), overwrite=True),
                       decode=DecodeConfig(workers=0), parallel=ParallelConfig(device="cpu"), progress=False)
    with distributed(sp_size=1, device="cpu", environ={}) as ctx:
        summary = run_encode(cfg, ctx)
    if summary.exit_code != 0:
        raise SystemExit(f"building the cache failed: exit {summary.exit_code}")
    shutil.rmtree(data, ignore_errors=True)
    return out


def shard_files(out: Path) -> tuple[list[Path], dict[str, str], int]:
    manifest = json.loads((out / "manifest.json").read_text())
    files = [out / s["file"] for s in manifest["shards"]]
    digests = {str(out / s["file"]): s["sha256"] for s in manifest["shards"]}
    return files, digests, sum(int(s["bytes"]) for s in manifest["shards"])


# --------------------------------------------------------------------------- tools


def run_verify(out: Path, quick: bool, threads: int | None) -> Callable[[], None]:
    from vaecache.verify.integrity import verify_cache

    def go() -> None:
        report = verify_cache(out, quick=quick, threads=threads)
        if not report.ok:
            raise SystemExit(f"verify reported problems: {report.to_json()}")
    return go


def run_sha256sum(files: list[Path], digests: dict[str, str]) -> Callable[[], None]:
    def go() -> None:
        proc = subprocess.run(["sha256sum", *map(str, files)], capture_output=True, text=True, check=True)
        for line in proc.stdout.splitlines():
            digest, name = line.split(maxsplit=1)
            if digests[name.lstrip("*")] != digest:
                raise SystemExit(f"sha256sum disagrees with the manifest on {name}")
    return go


def run_openssl(files: list[Path], digests: dict[str, str]) -> Callable[[], None]:
    def go() -> None:
        proc = subprocess.run(["openssl", "dgst", "-sha256", "-r", *map(str, files)], capture_output=True, text=True,
                              check=True)
        for line in proc.stdout.splitlines():
            digest, name = line.split(maxsplit=1)
            if digests[name.lstrip("*")] != digest:
                raise SystemExit(f"openssl disagrees with the manifest on {name}")
    return go


def run_python_sha256(files: list[Path], digests: dict[str, str]) -> Callable[[], None]:
    from vaecache.cache.io import sha256_file

    def go() -> None:
        for path in files:
            if sha256_file(path) != digests[str(path)]:
                raise SystemExit(f"hashlib disagrees with the manifest on {path}")
    return go


def split_verify(out: Path, files: list[Path]) -> dict[str, float]:
    """verify's per-shard steps timed one by one on one worker thread (as verify_cache(threads=1) runs them):
    seconds summed over shards. Value checks compare with the stats recorded in the clip table (per tensor and per
    channel), as verify does."""
    from safetensors.torch import load as safetensors_load

    from vaecache.cache.reader import CacheReader
    from vaecache.cache.writer import stats_problem

    recorded = {entry["name"]: (entry.get("stats"), entry.get("channel_stats"))
                for record in CacheReader(out).clip_records() for entry in record["tensors"].values()}

    def steps() -> dict[str, float]:
        parts = {"read": 0.0, "hash": 0.0, "load": 0.0, "values": 0.0}
        for path in files:
            t0 = time.perf_counter()
            data = path.read_bytes()
            t1 = time.perf_counter()
            hashlib.sha256(data).hexdigest()
            t2 = time.perf_counter()
            tensors = safetensors_load(data)
            t3 = time.perf_counter()
            for name, tensor in tensors.items():
                problem = stats_problem(tensor, *recorded.get(name, (None, None)))  # as verify checks each tensor
                if problem:
                    raise SystemExit(f"{path}: {name} {problem}")
            t4 = time.perf_counter()
            parts["read"] += t1 - t0
            parts["hash"] += t2 - t1
            parts["load"] += t3 - t2
            parts["values"] += t4 - t3
            del data, tensors
        return parts

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(steps).result()


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    machine = bl.machine_info("cpu")
    own_tmp = args.tmp is None and args.out is None
    tmp = Path(tempfile.mkdtemp(prefix="vaecache-bench-verify-")) if args.tmp is None else Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        out = Path(args.out) if args.out else build_cache(args, tmp)
        files, digests, total = shard_files(out)
        mb = total / 1e6
        bl.progress(f"{len(files)} shards, {mb:.0f} MB; warming the page cache")
        for path in files:  # every tool below reads from a warm page cache
            path.read_bytes()
        tools = {
            "verify_full": run_verify(out, False, args.threads),
            "verify_quick": run_verify(out, True, args.threads),
            "sha256sum": run_sha256sum(files, digests),
            "python_sha256": run_python_sha256(files, digests),
        }
        if shutil.which("openssl"):
            tools["openssl_sha256"] = run_openssl(files, digests)
        if args.threads != 1:
            tools["verify_full_1thread"] = run_verify(out, False, 1)
        times: dict[str, list[float]] = {name: [] for name in tools}
        splits: list[dict[str, float]] = []
        names = list(tools)
        for repeat in range(args.repeats):
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                bl.progress(f"repeat {repeat + 1}/{args.repeats}: {name}")
                start = time.perf_counter()
                tools[name]()
                times[name].append(time.perf_counter() - start)
            splits.append(split_verify(out, files))
    finally:
        if own_tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    mbps = {name: mb / bl.median(values) for name, values in times.items()}
    split = {key: bl.median([s[key] for s in splits]) for key in splits[0]}
    split_total = sum(split.values())
    verify_threads = args.threads or min(8, os.cpu_count() or 2)
    result = {
        "mb_per_s": {name: bl.rnd(v, 4) for name, v in mbps.items()},
        "ratio_verify_full_vs_sha256sum": bl.rnd(mbps["verify_full"] / mbps["sha256sum"], 3),
        "ratio_verify_quick_vs_sha256sum": bl.rnd(mbps["verify_quick"] / mbps["sha256sum"], 3),
        "ratio_python_sha256_vs_sha256sum": bl.rnd(mbps["python_sha256"] / mbps["sha256sum"], 3),
        "verify_split_1thread": {
            "seconds": {k: bl.rnd(v, 4) for k, v in split.items()},
            "share": {k: bl.rnd(v / split_total, 3) for k, v in split.items()},
            "mb_per_s": {k: bl.rnd(mb / v, 4) if v > 0 else None for k, v in split.items()},
            "hash_only_mb_per_s": bl.rnd(mb / (split["read"] + split["hash"]), 4),
            "values_only_mb_per_s": bl.rnd(mb / (split["load"] + split["values"]), 4),
            "rest_of_verify_s": (bl.rnd(bl.median(times["verify_full_1thread"]) - split_total, 3)
                                 if "verify_full_1thread" in times else None),
        },
        "seconds": {name: [bl.rnd(t, 4) for t in values] for name, values in times.items()},
        "cache": {"shards": len(files), "bytes": total, "mb": bl.rnd(mb, 4), "vae": args.vae,
                  "shard_size": args.shard_size, "size": args.size, "num_frames": args.num_frames,
                  "cameras": args.cameras, "built_here": args.out is None},
        "machine": {**machine, "load_avg_at_end": bl.load_avg()},
        "config": {"repeats": args.repeats, "verify_threads": verify_threads, "torch_threads": torch.get_num_threads(),
                   "page_cache": "warm: shards read once before timing, every tool then timed on cached data"},
        "notes": [
            "MB = 10^6 bytes of shard files (the manifest's byte counts); figures are medians of --repeats.",
            f"verify_full hashes {verify_threads} shard(s) at a time (its thread pool); sha256sum and python_sha256 "
            "use one core. verify_full_1thread is verify with threads=1, the like-for-like comparison.",
            "verify_split_1thread times verify's per-shard steps in order (read_bytes, sha256, safetensors load, "
            "isfinite + float64 stats) on one worker thread; hash_only = read + hash, values_only = load + value "
            "checks; rest_of_verify_s = verify_full_1thread minus their sum (manifest, records, headers, report).",
        ],
    }
    rows = [(name, result["mb_per_s"][name], bl.median(times[name])) for name in times]
    rows += [(f"  split: {k}", result["verify_split_1thread"]["mb_per_s"][k], split[k]) for k in split]
    human = bl.table(f"bench_verify.py: {len(files)} shards, {mb:.0f} MB, warm page cache, medians of {args.repeats} "
                     f"(load avg {machine['load_avg_at_start']} -> {bl.load_avg()})", ("tool", "MB/s", "seconds"), rows)
    human += (f"\nverify_full / sha256sum = {result['ratio_verify_full_vs_sha256sum']}   "
              f"verify_quick / sha256sum = {result['ratio_verify_quick_vs_sha256sum']}")
    bl.emit(result, human)
    return result


if __name__ == "__main__":
    main()
