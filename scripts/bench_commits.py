#!/usr/bin/env python
"""What a resume into an S3 OUT asks before its first batch: the commit records read back, with and without their
compaction (vaecache.cache.objects: a compacted object per COMPACT_EVERY records of a process, one final object at
finalize), side by side in one run against moto's S3 server, whose request log is counted.

For each --shards N, one process commits N shards' records through the real `ObjectOut.commit` (progress lines of
the shape a writer commits, --line-bytes each) into three OUTs:

- records only: the compaction turned off (COMPACT_EVERY above N), as every stop before it stored them;
- crash-resume: compacted every COMPACT_EVERY records, the run ended before finalize;
- finished: the same, then finalize's one compacted object (`compact_all`).

Then a new `ObjectOut` rebuilds the work folder's progress logs from each OUT (`pull_records`, what a resume and
finalize run): its GETs, LISTs and seconds are printed as JSON and a table, and the rebuilt logs compared (the same
lines in all three).

    python scripts/bench_commits.py                          # 1000 and 10000 shards
    python scripts/bench_commits.py --shards 200 --smoke     # quick (the same code paths)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _benchlib as bl  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, nargs="+", default=[1000, 10000], help="Shards committed, per run.")
    p.add_argument("--line-bytes", type=int, default=2000, help="Bytes of each commit record (its clip records).")
    p.add_argument("--smoke", action="store_true", help="A few hundred shards: the code paths, quickly.")
    return p.parse_args(argv)


def commit_line(index: int, size: int) -> str:
    """A progress line of the shape a writer commits: the shard record, its clip ids, then clip records."""
    shard = {"file": f"shards/a000-r00000-{index:06d}.safetensors", "bytes": 1000, "sha256": f"{index:064x}"}
    ids = [f"scene_{index:06d}/clip"]
    line = json.dumps({"shard": shard, "ids": ids, "clips": [{"id": ids[0], "pad": ""}]}, separators=(",", ":"))
    return line.replace('"pad":""', '"pad":"' + "x" * max(0, size - len(line)) + '"')


def one_run(url: str, shards: int, line_bytes: int, mode: str) -> None:
    from vaecache.cache import objects
    from vaecache.cache.objects import ObjectOut

    out = ObjectOut(url)
    out.compact_every = shards + 1 if mode == "records only" else objects.COMPACT_EVERY
    try:
        for index in range(shards):
            out.commit(f"shards/a000-r00000-{index:06d}.safetensors", commit_line(index, line_bytes))
        out.settle()
        if mode == "finished":
            out.pull_records(finished=False, held=out._held_records())  # finalize's: its own records held
            out.compact_all()
    finally:
        out.close()


def measure(url: str, log_file: Path) -> tuple[dict[str, int], float, bytes]:
    from vaecache.cache.objects import ObjectOut

    start = bl.s3_requests(log_file, 0)[1]
    out = ObjectOut(url)
    began = time.perf_counter()
    try:
        out.pull_records(finished=False)
        seconds = time.perf_counter() - began
        lines = b"".join(path.read_bytes() for path in sorted((out.work / "progress").glob("rank-*.jsonl")))
    finally:
        out.close()
    time.sleep(0.5)  # the server's log lines of the last requests
    return bl.s3_requests(log_file, start)[0], seconds, lines


def main(argv: list[str] | None = None) -> int:
    import s3fs

    args = parse_args(argv)
    sizes = [200] if args.smoke else args.shards
    rows: list[list[Any]] = []
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vaecache-bench-commits-") as tmp:
        log_file = Path(tmp) / "s3.log"
        with bl.s3_server(log_file) as endpoint:
            fs = s3fs.S3FileSystem(endpoint_url=str(endpoint), skip_instance_cache=True, use_listings_cache=False)
            fs.mkdir("bench")
            for shards in sizes:
                logs = {}
                for mode in ("records only", "crash-resume", "finished"):
                    url = f"s3://bench/{mode.replace(' ', '-')}-{shards}"
                    bl.progress(f"{shards} shards, {mode}: committing")
                    one_run(url, shards, args.line_bytes, mode)
                    requests, seconds, logs[mode] = measure(url, log_file)
                    gets = requests.get("GET", 0) + requests.get("GET range", 0)
                    results.append({"shards": shards, "mode": mode, "gets": gets, "lists": requests.get("LIST", 0),
                                    "seconds": bl.rnd(seconds)})
                    rows.append([shards, mode, gets, requests.get("LIST", 0), bl.rnd(seconds)])
                same = len({value for value in logs.values()}) == 1
                for result in results[-3:]:
                    result["same_logs"] = same
    bl.emit({"machine": bl.machine_info(), "line_bytes": args.line_bytes, "runs": results},
            bl.table("pull_records (what a resume and finalize read) from an S3 OUT",
                     ("shards", "stored as", "GETs", "LISTs", "seconds"), rows))
    return 0 if all(result["same_logs"] for result in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
