"""The cache's index: the per-rank progress logs (one parser, used by resume-repair and by finalize),
failure records, the clip and failure tables (a streaming merge of the logs) and manifest.json (built,
written last, read back with a version check)."""

from __future__ import annotations

import datetime as _dt
import hashlib
import heapq
import itertools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from vaecache.errors import EmptyCacheError, ManifestError
from vaecache.format.io import atomic_write_bytes, atomic_write_json, iter_jsonl, jsonl_bytes, sha256_file
from vaecache.format.layout import (
    CLIPS, FAILURES, FORMAT_NAME, FORMAT_VERSION, MANIFEST, PROGRESS_DIR, SHARDS_DIR, SUPPORTED_VERSIONS,
)
from vaecache.format.table import CLIP_TABLE, FAILURE_TABLE, WrittenTable, write_table


@dataclass(frozen=True)
class ProgressEntry:
    """One committed shard, as its rank's progress log recorded it: the shard record and its clip records."""

    log: Path
    shard: dict[str, Any]
    clips: list[dict[str, Any]]

    def __post_init__(self) -> None:
        if not isinstance(self.shard, dict) or "file" not in self.shard or not isinstance(self.clips, list):
            raise ManifestError(f"{self.log}: progress entry without a shard record or clip list")


def iter_progress(out: Path) -> list[ProgressEntry]:
    """Every committed shard in every rank's progress log, whatever the world size (torn last lines ignored)."""
    folder = Path(out) / PROGRESS_DIR
    if not folder.is_dir():
        return []
    return [ProgressEntry(log, entry.get("shard"), entry.get("clips"))
            for log in sorted(folder.glob("rank-*.jsonl")) for entry in iter_jsonl(log)]


def read_progress(out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Committed shards and their clip records from every rank's progress log."""
    entries = iter_progress(out)
    return [e.shard for e in entries], [clip for e in entries for clip in e.clips]


def failure_identity(record: dict[str, Any]) -> tuple[str, str, str, str]:
    """What makes two failure records the same failure (a rerun records a skipped scene again)."""
    return tuple(str(record.get(k) or "") for k in ("scene", "clip", "camera", "path"))  # type: ignore[return-value]


def read_failures(out: Path) -> list[dict[str, Any]]:
    """Failure records of every rank, deduplicated by (scene, clip, camera, path), in that order."""
    failures: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    folder = Path(out) / PROGRESS_DIR
    for log in sorted(folder.glob("failures-rank-*.jsonl")) if folder.is_dir() else []:
        for entry in iter_jsonl(log):
            failures[failure_identity(entry)] = entry
    return [failures[key] for key in sorted(failures)]


def shard_problem(out: Path, shard: dict[str, Any]) -> str | None:
    """Why a committed shard cannot be kept (missing, another size, another sha256), or None when intact."""
    path = Path(out) / shard["file"]
    try:
        if not path.is_file():
            return "missing"
        if path.stat().st_size != shard["bytes"]:
            return f"{path.stat().st_size} bytes, {shard['bytes']} recorded"
        if shard.get("sha256") and sha256_file(path) != shard["sha256"]:
            return "sha256 differs from the one recorded when it was committed"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return None


def damaged_shards(out: Path, shards: list[dict[str, Any]], threads: int = 8) -> dict[str, str]:
    """Shard file -> problem, for the shards that are not intact (hashed in parallel)."""
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(shards)))) as pool:
        problems = pool.map(lambda shard: shard_problem(out, shard), shards)
    return {shard["file"]: problem for shard, problem in zip(shards, problems) if problem is not None}


def repair_progress(out: Path) -> tuple[set[str], int, dict[str, str]]:
    """Keep committed shards whose file is intact (size and sha256); drop torn log lines, damaged shards,
    orphans, temp files and the failure logs (a rerun records failures afresh).

    Returns (committed clip ids, files discarded, damaged shard file -> problem): the clips of a damaged
    shard are no longer committed, so the run encodes them again."""
    out = Path(out)
    progress = out / PROGRESS_DIR
    kept: dict[Path, list[ProgressEntry]] = {log: [] for log in sorted(progress.glob("rank-*.jsonl"))}
    claimed: set[str] = set()
    done: set[str] = set()
    entries = iter_progress(out)
    damaged = damaged_shards(out, [entry.shard for entry in entries])
    for entry in entries:
        if entry.shard["file"] not in damaged:
            path = out / entry.shard["file"]
            kept[entry.log].append(entry)
            claimed.add(path.name)
            done.update(clip["id"] for clip in entry.clips)
    for log, entries in kept.items():
        atomic_write_bytes(log, jsonl_bytes({"shard": e.shard, "clips": e.clips} for e in entries))
    for log in progress.glob("failures-rank-*.jsonl"):
        log.unlink()
    discarded = 0
    for path in (out / SHARDS_DIR).iterdir():
        if path.name not in claimed and (path.is_file() or path.is_symlink()):
            path.unlink()
            discarded += 1
    for path in [*out.glob(".*.tmp"), *progress.glob(".*.tmp")]:
        path.unlink()
        discarded += 1
    return done, discarded, damaged


def reason_kind(reason: str) -> str:
    """The kind of a failure reason without its particulars: 'too short: 8 usable frames, ...' -> 'too short'."""
    return str(reason).split(" (")[0].split(":")[0].strip() or "?"


def describe_failures(failures: list[dict[str, Any]]) -> str:
    """'3 scenes too short, 1 clip not a readable video': failure counts by unit and kind, most first."""
    kinds: dict[tuple[str, str], int] = {}
    for failure in failures:
        key = ("clip" if failure.get("clip") else "scene", reason_kind(failure.get("reason", "?")))
        kinds[key] = kinds.get(key, 0) + 1
    parts = [f"{n} {unit}{'s' if n != 1 else ''} {kind}"
             for (unit, kind), n in sorted(kinds.items(), key=lambda item: (-item[1], item[0]))]
    return ", ".join(parts) or "nothing was planned"


def reason_counts(failures: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for failure in failures:
        reason = str(failure.get("reason", "?")).split(" (")[0]
        counts[reason] = counts.get(reason, 0) + 1
    return counts


def manifest_header(*, producer: dict[str, str], vae: dict[str, Any], fingerprint: dict[str, Any],
                    frame_rule: dict[str, Any], settings: dict[str, Any], store: list[str], dtype: str,
                    planned_clips: int, oom_backoffs: int) -> dict[str, Any]:
    """The manifest fields only the encoding run knows; `finalize` adds counts, shards, clips and failures."""
    return {
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "producer": producer,
        "vae": vae,
        "fingerprint_sha256": hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest(),
        "frame_rule": frame_rule,
        "settings": settings,
        "latent": {"store": store, "dtype": dtype,
                   "layout": "(cameras, channels, latent_frames, height/spatial_factor, width/spatial_factor)"},
        "planned_clips": planned_clips,
        "oom_backoffs": oom_backoffs,
    }


MAX_RUNS_PER_LOG = 32
"""A progress log that falls into more ascending runs than this is sorted in chunks instead (see _runs_of)."""
MAX_OPEN_RUNS = 128
"""Runs merged at once (open files); more are merged in rounds through spill files first."""
SPILL_ROWS = 50_000
"""Clip records held in memory at once when a log must be sorted in chunks."""


@dataclass(frozen=True)
class _Run:
    """A stretch of clip records in ascending id order, re-read lazily by the merge: in a progress log, from
    the clip `skip` of the line at byte `offset`, `count` clips; in a spill file, one record per line."""

    path: Path
    offset: int
    skip: int
    count: int
    spilled: bool = False


@dataclass
class _Totals:
    """What finalize sums while it scans the progress logs (bounded by shard count, not clip count)."""

    shards: list[dict[str, Any]] = field(default_factory=list)
    clips: int = 0
    views: int = 0
    frames: int = 0
    shape: dict[str, Any] | None = None

    def add(self, clip: dict[str, Any]) -> None:
        self.clips += 1
        self.views += len(clip.get("cameras", []))
        self.frames += len(clip.get("cameras", [])) * len(clip.get("frames", []))
        if self.shape is None:
            self.shape = {key: entry["shape"] for key, entry in clip["tensors"].items()}


def _log_entries(log: Path) -> Iterator[tuple[int, ProgressEntry]]:
    """(byte offset, entry) of every complete line of a progress log; a torn last line is ignored."""
    offset = 0
    with open(log, "rb") as handle:
        for line in handle:
            if not line.endswith(b"\n"):
                return
            if line.strip():
                try:
                    entry = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise ManifestError(f"{log}: line at byte {offset} does not parse ({exc})") from None
                if not isinstance(entry, dict):
                    raise ManifestError(f"{log}: line at byte {offset} is not a progress entry")
                yield offset, ProgressEntry(log, entry.get("shard"), entry.get("clips"))
            offset += len(line)


def _clip_id(log: Path, clip: Any) -> str:
    if not isinstance(clip, dict) or not isinstance(clip.get("id"), str):
        raise ManifestError(f"{log}: a committed clip record has no id")
    return clip["id"]


def _scan_log(log: Path, totals: _Totals) -> list[_Run]:
    """One pass over a progress log: add its shards and clips to `totals`; return its ascending runs.

    A rank appends clips in plan order, which is id order within one attempt for folder datasets (scenes
    sorted by id, windows in frame order); a resumed attempt appends another block later, and an index
    file or a scene id holding a character below '/' can break the order: each break starts a new run."""
    runs: list[_Run] = []
    start: tuple[int, int] | None = None
    count, previous = 0, None
    for offset, entry in _log_entries(log):
        totals.shards.append(entry.shard)
        for index, clip in enumerate(entry.clips):
            clip_id = _clip_id(log, clip)
            totals.add(clip)
            if start is None or clip_id < previous:
                if start is not None:
                    runs.append(_Run(log, *start, count))
                start, count = (offset, index), 0
            count += 1
            previous = clip_id
    if start is not None:
        runs.append(_Run(log, *start, count))
    return runs


def _read_run(run: _Run) -> Iterator[dict[str, Any]]:
    left, skip = run.count, run.skip
    with open(run.path, "rb") as handle:
        handle.seek(run.offset)
        for line in handle:
            if run.spilled:
                yield json.loads(line)
                left -= 1
            else:
                clips = json.loads(line)["clips"]
                for clip in clips[skip:skip + left]:
                    yield clip
                    left -= 1
                skip = 0
            if left <= 0:
                return


def _spill(folder: Path, records: Iterable[dict[str, Any]], number: int) -> _Run:
    path = folder / f".merge-{os.getpid()}-{number:06d}.tmp"
    count = 0
    with open(path, "wb") as handle:
        for record in records:
            handle.write(json.dumps(record, sort_keys=True, separators=(",", ":")).encode() + b"\n")
            count += 1
    return _Run(path, 0, 0, count, spilled=True)


def _sorted_runs(out: Path, totals: _Totals) -> tuple[list[_Run], list[Path]]:
    """Every progress log's clips as at most MAX_OPEN_RUNS ascending runs (and the spill files made)."""
    folder = Path(out) / PROGRESS_DIR
    logs = sorted(folder.glob("rank-*.jsonl")) if folder.is_dir() else []
    runs: list[_Run] = []
    spills: list[Path] = []
    for log in logs:
        found = _scan_log(log, totals)
        if len(found) <= MAX_RUNS_PER_LOG:
            runs.extend(found)
            continue
        clips = itertools.chain.from_iterable(map(_read_run, found))  # out of order: sort it in bounded chunks
        while chunk := list(itertools.islice(clips, SPILL_ROWS)):
            runs.append(_spill(folder, sorted(chunk, key=_by_id), len(spills)))
            spills.append(runs[-1].path)
    while len(runs) > MAX_OPEN_RUNS:  # merge in rounds so that no more files are open at once
        merged = []
        for start in range(0, len(runs), MAX_OPEN_RUNS):
            group = runs[start:start + MAX_OPEN_RUNS]
            merged.append(_spill(folder, heapq.merge(*map(_read_run, group), key=_by_id), len(spills)))
            spills.append(merged[-1].path)
        runs = merged
    return runs, spills


def _by_id(record: dict[str, Any]) -> str:
    return record["id"]


def finalize(out: Path, header: dict[str, Any]) -> dict[str, Any]:
    """Merge every rank's progress log into clips.parquet and failures.parquet, then write manifest.json last.

    Streaming: one pass over the logs sums the counts and finds each log's ascending runs, a k-way merge of
    the runs writes the clip table row group by row group. Memory holds the shard list, the failures and
    one progress-log line per run, never all clip records. Refuses (EmptyCacheError, no table and no
    manifest written) when no clip at all was committed."""
    out = Path(out)
    totals = _Totals()
    runs, spills = _sorted_runs(out, totals)
    try:
        failures = read_failures(out)
        if not totals.clips:
            raise EmptyCacheError(f"{out}: no clips encoded: {describe_failures(failures)} (no manifest written)")
        header = dict(header)
        planned, backoffs = header.pop("planned_clips"), header.pop("oom_backoffs")
        header["latent"] = {**header["latent"], "shape": totals.shape}
        header["counts"] = {
            "clips": totals.clips, "views": totals.views, "frames": totals.frames,
            "shards": len(totals.shards), "bytes": sum(s["bytes"] for s in totals.shards), "failures": len(failures),
            "oom_backoffs": backoffs, "planned_clips": planned,
        }
        clips = write_table(out / CLIPS, CLIP_TABLE, heapq.merge(*map(_read_run, runs), key=_by_id))
    finally:
        for path in spills:
            path.unlink(missing_ok=True)
    return _write_manifest_last(out, header, totals.shards, clips, write_table(out / FAILURES, FAILURE_TABLE, failures))


def write_manifest(out: Path, header: dict[str, Any], shards: list[dict[str, Any]], clips: Iterable[dict[str, Any]],
                   failures: list[dict[str, Any]]) -> dict[str, Any]:
    """Write the clip table (sorted by id here, in memory: small caches, tests) and the failure table, then
    manifest.json last. `finalize` is the streaming path an encode takes."""
    out = Path(out)
    written = write_table(out / CLIPS, CLIP_TABLE, sorted(clips, key=_by_id))
    return _write_manifest_last(out, header, shards, written, write_table(out / FAILURES, FAILURE_TABLE, failures))


def _write_manifest_last(out: Path, header: dict[str, Any], shards: list[dict[str, Any]], clips: WrittenTable,
                         failures: WrittenTable) -> dict[str, Any]:
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        **header,
        "shards": sorted(shards, key=lambda s: s["file"]),
        "clips": {"file": CLIPS, "count": clips.count, "sha256": clips.sha256},
        "failures": {"file": FAILURES, "count": failures.count, "sha256": failures.sha256},
    }
    atomic_write_json(out / MANIFEST, manifest)
    return manifest


def progress_counts(out: Path) -> tuple[int, int]:
    """(committed clips, committed shards) in every rank's progress log, counted as they stream."""
    folder = Path(out) / PROGRESS_DIR
    clips = shards = 0
    for log in sorted(folder.glob("rank-*.jsonl")) if folder.is_dir() else []:
        for _, entry in _log_entries(log):
            shards += 1
            clips += len(entry.clips)
    return clips, shards


def read_manifest(out: Path) -> dict[str, Any]:
    """Parse manifest.json and refuse unknown formats and versions."""
    path = Path(out) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest (the run is incomplete or OUT is not a vaecache output)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: manifest does not parse ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ManifestError(f"{path}: not a vaecache manifest")
    version = manifest.get("format_version")
    if version not in SUPPORTED_VERSIONS:
        raise ManifestError(f"{path}: format version {version!r} is not supported (this vaecache reads {list(SUPPORTED_VERSIONS)})")
    return manifest
