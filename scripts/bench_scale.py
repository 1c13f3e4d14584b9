#!/usr/bin/env python
"""Scale benchmarks: how planning, the cache's index steps and the per-clip cost grow with the corpus.

Sections `plan` and `rank_planning`: one small real video (PyAV, h264) and a JSONL index of --scenes scenes
that all reference it, each with the probe fields `vaecache index` writes (frame counts given, so no video
is opened). Each in a fresh process: `plan`: `vaecache plan INDEX --no-measure` (with --plan-json: and
`--json FILE`) with --plan-clips-per-scene clips per scene, timed --repeats times (median), with the
process's peak RSS; `rank_planning`: what one encode rank does before it decodes anything (discover the
index, probes from it, plan_job, the rank's own RankWork) for --world ranks, computed for --rank, on scenes
of uneven length averaging --rank-clips-per-scene clips (10 x 1M scenes = 10M clips). Each figure is
extrapolated linearly to 10M clips.

Section `overhead`: a real encode with the near-zero-cost VAE (`_null_vae:factory`) of --overhead-scenes
one-clip scenes (5 frames of 32x32) on one rank, with --workers 0 and 2 (--overhead-workers), once with every scene
naming the same video and once with a hard link per scene (a file opened per clip): the encode loop's time per
clip (the summary's `encode_s`, start-up and finalize excluded). Target: <= 5 ms per clip.

Section `finalize`: synthesizes N committed clip records in per-rank progress logs and row logs, as an
encode leaves them (realistic records: several cameras, mean and logvar with stats, sources with their
identity, the encode field; tiny or no shards, since finalize reads only the logs), including a resumed
attempt that appended a second block to every progress log (and wrote its own row log). Then, each in a
fresh child process so that peak RSS is that step's alone:

* finalize: `vaecache.cache.progress.finalize` (shard records and ids from the progress logs, clip-table rows
  from the row logs, streaming k-way merge -> clips.parquet, manifest last);
* finalize_lines: the same with the row logs removed, as for a cache written before row logs (every clip
  record parsed from its progress line);
* load: `pyarrow.parquet.read_table(clips.parquet, columns=[id, shard, tensor_names, tensor_shapes])`;
* verify pass: verify's streaming pass over the clip records (sha256 of the table, order, every record
  against the manifest), with the per-shard checks left out (no shard files exist).

    python scripts/bench_scale.py --sections plan,rank_planning --scenes 1000000   # targets: 30 s, 1 GB for 10M
    python scripts/bench_scale.py --sections finalize --clips 1000000   # targets: finalize <= 60 s, <= 1 GB RSS
    python scripts/bench_scale.py --sections resume --clips 1000000     # target: resume scan <= 10 s
    python scripts/bench_scale.py --sections overhead                   # target: <= 5 ms per clip

Section `resume`: rank 0's start of a resumed encode with --clips committed clips (the same synthetic
records, --clips-per-scene 17-frame windows per scene of a probed index, a real 1-byte file per shard):
planning, then the resume scan (repair_progress: torn tails cut, every shard's size and sha256 checked, each
progress line's shard record and clip ids read without parsing its clip records, the committed clips marked
in the plan's DoneMask), then --rank's share of the --world ranks from that mask. Target: scan <= 10 s at 1M.

Prints a table on stderr and JSON on stdout; the machine is named from /proc/cpuinfo and `platform`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _benchlib as bl  # noqa: E402

SECTIONS = ("plan", "rank_planning", "finalize", "resume", "overhead")
FINALIZE_TARGET_S, FINALIZE_TARGET_RSS_MB = 60.0, 1024.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="plan,rank_planning,finalize,resume,overhead",
                   help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--scenes", type=int, default=100_000, help="plan sections: scenes in the synthetic index")
    p.add_argument("--plan-clips-per-scene", type=int, default=1)
    p.add_argument("--plan-source", default="video", choices=("video", "tar-member", "seconds"),
                   help="plan: what each index line names: a video file, a video inside a WebDataset tar, or a "
                        "file with a clip range in seconds (a metadata table's row)")
    p.add_argument("--rank-clips-per-scene", type=float, default=10.0)
    p.add_argument("--world", type=int, default=64, help="rank_planning: world size")
    p.add_argument("--rank", type=int, default=31, help="rank_planning: the rank whose planning is measured")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--plan-json", action="store_true", help="time `vaecache plan --json FILE` (the report "
                   "lists every clip id and scene; indented JSON is written by Python's pure-Python encoder)")
    p.add_argument("--overhead-scenes", type=int, default=2000, help="overhead: one-clip scenes encoded")
    p.add_argument("--overhead-workers", default="0,2", help="overhead: the --workers values to run, comma-separated")
    p.add_argument("--clips", type=int, default=100_000, help="finalize: committed clips to synthesize")
    p.add_argument("--writers", type=int, default=16, help="finalize: writer ranks (one progress log each)")
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


# --------------------------------------------------------------------------- planning

NUM_FRAMES = 5
HWM = bl.HWM_SOURCE
RANK_SCRIPT = HWM + textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    started = time.perf_counter()
    from vaecache.settings.clip import SamplingConfig
    from vaecache.planning.jobs import plan_job
    from vaecache.sources.discover import discover
    from vaecache.sources.probing import probe_scene
    index, world, rank = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    imported = time.perf_counter()
    base_rss = hwm_mb()
    scenes = discover(index).scenes
    probes = {scene.scene_id: probe_scene(scene) for scene in scenes if scene.probed is None}
    job = plan_job(scenes, probes, SamplingConfig(num_frames=%d), world, 1, 4)
    del probes
    work = job.rank_work(rank)
    done = time.perf_counter()
    print(json.dumps({"seconds": done - imported, "import_s": imported - started, "rank_clips": len(work.clips),
                      "rank_batches": len(work.batches), "import_rss_mb": base_rss, "clips": len(job.clips),
                      "skipped": len(job.skipped), "peak_rss_mb": hwm_mb()}))
""" % NUM_FRAMES)


def write_video(path: Path, frames: int = 8) -> None:
    import av
    import numpy as np

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(frames):
            image = np.full((32, 32, 3), (i * 30) % 256, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_index(path: Path, video: Path, scenes: int, clips_per_scene: float, source: str = "video") -> int:
    """`scenes` lines referencing `video`; frame counts cycle so scenes give 0..2x clips_per_scene clips
    (mean clips_per_scene), each line's probe with the video's frame index (`timeline`) as `vaecache index` writes
    it, its frame rule as long as the line. Returns the clip count a plan of NUM_FRAMES-frame clips gives.

    `source`: what each line names, as `vaecache index` writes it: "video" the file; "tar-member" the video inside a
    WebDataset shard (TAR#NAME@OFFSET+SIZE); "seconds" the file with a clip range in seconds (a metadata table's row),
    the range covering the frames the line's probe gives, so the clip count is the same."""
    from vaecache.sources.probing import probe_file
    from vaecache.video.timeline import Timeline

    probe = probe_file(str(video)).to_json()
    timeline = Timeline.from_json(probe["timeline"], "probe") if "timeline" in probe else None
    named = video.name
    if source == "tar-member":
        import tarfile

        from vaecache.sources.tars import read_samples

        shard = video.with_suffix(".tar")
        with tarfile.open(shard, "w") as tar:
            tar.add(video, arcname="clip.mp4")
        member = next(read_samples(shard)).members["mp4"]
        named = member.reference
        probe = {**probe, "size": member.size, "mtime_ns": shard.stat().st_mtime_ns}
    spread = max(1, round(2 * clips_per_scene))
    clips = 0
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(scenes):
            count = (i % (spread + 1)) if clips_per_scene != 1 else 1
            frames = max(1, count * NUM_FRAMES + (i % NUM_FRAMES if count else NUM_FRAMES - 1))
            clips += frames // NUM_FRAMES
            fields = {**probe, "frames": frames, "mtime_ns": probe["mtime_ns"] + i}
            if "start_ns" in probe:  # the times of `frames` frames at the video's rate
                fields["end_ns"] = probe["start_ns"] + round((frames - 1) * 1e9 / probe["fps"])
            if timeline is not None:  # its frame index, as long as the line says
                fields["timeline"] = Timeline((*timeline.pts_rule[:2], frames), None, timeline.keys_packed,
                                              timeline.head, timeline.rotation).to_json()
            line = {"id": f"scene_{i:08d}", "path": named, "probe": fields}
            if source == "seconds":  # [0, the time just past the last frame): every frame of the probe
                line["seconds"] = [0.0, round(frames / probe["fps"], 6)]
            handle.write(json.dumps(line, separators=(",", ":")) + "\n")
    return clips


def bench_plan(args: argparse.Namespace, root: Path, video: Path) -> dict[str, Any]:
    env = bl.child_env(threads=1, pythonpath=[bl.SCRIPTS])
    bl.progress(f"writing a {args.scenes}-scene index for plan")
    plan_index = root / "plan.jsonl"
    plan_clips = write_index(plan_index, video, args.scenes, args.plan_clips_per_scene, args.plan_source)
    plan_runs = []
    json_args = ["--json", str(root / "plan.json")] if args.plan_json else []
    for repeat in range(args.repeats):
        bl.progress(f"vaecache plan, run {repeat + 1}/{args.repeats}")
        timed = bl.run_timed([sys.executable, "-c", HWM + "import sys\nfrom vaecache.cli.app import main\n"
                              "try:\n    main(sys.argv[1:])\nfinally:\n    print(hwm_mb(), file=sys.stderr)",
                              "plan", plan_index, "--vae", "python:_null_vae:factory", "--num-frames",
                              str(NUM_FRAMES), "--size", "32x32", "--store", "mean", "--no-measure",
                              "--world-size", str(args.world), *json_args], env=env)
        if timed.returncode != 0:
            bl.check(timed, "vaecache plan")
        planned = re.search(r"│ clips\s*│\s*(\d+)", timed.stderr)
        assert planned and int(planned.group(1)) == plan_clips, (timed.stderr[-2000:], plan_clips)
        plan_runs.append((timed.wall_s, float(timed.stderr.strip().splitlines()[-1])))
    plan_s = bl.median([wall for wall, _ in plan_runs])
    return {"scenes": args.scenes, "clips": plan_clips, "world_size": args.world, "json": args.plan_json,
            "source": args.plan_source,
            "seconds": [round(w, 2) for w, _ in plan_runs], "median_s": round(plan_s, 2),
            "peak_rss_mb": round(max(rss for _, rss in plan_runs), 1),
            "extrapolated_10m_clips_s": round(plan_s * 10_000_000 / plan_clips, 1), "target_s": 30.0}


def bench_rank_planning(args: argparse.Namespace, root: Path, video: Path) -> dict[str, Any]:
    env = bl.child_env(threads=1, pythonpath=[bl.SCRIPTS])
    bl.progress(f"writing a {args.scenes}-scene index of ~{args.rank_clips_per_scene:g} clips per scene")
    rank_index = root / "rank.jsonl"
    rank_clips = write_index(rank_index, video, args.scenes, args.rank_clips_per_scene)
    bl.progress(f"planning rank {args.rank} of {args.world}")
    timed = bl.run_timed([sys.executable, "-c", RANK_SCRIPT, rank_index, str(args.world), str(args.rank)], env=env)
    bl.check(timed, "rank planning")
    measured = json.loads(timed.stdout)
    assert measured["clips"] == rank_clips, (measured["clips"], rank_clips)
    return {"scenes": args.scenes, "clips": rank_clips, "world_size": args.world, "rank": args.rank,
            "rank_clips": measured["rank_clips"], "seconds": round(measured["seconds"], 2),
            "peak_rss_mb": round(measured["peak_rss_mb"], 1), "import_rss_mb": round(measured["import_rss_mb"], 1),
            "extrapolated_10m_clips_rss_mb": round(measured["import_rss_mb"] + (
                measured["peak_rss_mb"] - measured["import_rss_mb"]) * 10_000_000 / rank_clips, 1),
            "target_rss_mb": 1024.0,
            "note": "includes the interpreter, torch (imported by vaecache.planning's mesh) and the whole parsed "
                    "index; extrapolation: import_rss_mb + (peak - import) x 10M / clips"}


# --------------------------------------------------------------------------- per-clip overhead


def bench_overhead(args: argparse.Namespace, root: Path, video: Path) -> dict[str, Any]:
    """encode_s per clip of a real encode with the null VAE: one shared video, or a hard link per scene."""
    from vaecache.sources.probing import probe_file

    probe = probe_file(str(video)).to_json()
    links = root / "links"
    links.mkdir()
    indexes = {}
    for layout in ("one video", "a file per clip"):
        index = root / f"overhead-{len(indexes)}.jsonl"
        with open(index, "w", encoding="utf-8") as handle:
            for i in range(args.overhead_scenes):
                path = video
                if layout == "a file per clip":
                    path = links / f"v{i:07d}.mp4"
                    os.link(video, path)
                fields = {**probe, "mtime_ns": path.stat().st_mtime_ns}
                handle.write(json.dumps({"id": f"s{i:07d}", "path": str(path), "frames": [0, NUM_FRAMES],
                                         "probe": fields}) + "\n")
        indexes[layout] = index
    env = bl.child_env(threads=1, pythonpath=[bl.SCRIPTS])
    rows = {}
    for layout, index in indexes.items():
        for workers in [int(w) for w in args.overhead_workers.split(",")]:
            out = root / f"overhead-out-{len(rows)}"
            bl.progress(f"overhead: {args.overhead_scenes} clips, {layout}, --workers {workers}")
            timed = bl.run_timed([sys.executable, "-m", "vaecache", "encode", str(index), "--out", str(out),
                                  "--vae", "python:_null_vae:factory", "--num-frames", str(NUM_FRAMES), "--size",
                                  "32x32", "--store", "mean", "--workers", str(workers), "--no-progress",
                                  "--json", "-"], env=env)
            bl.check(timed, "encode")
            summary = json.loads(timed.stdout)
            assert summary["clips"] == args.overhead_scenes, summary
            rows[f"{layout}, workers {workers}"] = {
                "clips": summary["clips"], "encode_s": round(summary["encode_s"], 2),
                "ms_per_clip": round(1000 * summary["encode_s"] / summary["clips"], 2),
                "startup_s": round(summary["startup_s"], 2), "finalize_s": round(summary["finalize_s"], 2)}
            shutil.rmtree(out)
    return {"scenes": args.overhead_scenes, "runs": rows, "target_ms_per_clip": 5.0}


# --------------------------------------------------------------------------- synthetic progress logs


def clip_record(index: int, args: argparse.Namespace, scene: str | None = None) -> dict[str, Any]:
    """A committed clip record shaped as the shard writer completes it (17-frame windows, back to back)."""
    scene = scene or f"fleet-2024-05-01-drive_{index // args.clips_per_scene:07d}"
    first = (index % args.clips_per_scene) * 17
    clip_id = f"{scene}/{first:06d}-{first + 16:06d}"
    cameras = [f"cam_{c}" for c in range(args.cameras)]
    shape = [args.cameras, 16, 5, 60, 104]
    stats = {"min": -3.25 - index % 7, "max": 3.5 + index % 5, "mean": 0.0123 * (index % 11), "std": 0.987654321}
    return {
        "id": clip_id, "scene": scene, "cameras": cameras,
        "sources": [f"/datasets/{scene}/{cam}.mp4" for cam in cameras],
        "source_identity": [{"size": 48_000_000 + c, "mtime_ns": 1_714_521_600_000_000_000 + index}
                            for c in range(args.cameras)],
        "frames": list(range(first, first + 17)), "fps": 10.0,
        "times": [round((first + f) / 10, 6) for f in range(17)],
        "tensors": {key: {"name": f"{clip_id}/{key}", "shape": shape, "dtype": "bfloat16", "stats": stats}
                    for key in ("mean", "logvar")},
        "encode": {"tiled": False, "tiled_cameras": [], "units_per_forward": 1},
    }


def _blocks(count: int, parts: int) -> list[range]:
    return [range(p * count // parts, (p + 1) * count // parts) for p in range(parts)]


def write_progress_logs(out: Path, args: argparse.Namespace, resume_scenes: bool = False) -> dict[str, Any]:
    """Attempt 0: each rank commits the first part of its contiguous block; attempt 1 splits what is left
    over the ranks again and appends to the same logs (so every log holds two ascending runs). With
    `resume_scenes`, scenes are named as in the resume section's index and every shard file exists."""
    from vaecache.cache.layout import progress_path, rows_name
    from vaecache.cache.progress import progress_line
    from vaecache.cache.table import RowLog

    shard_bytes = b"x"
    shard_sha = hashlib.sha256(shard_bytes).hexdigest()

    (out / "progress").mkdir(parents=True)
    (out / "shards").mkdir()
    ranks = args.writers
    first_attempt, left = [], []
    for block in _blocks(args.clips, ranks):
        cut = block.start + int(len(block) * (1 - args.resumed))
        first_attempt.append(range(block.start, cut))
        left.extend(range(cut, block.stop))
    second_attempt = [left[b.start:b.stop] for b in _blocks(len(left), ranks)]
    for rank in range(ranks):
        with open(progress_path(out, rank), "w", encoding="utf-8") as handle:
            for attempt, indices in ((0, list(first_attempt[rank])), (1, second_attempt[rank])):
                rows = RowLog(out / "progress" / rows_name(rank, attempt))
                for seq, start in enumerate(range(0, len(indices), args.clips_per_shard)):
                    name = f"a{attempt:03d}-r{rank:05d}-{seq:06d}.safetensors"
                    clips = [clip_record(i, args, resume_scene(i, args) if resume_scenes else None)
                             for i in indices[start:start + args.clips_per_shard]]
                    for clip in clips:
                        clip["shard"] = name
                    shard = {"file": f"shards/{name}", "bytes": 1, "sha256": shard_sha, "clips": len(clips),
                             "tensors": 2 * len(clips)}
                    if resume_scenes:
                        (out / "shards" / name).write_bytes(shard_bytes)
                    line = progress_line(shard, clips)
                    rows.append(json.loads(line)["clips"])  # as the shard writer does
                    handle.write(line + "\n")
                rows.close()
    logs = sum(p.stat().st_size for p in (out / "progress").glob("rank-*.jsonl"))
    rows = sum(p.stat().st_size for p in (out / "progress").glob("rows-*"))
    return {"progress_logs_mb": round(logs / 1e6, 1), "row_logs_mb": round(rows / 1e6, 1)}


RESUME_FRAMES = 17
"""The resume section plans 17-frame windows back to back, as clip_record's ids are."""


def resume_scene(index: int, args: argparse.Namespace) -> str:
    return f"scene_{index // args.clips_per_scene:08d}"


def write_resume_index(path: Path, video: Path, args: argparse.Namespace) -> int:
    """An index of the scenes the synthetic progress logs name and a tenth more (work left to do), each giving
    --clips-per-scene windows."""
    from vaecache.sources.probing import probe_file
    from vaecache.video.timeline import Timeline

    probe = probe_file(str(video)).to_json()
    frames = args.clips_per_scene * RESUME_FRAMES
    if "timeline" in probe:  # its frame index as long as the line says (an index line's claims must agree)
        timeline = Timeline.from_json(probe["timeline"], "probe")
        probe["timeline"] = Timeline((*timeline.pts_rule[:2], frames), None, timeline.keys_packed, timeline.head,
                                     timeline.rotation).to_json()
    scenes = -(-args.clips * 11 // (10 * args.clips_per_scene))
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(scenes):
            fields = {**probe, "frames": frames, "mtime_ns": probe["mtime_ns"] + i}
            handle.write(json.dumps({"id": f"scene_{i:08d}", "path": video.name, "probe": fields},
                                    separators=(",", ":")) + "\n")
    return scenes * args.clips_per_scene


RESUME_SCRIPT = HWM + textwrap.dedent("""
    import dataclasses, json, sys, time
    from pathlib import Path
    from vaecache.settings.clip import SamplingConfig
    from vaecache.cache.repair import repair_progress
    from vaecache.planning.clips import DoneMaskBuilder
    from vaecache.planning.jobs import plan_job
    from vaecache.sources.discover import discover
    index, out, world, rank = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    started = time.perf_counter()
    job = plan_job(discover(index).scenes, {}, SamplingConfig(num_frames=%d), world, 1, 4)
    planned = time.perf_counter()
    plan_rss = hwm_mb()
    marks = DoneMaskBuilder(job.clips)
    kept, discarded, damaged = repair_progress(out, marks)
    mask = marks.mask()
    scanned = time.perf_counter()
    scan_rss = hwm_mb()
    job = dataclasses.replace(job, done=mask)
    work = job.rank_work(rank)
    done = time.perf_counter()
    print(json.dumps({"plan_s": planned - started, "scan_s": scanned - planned, "rank_work_s": done - scanned,
                      "committed": kept, "marked": mask.count, "damaged": len(damaged), "discarded": discarded,
                      "planned": len(job.clips), "rank_clips": len(work.clips), "mask_bytes": len(mask.bits),
                      "plan_rss_mb": plan_rss, "scan_rss_mb": scan_rss, "peak_rss_mb": hwm_mb()}))
""" % RESUME_FRAMES)


def bench_resume(args: argparse.Namespace, root: Path, video: Path) -> dict[str, Any]:
    """Rank 0's resume with --clips committed: plan, repair the logs (shard sizes and sha256 checked: the
    shards are 1-byte files, so hashing costs per file, not per byte) and mark the plan; then rank --rank's
    share of what is left."""
    out = root / "resume-out"
    index = root / "resume.jsonl"
    planned = write_resume_index(index, video, args)
    bl.progress(f"resume: writing {args.clips} committed clip records and their shard files")
    made = write_progress_logs(out, args, resume_scenes=True)
    env = bl.child_env(threads=1, pythonpath=[bl.SCRIPTS])
    timed = bl.run_timed([sys.executable, "-c", RESUME_SCRIPT, index, out, str(args.world), str(args.rank)], env=env)
    bl.check(timed, "resume")
    measured = json.loads(timed.stdout)
    if measured["marked"] != args.clips or measured["damaged"] or measured["planned"] != planned:
        raise SystemExit(f"resume marked {measured['marked']} of {args.clips} committed clips "
                         f"({measured['damaged']} damaged shards, {measured['planned']} planned)")
    shards = sum(1 for _ in (out / "shards").iterdir())
    return {**made, "clips": args.clips, "shards": shards, "planned": planned, "world_size": args.world,
            "rank": args.rank, "rank_clips": measured["rank_clips"], "mask_bytes": measured["mask_bytes"],
            "plan_s": round(measured["plan_s"], 2), "scan_s": round(measured["scan_s"], 2),
            "rank_work_s": round(measured["rank_work_s"], 2), "plan_rss_mb": round(measured["plan_rss_mb"], 0),
            "peak_rss_mb": round(measured["peak_rss_mb"], 0), "target_scan_s_at_1M": 10.0,
            "scan_s_per_1M_clips": round(measured["scan_s"] * 1e6 / args.clips, 1)}


# --------------------------------------------------------------------------- steps, each in a child process


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(step: str, out: Path, workers: int | None) -> dict[str, Any]:
    """One step, timed, in this fresh process; its peak RSS includes its scan workers' (RUSAGE_CHILDREN)."""
    import pyarrow.parquet as pq

    from vaecache.cache.finalize import finalize

    if step == "verify_pass":
        from vaecache.cache.reader import CacheReader
        from vaecache.verify.integrity import Check, scan_records
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
        seen = scan_records(cache, records, tensors, cache.shard_files(), lambda file, record: None)
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
    bl.progress(f"finalize: writing {args.clips} clip records in {args.writers} progress logs")
    start = time.perf_counter()
    made = write_progress_logs(out, args)
    bl.progress(f"finalize: logs written in {time.perf_counter() - start:.1f} s; timing finalize")
    steps = {step: run_child(step, out, args.workers) for step in ("finalize", "load", "verify_pass")}
    table = (out / "clips.parquet").read_bytes()
    for path in (out / "progress").glob("rows-*"):
        path.unlink()
    steps["finalize_lines"] = run_child("finalize", out, args.workers)
    if (out / "clips.parquet").read_bytes() != table:
        raise SystemExit("finalize from progress lines wrote another clip table than finalize from row logs")
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
        "finalize_from_lines_s": round(steps["finalize_lines"]["seconds"], 2),
        "finalize_from_lines_peak_rss_mb": round(steps["finalize_lines"]["peak_rss_mb"], 0),
        "finalize_largest_worker_rss_mb": round(steps["finalize_lines"]["largest_worker_rss_mb"], 0),
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
            "config": {k: getattr(args, k) for k in ("clips", "writers", "cameras", "clips_per_scene",
                                                     "clips_per_shard", "resumed", "workers")},
        }
        if {"plan", "rank_planning", "overhead", "resume"} & set(sections):
            video = tmp / "v.mp4"
            write_video(video)
            for name, bench in (("plan", bench_plan), ("rank_planning", bench_rank_planning),
                                ("resume", bench_resume), ("overhead", bench_overhead)):
                if name in sections:
                    result[name] = bench(args, tmp, video)
        if "finalize" in sections:
            result["finalize"] = bench_finalize(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    if "plan" in result:
        plan = result["plan"]
        rows.append([f"vaecache plan --no-measure --world-size {args.world} ({plan['scenes']} scenes, "
                     f"{plan['clips']} clips)", plan["median_s"], plan["peak_rss_mb"]])
    if "rank_planning" in result:
        rank = result["rank_planning"]
        rows.append([f"rank {args.rank}/{args.world} planning ({rank['clips']} clips, {rank['rank_clips']} its own)",
                     rank["seconds"], rank["peak_rss_mb"]])
    if "overhead" in result:
        for label, run in result["overhead"]["runs"].items():
            rows.append([f"encode loop, null VAE, {label}: {run['ms_per_clip']} ms/clip", run["encode_s"], "-"])
    if "finalize" in result:
        f = result["finalize"]
        rows += [["finalize (row logs, k-way merge -> clips.parquet)", f["finalize_s"], f["finalize_peak_rss_mb"]],
                 ["finalize from progress lines (cache written before row logs)", f["finalize_from_lines_s"],
                  f"{f['finalize_from_lines_peak_rss_mb']:.0f} (+ scan workers)"],
                ["load id, shard, tensor names, shapes (pyarrow)", f["load_columns_s"], f["load_peak_rss_mb"]],
                ["verify's streaming record pass", f["verify_record_pass_s"], f["verify_record_pass_peak_rss_mb"]]]
    if "resume" in result:
        r = result["resume"]
        rows += [[f"resume: plan {r['planned']} clips (rank 0)", r["plan_s"], r["plan_rss_mb"]],
                 [f"resume scan: repair logs, check {r['shards']} shards, mark {r['clips']} committed clips",
                  r["scan_s"], r["peak_rss_mb"]],
                 [f"rank {r['rank']}/{r['world_size']}'s share from the {r['mask_bytes']}-byte mask",
                  r["rank_work_s"], "-"]]
    machine = result["machine"]
    human = bl.table(f"bench_scale on {machine['cpu_model']} ({machine['cores_usable']} cores usable, load "
                     f"{machine.get('load_avg_at_start')})", ["step", "seconds", "peak RSS MB"], rows)
    bl.emit(result, human)
    return result


if __name__ == "__main__":
    main()
