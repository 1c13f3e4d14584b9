#!/usr/bin/env python
"""`vaecache report` on a large cache: its time and peak memory, against the target of a minute and 2 GB for
100,000 clips on 2 cores.

The cache: a real one first (the demo data's one scene of --cameras cameras and 4 x 9-frame windows, encoded by
builtin:tiny), then --clips clip records made from its records (scene k's clip j is a copy of real clip j, renamed:
the same sources, frames, frame index, stats and per-channel stats), each with a caption drawn from a pool with
repeats and 2 % empty ones, and --failures failure records of three kinds, written as the cache's clip and failure
tables with a manifest that lists them and the real VAE record. A text set's tables are synthesized beside them
(--text-set: the prompts, and the prompt of every clip). Only the clips the report samples have tensors: the report's
own sampling function gives their positions, and one shard holds the real latents of each one's window under its
name; every other record names a shard that does not exist, which the report never opens (it reads the tables alone
and the sample's shards). So the report decodes real latents against their real sources, as it would in a cache of
that size.

Timed: `vaecache report OUT --clips N --device cpu` in a fresh process (wall seconds and VmHWM, its peak RSS), the
median of --repeats runs, once with --clips (the tables and the decoded sample) and once with --clips 0 (the tables
alone). Prints a table on stderr and JSON on stdout.

    python scripts/bench_report.py                       # 100,000 clips, 12 decoded; target: < 60 s, < 2 GB
    python scripts/bench_report.py --clips-in-cache 2000 --repeats 1   # a smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _benchlib as bl  # noqa: E402

TARGET_S, TARGET_RSS_MB = 60.0, 2048.0
WINDOWS = 4
"""Clips per scene: the real scene is cut into this many 9-frame windows."""
CHILD = bl.HWM_SOURCE + textwrap.dedent("""
    import json, sys, time
    started = time.perf_counter()
    from vaecache.cli.app import main
    code = 0
    try:
        main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code or 0
    print(json.dumps({"code": code, "seconds": time.perf_counter() - started, "peak_rss_mb": hwm_mb()}),
          file=sys.stderr)
""")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clips-in-cache", type=int, default=100_000)
    p.add_argument("--clips", type=int, default=12, help="clips the report samples and decodes")
    p.add_argument("--cameras", type=int, default=2)
    p.add_argument("--failures", type=int, default=2_000)
    p.add_argument("--captions", type=int, default=20_000, help="distinct captions the clips draw from")
    p.add_argument("--text-set", action=argparse.BooleanOptionalAction, default=True,
                   help="synthesize a text set's tables (the report counts prompts from them)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tmp", default=None)
    return p.parse_args(argv)


def real_cache(root: Path, cameras: int) -> Path:
    """The demo data's one scene (36 frames, `cameras` cameras) encoded by builtin:tiny into 4 clips."""
    from vaecache.demodata import DemoDataSpec, write_demo_dataset

    write_demo_dataset(root / "data", DemoDataSpec(scenes=1, cameras=cameras, frames=9 * WINDOWS, height=64, width=64,
                                                   fps=10, seed=0))
    timed = bl.run_timed([sys.executable, "-m", "vaecache", "encode", str(root / "data"), "--out", str(root / "real"),
                          "--vae", "builtin:tiny", "--num-frames", "9", "--size", "64x64", "--workers", "0",
                          "--no-progress"], env=bl.child_env(threads=1))
    bl.check(timed, "the real encode")
    return root / "real"


def caption_pool(count: int, rng: random.Random) -> list[str]:
    subjects = ["a red car", "a cyclist", "two pedestrians", "a delivery van", "a bus", "a dog", "a robot arm"]
    actions = ["turns left", "waits at a light", "crosses the street", "parks", "picks up a cube", "overtakes a truck"]
    places = ["in the rain", "at night", "on a highway", "in a parking lot", "near a school", "at dawn"]
    return [f"{rng.choice(subjects)} {rng.choice(actions)} {rng.choice(places)}, take {i}" for i in range(count)]


def records(real: list[dict[str, Any]], count: int, captions: list[str], sampled: set[int], shard: str,
            rng: random.Random) -> Iterator[dict[str, Any]]:
    """`count` clip records, scene by scene, in id order: clip i is a copy of real clip i % WINDOWS renamed."""
    for index in range(count):
        scene = f"drive_{index // WINDOWS:07d}"
        record = json.loads(json.dumps(real[index % WINDOWS]))
        window = record["id"].split("/", 1)[1]
        record["id"], record["scene"] = f"{scene}/{window}", scene
        for key, entry in record["tensors"].items():
            entry["name"] = f"{record['id']}/{key}"
        record["shard"] = shard if index in sampled else f"a000-r{index // 512 % 64:05d}-{index // 32768:06d}" \
                                                                ".safetensors"
        draw = rng.random()
        caption = "" if draw < 0.02 else captions[min(len(captions) - 1, int(rng.paretovariate(1.2)) - 1)] \
            if draw < 0.5 else rng.choice(captions)
        record["metadata"] = {"caption": caption}
        yield record


def build_cache(args: argparse.Namespace, root: Path) -> Path:
    """The large cache (see the module docstring): tables, one shard of the sample's latents, a manifest."""
    from safetensors.torch import save_file

    from vaecache.cache.reader import CacheReader
    from vaecache.cache.table import CLIP_TABLE, FAILURE_TABLE, write_table
    from vaecache.report.tables import sample_positions

    source = CacheReader(real_cache(root, args.cameras))
    real = list(source.clip_records())
    if len(real) != WINDOWS:
        raise SystemExit(f"the real cache holds {len(real)} clips, expected {WINDOWS}")
    out = root / "cache"
    (out / "shards").mkdir(parents=True)
    rng = random.Random(0)
    sampled = set(sample_positions(args.clips_in_cache, args.clips, 0))  # what `report --seed 0` will draw
    shard = "a000-r00000-000000.safetensors"
    tensors = {}
    for index in sorted(sampled):
        scene, clip = f"drive_{index // WINDOWS:07d}", real[index % WINDOWS]
        for key, value in source.clip_tensors(clip).items():
            tensors[f"{scene}/{clip['id'].split('/', 1)[1]}/{key}"] = value.contiguous()
    save_file(tensors, out / "shards" / shard, metadata={"format": "vaecache/2"})
    started = time.perf_counter()
    captions = caption_pool(args.captions, rng)
    clips = write_table(out / "clips.parquet", CLIP_TABLE, records(real, args.clips_in_cache, captions, sampled,
                                                                   shard, rng))
    reasons = ["too short: 5 usable frames, one clip needs 9", "not a readable video (moov atom not found)",
               "missing camera cam_1"]
    failures = write_table(out / "failures.parquet", FAILURE_TABLE, (
        {"scene": f"bad_{i:06d}", "clip": None, "camera": "cam_0", "path": f"/data/bad_{i:06d}/cam_0.mp4",
         "reason": reasons[i % 3]} for i in range(args.failures)))
    manifest = dict(source.manifest)
    data = (out / "shards" / shard).read_bytes()
    manifest.update({
        "counts": {**manifest["counts"], "clips": args.clips_in_cache, "views": args.clips_in_cache * args.cameras,
                   "failures": args.failures, "planned_clips": args.clips_in_cache, "shards": 1, "bytes": len(data)},
        "shards": [{"file": f"shards/{shard}", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                    "clips": len(sampled), "tensors": len(tensors)}],
        "clips": {"file": "clips.parquet", "count": clips.count, "sha256": clips.sha256},
        "failures": {"file": "failures.parquet", "count": failures.count, "sha256": failures.sha256}})
    if args.text_set:
        manifest["text"] = {"default": text_set(out, args.clips_in_cache, captions, rng)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    bl.progress(f"tables of {args.clips_in_cache:,} clips written in {time.perf_counter() - started:.1f} s")
    return out


def text_set(out: Path, count: int, captions: list[str], rng: random.Random) -> dict[str, Any]:
    """A text set's prompt table and clip table (each clip's prompt key), as `vaecache embed` lays them out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = out / "text" / "default" / "0000000000000000"
    folder.mkdir(parents=True)
    texts = ["", *captions]
    keys = [hashlib.sha256(text.encode()).hexdigest() for text in texts]
    prompts = pa.table({"key": keys, "text": texts, "tokens": [len(t.split()) + 1 for t in texts],
                        "truncated": [False] * len(texts), "shard": ["x"] * len(texts)})
    chosen = [0 if rng.random() < 0.02 else 1 + int(min(len(captions) - 1, rng.paretovariate(1.2) - 1))
              for _ in range(count)]
    clips = pa.table({"id": [f"drive_{i // WINDOWS:07d}/{i % WINDOWS * 9:06d}-{i % WINDOWS * 9 + 8:06d}"
                             for i in range(count)], "key": [keys[c] for c in chosen]})
    pq.write_table(prompts, folder / "prompts.parquet")
    pq.write_table(clips, folder / "clips.parquet")
    tables = {name: {"file": str((folder / f"{name}.parquet").relative_to(out)),
                     "bytes": (folder / f"{name}.parquet").stat().st_size, "rows": rows}
              for name, rows in (("prompts", len(texts)), ("clips", count))}
    return {"clips": count, "prompts": len(texts), "shards": [], "tables": tables,
            "captions": {"kind": "clip metadata", "field": "caption"}, "fingerprint": {"class": "synthetic"}}


def run_report(cache: Path, folder: Path, clips: int) -> dict[str, Any]:
    timed = bl.run_timed([sys.executable, "-c", CHILD, "report", str(cache), "--out", str(folder), "--clips",
                          str(clips), "--device", "cpu"], env=bl.child_env(threads=1))
    found = json.loads(timed.stderr.strip().splitlines()[-1])
    if timed.returncode != 0 or found["code"] != 0:
        raise SystemExit(f"report failed:\n{timed.stderr[-3000:]}")
    summary = json.loads((folder / "report.json").read_text())
    return {"wall_s": timed.wall_s, "cpu_s": timed.cpu_s, "peak_rss_mb": found["peak_rss_mb"],
            "vae_load_s": summary["decoder"]["load_s"], "decode_s": summary["decoder"]["decode_s"],
            "decoded": summary["sample"]["decoded"], "clips_seen": summary["contents"]["counts"]["clips"],
            "scale_exact": summary["scale"].get("exact")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench_report-", dir=args.tmp))
    try:
        cache = build_cache(args, tmp)
        runs: dict[str, list[dict[str, Any]]] = {"sample": [], "tables": []}
        for repeat in range(args.repeats):
            for name, clips in (("sample", args.clips), ("tables", 0)):
                bl.progress(f"report, {name} ({clips} clips decoded), run {repeat + 1}/{args.repeats}")
                runs[name].append(run_report(cache, tmp / f"report-{name}", clips))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for name, found in runs.items():
        if any(run["clips_seen"] != args.clips_in_cache or not run["scale_exact"] for run in found):
            raise SystemExit(f"{name}: the report did not see every clip's statistics: {found}")
    result: dict[str, Any] = {
        "machine": bl.machine_info(),
        "config": {k: getattr(args, k) for k in ("clips_in_cache", "clips", "cameras", "failures", "captions",
                                                 "text_set", "repeats")},
        "targets": {"seconds": TARGET_S, "peak_rss_mb": TARGET_RSS_MB},
    }
    for name, found in runs.items():
        result[name] = {"median_wall_s": round(bl.median([r["wall_s"] for r in found]), 2),
                        "median_cpu_s": round(bl.median([r["cpu_s"] for r in found]), 2),
                        "peak_rss_mb": round(max(r["peak_rss_mb"] for r in found), 0),
                        "decoded": found[0]["decoded"], "runs": found}
    result["within_target"] = all(result[name]["median_wall_s"] < TARGET_S and
                                  result[name]["peak_rss_mb"] < TARGET_RSS_MB for name in runs)
    rows = [[f"report, {args.clips} sampled clips decoded on cpu", result["sample"]["median_wall_s"],
             result["sample"]["median_cpu_s"], result["sample"]["peak_rss_mb"]],
            ["report, the tables alone (--clips 0)", result["tables"]["median_wall_s"],
             result["tables"]["median_cpu_s"], result["tables"]["peak_rss_mb"]]]
    bl.emit(result, bl.table(f"vaecache report of {args.clips_in_cache:,} clips ({args.cameras} cameras, "
                             f"{args.failures:,} failures), median of {args.repeats}; target < {TARGET_S:.0f} s, "
                             f"< {TARGET_RSS_MB:.0f} MB", ["what", "wall s", "cpu s", "peak RSS MB"], rows))
    return result


if __name__ == "__main__":
    main()
