"""The clip table and the failure table as Parquet (format version 2): a record <-> row mapping that loses
nothing, a streaming writer (row group by row group) and a streaming reader.

A clip record is the JSON object the shard writer completes. Its parts a trainer queries are columns
(id, scene, shard, cameras, sources and their identity, frames, fps, times, and the tensors as parallel
lists: keys, names, shapes, dtypes, stats, per-channel stats); every other key (`encode`, metadata passed through
from an index) is kept in the JSON column `extra`. A key whose value does not fit its column's type also goes to
`extra`, so a record read back equals the record written, whatever it holds. A null column means "key
absent"; a null list element means "field absent" in that element.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from vaecache.cache.io import (
    FILE_MODE,
    NON_FINITE_KEY,
    NonFiniteNumber,
    fsync_dir,
    loads,
    replace_non_finite,
    sha256_file,
)
from vaecache.errors import ClipTableError, OutputError, first_line

ROW_GROUP_ROWS = 16384
"""Rows per row group: what the writer holds in memory at once, and the unit a reader skips by."""
READ_BATCH_ROWS = 8192
TABLE_METADATA_KEY = b"vaecache"


def _is_int(value: Any) -> bool:
    return type(value) is int and -2**63 <= value < 2**63


_STR, _INT, _FLOAT = frozenset({str}), frozenset({int}), frozenset({float})
# The checks below run per record (millions in a finalize): types are compared set-wise at C speed.


def _is_str_list(value: Any) -> bool:
    return type(value) is list and set(map(type, value)) <= _STR


def _is_int_list(value: Any) -> bool:
    return type(value) is list and (not value or (set(map(type, value)) <= _INT
                                                  and -2**63 <= min(value) and max(value) < 2**63))


def _is_float_list(value: Any) -> bool:
    return type(value) is list and set(map(type, value)) <= _FLOAT


@dataclass(frozen=True)
class Column:
    """A record key stored as one column: its Arrow type and the test a value must pass to be stored there."""

    key: str
    type: pa.DataType
    fits: Callable[[Any], bool]


STATS_TYPE = pa.struct([("min", pa.float64()), ("max", pa.float64()), ("mean", pa.float64()), ("std", pa.float64())])
STATS_KEYS = ("min", "max", "mean", "std")
_STATS_KEY_SET = frozenset(STATS_KEYS)
_NO_STATS: dict[str, float] = {key: 0.0 for key in STATS_KEYS}
CHANNEL_STATS_TYPE = pa.struct([("mean", pa.list_(pa.float64())), ("std", pa.list_(pa.float64()))])
CHANNEL_STATS_KEYS = frozenset({"mean", "std"})
TENSOR_FIELDS = ("name", "shape", "dtype", "stats", "channel_stats")
IDENTITY_FIELDS = ("size", "mtime_ns", "sha256")
_TENSOR_FIELD_SET = frozenset(TENSOR_FIELDS)
_IDENTITY_FIELD_SET = frozenset(IDENTITY_FIELDS)

CLIP_COLUMNS = (
    Column("id", pa.string(), lambda v: type(v) is str),
    Column("scene", pa.string(), lambda v: type(v) is str),
    Column("shard", pa.string(), lambda v: type(v) is str),
    Column("cameras", pa.list_(pa.string()), _is_str_list),
    Column("sources", pa.list_(pa.string()), _is_str_list),
    Column("frames", pa.list_(pa.int64()), _is_int_list),
    Column("fps", pa.float64(), lambda v: type(v) is float),
    Column("times", pa.list_(pa.float64()), _is_float_list),
)
"""Plain record keys stored as columns of the same name."""

TENSOR_COLUMNS = {"tensor_keys": pa.list_(pa.string()), "tensor_names": pa.list_(pa.string()),
                  "tensor_shapes": pa.list_(pa.list_(pa.int64())), "tensor_dtypes": pa.list_(pa.string()),
                  "tensor_stats": pa.list_(STATS_TYPE), "tensor_channel_stats": pa.list_(CHANNEL_STATS_TYPE)}
"""`tensors` ({key: {name, shape, dtype, stats, channel_stats}}) as parallel lists, one element per stored key, in
record order."""

ADDED_CLIP_COLUMNS = frozenset({"tensor_channel_stats"})
"""Columns added to the clip table after its first version: a table written before lacks them, and reads as if
they were null (the records hold no such key)."""

IDENTITY_COLUMNS = {"source_sizes": pa.list_(pa.int64()), "source_mtimes_ns": pa.list_(pa.int64()),
                    "source_sha256": pa.list_(pa.string())}
"""`source_identity` ([{size, mtime_ns[, sha256]}], one per camera, aligned with `sources`) as parallel lists."""

CLIP_SCHEMA = pa.schema([pa.field("id", pa.string(), nullable=False),
                         *[pa.field(c.key, c.type) for c in CLIP_COLUMNS[1:]],
                         *[pa.field(name, kind) for name, kind in IDENTITY_COLUMNS.items()],
                         *[pa.field(name, kind) for name, kind in TENSOR_COLUMNS.items()],
                         pa.field("extra", pa.string())])

FAILURE_COLUMNS = tuple(Column(key, pa.string(), lambda v: type(v) is str)
                        for key in ("scene", "clip", "camera", "path", "reason"))
FAILURE_SCHEMA = pa.schema([*[pa.field(c.key, c.type) for c in FAILURE_COLUMNS], pa.field("extra", pa.string())])


def _tensors_fit(tensors: Any) -> bool:
    if type(tensors) is not dict:
        return False
    for key, entry in tensors.items():
        if type(key) is not str or type(entry) is not dict or not entry.keys() <= _TENSOR_FIELD_SET:
            return False
        if (("name" in entry and type(entry["name"]) is not str)
                or ("dtype" in entry and type(entry["dtype"]) is not str)):
            return False
        if "shape" in entry and not _is_int_list(entry["shape"]):
            return False
        stats = entry.get("stats", _NO_STATS)
        if stats is not _NO_STATS and (type(stats) is not dict or stats.keys() != _STATS_KEY_SET
                                       or not set(map(type, stats.values())) <= _FLOAT):
            return False
        channels = entry.get("channel_stats")
        if channels is not None and (type(channels) is not dict or channels.keys() != CHANNEL_STATS_KEYS
                                     or not all(_is_float_list(v) for v in channels.values())):
            return False
    return True


def _identity_fits(identity: Any) -> bool:
    if type(identity) is not list:
        return False
    for item in identity:
        if (type(item) is not dict or not item.keys() <= _IDENTITY_FIELD_SET or not _is_int(item.get("size"))
                or not _is_int(item.get("mtime_ns")) or ("sha256" in item and type(item["sha256"]) is not str)):
            return False
    return True


def _dumps(extra: dict[str, Any]) -> str | None:
    return json.dumps(extra, sort_keys=True, separators=(",", ":"), allow_nan=False) if extra else None


def loads_extra(text: str) -> dict[str, Any]:
    """A row's `extra` JSON. vaecache 0.5.0 wrote non-finite metadata numbers into it as NaN/Infinity tokens,
    leaving a cache no strict reader opens: such a value is read as null and named in `non_finite`, as the writer
    now stores it."""
    try:
        return loads(text)
    except NonFiniteNumber:
        extra, replaced = replace_non_finite(json.loads(text))
        if replaced:
            extra[NON_FINITE_KEY] = list(extra.get(NON_FINITE_KEY) or []) + replaced
        return extra


_PLAIN_FITS = {column.key: column.fits for column in CLIP_COLUMNS}


def clip_row(record: dict[str, Any]) -> dict[str, Any]:
    """The table row of a clip record (see the module docstring). One pass over the record's keys: this
    runs for every clip in a finalize."""
    row: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in record.items():
        fits = _PLAIN_FITS.get(key)
        if fits is not None:
            if fits(value):
                row[key] = value
                continue
        elif key == "tensors" and _tensors_fit(value):
            entries = list(value.values())
            row["tensor_keys"] = list(value)
            row["tensor_names"] = [e.get("name") for e in entries]
            row["tensor_shapes"] = [e.get("shape") for e in entries]
            row["tensor_dtypes"] = [e.get("dtype") for e in entries]
            row["tensor_stats"] = [e.get("stats") for e in entries]
            row["tensor_channel_stats"] = [e.get("channel_stats") for e in entries]
            continue
        elif key == "source_identity" and _identity_fits(value):
            row["source_sizes"] = [item["size"] for item in value]
            row["source_mtimes_ns"] = [item["mtime_ns"] for item in value]
            row["source_sha256"] = [item.get("sha256") for item in value]
            continue
        extra[key] = value
    if "id" not in row:
        raise ValueError(f"clip record without a string id: {str(record)[:80]}")
    row["extra"] = _dumps(extra)
    return row


def clip_record(row: dict[str, Any]) -> dict[str, Any]:
    """The clip record a table row holds (inverse of clip_row)."""
    record = {column.key: row[column.key] for column in CLIP_COLUMNS if row.get(column.key) is not None}
    sizes = row.get("source_sizes")
    if sizes is not None:
        record["source_identity"] = [
            {"size": size, "mtime_ns": mtime, **({"sha256": digest} if digest is not None else {})}
            for size, mtime, digest in zip(sizes, row["source_mtimes_ns"], row["source_sha256"])]
    keys = row.get("tensor_keys")
    if keys is not None:
        tensors = {}
        channels = row.get("tensor_channel_stats") or [None] * len(keys)
        for key, name, shape, dtype, stats, per_channel in zip(keys, row["tensor_names"], row["tensor_shapes"],
                                                               row["tensor_dtypes"], row["tensor_stats"], channels):
            entry = {field: value for field, value in (("name", name), ("shape", shape), ("dtype", dtype),
                                                        ("stats", stats), ("channel_stats", per_channel))
                     if value is not None}
            tensors[key] = entry
        record["tensors"] = tensors
    if row.get("extra"):
        record.update(loads_extra(row["extra"]))
    return record


def failure_row(record: dict[str, Any]) -> dict[str, Any]:
    extra = dict(record)
    row = {column.key: extra.pop(column.key) for column in FAILURE_COLUMNS
           if column.key in extra and column.fits(extra[column.key])}
    row["extra"] = _dumps(extra)
    return row


def failure_from_row(row: dict[str, Any]) -> dict[str, Any]:
    record = {column.key: row[column.key] for column in FAILURE_COLUMNS if row.get(column.key) is not None}
    if row.get("extra"):
        record.update(loads_extra(row["extra"]))
    return record


@dataclass(frozen=True)
class TableKind:
    """A Parquet table of records: its schema and the record <-> row mapping."""

    name: str
    schema: pa.Schema
    to_row: Callable[[dict[str, Any]], dict[str, Any]]
    to_record: Callable[[dict[str, Any]], dict[str, Any]]
    added: frozenset[str] = frozenset()
    """Columns a table of this kind written before they existed lacks (read as null)."""

    def required(self) -> list[str]:
        """The columns every table of this kind has."""
        return [name for name in self.schema.names if name not in self.added]


CLIP_TABLE = TableKind("clips", CLIP_SCHEMA, clip_row, clip_record, ADDED_CLIP_COLUMNS)
FAILURE_TABLE = TableKind("failures", FAILURE_SCHEMA, failure_row, failure_from_row)


@dataclass(frozen=True)
class WrittenTable:
    """What the manifest records of a table: its row count and the sha256 of the file."""

    count: int
    sha256: str


def schema_of(kind: TableKind) -> pa.Schema:
    """The table's schema as written (with a small metadata entry naming the table)."""
    return kind.schema.with_metadata({TABLE_METADATA_KEY: json.dumps({"table": kind.name}).encode()})


def rows_table(kind: TableKind, records: Iterable[dict[str, Any]]) -> pa.Table:
    """Records as an Arrow table of the kind's schema (in memory: one row group's worth at a time)."""
    return pa.Table.from_pylist([kind.to_row(record) for record in records], schema=schema_of(kind))


def write_table(path: Path, kind: TableKind, records: Iterable[dict[str, Any]],
                row_group_rows: int | None = None) -> WrittenTable:
    """Write `records` (in the order given) as Parquet at `path`, one row group per `row_group_rows` records
    as they stream in (see write_tables)."""
    size = row_group_rows or ROW_GROUP_ROWS
    iterator = iter(records)
    chunks = iter(lambda: list(itertools.islice(iterator, size)), [])
    return write_tables(path, kind, (rows_table(kind, chunk) for chunk in chunks))


def write_tables(path: Path, kind: TableKind, tables: Iterable[pa.Table]) -> WrittenTable:
    """Write Arrow tables of the kind's schema at `path`, one zstd row group each, atomically: a temp file in
    the same folder is written as they stream in, fsynced, hashed and renamed over `path`, and the folder is
    fsynced. Holds one row group in memory, never the whole table."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    count = 0
    schema = schema_of(kind)
    try:
        with open(tmp, "wb") as handle:
            os.fchmod(handle.fileno(), FILE_MODE)
            writer = pq.ParquetWriter(handle, schema, compression="zstd", write_page_checksum=True)
            try:
                for table in tables:
                    if table.num_rows:
                        # one chunk per column: the bytes then depend on the rows alone, not on how the
                        # merge sliced them (page boundaries follow chunk boundaries)
                        table = table.combine_chunks().replace_schema_metadata(schema.metadata)
                        writer.write_table(table, row_group_size=table.num_rows)
                        count += table.num_rows
                if not count:
                    writer.write_table(pa.Table.from_pylist([], schema=schema))
            finally:
                writer.close()
            handle.flush()
            os.fsync(handle.fileno())
        digest = sha256_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise OutputError(f"{path}: cannot write ({exc.strerror or exc})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return WrittenTable(count, digest)


def open_table(source: Any, kind: TableKind, where: Any = None) -> pq.ParquetFile:
    """A table to read from `source`: a local path, or an open binary file (a store's object, named `where` in
    messages)."""
    path = source if where is None else where
    try:
        table = pq.ParquetFile(source, page_checksum_verification=True)
    except FileNotFoundError:
        raise ClipTableError(f"{path}: missing") from None
    except (pa.ArrowException, OSError) as exc:
        raise ClipTableError(f"{path}: not a readable Parquet file ({first_line(exc)})") from None
    missing = [name for name in kind.required() if name not in table.schema_arrow.names]
    if missing:
        raise ClipTableError(f"{path}: not a vaecache {kind.name} table (no column {', '.join(missing)})")
    return table


def iter_table(source: Any, kind: TableKind, batch_rows: int = READ_BATCH_ROWS,
               where: Any = None) -> Iterator[dict[str, Any]]:
    """The records of a table, one record batch at a time (bounded memory at any row count)."""
    table = open_table(_source(source), kind, where)
    path = source if where is None else where
    number = 0
    try:
        for batch in table.iter_batches(batch_size=batch_rows, columns=present_columns(table, kind)):
            for row in batch.to_pylist():
                try:
                    record = kind.to_record(row)
                except (ValueError, TypeError, KeyError, AttributeError) as exc:  # a row no writer of ours made
                    raise ClipTableError(f"{path}: row {number} is malformed ({type(exc).__name__}: "
                                         f"{first_line(exc)})") from None
                number += 1
                yield record
    except (pa.ArrowException, OSError) as exc:
        raise ClipTableError(f"{path}: does not read ({first_line(exc)})") from None


def iter_column(source: Any, kind: TableKind, column: str, batch_rows: int = 65536,
                where: Any = None) -> Iterator[Any]:
    """One column's values, batch by batch (no other column is read)."""
    table = open_table(_source(source), kind, where)
    path = source if where is None else where
    try:
        for batch in table.iter_batches(batch_size=batch_rows, columns=[column]):
            yield from batch.column(0).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise ClipTableError(f"{path}: does not read ({first_line(exc)})") from None


def present_columns(table: pq.ParquetFile, kind: TableKind) -> list[str]:
    """The kind's columns this table holds: all of them, but those added since it was written (TableKind.added)."""
    names = set(table.schema_arrow.names)
    return [name for name in kind.schema.names if name in names]


def with_added_columns(rows: pa.Table, kind: TableKind) -> pa.Table:
    """`rows` read from an older table, with each column added since (TableKind.added) appended as nulls, in the
    kind's schema order: what a reader of the whole table expects."""
    for name in kind.schema.names:
        if name not in rows.column_names:
            rows = rows.append_column(kind.schema.field(name), pa.nulls(rows.num_rows, kind.schema.field(name).type))
    return rows.select(kind.schema.names)


def table_rows(path: Path, kind: TableKind) -> int:
    """Row count from the Parquet footer (no data read)."""
    return open_table(Path(path), kind).metadata.num_rows


def _source(source: Any) -> Any:
    return Path(source) if isinstance(source, str) else source


class RowLog:
    """An append-only Arrow IPC stream of clip-table rows beside a rank's progress log: one record batch per
    committed shard, written and fsynced before the shard's progress line. Finalize merges these batches
    instead of parsing millions of JSON records; a batch whose shard has no progress line (a crash between the
    two) is ignored there, and a torn last batch ends the stream."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._handle: Any = None
        self._writer: Any = None

    def append(self, records: list[dict[str, Any]]) -> None:
        table = pa.Table.from_pylist([clip_row(record) for record in records], schema=schema_of(CLIP_TABLE))
        try:
            if self._writer is None:
                self._handle = open(self.path, "wb")
                # uncompressed: a compressed buffer costs a decompression context each, ~0.5 ms a commit's batch
                # at finalize (10 us uncompressed), for ~1.4 KB a clip on disk (about the size of the progress log)
                self._writer = pa.ipc.new_stream(self._handle, table.schema)
            self._writer.write_table(table, max_chunksize=len(records) or 1)
            self._handle.flush()
            os.fsync(self._handle.fileno())
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot append ({exc.strerror or exc})") from None

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._handle.close()
            self._writer = self._handle = None


def read_row_log(path: Path) -> Iterator[pa.RecordBatch]:
    """The record batches of a RowLog, up to a torn tail; nothing from a stream of another schema (finalize
    then reads those shards' clip records from the progress log)."""
    try:
        reader = pa.ipc.open_stream(pa.OSFile(str(path)))
    except (pa.ArrowInvalid, OSError):
        return
    if not reader.schema.equals(CLIP_SCHEMA):
        return
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            return
        except (pa.ArrowInvalid, OSError):
            return
        if batch.num_rows:
            yield batch


__all__ = ["CLIP_SCHEMA", "CLIP_TABLE", "FAILURE_SCHEMA", "FAILURE_TABLE", "ClipTableError", "RowLog", "TableKind",
           "WrittenTable", "clip_record", "clip_row", "iter_column", "iter_table", "present_columns", "read_row_log",
           "rows_table", "schema_of", "table_rows", "with_added_columns", "write_table", "write_tables"]
