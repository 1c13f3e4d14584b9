"""The cache's index: the per-rank progress logs (one parser, used by resume-repair and by finalize),
failure records, the clip and failure tables (a streaming merge of the logs) and manifest.json (built,
written last, read back with a version check)."""

from __future__ import annotations

import bisect
import datetime as _dt
import hashlib
import heapq
import json
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from vaecache.errors import EmptyCacheError, ManifestError
from vaecache.format.io import (
    STRICT_JSON, atomic_write_bytes, atomic_write_json, cut_torn_tail, iter_jsonl, loads, read_json, sha256_file,
)
from vaecache.format.layout import (
    CLIPS, FAILURES, FORMAT_NAME, FORMAT_VERSION, MANIFEST, PROGRESS_DIR, ROWS_SUFFIX, SHARDS_DIR, SUPPORTED_VERSIONS,
)
from vaecache.format import table as _table
from vaecache.format.table import (
    CLIP_TABLE, FAILURE_TABLE, WrittenTable, clip_row, read_row_log, schema_of, write_table, write_tables,
)


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


def progress_line(shard: dict[str, Any], clips: list[dict[str, Any]]) -> str:
    """One progress log line: the shard record, then its clip ids, then the clip records. The first two come
    first so that a resume reads them without parsing the records (scan_committed)."""
    return ('{"shard":' + json.dumps(shard, sort_keys=True, separators=(",", ":"))
            + ',"ids":' + json.dumps([clip["id"] for clip in clips], separators=(",", ":"))
            + ',"clips":' + json.dumps(clips, sort_keys=True, separators=(",", ":")) + "}")


@dataclass(frozen=True)
class CommittedLine:
    """Where one committed shard's progress line lies in its log, and what a resume needs of it."""

    offset: int
    length: int
    shard: dict[str, Any]
    clips: int


_DECODER = STRICT_JSON
_SHARD_HEAD, _IDS_HEAD = '{"shard":', ',"ids":'


def _line_head(log: Path, offset: int, line: bytes) -> tuple[dict[str, Any], list[str]]:
    """The shard record and clip ids of a progress line; a line written before ids led (keys sorted, clips
    first) is parsed whole."""
    try:
        text = line.decode("utf-8")
        if text.startswith(_SHARD_HEAD):
            shard, end = _DECODER.raw_decode(text, len(_SHARD_HEAD))
            if text.startswith(_IDS_HEAD, end):
                ids, _ = _DECODER.raw_decode(text, end + len(_IDS_HEAD))
                if isinstance(shard, dict) and "file" in shard and isinstance(ids, list) \
                        and all(type(clip_id) is str for clip_id in ids):
                    return shard, ids
        entry = loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{log}: line at byte {offset} does not parse ({exc})") from None
    if not isinstance(entry, dict):
        raise ManifestError(f"{log}: line at byte {offset} is not a progress entry")
    found = ProgressEntry(log, entry.get("shard"), entry.get("clips"))
    return found.shard, [_clip_id(log, clip) for clip in found.clips]


def scan_committed(log: Path) -> Iterator[tuple[CommittedLine, list[str]]]:
    """Each complete line of a progress log as (where it is, its shard record and clip count) and its clip
    ids; a torn last line is ignored."""
    offset = 0
    with open(log, "rb") as handle:
        for line in handle:
            if not line.endswith(b"\n"):
                return
            if line.strip():
                shard, ids = _line_head(log, offset, line)
                yield CommittedLine(offset, len(line), shard, len(ids)), ids
            offset += len(line)


def committed_shards(out: Path) -> list[dict[str, Any]]:
    """The shard record of every committed shard in every rank's progress log (clip records not parsed)."""
    folder = Path(out) / PROGRESS_DIR
    logs = sorted(folder.glob("rank-*.jsonl")) if folder.is_dir() else []
    return [line.shard for log in logs for line, _ in scan_committed(log)]


class CommittedIds(Protocol):
    """What a resume tells about committed clips as it reads them (planning.DoneMaskBuilder)."""

    def add(self, clip_ids: list[str]) -> None: ...

    def discard(self, clip_ids: list[str]) -> None: ...


def committed_ids(out: Path, committed: CommittedIds | None) -> int:
    """Tell `committed` the clip ids of every committed shard; returns how many there were."""
    folder = Path(out) / PROGRESS_DIR
    count = 0
    for log in sorted(folder.glob("rank-*.jsonl")) if folder.is_dir() else []:
        for _, ids in scan_committed(log):
            if committed is not None:
                committed.add(ids)
            count += len(ids)
    return count


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


def shard_problem(out: Path, shard: dict[str, Any], hashed: dict[str, list[Any]] | None = None) -> str | None:
    """Why a committed shard cannot be kept (missing, another size, another sha256), or None when intact.

    `hashed` (file -> [bytes, mtime_ns, sha256]) lists shards whose bytes an earlier check hashed: one whose
    size, mtime and recorded sha256 are still those is not hashed again; on return it holds this shard too."""
    path = Path(out) / shard["file"]
    try:
        if not path.is_file():
            return "missing"
        stat = path.stat()
        if stat.st_size != shard["bytes"]:
            return f"{stat.st_size} bytes, {shard['bytes']} recorded"
        seen = [stat.st_size, stat.st_mtime_ns, shard.get("sha256")]
        if hashed is not None and hashed.get(shard["file"]) == seen:
            return None
        if shard.get("sha256") and sha256_file(path) != shard["sha256"]:
            return "sha256 differs from the one recorded when it was committed"
        if hashed is not None:
            hashed[shard["file"]] = seen
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return None


POOLED_HASH_BYTES = 1 << 20
"""Shards at least this big are hashed in the thread pool; smaller ones inline (a pooled task costs ~10x a
small file's hashing in thread switches)."""


def damaged_shards(out: Path, shards: list[dict[str, Any]], threads: int = 8,
                   hashed: dict[str, list[Any]] | None = None) -> dict[str, str]:
    """Shard file -> problem, for the shards that are not intact (large ones hashed in parallel); `hashed` as
    for shard_problem."""
    large = [shard for shard in shards if shard.get("bytes", 0) >= POOLED_HASH_BYTES]
    problems = {shard["file"]: shard_problem(out, shard, hashed) for shard in shards
                if shard.get("bytes", 0) < POOLED_HASH_BYTES}
    if large:
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(large)))) as pool:
            problems.update(zip((shard["file"] for shard in large),
                                pool.map(lambda shard: shard_problem(out, shard, hashed), large)))
    return {shard["file"]: problems[shard["file"]] for shard in shards if problems[shard["file"]] is not None}


HASHED_SHARDS = "hashed-shards.json"
"""In OUT/progress: the committed shards a resume hashed and found intact, with their size and mtime then."""


def forget_hashed_shards(out: Path) -> None:
    """Drop the record of hashed shards: the next repair hashes every committed shard (a shard can rot in place,
    keeping its size and mtime)."""
    (Path(out) / PROGRESS_DIR / HASHED_SHARDS).unlink(missing_ok=True)


def _read_hashed(progress: Path) -> dict[str, list[Any]]:
    try:
        record = loads((progress / HASHED_SHARDS).read_bytes())
    except (OSError, ValueError):
        return {}
    shards = record.get("shards") if isinstance(record, dict) and record.get("format") == 1 else None
    return {k: v for k, v in shards.items() if isinstance(v, list)} if isinstance(shards, dict) else {}


def repair_progress(out: Path, committed: CommittedIds | None = None) -> tuple[int, int, dict[str, str]]:
    """Keep committed shards whose file is intact (size and sha256); drop torn log lines, damaged shards,
    orphans, temp files and the failure logs (a rerun records failures afresh).

    Reads only each progress line's shard record and clip ids (see progress_line), once, and rewrites a log
    only when one of its shards is damaged: a resume over millions of committed clips costs seconds plus the
    hashing. `committed` gets the clip ids of every line as it is read, and then those of damaged shards
    taken back (discard).

    Returns (committed clips kept, files discarded, damaged shard file -> problem): the clips of a damaged
    shard are no longer committed, so the run encodes them again."""
    out = Path(out)
    progress = out / PROGRESS_DIR
    logs = sorted(progress.glob("rank-*.jsonl"))
    lines: dict[Path, list[CommittedLine]] = {}
    for log in logs:
        cut_torn_tail(log)
        lines[log] = []
        for line, ids in scan_committed(log):
            lines[log].append(line)
            if committed is not None:
                committed.add(ids)
    # A requeued job resumes again and again: each resume hashes only the shards committed since the last one
    # (or changed since: another size or mtime). Damage that keeps both is verify's to find, and a rerun on
    # the complete cache then hashes every shard again (prepare_out).
    hashed = _read_hashed(progress)
    damaged = damaged_shards(out, [line.shard for found in lines.values() for line in found], hashed=hashed)
    kept_files = {line.shard["file"] for found in lines.values() for line in found} - set(damaged)
    atomic_write_json(progress / HASHED_SHARDS, {"format": 1, "shards": {f: v for f, v in sorted(hashed.items())
                                                                         if f in kept_files}})
    claimed: set[str] = set()
    kept_clips = 0
    for log, found in lines.items():
        kept = [line for line in found if line.shard["file"] not in damaged]
        if len(kept) < len(found):
            if committed is not None:
                with open(log, "rb") as handle:
                    for line in found:
                        if line.shard["file"] in damaged:
                            handle.seek(line.offset)
                            committed.discard(_line_head(log, line.offset, handle.read(line.length))[1])
            _keep_lines(log, kept)
        claimed.update(Path(line.shard["file"]).name for line in kept)
        kept_clips += sum(line.clips for line in kept)
    del lines
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
    return kept_clips, discarded, damaged


def _keep_lines(log: Path, kept: list[CommittedLine]) -> None:
    """Rewrite `log` (atomically) with only the lines `kept`, byte for byte."""
    with open(log, "rb") as source:
        def lines() -> Iterator[bytes]:
            for line in kept:
                source.seek(line.offset)
                yield source.read(line.length)
        atomic_write_bytes(log, b"".join(lines()))


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


RUN_CHUNK_ROWS = 16384
"""Clip records converted to table rows, sorted if need be and appended to a run, at a time."""
RUN_BATCH_ROWS = 1024
"""Rows per record batch in a run file: the merge holds one batch of every run at once."""
MAX_OPEN_RUNS = 64
"""Runs merged at once (open files); more are merged in rounds first."""
PARALLEL_SCAN_BYTES = 32 * 2**20
"""Progress logs smaller than this in all are scanned in this process (starting workers costs seconds)."""


@dataclass
class _Totals:
    """What finalize sums while it scans the progress logs (bounded by shard count, not clip count)."""

    shards: list[dict[str, Any]] = field(default_factory=list)
    clips: int = 0
    views: int = 0
    frames: int = 0
    shape: dict[str, Any] | None = None
    buckets: dict[str, list[Any]] = field(default_factory=dict)
    """Bucket name -> [clips, views, the first clip's tensor shapes] (a bucketed run's records name theirs)."""

    def add(self, clip: dict[str, Any]) -> None:
        self.clips += 1
        cameras = len(clip.get("cameras") or ())
        self.views += cameras
        self.frames += cameras * len(clip.get("frames") or ())
        if self.shape is None:
            self.shape = {key: entry["shape"] for key, entry in clip["tensors"].items()}
        bucket = clip.get("bucket")
        if isinstance(bucket, dict):
            entry = self.buckets.get(bucket.get("name"))
            if entry is None:
                entry = self.buckets[bucket.get("name")] = [0, 0, {key: e["shape"] for key, e in clip["tensors"].items()}]
            entry[0] += 1
            entry[1] += cameras

    def add_rows(self, table: pa.Table, shards: list[tuple[int, str | None]]) -> None:
        """Committed shards' rows from the row logs, `shards` giving each shard's (row count, bucket name) in
        order: counted column-wise; a bucket's shape is that of its first clip (a shard holds one bucket)."""
        cameras = pc.fill_null(pc.list_value_length(table.column("cameras")), 0).to_numpy()
        frames = pc.fill_null(pc.list_value_length(table.column("frames")), 0).to_numpy()
        self.clips += table.num_rows
        self.views += int(cameras.sum())
        self.frames += int((cameras * frames).sum())
        starts = np.cumsum([0] + [rows for rows, _ in shards[:-1]])
        views = np.add.reduceat(cameras, starts) if len(shards) else []
        for (rows, bucket), start, shard_views in zip(shards, starts, views):
            if self.shape is None or (bucket is not None and bucket not in self.buckets):
                first = _table.clip_record(table.slice(int(start), 1).to_pylist()[0])
                shape = {key: entry["shape"] for key, entry in first["tensors"].items()}
                self.shape = self.shape or shape
                if bucket is not None:
                    self.buckets[bucket] = [0, 0, shape]
            if bucket is not None:
                self.buckets[bucket][0] += rows
                self.buckets[bucket][1] += int(shard_views)

    def merge(self, part: _Totals) -> None:
        self.shards.extend(part.shards)
        self.clips, self.views, self.frames = self.clips + part.clips, self.views + part.views, self.frames + part.frames
        self.shape = self.shape or part.shape
        for name, (clips, views, shape) in part.buckets.items():
            entry = self.buckets.setdefault(name, [0, 0, shape])
            entry[0] += clips
            entry[1] += views


def _log_entries(log: Path, only: frozenset[str] | None = None) -> Iterator[tuple[int, ProgressEntry]]:
    """(byte offset, entry) of every complete line of a progress log (of the shard files in `only`, if given);
    a torn last line is ignored."""
    offset = 0
    with open(log, "rb") as handle:
        for line in handle:
            if not line.endswith(b"\n"):
                return
            # a line that leads with its shard record is skipped by its head; an older one is parsed once, below
            if only is not None and line.startswith(b'{"shard":') and _line_head(log, offset, line)[0]["file"] not in only:
                offset += len(line)
                continue
            if line.strip():
                try:
                    entry = loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise ManifestError(f"{log}: line at byte {offset} does not parse ({exc})") from None
                if not isinstance(entry, dict):
                    raise ManifestError(f"{log}: line at byte {offset} is not a progress entry")
                found = ProgressEntry(log, entry.get("shard"), entry.get("clips"))
                if only is None or found.shard["file"] in only:
                    yield offset, found
            offset += len(line)


def _clip_id(log: Path, clip: Any) -> str:
    if not isinstance(clip, dict) or not isinstance(clip.get("id"), str):
        raise ManifestError(f"{log}: a committed clip record has no id")
    return clip["id"]


class _Runs:
    """Sorted runs of table rows in Arrow IPC files beside the progress logs (finalize deletes them).

    Chunks of rows are appended to the open run while their ids keep ascending; a chunk that is out of
    order is sorted, and one that starts below the run's last id opens a new run. A rank appends clips
    in plan order, which is id order within one attempt for folder datasets (scenes sorted by id,
    windows in frame order), so the runs are about one per rank and attempt; a resumed attempt appends
    another block, and an index file or a scene id holding a character below '/' breaks the order."""

    def __init__(self, folder: Path, prefix: str) -> None:
        self.folder, self.prefix, self.schema = folder, prefix, schema_of(CLIP_TABLE)
        self.paths: list[Path] = []
        self._writer: Any = None
        self._last: str | None = None

    def _new_file(self) -> Any:
        self.paths.append(self.folder / f"{self.prefix}{len(self.paths):06d}.tmp")
        return pa.ipc.new_file(str(self.paths[-1]), self.schema)

    def add(self, chunk: list[tuple[str, dict[str, Any]]]) -> None:
        if not chunk:
            return
        if any(chunk[i][0] > chunk[i + 1][0] for i in range(len(chunk) - 1)):
            chunk.sort(key=lambda item: item[0])
        if self._writer is None or chunk[0][0] < self._last:
            self.close()
            self._writer = self._new_file()
        self._writer.write_table(pa.Table.from_pylist([row for _, row in chunk], schema=self.schema),
                                 max_chunksize=RUN_BATCH_ROWS)
        self._last = chunk[-1][0]

    def add_table(self, table: pa.Table) -> None:
        """Rows already in table form (a row log's batches), sorted by id here if they are not."""
        if not table.num_rows:
            return
        ids = table.column("id")
        if table.num_rows > 1 and not pc.all(pc.less_equal(ids.slice(0, len(ids) - 1), ids.slice(1))).as_py():
            table = table.sort_by("id")
            ids = table.column("id")
        first = ids[0].as_py()
        if self._writer is None or first < self._last:
            self.close()
            self._writer = self._new_file()
        self._writer.write_table(table, max_chunksize=RUN_BATCH_ROWS)
        self._last = ids[-1].as_py()

    def add_tables(self, tables: Iterable[pa.Table]) -> Path:
        """A run made of tables already in id order (a merge round); returns its file."""
        self.close()
        self._writer = self._new_file()
        for table in tables:
            self._writer.write_table(table, max_chunksize=RUN_BATCH_ROWS)
        self.close()
        return self.paths[-1]

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None



def _scan_log(log: Path, prefix: str, chunk_rows: int, only: frozenset[str] | None = None
              ) -> tuple[_Totals, list[Path]]:
    """One pass over one progress log: its counts, and its clip records as table rows in sorted runs (of the
    shards named in `only`, if given; a line is parsed whole only for those)."""
    totals, runs = _Totals(), _Runs(log.parent, prefix)
    chunk: list[tuple[str, dict[str, Any]]] = []
    for _, entry in _log_entries(log, only):
        totals.shards.append(entry.shard)
        for clip in entry.clips:
            clip_id = _clip_id(log, clip)
            totals.add(clip)
            chunk.append((clip_id, clip_row(clip)))
            if len(chunk) >= chunk_rows:
                runs.add(chunk)
                chunk = []
    runs.add(chunk)
    runs.close()
    return totals, runs.paths


def _scan_logs(out: Path, prefix: str, workers: int, only: frozenset[str] | None = None) -> tuple[_Totals, list[Path]]:
    """Every rank's progress log scanned (in `workers` processes: the JSON parsing is the cost), totals
    summed in log order; with `only`, the lines of those shard files alone."""
    folder = Path(out) / PROGRESS_DIR
    logs = sorted(folder.glob("rank-*.jsonl")) if folder.is_dir() else []
    jobs = [(log, f"{prefix}{number:05d}-", RUN_CHUNK_ROWS, only) for number, log in enumerate(logs)]
    if workers > 1 and len(logs) > 1 and sum(log.stat().st_size for log in logs) >= PARALLEL_SCAN_BYTES:
        # spawn: rank 0 may hold CUDA and torch threads, which a forked child must not inherit
        with ProcessPoolExecutor(max_workers=min(workers, len(logs)), mp_context=mp.get_context("spawn")) as pool:
            parts = list(pool.map(_scan_log, *zip(*jobs)))
    else:
        parts = [_scan_log(*job) for job in jobs]
    totals, paths = _Totals(), []
    for part, part_paths in parts:
        totals.merge(part)
        paths.extend(part_paths)
    return totals, paths


def _bucket_name(extra: str | None) -> str | None:
    """The bucket a clip-table row names in its `extra` JSON (a bucketed run), or None."""
    if not extra or '"bucket"' not in extra:
        return None
    bucket = loads(extra).get("bucket")
    return bucket.get("name") if isinstance(bucket, dict) else None


def _gather_rows(out: Path, prefix: str, workers: int) -> tuple[_Totals, list[Path]]:
    """The committed shards (progress logs, shard record and ids only) and their clip-table rows in sorted
    runs: from the row logs the writers left, and, for shards without rows there (a cache written before row
    logs), from their progress lines' clip records."""
    folder = Path(out) / PROGRESS_DIR
    committed: dict[str, dict[str, Any]] = {}
    for log in sorted(folder.glob("rank-*.jsonl")) if folder.is_dir() else []:
        for line, _ in scan_committed(log):
            committed.setdefault(Path(line.shard["file"]).name, line.shard)
    totals, runs = _Totals(), _Runs(folder, f"{prefix}r-")
    taken: set[str] = set()
    pending: list[pa.RecordBatch] = []
    shards: list[tuple[int, str | None]] = []
    rows = 0

    def flush() -> None:
        table = pa.Table.from_batches(pending, schema=schema_of(CLIP_TABLE))
        if table.num_rows:
            totals.add_rows(table, shards)
            runs.add_table(table)
        pending.clear()
        shards.clear()

    for path in sorted(folder.glob(f"rows-rank-*{ROWS_SUFFIX}")) if folder.is_dir() else []:
        for batch in read_row_log(path):
            shard = batch.column("shard")[0].as_py()
            if shard not in committed or shard in taken:
                continue  # written by a commit that never reached its progress line, or dropped on resume
            taken.add(shard)
            pending.append(batch)
            shards.append((batch.num_rows, _bucket_name(batch.column("extra")[0].as_py())))
            rows += batch.num_rows
            if rows >= RUN_CHUNK_ROWS:
                flush()
                rows = 0
    flush()
    runs.close()
    paths = list(runs.paths)
    untaken = frozenset(shard["file"] for name, shard in committed.items() if name not in taken)
    if untaken:
        older, older_paths = _scan_logs(out, prefix, workers, untaken)
        totals.merge(older)
        paths.extend(older_paths)
    totals.shards = list(committed.values())
    return totals, paths


def default_workers() -> int:
    """Processes that scan progress logs in finalize: the cores this process may use, at most 4 (memory)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def _merge(paths: list[Path], rows: int) -> Iterator[pa.Table]:
    """K-way merge by id of sorted Arrow files, as tables of `rows` rows. Whole stretches of one run that
    come before every other run's head are taken at once (bisect), so disjoint runs cost a few slices."""
    readers = [pa.ipc.open_file(pa.OSFile(str(path))) for path in paths]  # read per batch (no mapped pages kept)
    batches: list[Any] = [None] * len(paths)
    ids: list[list[str]] = [[] for _ in paths]
    where = [0] * len(paths)
    next_batch = [0] * len(paths)

    def load(run: int) -> bool:
        while next_batch[run] < readers[run].num_record_batches:
            batch = readers[run].get_batch(next_batch[run])
            next_batch[run] += 1
            if batch.num_rows:
                batches[run], ids[run], where[run] = batch, batch.column("id").to_pylist(), 0
                return True
        return False

    heap = [(ids[run][0], run) for run in range(len(paths)) if load(run)]
    heapq.heapify(heap)
    pending: list[Any] = []
    count = 0
    while heap:
        _, run = heapq.heappop(heap)
        start = where[run]
        limit = len(ids[run]) if not heap else bisect.bisect_right(ids[run], heap[0][0], start)
        stop = min(max(limit, start + 1), start + rows - count)
        pending.append(batches[run].slice(start, stop - start))
        count += stop - start
        where[run] = stop
        if stop < len(ids[run]) or load(run):
            heapq.heappush(heap, (ids[run][where[run]], run))
        if count >= rows:
            yield pa.Table.from_batches(pending)
            pending, count = [], 0
    if pending:
        yield pa.Table.from_batches(pending)


def _merged_tables(paths: list[Path], rounds: _Runs, rows: int) -> Iterator[pa.Table]:
    """Every run merged into one id-sorted stream, in rounds (written by `rounds`) of at most MAX_OPEN_RUNS
    open files."""
    while len(paths) > MAX_OPEN_RUNS:
        paths = [rounds.add_tables(_merge(paths[i:i + MAX_OPEN_RUNS], rows)) for i in range(0, len(paths), MAX_OPEN_RUNS)]
    yield from _merge(paths, rows)


def finalize(out: Path, header: dict[str, Any], workers: int | None = None) -> dict[str, Any]:
    """Merge every rank's progress log into clips.parquet and failures.parquet, then write manifest.json last.

    Streaming: one pass over the logs (`workers` processes, default_workers()) sums the counts and turns
    the records into table rows kept in sorted runs (Arrow files beside the logs); a k-way merge of the
    runs writes the clip table row group by row group. Memory holds the shard list, the failures and a few
    row groups per process, never all clip records. Refuses (EmptyCacheError, no table and no manifest
    written) when no clip at all was committed."""
    out = Path(out)
    folder = out / PROGRESS_DIR
    prefix = f".merge-{os.getpid()}-"
    try:
        totals, paths = _gather_rows(out, prefix, default_workers() if workers is None else workers)
        failures = read_failures(out)
        if not totals.clips:
            raise EmptyCacheError(f"{out}: no clips encoded: {describe_failures(failures)} (no manifest written)")
        header = dict(header)
        planned, backoffs = header.pop("planned_clips"), header.pop("oom_backoffs")
        header["latent"] = {**header["latent"], "shape": totals.shape}
        if "buckets" in header:  # a bucketed run: every planned bucket, with what was committed to it
            header["buckets"] = [{**bucket, "clips": totals.buckets.get(bucket["name"], [0])[0],
                                  "views": totals.buckets.get(bucket["name"], [0, 0])[1],
                                  "shape": totals.buckets.get(bucket["name"], [0, 0, None])[2]}
                                 for bucket in header["buckets"]]
            if sum(1 for bucket in header["buckets"] if bucket["clips"]) > 1:
                header["latent"]["shape"] = None  # several latent shapes: see "buckets"
        header["counts"] = {
            "clips": totals.clips, "views": totals.views, "frames": totals.frames,
            "shards": len(totals.shards), "bytes": sum(s["bytes"] for s in totals.shards), "failures": len(failures),
            "oom_backoffs": backoffs, "planned_clips": planned,
        }
        rounds = _Runs(folder, f"{prefix}m-")
        clips = write_tables(out / CLIPS, CLIP_TABLE, _merged_tables(paths, rounds, _table.ROW_GROUP_ROWS))
    finally:
        for path in folder.glob(f"{prefix}*.tmp") if folder.is_dir() else []:
            path.unlink(missing_ok=True)
    return _write_manifest_last(out, header, totals.shards, clips, write_table(out / FAILURES, FAILURE_TABLE, failures))


def write_manifest(out: Path, header: dict[str, Any], shards: list[dict[str, Any]], clips: Iterable[dict[str, Any]],
                   failures: list[dict[str, Any]]) -> dict[str, Any]:
    """Write the clip table (sorted by id here, in memory: small caches, tests) and the failure table, then
    manifest.json last. `finalize` is the streaming path an encode takes."""
    out = Path(out)
    written = write_table(out / CLIPS, CLIP_TABLE, sorted(clips, key=lambda clip: clip["id"]))
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
        for line, _ in scan_committed(log):
            shards += 1
            clips += line.clips
    return clips, shards


def read_manifest(out: Path) -> dict[str, Any]:
    """Parse manifest.json and refuse unknown formats and versions."""
    path = Path(out) / MANIFEST
    if not path.exists():
        raise ManifestError(f"{path}: no manifest (the run is incomplete or OUT is not a vaecache output)")
    manifest = read_json(path, "manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ManifestError(f"{path}: not a vaecache manifest")
    version = manifest.get("format_version")
    if version not in SUPPORTED_VERSIONS:
        raise ManifestError(f"{path}: format version {version!r} is not supported (this vaecache reads {list(SUPPORTED_VERSIONS)})")
    return manifest
