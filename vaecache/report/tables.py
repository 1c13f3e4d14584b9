"""What `vaecache report` learns from a cache's clip table without reading a shard: one streamed pass over a few
columns (record batches of the Parquet file; a version-1 cache's JSON lines turned into the same batches), in
bounded memory at any clip count. What grows with the cache is counted in bounded structures: scenes as runs of
the id-sorted table, lengths and cameras in small counters, per-channel statistics as running moments."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from vaecache.cache.reader import CacheReader
from vaecache.cache.table import CLIP_TABLE, open_table, present_columns, rows_table, with_added_columns
from vaecache.report.scale import MomentSum

BATCH_ROWS = 16384
MAX_DISTINCT = 4096
"""The most distinct values a counter of the table keeps (clip lengths, camera names, frame rates); beyond it the
rest are counted together as "other"."""
STORED_FOR_SCALE = ("mean", "sample")
"""The stored tensor whose statistics are the cache's scale: the posterior mean, else a stored sample."""


class CappedCounter:
    """A Counter that keeps at most MAX_DISTINCT keys; later new keys are counted under `other`."""

    def __init__(self, limit: int = MAX_DISTINCT) -> None:
        self.counts: Counter[Any] = Counter()
        self.other = 0
        self.limit = limit

    def add(self, key: Any, count: int = 1) -> None:
        if key in self.counts or len(self.counts) < self.limit:
            self.counts[key] += count
        else:
            self.other += count

    def most_common(self, n: int | None = None) -> list[tuple[Any, int]]:
        return self.counts.most_common(n)


@dataclass
class ClipTableSummary:
    """The clip table at a glance (ContentsSection reads it)."""

    clips: int = 0
    scenes: int = 0
    views: int = 0
    frames: int = 0
    cameras: CappedCounter = field(default_factory=CappedCounter)
    """Clips per camera name."""
    cameras_per_clip: CappedCounter = field(default_factory=CappedCounter)
    lengths: CappedCounter = field(default_factory=CappedCounter)
    """Clips per (frames, fps): a clip's length in frames and its frame rate (None: an image sequence of unknown
    rate)."""
    shapes: CappedCounter = field(default_factory=CappedCounter)
    """Clips per latent shape of the scale tensor (cameras, C, t, h, w)."""
    scale_key: str | None = None
    """The stored key (mean or sample) whose per-channel statistics `moments` sums."""
    moments: MomentSum | None = None
    """Per-channel moments of `scale_key` over every clip whose record holds per-channel statistics."""
    with_channel_stats: int = 0
    """Clips whose record holds per-channel statistics of `scale_key` (written since they were recorded)."""


def clip_batches(reader: CacheReader, columns: list[str]) -> Iterator[pa.RecordBatch]:
    """The clip table's `columns` (those of CLIP_TABLE), batch by batch, in id order; a column added to the table
    after it was written comes as nulls; a version-1 cache's records are made into the same batches."""
    if reader.version == 1:
        records = reader.clip_records()
        while True:
            chunk = list(itertools.islice(records, BATCH_ROWS))
            if not chunk:
                return
            yield from rows_table(CLIP_TABLE, chunk).select(columns).to_batches()
    table = open_table(reader.table_source(reader.clips_name), CLIP_TABLE, where=reader.clips_path)
    present = [name for name in columns if name in present_columns(table, CLIP_TABLE)]
    for batch in table.iter_batches(batch_size=BATCH_ROWS, columns=present):
        if len(present) == len(columns):
            yield batch
            continue
        rows = with_added_columns(pa.Table.from_batches([batch]), CLIP_TABLE)
        yield from rows.select(columns).to_batches()


def summarize_clip_table(reader: CacheReader) -> ClipTableSummary:
    """One pass over the clip table's scene, cameras, frames, fps and tensor columns."""
    summary = ClipTableSummary()
    columns = ["scene", "cameras", "frames", "fps", "tensor_keys", "tensor_shapes", "tensor_channel_stats"]
    last_scene: str | None = None
    for batch in clip_batches(reader, columns):
        rows = batch.num_rows
        if not rows:
            continue
        summary.clips += rows
        scenes = batch.column("scene")
        changes = int(pc.sum(pc.not_equal(scenes.slice(1), scenes.slice(0, rows - 1))).as_py() or 0)
        summary.scenes += changes + (scenes[0].as_py() != last_scene)  # the table is sorted by id: scene by scene
        last_scene = scenes[rows - 1].as_py()
        camera_counts = pc.list_value_length(batch.column("cameras")).fill_null(0)
        frame_counts = pc.list_value_length(batch.column("frames")).fill_null(0)
        summary.views += int(pc.sum(camera_counts).as_py() or 0)
        summary.frames += int(pc.sum(pc.multiply(camera_counts, frame_counts)).as_py() or 0)
        for entry in pc.value_counts(pc.list_flatten(batch.column("cameras"))).to_pylist():
            summary.cameras.add(entry["values"], entry["counts"])
        for entry in pc.value_counts(camera_counts).to_pylist():
            summary.cameras_per_clip.add(entry["values"], entry["counts"])
        for pair, count in Counter(zip(frame_counts.to_pylist(), batch.column("fps").to_pylist())).items():
            summary.lengths.add(pair, count)
        _add_scale(summary, batch)
    return summary


def _add_scale(summary: ClipTableSummary, batch: pa.RecordBatch) -> None:
    """Fold the batch's per-clip channel statistics of the scale tensor into `summary.moments`, each clip weighted
    by the values per channel it holds (cameras x frames x h x w)."""
    keys = batch.column("tensor_keys").to_pylist()
    shapes = batch.column("tensor_shapes").to_pylist()
    channels = batch.column("tensor_channel_stats").to_pylist()
    counts, means, stds = [], [], []
    for row, row_keys in enumerate(keys):
        found = next((k for k in STORED_FOR_SCALE if k in (row_keys or [])), None)
        if found is None:
            continue
        if summary.scale_key is None:
            summary.scale_key = found
        if found != summary.scale_key:
            continue
        position = row_keys.index(found)
        shape = (shapes[row] or [])[position] or []
        summary.shapes.add(tuple(shape))
        stats = channels[row][position] if channels[row] else None
        if not stats or len(shape) < 2 or not len(stats["mean"]) == len(stats["std"]) == shape[1]:
            continue  # no statistics, or not of its shape's channels (verify names such a record)
        if summary.moments is None:
            summary.moments = MomentSum(shape[1])
        if shape[1] != summary.moments.channels:
            continue
        counts.append(float(np.prod(shape)) / shape[1])
        means.append(stats["mean"])
        stds.append(stats["std"])
    if counts:
        summary.moments.add_clips(np.asarray(counts), np.asarray(means, dtype=np.float64),  # type: ignore[union-attr]
                                  np.asarray(stds, dtype=np.float64))
        summary.with_channel_stats += len(counts)


def sample_positions(count: int, wanted: int, seed: int) -> list[int]:
    """`wanted` distinct positions of a table of `count` rows, drawn with `seed`, sorted: the same cache, count and
    seed sample the same clips. Pure."""
    return sorted(random.Random(seed).sample(range(count), min(max(0, wanted), count)))


def records_at(reader: CacheReader, positions: list[int]) -> list[dict[str, Any]]:
    """The clip records at sorted `positions` of the table: only the row groups holding them are read."""
    if not positions:
        return []
    if reader.version == 1:
        wanted = set(positions)
        return [record for index, record in enumerate(reader.clip_records()) if index in wanted]
    table = open_table(reader.table_source(reader.clips_name), CLIP_TABLE, where=reader.clips_path)
    columns = present_columns(table, CLIP_TABLE)
    found: list[dict[str, Any]] = []
    start = 0
    remaining = list(positions)
    for group in range(table.metadata.num_row_groups):
        size = table.metadata.row_group(group).num_rows
        inside = [p - start for p in remaining if start <= p < start + size]
        if inside:
            rows = with_added_columns(table.read_row_group(group, columns=columns), CLIP_TABLE)
            found.extend(CLIP_TABLE.to_record(row) for row in rows.take(inside).to_pylist())
            remaining = remaining[len(inside):]
        start += size
        if not remaining:
            break
    return found


__all__ = ["CappedCounter", "ClipTableSummary", "clip_batches", "records_at", "sample_positions",
           "summarize_clip_table"]
