"""Finalize: every rank's committed rows merged into the clip table, then the manifest written last."""

from __future__ import annotations

import bisect
import heapq
import json
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from vaecache.cache.failures import describe_failures, read_failures
from vaecache.cache.layout import CLIPS, FAILURES, PROGRESS_DIR, ROWS_SUFFIX
from vaecache.cache.manifest import write_manifest_last
from vaecache.cache.progress import committed_clip_id, progress_entries, progress_logs, scan_committed
from vaecache.cache.table import (
    CLIP_TABLE,
    FAILURE_TABLE,
    ROW_GROUP_ROWS,
    clip_record,
    clip_row,
    loads_extra,
    read_row_log,
    schema_of,
    write_table,
    write_tables,
)
from vaecache.errors import EmptyCacheError, ManifestError, first_line

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
                entry = self.buckets[bucket.get("name")] = [0, 0, {key: e["shape"]
                                                                   for key, e in clip["tensors"].items()}]
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
                row = table.slice(int(start), 1).to_pylist()[0]
                try:
                    first = clip_record(row)
                except (json.JSONDecodeError, UnicodeDecodeError, TypeError, AttributeError) as exc:
                    raise ManifestError(f"{row['shard']}: its first clip record ({row['id']}) does not parse "
                                        f"({first_line(exc)})") from None
                shape = {key: entry["shape"] for key, entry in first["tensors"].items()}
                self.shape = self.shape or shape
                if bucket is not None:
                    self.buckets[bucket] = [0, 0, shape]
            if bucket is not None:
                self.buckets[bucket][0] += rows
                self.buckets[bucket][1] += int(shard_views)

    def merge(self, part: _Totals) -> None:
        self.shards.extend(part.shards)
        self.clips, self.views, self.frames = (self.clips + part.clips, self.views + part.views,
                                               self.frames + part.frames)
        self.shape = self.shape or part.shape
        for name, (clips, views, shape) in part.buckets.items():
            entry = self.buckets.setdefault(name, [0, 0, shape])
            entry[0] += clips
            entry[1] += views


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
    for _, entry in progress_entries(log, only):
        totals.shards.append(entry.shard)
        for clip in entry.clips:
            clip_id = committed_clip_id(log, clip)
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
    logs = progress_logs(out)
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


def _bucket_name(extra: str | None, where: Path, shard: str) -> str | None:
    """The bucket a clip-table row names in its `extra` JSON (a bucketed run), or None."""
    if not extra or '"bucket"' not in extra:
        return None
    try:
        bucket = loads_extra(extra).get("bucket")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise ManifestError(f"{where}: the clip records of {shard} do not parse ({first_line(exc)})") from None
    return bucket.get("name") if isinstance(bucket, dict) else None


def _gather_rows(out: Path, prefix: str, workers: int) -> tuple[_Totals, list[Path]]:
    """The committed shards (progress logs, shard record and ids only) and their clip-table rows in sorted
    runs: from the row logs the writers left, and, for shards without rows there (a cache written before row
    logs), from their progress lines' clip records."""
    folder = Path(out) / PROGRESS_DIR
    committed: dict[str, dict[str, Any]] = {}
    for log in progress_logs(out):
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
            shards.append((batch.num_rows, _bucket_name(batch.column("extra")[0].as_py(), path, shard)))
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
        paths = [rounds.add_tables(_merge(paths[i:i + MAX_OPEN_RUNS], rows))
                 for i in range(0, len(paths), MAX_OPEN_RUNS)]
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
        clips = write_tables(out / CLIPS, CLIP_TABLE, _merged_tables(paths, rounds, ROW_GROUP_ROWS))
    finally:
        for path in folder.glob(f"{prefix}*.tmp") if folder.is_dir() else []:
            path.unlink(missing_ok=True)
    return write_manifest_last(out, header, totals.shards, clips, write_table(out / FAILURES, FAILURE_TABLE, failures))
