#!/usr/bin/env python
"""nuScenes at trainval size: the peak memory and time of parsing the tables once, and of planning an
encode from the index that parse writes, each in a fresh process (peak RSS = the process's VmHWM).

Synthetic tables in the official schema (the fields nuscenes-devkit 1.2.0 reads, as tests/sources/nuscenes_fixture.py
writes them), sized like v1.0-trainval: --scenes scenes of --seconds seconds, six cameras at 12 Hz, and per scene
the LIDAR_TOP (20 Hz) and five RADAR (13 Hz) sample_data records a camera reader must stream past; one ego_pose per
sample_data (850 scenes of 20 s: 2.67M sample_data and ego_pose records, trainval has 2.63M). No image is written:

* parse: `vaecache.sources.nuscenes.read_nuscenes` (what `vaecache index NUSCENES` runs before probing the frames);
* index: the parsed scenes written as `vaecache index` writes its lines (the probe of each camera computed from its
  frame list instead of reading the JPEG headers), --copies times with new scene ids (a corpus that many times
  larger);
* plan: what an encode rank does with that index before it decodes (discover it, plan the clips of every scene with
  --sync timestamps, build --world's last rank's clips), for 1 copy and for --copies copies: the difference is
  what each further scene costs the plan.

    python scripts/bench_nuscenes.py [--scenes 850] [--seconds 20] [--copies 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import _benchlib as bl  # noqa: E402

CAMERAS = ("CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_BACK_RIGHT", "CAM_BACK", "CAM_BACK_LEFT", "CAM_FRONT_LEFT")
OTHERS = (("LIDAR_TOP", "lidar", 20), *((f"RADAR_{n}", "radar", 13) for n in
                                        ("FRONT", "FRONT_LEFT", "FRONT_RIGHT", "BACK_LEFT", "BACK_RIGHT")))
CAMERA_HZ = 12
KEYFRAME_HZ = 2

HWM = bl.HWM_SOURCE + textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
""")
PARSE = HWM + textwrap.dedent("""
    from vaecache.sources.nuscenes import read_nuscenes
    from vaecache.sources.scene import SourceOptions
    base = hwm_mb()
    started = time.perf_counter()
    found = read_nuscenes(Path(sys.argv[1]), SourceOptions())
    seconds = time.perf_counter() - started
    frames = sum(len(listed.files) for scene in found.scenes for listed in scene.frame_lists if listed is not None)
    print(json.dumps({"seconds": seconds, "scenes": len(found.scenes), "camera_frames": frames,
                      "import_rss_mb": base, "peak_rss_mb": hwm_mb()}))
""")
WRITE_INDEX = HWM + textwrap.dedent("""
    from vaecache.sources.indexing import index_line
    from vaecache.sources.jsonl import index_line_text
    from vaecache.sources.nuscenes import REFERENCE_CAMERA, read_nuscenes
    from vaecache.sources.scene import CameraProbe, SourceOptions
    root, index, copies = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    started = time.perf_counter()
    found = read_nuscenes(root, SourceOptions())
    with open(index, "w") as out:
        for copy in range(copies):
            for scene in found.scenes:
                probes = [CameraProbe(len(listed.files), 12.0, 1600, 900, "jpeg", 100_000 * len(listed.files), 1,
                                      0, listed.times_ns[0], listed.times_ns[-1]) for listed in scene.frame_lists]
                line = index_line(scene, "cameras", probes, REFERENCE_CAMERA)
                if copy:
                    line["id"] = f"{scene.scene_id}-copy{copy}"
                out.write(index_line_text(line))
    print(json.dumps({"seconds": time.perf_counter() - started, "peak_rss_mb": hwm_mb()}))
""")
PLAN = HWM + textwrap.dedent("""
    from vaecache.planning.jobs import plan_job
    from vaecache.settings.clip import SamplingConfig, SyncConfig
    from vaecache.sources.discover import discover
    from vaecache.sources.jsonl import _read_listing
    index, world = Path(sys.argv[1]), int(sys.argv[2])
    base = hwm_mb()
    started = time.perf_counter()
    scenes = discover(index).scenes
    sampling = SamplingConfig(num_frames=17, sync=SyncConfig("timestamps", "CAM_FRONT"))
    job = plan_job(scenes, {}, sampling, world, 1, 1)
    planned = time.perf_counter()
    work = job.rank_work(world - 1)
    built = time.perf_counter()
    print(json.dumps({"scenes": len(scenes), "clips": len(job.clips), "skipped": len(job.skipped),
                      "plan_s": planned - started, "rank_clips": len(work.clips), "rank_s": built - planned,
                      "lines_read_back": _read_listing.cache_info().misses, "import_rss_mb": base,
                      "peak_rss_mb": hwm_mb()}))
""")


class JsonArray:
    """A JSON array written record by record (never the whole table in memory)."""

    def __init__(self, path: Path) -> None:
        self.handle: TextIO = open(path, "w")
        self.handle.write("[")
        self.first = True
        self.count = 0

    def add(self, record: dict[str, Any]) -> None:
        self.handle.write(("" if self.first else ",\n") + json.dumps(record, separators=(",", ":")))
        self.first = False
        self.count += 1

    def close(self) -> None:
        self.handle.write("]\n")
        self.handle.close()


def token(*parts: Any) -> str:
    import hashlib

    return hashlib.md5("/".join(map(str, parts)).encode()).hexdigest()


def write_tables(root: Path, scenes: int, seconds: float) -> dict[str, int]:
    tables = root / "v1.0-trainval"
    tables.mkdir(parents=True)
    for name in ("category", "attribute", "visibility", "instance", "sample_annotation", "map"):
        (tables / f"{name}.json").write_text("[]")
    sensors = [(channel, "camera") for channel in CAMERAS] + [(channel, kind) for channel, kind, _ in OTHERS]
    (tables / "sensor.json").write_text(json.dumps(
        [{"token": token("sensor", c), "channel": c, "modality": m} for c, m in sensors]))
    out = {name: JsonArray(tables / f"{name}.json")
           for name in ("log", "scene", "sample", "calibrated_sensor", "sample_data", "ego_pose")}
    rates = [(channel, CAMERA_HZ) for channel in CAMERAS] + [(channel, hz) for channel, _, hz in OTHERS]
    for s in range(scenes):
        log, logfile = token("log", s), f"n{s % 100:03d}-2018-08-01-15-16-36-0400"
        out["log"].add({"token": log, "logfile": logfile, "vehicle": "n008", "date_captured": "2018-08-01",
                        "location": "boston-seaport"})
        start = 1533151603_000000 + s * 100_000_000
        samples = [token("sample", s, k) for k in range(int(seconds * KEYFRAME_HZ))]
        for k, sample in enumerate(samples):
            out["sample"].add({"token": sample, "timestamp": start + k * 500_000, "scene_token": token("scene", s),
                               "prev": samples[k - 1] if k else "",
                               "next": samples[k + 1] if k + 1 < len(samples) else ""})
        out["scene"].add({"token": token("scene", s), "name": f"scene-{s:04d}", "description": "night, rain",
                          "log_token": log, "nbr_samples": len(samples), "first_sample_token": samples[0],
                          "last_sample_token": samples[-1]})
        for c, (channel, hz) in enumerate(rates):
            calibrated = token("cs", s, channel)
            out["calibrated_sensor"].add({
                "token": calibrated, "sensor_token": token("sensor", channel), "translation": [1.7, 0.01 * c, 1.5],
                "rotation": [0.5, -0.5, 0.5, -0.5],
                "camera_intrinsic": [[1266.4, 0.0, 816.3], [0.0, 1266.4, 491.5], [0.0, 0.0, 1.0]]
                if channel in CAMERAS else []})
            count = int(seconds * hz)
            per_key = hz // KEYFRAME_HZ
            tokens = [token("sd", s, channel, f) for f in range(count)]
            for f in range(count):
                stamp = start + round(f * 1e6 / hz) + 8_000 * c
                key = f % per_key == 0 and f // per_key < len(samples)
                folder = "samples" if key else "sweeps"
                pose = token("pose", s, channel, f)
                out["ego_pose"].add({"token": pose, "timestamp": stamp,
                                     "rotation": [0.5720, -0.0016, 0.0118, -0.8201],
                                     "translation": [411.3 + 0.4 * f, 1180.9 + 0.1 * f, 0.0]})
                extension = "jpg" if channel in CAMERAS else "pcd.bin"
                out["sample_data"].add({
                    "token": tokens[f], "sample_token": samples[min(f // per_key, len(samples) - 1)],
                    "ego_pose_token": pose, "calibrated_sensor_token": calibrated, "timestamp": stamp,
                    "fileformat": extension[:3], "is_key_frame": key,
                    "height": 900 if channel in CAMERAS else 0, "width": 1600 if channel in CAMERAS else 0,
                    "filename": f"{folder}/{channel}/{logfile}__{channel}__{stamp}.{extension}",
                    "prev": tokens[f - 1] if f else "", "next": tokens[f + 1] if f + 1 < count else ""})
    for table in out.values():
        table.close()
    return {name: table.count for name, table in out.items()}


def child(script: str, *args: Any) -> dict[str, Any]:
    result = bl.run_timed([sys.executable, "-c", script, *map(str, args)], env=bl.child_env(pythonpath=[ROOT]))
    bl.check(result, script.strip().splitlines()[-1][:60])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenes", type=int, default=850, help="v1.0-trainval has 850")
    p.add_argument("--seconds", type=float, default=20.0, help="per scene (nuScenes scenes are 20 s)")
    p.add_argument("--copies", type=int, default=4, help="the index written this many times over, new ids")
    p.add_argument("--world", type=int, default=8, help="plan: world size (the last rank's clips are built)")
    p.add_argument("--tmp", default=None)
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="vaecache-nusc-", dir=args.tmp))
    try:
        started = time.perf_counter()
        bl.progress(f"writing tables: {args.scenes} scenes of {args.seconds} s")
        counts = write_tables(tmp / "nuscenes", args.scenes, args.seconds)
        tables = tmp / "nuscenes" / "v1.0-trainval"
        sizes = {path.name: round(path.stat().st_size / 2**20, 1) for path in tables.iterdir()}
        bl.progress(f"tables written in {time.perf_counter() - started:.0f} s: {counts}")
        parse = child(PARSE, tmp / "nuscenes")
        bl.progress(f"parse: {parse}")
        one, many = tmp / "index-1.jsonl", tmp / f"index-{args.copies}.jsonl"
        write_one = child(WRITE_INDEX, tmp / "nuscenes", one, 1)
        index_mb_per_scene = one.stat().st_size / 2**20 / args.scenes
        child(WRITE_INDEX, tmp / "nuscenes", many, args.copies)
        plans = {1: child(PLAN, one, args.world), args.copies: child(PLAN, many, args.world)}
        bl.progress(f"plans: {plans}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    extra_scenes = plans[args.copies]["scenes"] - plans[1]["scenes"]
    per_scene_kb = (plans[args.copies]["peak_rss_mb"] - plans[1]["peak_rss_mb"]) * 1024 / max(extra_scenes, 1)
    result = {"records": counts, "table_mb": sizes, "parse": parse, "write_index": write_one,
              "index_mb_per_scene": round(index_mb_per_scene, 3),
              "plan": {str(k): v for k, v in plans.items()}, "plan_kb_per_extra_scene": round(per_scene_kb, 2),
              "machine": bl.machine_info(None)}
    rows = [("parse the tables (read_nuscenes)", parse["scenes"], f"{parse['seconds']:.1f} s",
             f"{parse['peak_rss_mb']:.0f} MB")]
    rows += [(f"plan from the index x{k} (world {args.world})", v["scenes"], f"{v['plan_s'] + v['rank_s']:.1f} s",
              f"{v['peak_rss_mb']:.0f} MB") for k, v in plans.items()]
    human = bl.table(f"bench_nuscenes.py: {counts['sample_data']:,} sample_data, {counts['ego_pose']:,} ego_pose "
                     f"({sizes['sample_data.json']} MB + {sizes['ego_pose.json']} MB of JSON)",
                     ("step", "scenes", "time", "peak RSS"), rows)
    human += f"\nplan memory per further scene: {per_scene_kb:.1f} KB"
    bl.emit(result, human)
    return result


if __name__ == "__main__":
    main()
