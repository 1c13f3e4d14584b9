"""`vaecache index`: probe every video once, across ranks and with a pool of threads in each, into a JSONL index.

Each rank probes a round-robin share of the scenes not probed yet and appends what it found to its own
partial file, `INDEX.jsonl.partial/rank-NNNNN.jsonl` (the probe-cache record layout of OUT/probes, fsynced in
batches). A killed run loses at most the batch in flight: a rerun reads every partial file and opens only
the videos with no record or whose size or mtime changed. When every rank is done, rank 0 writes INDEX.jsonl
(scenes sorted by id, so the same data gives the same bytes whatever the world size) and
INDEX.rejected.jsonl (unusable scenes and why), each atomically, then removes the partial folder.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from vaecache import faults
from vaecache.cache.io import FILE_MODE, NON_FINITE_KEY, fsync_dir, replace_non_finite
from vaecache.errors import EXIT_OK, EXIT_PARTIAL, OutputError, UsageError
from vaecache.meter import Advance
from vaecache.settings.options import DEFAULT_PROBE_WORKERS
from vaecache.sources.discover import discover
from vaecache.sources.jsonl import index_line_text
from vaecache.sources.lerobot import EpisodeRows
from vaecache.sources.probing import (
    ProbeLog,
    cache_verdicts,
    judge_scene,
    open_scene,
    probe_dataset,
    probe_from_cache,
    read_probe_cache,
)
from vaecache.sources.scene import SINGLE_CAMERA, Discovery, Scene, Skipped, SourceOptions
from vaecache.sources.scene_json import scenes_from_bytes, scenes_to_bytes
from vaecache.video.frames import FrameList

log = logging.getLogger("vaecache")

PARTIAL_SUFFIX = ".partial"
REJECTED_SUFFIX = ".rejected.jsonl"
FSYNC_EVERY_SCENES = 256
FSYNC_EVERY_S = 5.0
CRASH_POINT = "crash-after-probe"
"""VAECACHE_FAULT point: a rank exits (137) right after its k-th newly probed scene is durable."""


@dataclass(frozen=True)
class IndexConfig:
    """What `vaecache index` is asked: the dataset, where the index goes, the camera set, the pool size."""

    data: Path
    output: Path
    cameras: tuple[str, ...] | None = None
    workers: int = DEFAULT_PROBE_WORKERS
    """Threads probing in each rank (PyAV releases the GIL while FFmpeg demuxes and decodes)."""
    frame_rate: float | None = None
    """--fps: the rate of image-sequence cameras whose frames carry no times (written into each line as "fps")."""
    nuscenes_version: str | None = None
    columns: tuple[tuple[str, str], ...] = ()
    """--column: which column of a metadata table plays which role."""

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise UsageError(f"--workers must be an integer >= 1, got {self.workers!r}")
        if self.output.suffix.lower() != ".jsonl":
            raise UsageError(f"{self.output}: the index must be a .jsonl file (-o INDEX.jsonl)")
        if self.output.is_dir():
            raise UsageError(f"{self.output}: -o names a folder; give the index file's name")
        parent = self.output.parent if str(self.output.parent) else Path(".")
        if not parent.is_dir():
            raise UsageError(f"{self.output}: folder {parent} does not exist")


@dataclass(frozen=True)
class RankUse:
    """One rank of an index run: how many scenes it read from DATA (rank 0 alone reads DATA), how many it received
    from rank 0 to probe, and its peak memory."""

    rank: int
    listed: int
    received: int
    peak_rss_mb: float


@dataclass(frozen=True)
class IndexSummary:
    """What an index run did (the same on every rank)."""

    output: Path
    rejected_file: Path
    scenes: int
    usable: int
    rejected: int
    probed: int
    """Scenes whose videos were opened in this run (summed over ranks); the rest came from partial files."""
    reused: int
    wall_s: float
    ranks: tuple[RankUse, ...] = ()
    """What each rank read and held, by rank."""

    @property
    def exit_code(self) -> int:
        return EXIT_PARTIAL if self.rejected else EXIT_OK


def rejected_path(output: Path) -> Path:
    """INDEX.jsonl -> INDEX.rejected.jsonl, beside it."""
    return output.with_name(output.name[: -len(output.suffix)] + REJECTED_SUFFIX)


def partial_dir(output: Path) -> Path:
    """INDEX.jsonl -> INDEX.jsonl.partial/, the per-rank partial files of an unfinished run."""
    return output.with_name(output.name + PARTIAL_SUFFIX)


def run_index(cfg: IndexConfig, ctx: Any, advance: Advance | None = None) -> IndexSummary:
    """Probe this rank's share of DATA's scenes (resuming from the partial files), then rank 0 writes the index.

    Rank 0 alone reads DATA (a nuScenes root's tables: 1.3 GB of JSON for trainval) and the partial files, and
    sends each other rank only the scenes it probes (sources.scene_json, JSON Lines over the process group)."""
    started = time.perf_counter()
    rank, world = ctx.info.rank, ctx.info.world_size
    work = partial_dir(cfg.output)
    partial: ProbeLog | None = None
    done = 0
    found: Discovery | None = None  # rank 0's
    unknown: list[int] = []  # rank 0's: positions in found.scenes of the scenes no partial record answers for

    def plan() -> tuple[int, int]:
        nonlocal found, unknown
        found = discover(cfg.data, options=SourceOptions(cfg.cameras, cfg.frame_rate, cfg.nuscenes_version,
                                                         cfg.columns))
        try:
            work.mkdir(exist_ok=True)
        except OSError as exc:
            raise OutputError(f"{work}: cannot create the partial folder ({exc.strerror or exc})") from None
        known, unknown = cache_verdicts(found.scenes, lambda: work.glob("rank-*.jsonl"), trust_index_probes=False)
        return len(found.scenes) + len(found.rejected), len(known)

    def append(scene: Scene, records: list[dict[str, Any]]) -> None:
        nonlocal partial, done
        if partial is None:  # opened (and its torn tail cut) after rank 0 read every partial file
            partial = ProbeLog(work / f"rank-{rank:05d}.jsonl", FSYNC_EVERY_SCENES, FSYNC_EVERY_S)
        partial.add(records)
        done += 1
        if faults.should_fail(CRASH_POINT, done, rank):
            partial.sync()
            faults.crash()

    scenes, cached = ctx.on_rank0(plan)
    # Each rank's share of the scenes to open, round-robin: rank 0 keeps its own, the others get theirs as JSON.
    payload = ctx.send_each(lambda other: scenes_to_bytes(found.scenes[p] for p in unknown[other::world]))  # type: ignore[union-attr]
    share = ([found.scenes[p] for p in unknown[0::world]] if found is not None  # type: ignore[union-attr]
             else list(scenes_from_bytes(payload)))
    del payload
    try:  # the share alone, no probe cache: rank 0 judged the cache above
        probed = probe_dataset(share, None, workers=cfg.workers, trust_index_probes=False, on_scene=append,
                               advance=advance)
    finally:
        if partial is not None:
            partial.close()
    received = len(share) if rank else 0
    del share
    if rank == 0 and cached:
        log.info("resuming %s: %d of %d scenes already probed", cfg.output, cached, len(found.scenes))  # type: ignore[union-attr]
    opened = ctx.all_reduce_sum(probed.opened)
    ctx.barrier()
    result = ctx.on_rank0(lambda: _write_index(cfg, found, work))  # type: ignore[arg-type]
    found = None
    ranks = tuple(RankUse(*use) for use in ctx.all_gather_object((rank, scenes if rank == 0 else 0, received,
                                                                   peak_rss_mb())))
    log.info("per rank: %s", describe_ranks(ranks))
    return IndexSummary(cfg.output, rejected_path(cfg.output), scenes, result[0], result[1], opened, cached,
                        time.perf_counter() - started, ranks)


def describe_ranks(ranks: Sequence[RankUse]) -> str:
    """What each rank read and its peak memory, one line: `rank 0 read DATA (2 scenes) 412 MB, rank 1 got 1 scene
    123 MB` (past 4 ranks, the others summed up)."""
    def one(use: RankUse) -> str:
        what = (f"read DATA ({use.listed} scenes)" if use.listed else
                f"got {use.received} scene{'' if use.received == 1 else 's'}")
        return f"rank {use.rank} {what} {use.peak_rss_mb:.0f} MB"

    if len(ranks) <= 4:
        return ", ".join(map(one, ranks))
    others = ranks[1:]
    return (f"{one(ranks[0])}, ranks 1-{len(ranks) - 1} got {sum(use.received for use in others)} scenes, up to "
            f"{max(use.peak_rss_mb for use in others):.0f} MB")


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB: VmHWM where /proc has it (getrusage's ru_maxrss is not used there:
    a process started by fork and exec, as torchrun starts its ranks, inherits its parent's peak in it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # macOS reports bytes, Linux KiB


def index_line(scene: Scene, form: str, probes: Sequence[Any], reference: str | None = None) -> dict[str, Any]:
    """One line of the index: the scene as discovery read it, and per camera what was probed."""
    line: dict[str, Any] = {"id": scene.scene_id}
    if form == "path" and scene.cameras == (SINGLE_CAMERA,):
        line["path"] = scene.paths[0]
    else:  # a single video named by --cameras keeps its name: a "path" line reads back as `video`
        line["cameras"] = {camera: _source_json(scene.source(index)) for index, camera in enumerate(scene.cameras)}
        if list(scene.cameras) != sorted(scene.cameras):  # a layout's own order (nuScenes' surround order) is kept
            line["camera_order"] = list(scene.cameras)
    if reference is not None:
        line["sync_reference"] = reference
    if scene.frame_range is not None:
        line["frames"] = list(scene.frame_range)
    if scene.time_range is not None:
        line["seconds"] = [scene.time_range[0] / 1e9, scene.time_range[1] / 1e9]
    if scene.frame_rate is not None:
        line["fps"] = scene.frame_rate
    if isinstance(scene.listing, EpisodeRows):  # where a LeRobot episode's rows are, for each clip's tasks and state
        line["lerobot_rows"] = scene.listing.to_json()
    if scene.frame_metadata is not None:
        line["frame_metadata"] = {camera: json.loads(text)
                                  for camera, text in zip(scene.cameras, scene.frame_metadata.per_camera)}
    line["probe"] = probes[0].to_json() if "path" in line else {
        camera: probe.to_json() for camera, probe in zip(scene.cameras, probes)}
    if scene.metadata is not None:  # a caption or tags on the input index line stay on the written one
        line.update({key: value for key, value in json.loads(scene.metadata).items() if key not in line})
    line, replaced = replace_non_finite(line)  # JSON has no NaN: stored as null, named for the clip records
    if replaced:
        line[NON_FINITE_KEY] = sorted(set(line.get(NON_FINITE_KEY) or []) | set(replaced))
    return line


def _source_json(source: Any) -> Any:
    """A camera's source as an index line gives it: its path, or its frame list."""
    if isinstance(source, FrameList):
        return {"files": list(source.files),
                **({"times_ns": list(source.times_ns)} if source.times_ns is not None else {})}
    return source


def _write_index(cfg: IndexConfig, found: Discovery, work: Path) -> tuple[int, int]:
    """Rank 0, once every rank is done: the index and the rejected scenes, sorted by id, each written
    atomically; then the partial folder goes. Returns (usable, rejected) scene counts."""
    cache = read_probe_cache(sorted(work.glob("rank-*.jsonl")))
    rejected: list[Skipped] = list(found.rejected)
    usable = 0
    with _AtomicLines(cfg.output) as index:
        for scene in found.scenes:
            # A file no record covers (it cannot be stat'ed, or it changed since it was probed) is opened here.
            # every camera there and readable; which cameras pair how is the encode's --sync to judge
            probe = probe_from_cache(scene, cache, None) or judge_scene(scene, open_scene(scene), None)
            if probe.error is not None:
                rejected.append(Skipped(scene.scene_id, probe.error_path, probe.error, probe.error_camera))
                continue
            index.write(index_line(scene, found.form, probe.cameras, found.reference_camera))
            usable += 1
        rejected.sort(key=lambda skip: (skip.scene_id, skip.path or ""))
        if rejected:
            with _AtomicLines(rejected_path(cfg.output)) as side:
                for skip in rejected:
                    side.write({"id": skip.scene_id, "camera": skip.camera, "path": skip.path, "reason": skip.reason})
        else:  # no rejected file, and none left from an earlier index of other data
            rejected_path(cfg.output).unlink(missing_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    return usable, len(rejected)


class _AtomicLines:
    """A JSON Lines file that appears complete or not at all: temp file, lines, fsync, rename, fsync folder."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp")

    def __enter__(self) -> _AtomicLines:
        try:
            self._handle = open(self.tmp, "w", encoding="utf-8")
            os.chmod(self.tmp, FILE_MODE)
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot write ({exc.strerror or exc})") from None
        return self

    def write(self, record: dict[str, Any]) -> None:
        try:
            self._handle.write(index_line_text(record))  # a plain JSON line unless it lists frames
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot write ({exc.strerror or exc})") from None

    def __exit__(self, kind: Any, *rest: Any) -> None:
        try:
            if kind is not None:
                self._handle.close()
                self.tmp.unlink(missing_ok=True)
                return
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            os.replace(self.tmp, self.path)
            fsync_dir(self.path.parent if str(self.path.parent) else Path("."))
        except OSError as exc:
            self.tmp.unlink(missing_ok=True)
            raise OutputError(f"{self.path}: cannot write ({exc.strerror or exc})") from None


__all__ = ["IndexConfig", "IndexSummary", "RankUse", "describe_ranks", "index_line", "partial_dir", "rejected_path",
           "run_index"]
