#!/usr/bin/env python
"""Scale benchmarks (issue 14): how the cache's index steps grow with the clip count.

Section `finalize`: synthesizes N committed clip records in per-rank progress logs, as an encode leaves them
(realistic records: several cameras, mean and logvar with stats, sources with their identity, the encode
field; tiny or no shards, since finalize reads only the logs), including a resumed attempt that appended a
second block to every log. Then, each in a fresh child process so that peak RSS is that step's alone:

* finalize: `vaecache.format.index.finalize` (streaming k-way merge -> clips.parquet, manifest last);
* load: `pyarrow.parquet.read_table(clips.parquet, columns=[id, shard, tensor_names, tensor_shapes])`;
* verify pass: verify's streaming pass over the clip records (sha256 of the table, order, every record
  against the manifest), with the per-shard checks left out (no shard files exist).

    python scripts/bench_scale.py                      # 100k clips
    python scripts/bench_scale.py --clips 1000000      # 1M clips (targets: finalize <= 60 s, <= 1 GB RSS)

Prints a table on stderr and JSON on stdout; the machine is named from /proc/cpuinfo and `platform`.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _benchlib as bl  # noqa: E402

SECTIONS = ("finalize",)
FINALIZE_TARGET_S, FINALIZE_TARGET_RSS_MB = 60.0, 1024.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="finalize", help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--clips", type=int, default=100_000, help="committed clips to synthesize")
    p.add_argument("--ranks", type=int, default=16, help="writer ranks (one progress log each)")
    p.add_argument("--cameras", type=int, default=6)
    p.add_argument("--clips-per-scene", type=int, default=10)
    p.add_argument("--clips-per-shard", type=int, default=32, help="clips per committed shard (one log line)")
    p.add_argument("--resumed", type=float, default=0.3,
                   help="share of each rank's block committed by a second attempt (appended later to the logs)")
    p.add_argument("--workers", type=int, default=None,
                   help="finalize's log-scanning processes (default: vaecache's own, min(4, cores))")
    p.add_argument("--tmp", default=None)
    p.add_argument("--child", nargs=2, metavar=("STEP", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------- synthetic progress logs


def clip_record(index: int, args: argparse.Namespace) -> dict[str, Any]:
    """A committed clip record shaped as the shard writer completes it."""
    scene = f"fleet/2024-05-01/drive_{index // args.clips_per_scene:07d}"
    first = (index % args.clips_per_scene) * 17
    clip_id = f"{scene}/{first:06d}-{first + 16:06d}"
    cameras = [f"cam_{c}" for c in range(args.cameras)]
    shape = [args.cameras, 16, 5, 60, 104]
    stats = {"min": -3.25 - index % 7, "max": 3.5 + index % 5, "mean": 0.0123 * (index % 11), "std": 0.987654321}
    return {
        "id": clip_id, "scene": scene, "cameras": cameras,
        "sources": [f"/datasets/{scene}/{cam}.mp4" for cam in cameras],
        "source_identity": [{"size": 48_000_000 + c, "mtime_ns": 1_714_521_600_000_000_000 + index} for c in range(args.cameras)],
        "frames": list(range(first, first + 17)), "fps": 10.0,
        "times": [round((first + f) / 10, 6) for f in range(17)],
        "tensors": {key: {"name": f"{clip_id}/{key}", "shape": shape, "dtype": "bfloat16", "stats": stats}
                    for key in ("mean", "logvar")},
        "encode": {"tiled": False, "tiled_cameras": [], "units_per_forward": 1},
    }


def _blocks(count: int, parts: int) -> list[range]:
    return [range(p * count // parts, (p + 1) * count // parts) for p in range(parts)]


def write_progress_logs(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Attempt 0: each rank commits the first part of its contiguous block; attempt 1 splits what is left
    over the ranks again and appends to the same logs (so every log holds two ascending runs)."""
    from vaecache.format.layout import progress_path

    (out / "progress").mkdir(parents=True)
    (out / "shards").mkdir()
    ranks = args.ranks
    first_attempt, left = [], []
    for block in _blocks(args.clips, ranks):
        cut = block.start + int(len(block) * (1 - args.resumed))
        first_attempt.append(range(block.start, cut))
        left.extend(range(cut, block.stop))
    second_attempt = [left[b.start:b.stop] for b in _blocks(len(left), ranks)]
    for rank in range(ranks):
        with open(progress_path(out, rank), "w", encoding="utf-8") as handle:
            for attempt, indices in ((0, list(first_attempt[rank])), (1, second_attempt[rank])):
                for seq, start in enumerate(range(0, len(indices), args.clips_per_shard)):
                    name = f"a{attempt:03d}-r{rank:05d}-{seq:06d}.safetensors"
                    clips = [clip_record(i, args) for i in indices[start:start + args.clips_per_shard]]
                    for clip in clips:
                        clip["shard"] = name
                    shard = {"file": f"shards/{name}", "bytes": 1, "sha256": "0" * 64, "clips": len(clips),
                             "tensors": 2 * len(clips)}
                    handle.write(json.dumps({"shard": shard, "clips": clips}, sort_keys=True,
                                            separators=(",", ":")) + "\n")
    logs = sum(p.stat().st_size for p in (out / "progress").iterdir())
    return {"progress_logs_mb": round(logs / 1e6, 1)}


# --------------------------------------------------------------------------- steps, each in a child process


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(step: str, out: Path, workers: int | None) -> dict[str, Any]:
    """One step, timed, in this fresh process; its peak RSS includes its scan workers' (RUSAGE_CHILDREN)."""
    import pyarrow.parquet as pq

    from vaecache.format.index import finalize

    if step == "verify_pass":
        from vaecache.format.reader import CacheReader
        from vaecache.verify import Check, _scan_records
    imported = _rss_mb()
    start = time.perf_counter()
    if step == "finalize":
        header = {"settings": {}, "latent": {"store": ["mean", "logvar"], "dtype": "bfloat16", "layout": "x"},
                  "planned_clips": 0, "oom_backoffs": 0}
        manifest = finalize(out, header, workers=workers)
        result = {"clips": manifest["clips"]["count"]}
    elif step == "load":
        table = pq.read_table(out / "clips.parquet", columns=["id", "shard", "tensor_names", "tensor_shapes"])
        result = {"clips": table.num_rows}
    elif step == "verify_pass":
        cache = CacheReader(out)
        records, tensors = Check("clip records"), Check("tensors")
        seen = _scan_records(cache, records, tensors, cache.shard_files(), lambda file, record: None)
        if records.failed or tensors.failed:
            raise SystemExit(f"verify pass found problems: {records.problems + tensors.problems}")
        result = {"clips": seen.clips}
    else:
        raise SystemExit(f"unknown step {step}")
    workers_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {**result, "seconds": time.perf_counter() - start, "peak_rss_mb": _rss_mb(), "import_rss_mb": imported,
            "largest_worker_rss_mb": workers_rss}


def run_child(step: str, out: Path, workers: int | None) -> dict[str, Any]:
    extra = ["--workers", str(workers)] if workers is not None else []
    timed = bl.run_timed([sys.executable, __file__, "--child", step, str(out), *extra], env=bl.child_env())
    bl.check(timed, step)
    return json.loads(timed.stdout)


def bench_finalize(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out = tmp / "out"
    bl.progress(f"finalize: writing {args.clips} clip records in {args.ranks} progress logs")
    start = time.perf_counter()
    made = write_progress_logs(out, args)
    bl.progress(f"finalize: logs written in {time.perf_counter() - start:.1f} s; timing finalize")
    steps = {step: run_child(step, out, args.workers) for step in ("finalize", "load", "verify_pass")}
    for step, found in steps.items():
        if found["clips"] != args.clips:
            raise SystemExit(f"{step} saw {found['clips']} clips, {args.clips} were committed")
    return {
        **made,
        "clips_parquet_mb": round((out / "clips.parquet").stat().st_size / 1e6, 1),
        "finalize_s": round(steps["finalize"]["seconds"], 2),
        "finalize_peak_rss_mb": round(steps["finalize"]["peak_rss_mb"], 0),
        "finalize_rss_after_imports_mb": round(steps["finalize"]["import_rss_mb"], 0),
        "finalize_workers": args.workers,
        "finalize_largest_worker_rss_mb": round(steps["finalize"]["largest_worker_rss_mb"], 0),
        "load_columns_s": round(steps["load"]["seconds"], 3),
        "load_peak_rss_mb": round(steps["load"]["peak_rss_mb"], 0),
        "verify_record_pass_s": round(steps["verify_pass"]["seconds"], 2),
        "verify_record_pass_peak_rss_mb": round(steps["verify_pass"]["peak_rss_mb"], 0),
        "targets": {"finalize_s_at_1M": FINALIZE_TARGET_S, "finalize_rss_mb_at_1M": FINALIZE_TARGET_RSS_MB},
        "finalize_s_per_1M_clips": round(steps["finalize"]["seconds"] * 1e6 / args.clips, 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        result = child(args.child[0], Path(args.child[1]), args.workers)
        print(json.dumps(result))
        return result
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; known: {SECTIONS}")
    tmp = Path(tempfile.mkdtemp(prefix="bench_scale-", dir=args.tmp))
    try:
        result: dict[str, Any] = {
            "machine": bl.machine_info(),
            "config": {k: getattr(args, k) for k in ("clips", "ranks", "cameras", "clips_per_scene", "clips_per_shard",
                                                     "resumed", "workers")},
        }
        if "finalize" in sections:
            result["finalize"] = bench_finalize(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    if "finalize" in result:
        f = result["finalize"]
        rows = [["finalize (k-way merge -> clips.parquet)", f["finalize_s"],
                 f"{f['finalize_peak_rss_mb']:.0f} (+ {f['finalize_largest_worker_rss_mb']:.0f} per scan worker)"],
                ["load id, shard, tensor names, shapes (pyarrow)", f["load_columns_s"], f["load_peak_rss_mb"]],
                ["verify's streaming record pass", f["verify_record_pass_s"], f["verify_record_pass_peak_rss_mb"]]]
    machine = result["machine"]
    human = bl.table(f"bench_scale: {args.clips} clips, {args.ranks} ranks, {args.cameras} cameras on "
                     f"{machine['cpu_model']} ({machine['cores_usable']} cores)", ["step", "seconds", "peak RSS MB"], rows)
    bl.emit(result, human)
    return result


if __name__ == "__main__":
    main()
