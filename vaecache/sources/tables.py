"""The metadata-table layout: DATA is a .csv, .tsv or .parquet table of videos, one scene per row, or one per clip
range of a row.

Columns, by role (`--column ROLE=NAME` names another column for a role):

* `path` (required): the video, relative to the table's folder or absolute;
* `id`: the scene id (default: derived from the path);
* `start`/`end`: one clip range in seconds (a number, or `H:MM:SS.mmm` as Panda-70M writes it);
* `start_frame`/`end_frame`: one range in frames, [start, end);
* `ranges` (default column `timestamp` when the table has one and no `ranges`): a list of [start, end] ranges in
  seconds, as Panda-70M's `timestamp` column holds them; each range is a scene, and every other column whose value
  is a list of the same length (Panda's `caption`, `matching_score`) is split along with it.

Every other column is metadata (a CSV cell stays text; an empty one is left out). A range's scene id is
`<id or path>@<start>-<end>` (seconds with 3 decimals, or `f<start>-<end>` in frames): derived from the path and the
range only, so it never depends on row order. Parquet is read a batch of rows at a time, never whole.

A CSV cell holding a list (Panda-70M writes them as Python literals: `[['0:00:00.000', '0:00:05.005'], ...]`) is
read with `ast.literal_eval`, which evaluates literals only (no code, no pickle).
"""

from __future__ import annotations

import ast
import csv
import io
import json
import math
import posixpath
from pathlib import Path
from typing import Any, Iterator, Sequence

from vaecache.errors import DatasetError
from vaecache.settings.options import COLUMN_ROLES
from vaecache.sources.jsonl import resolved_in
from vaecache.sources.scene import SINGLE_CAMERA, LayoutScenes, Scene, SourceOptions
from vaecache.urls import folder_of

PANDA_RANGES = "timestamp"
"""Panda-70M's column of clip ranges: the `ranges` column when a table has it and no `ranges` column."""
SUFFIXES = (".csv", ".tsv", ".parquet")
PARQUET_BATCH_ROWS = 16384


def parse_seconds(value: Any, where: str) -> float:
    """A time in seconds: a number, or text `S.sss`, `M:SS.sss` or `H:MM:SS.sss`."""
    if isinstance(value, bool):
        raise DatasetError(f"{where}: a time must be seconds or H:MM:SS.mmm, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and value.strip():
        parts = value.strip().split(":")
        try:
            if len(parts) > 3:
                raise ValueError
            numbers = [float(part) for part in parts]
            if any(n < 0 for n in numbers) or any(n >= 60 for n in numbers[1:]):
                raise ValueError
        except ValueError:
            raise DatasetError(f"{where}: a time must be seconds or H:MM:SS.mmm, got {value!r}") from None
        seconds = 0.0
        for number in numbers:
            seconds = seconds * 60 + number
    else:
        raise DatasetError(f"{where}: a time must be seconds or H:MM:SS.mmm, got {value!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise DatasetError(f"{where}: a time must be a finite number of seconds >= 0, got {value!r}")
    return seconds


def _listed(value: Any) -> Any:
    """A CSV cell that holds a list literal, as the list; any other value as it is."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return ast.literal_eval(value.strip())
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return value
    return value


def _is_pair(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 2 and not any(isinstance(v, (list, tuple))
                                                                              for v in value)


def _is_ranges(value: Any) -> bool:
    return _is_pair(value) or (isinstance(value, (list, tuple)) and bool(value) and all(map(_is_pair, value)))


def read_rows(table: Path) -> Iterator[tuple[str, dict[str, Any], dict[str, int]]]:
    """(where, row, lines) for every row: `where` names the table and the row (CSV: the line it starts on; Parquet: its
    row number); `lines` maps each CSV column to the line its cell starts on (a quoted cell may hold line breaks, so
    a row may span lines; empty for Parquet)."""
    suffix = table.suffix.lower()
    if suffix == ".parquet":
        for where, row in _parquet_rows(table):
            yield where, row, {}
        return
    try:
        handle = (open(table, encoding="utf-8-sig", newline="") if isinstance(table, Path)
                  else io.TextIOWrapper(table.open("rb"), encoding="utf-8-sig", newline=""))  # a UrlPath
    except OSError as exc:
        raise DatasetError(f"{table}: cannot read the table ({exc.strerror or exc})") from None
    with handle:
        lines = _CountedLines(handle)
        header: list[str] | None = None
        try:  # csv.reader's line_num names the line before the one a csv.Error is in: count the lines read instead
            for cells in csv.reader(lines, delimiter="\t" if suffix == ".tsv" else ","):
                if not cells:  # a blank line (csv.DictReader skips them too)
                    continue
                starts = [lines.read - sum(map(_line_breaks, cells))]
                for cell in cells[:-1]:
                    starts.append(starts[-1] + _line_breaks(cell))
                if header is None:
                    header = cells
                    continue
                if len(cells) > len(header):
                    raise DatasetError(f"{table}:{starts[len(header)]}: more cells than the header has columns")
                row: dict[str, Any] = {column: None for column in header}  # a short row's missing cells are None
                row.update(zip(header, cells))
                yield f"{table}:{starts[0]}", row, dict(zip(header, starts))
        except csv.Error as exc:
            raise DatasetError(f"{table}:{lines.read}: not a valid {suffix[1:].upper()} row ({exc})") from None
        except UnicodeDecodeError as exc:
            raise DatasetError(f"{table}: not UTF-8 text (byte {exc.start} of a block)") from None


class _CountedLines:
    """A text file's lines, counted as csv.reader takes them (a csv.Error lies in the last line read)."""

    def __init__(self, handle: Any) -> None:
        self.handle, self.read = handle, 0

    def __iter__(self) -> _CountedLines:
        return self

    def __next__(self) -> str:
        line = next(self.handle)
        self.read += 1
        return line


def _line_breaks(cell: str) -> int:
    """Line breaks inside a (quoted) cell, as the file is split into lines: \\r\\n, \\r or \\n."""
    return cell.count("\n") + cell.count("\r") - cell.count("\r\n")


def _parquet_rows(table: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(table if isinstance(table, Path) else table.open("rb"))
        row = 0
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for record in batch.to_pylist():
                yield f"{table}: row {row}", record
                row += 1
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{table}: not a readable Parquet table ({exc})") from None


class _Roles:
    """Which column plays which role, from --column and the table's own header."""

    def __init__(self, given: tuple[tuple[str, str], ...], header: Sequence[str], table: Path) -> None:
        named = dict(given)
        missing = sorted(column for column in named.values() if column not in header)
        if missing:
            raise DatasetError(f"{table}: no column {', '.join(map(repr, missing))} (named by --column; the table has "
                               f"{', '.join(map(repr, header))})")
        self.column = {role: named.get(role, role) for role in COLUMN_ROLES}
        self.guessed_ranges = "ranges" not in named and "ranges" not in header and PANDA_RANGES in header
        if self.guessed_ranges:
            self.column["ranges"] = PANDA_RANGES
        self.column = {role: column for role, column in self.column.items() if column in header}
        if "path" not in self.column:
            raise DatasetError(f"{table}: no \"path\" column (the table has {', '.join(map(repr, header))}); name "
                               "the video column with --column path=NAME")
        self.taken = set(self.column.values())

    def drop(self, role: str) -> None:
        self.taken.discard(self.column.pop(role))

    def get(self, row: dict[str, Any], role: str) -> Any:
        column = self.column.get(role)
        value = row.get(column) if column is not None else None
        return None if value == "" else value


def _fmt(seconds: float) -> str:
    return f"{seconds:.3f}"


def _path_id(raw: str) -> str:
    """A scene id from a path as the table gives it, normalized (`./a.mp4` is `a.mp4`; a `..` step is `^`): '/' (and
    '\\') become '~', so folders stay apart."""
    parts = posixpath.normpath(raw.replace("\\", "/")).split("/")
    return "~".join("^" if part == ".." else part for part in parts)


def scenes_from_table(table: Path, options: SourceOptions) -> LayoutScenes:
    """One scene per row, or per range of a row (see the module docstring)."""
    order = options.cameras
    if order and len(order) != 1:
        raise DatasetError(f"{table}: a table's rows are single videos, but {len(order)} cameras were configured "
                           "(--cameras)")
    camera = (order[0] if order else SINGLE_CAMERA,)
    base = folder_of(table)
    parents: dict[str, str] = {}
    roles: _Roles | None = None
    scenes: list[Scene] = []
    for where, row, lines in read_rows(table):
        if roles is None:
            roles = _Roles(options.columns, list(row), table)
            if roles.guessed_ranges and not _is_ranges(_listed(roles.get(row, "ranges"))):
                roles.drop("ranges")  # a `timestamp` column that is not Panda-70M's clip ranges stays metadata
        at = _Cells(table, where, lines, roles.column)
        raw_path = roles.get(row, "path")
        if not isinstance(raw_path, str) or not raw_path.strip():
            raise DatasetError(f"{at('path')}: the path column {roles.column['path']!r} is empty")
        path = resolved_in(base, raw_path.strip(), parents)
        given_id = roles.get(row, "id")
        stem = str(given_id) if given_id is not None else _path_id(raw_path.strip())
        metadata = {column: _listed(value) for column, value in row.items()
                    if column not in roles.taken and value is not None and value != ""}
        for scene_id, frame_range, time_range, extra in _ranges(row, roles, stem, given_id is not None, metadata, at):
            try:
                # default=str: a Parquet date, decimal or bytes cell is kept as its text
                scenes.append(Scene(scene_id, camera, (path,), frame_range, None,
                                    json.dumps(extra, sort_keys=True, ensure_ascii=False, separators=(",", ":"),
                                               default=str) if extra else None,
                                    None, options.frame_rate, time_range))
            except DatasetError as exc:
                raise DatasetError(f"{where}: {exc}") from None
    if not scenes:
        raise DatasetError(f"{table}: the table holds no rows")
    return LayoutScenes(scenes, [], [])


class _Cells:
    """Where the cells of a row's roles are, for its errors: `at("start", "end")` names the table and the line the
    first of those cells starts on (a CSV row may span lines); the row itself where no such cell is there."""

    def __init__(self, table: Path, where: str, lines: dict[str, int], columns: dict[str, str]) -> None:
        self.table, self.where, self.lines, self.columns = table, where, lines, columns

    def __call__(self, *roles: str) -> str:
        found = [self.lines[self.columns[role]] for role in roles if self.columns.get(role) in self.lines]
        return f"{self.table}:{min(found)}" if found else self.where


def _ranges(row: dict[str, Any], roles: _Roles, stem: str, named: bool, metadata: dict[str, Any],
            at: _Cells) -> Iterator[tuple[str, tuple[int, int] | None, tuple[int, int] | None, dict[str, Any]]]:
    """(scene id, frame range, time range in ns, metadata) of each scene a row gives."""
    listed = _listed(roles.get(row, "ranges"))
    if listed is not None:
        if _is_pair(listed):
            listed = [listed]
        if not isinstance(listed, (list, tuple)) or not listed or not all(_is_pair(pair) for pair in listed):
            raise DatasetError(f"{at('ranges')}: column {roles.column['ranges']!r} must hold [start, end] or a list of "
                               f"them, got {row.get(roles.column['ranges'])!r:.80}")
        aligned = {column for column, value in metadata.items()
                   if isinstance(value, (list, tuple)) and len(value) == len(listed)}
        for index, (start, end) in enumerate(listed):
            seconds = (parse_seconds(start, at("ranges")), parse_seconds(end, at("ranges")))
            extra = {column: (value[index] if column in aligned else value) for column, value in metadata.items()}
            yield _timed(stem, seconds, at("ranges"), extra)
        return
    start, end = roles.get(row, "start"), roles.get(row, "end")
    if start is not None or end is not None:
        if start is None or end is None:
            raise DatasetError(f"{at('start', 'end')}: a clip range needs both "
                               f"{roles.column.get('start', 'start')!r} and {roles.column.get('end', 'end')!r}")
        seconds = (parse_seconds(start, at("start")), parse_seconds(end, at("end")))
        scene_id, frames, times, extra = _timed(stem, seconds, at("start", "end"), metadata)
        yield (stem if named else scene_id), frames, times, extra
        return
    first, stop = roles.get(row, "start_frame"), roles.get(row, "end_frame")
    if first is not None or stop is not None:
        try:
            frame_range = (int(str(first)), int(str(stop)))
        except ValueError:
            raise DatasetError(f"{at('start_frame', 'end_frame')}: start_frame and end_frame must be whole numbers, "
                               f"got {first!r} and {stop!r}") from None
        if not 0 <= frame_range[0] < frame_range[1]:
            raise DatasetError(f"{at('start_frame', 'end_frame')}: a frame range needs 0 <= start_frame < end_frame, "
                               f"got {list(frame_range)}")
        yield (stem if named else f"{stem}@f{frame_range[0]}-{frame_range[1]}"), frame_range, None, metadata
        return
    yield stem, None, None, metadata


def _timed(stem: str, seconds: tuple[float, float], where: str,
           metadata: dict[str, Any]) -> tuple[str, None, tuple[int, int], dict[str, Any]]:
    start, end = seconds
    if end <= start:
        raise DatasetError(f"{where}: a clip range needs start < end, got [{_fmt(start)}, {_fmt(end)}) s")
    return f"{stem}@{_fmt(start)}-{_fmt(end)}", None, (round(start * 1e9), round(end * 1e9)), metadata


class MetadataTable:
    """A .csv, .tsv or .parquet table of videos."""

    name = "table"
    reference_camera = None

    def matches(self, data: Path) -> bool:
        return data.is_file() and data.suffix.lower() in SUFFIXES

    def scenes(self, data: Path, options: SourceOptions) -> LayoutScenes:
        return scenes_from_table(data, options)


TABLE = MetadataTable()
