#!/usr/bin/env python
"""Planning at corpus scale (issue 14): `vaecache plan` on a synthetic index, and one rank's planning memory.

Writes one small real video (PyAV, h264) and a JSONL index of --scenes scenes that all reference it, each
with the probe fields `vaecache index` writes (frame counts given, so no video is opened). Then, each in
a fresh process:

* plan: `vaecache plan INDEX --no-measure` (with --plan-json: and `--json FILE`) with --plan-clips-per-scene clips per scene, timed --repeats
  times (median), with the process's peak RSS;
* rank_planning: what one encode rank does before it decodes anything (discover the index, probes from
  it, plan_job, the rank's own RankWork) for --world ranks, computed for --rank, on scenes of uneven
  length averaging --rank-clips-per-scene clips (10 x 1M scenes = 10M clips): seconds and peak RSS.

Each figure is extrapolated linearly to 10M clips. Output: a table on stderr, JSON on stdout.

    python scripts/bench_scale.py --scenes 1000000
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _benchlib as bl  # noqa: E402

NUM_FRAMES = 5
HWM = textwrap.dedent("""
    def hwm_mb():
        # VmHWM: this process's peak RSS. Not getrusage's ru_maxrss, which a child inherits across exec.
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
""")
RANK_SCRIPT = HWM + textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    started = time.perf_counter()
    from vaecache.config import SamplingConfig
    from vaecache.planning import plan_job
    from vaecache.sources import discover, probe_scene
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
                      "rank_batches": len(work.batches), "import_rss_mb": base_rss, "clips": len(job.clips), "skipped": len(job.skipped),
                      "peak_rss_mb": hwm_mb()}))
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


def write_index(path: Path, video: Path, scenes: int, clips_per_scene: float) -> int:
    """`scenes` lines referencing `video`; frame counts cycle so scenes give 0..2x clips_per_scene clips
    (mean clips_per_scene). Returns the clip count a plan of NUM_FRAMES-frame clips gives."""
    from vaecache.sources import probe_file

    probe = probe_file(str(video)).to_json()
    spread = max(1, round(2 * clips_per_scene))
    clips = 0
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(scenes):
            count = (i % (spread + 1)) if clips_per_scene != 1 else 1
            frames = max(1, count * NUM_FRAMES + (i % NUM_FRAMES if count else NUM_FRAMES - 1))
            clips += frames // NUM_FRAMES
            fields = {**probe, "frames": frames, "mtime_ns": probe["mtime_ns"] + i}
            handle.write(json.dumps({"id": f"scene_{i:08d}", "path": video.name, "probe": fields},
                                    separators=(",", ":")) + "\n")
    return clips


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenes", type=int, default=1_000_000)
    parser.add_argument("--plan-clips-per-scene", type=int, default=1)
    parser.add_argument("--rank-clips-per-scene", type=float, default=10.0)
    parser.add_argument("--world", type=int, default=64)
    parser.add_argument("--rank", type=int, default=31)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--plan-json", action="store_true", help="time `vaecache plan --json FILE` (the report "
                        "lists every clip id and scene; indented JSON is written by Python's pure-Python encoder)")
    parser.add_argument("--tmp", type=Path, default=None)
    args = parser.parse_args(argv)

    machine = bl.machine_info("cpu")
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="bench-scale-") as tmp:
        root = Path(tmp)
        video = root / "v.mp4"
        write_video(video)
        env = bl.child_env(threads=1, pythonpath=[bl.SCRIPTS])

        bl.progress(f"writing a {args.scenes}-scene index for plan")
        plan_index = root / "plan.jsonl"
        plan_clips = write_index(plan_index, video, args.scenes, args.plan_clips_per_scene)
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
        plan = {"scenes": args.scenes, "clips": plan_clips, "world_size": args.world, "json": args.plan_json, "seconds": [round(w, 2) for w, _ in plan_runs],
                "median_s": round(plan_s, 2), "peak_rss_mb": round(max(rss for _, rss in plan_runs), 1),
                "extrapolated_10m_clips_s": round(plan_s * 10_000_000 / plan_clips, 1),
                "target_s": 30.0}

        bl.progress(f"writing a {args.scenes}-scene index of ~{args.rank_clips_per_scene:g} clips per scene")
        rank_index = root / "rank.jsonl"
        rank_clips = write_index(rank_index, video, args.scenes, args.rank_clips_per_scene)
        bl.progress(f"planning rank {args.rank} of {args.world}")
        timed = bl.run_timed([sys.executable, "-c", RANK_SCRIPT, rank_index, str(args.world), str(args.rank)], env=env)
        bl.check(timed, "rank planning")
        measured = json.loads(timed.stdout)
        assert measured["clips"] == rank_clips, (measured["clips"], rank_clips)
        rank = {"scenes": args.scenes, "clips": rank_clips, "world_size": args.world, "rank": args.rank,
                "rank_clips": measured["rank_clips"], "seconds": round(measured["seconds"], 2),
                "peak_rss_mb": round(measured["peak_rss_mb"], 1),
                "import_rss_mb": round(measured["import_rss_mb"], 1),
                "extrapolated_10m_clips_rss_mb": round(measured["import_rss_mb"] + (measured["peak_rss_mb"] - measured[
                    "import_rss_mb"]) * 10_000_000 / rank_clips, 1),
                "target_rss_mb": 1024.0}

    result = {"machine": machine, "plan": plan, "rank_planning": rank,
              "notes": ["rank_planning includes the interpreter, torch (imported by vaecache.planning's mesh) "
                        "and the whole parsed index; extrapolation: import_rss_mb + (peak - import) x 10M / clips"]}
    rows = [["plan (vaecache plan --no-measure)", plan["scenes"], plan["clips"], plan["median_s"], plan["peak_rss_mb"]],
            [f"rank {args.rank}/{args.world} planning", rank["scenes"], rank["clips"], rank["seconds"],
             rank["peak_rss_mb"]]]
    bl.emit(result, bl.table(f"bench_scale on {machine['cpu_model']} ({machine['cores_usable']} cores usable, "
                             f"load {machine.get('load_avg_at_start')})",
                             ["step", "scenes", "clips", "seconds", "peak RSS MB"], rows))
    return result


if __name__ == "__main__":
    main()
