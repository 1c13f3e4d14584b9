"""The report's failures section: every input the encode skipped, grouped by the kind of its reason, with counts;
the page lists the first of each group and `failures.csv` beside it lists every one (the failure table streamed
through, never held; a cell a spreadsheet would take for a formula starts with an apostrophe)."""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vaecache.cache.failures import reason_kind
from vaecache.cache.reader import CacheReader
from vaecache.cache.table import FAILURE_TABLE, iter_table

SHOWN_PER_GROUP = 25
"""Failures of one reason kind the page lists (failures.csv has every one)."""
MAX_GROUPS = 200
"""Reason kinds the page tells apart; the rest are counted together."""
CSV_COLUMNS = ("scene", "clip", "camera", "path", "reason")
OTHER_KINDS = "other reasons"


@dataclass
class FailureGroup:
    kind: str
    count: int = 0
    units: dict[str, int] = field(default_factory=dict)
    """Failures per unit: "scene" (a whole scene skipped) or "clip"."""
    shown: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class FailuresSection:
    count: int = 0
    groups: list[FailureGroup] = field(default_factory=list)
    csv_name: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "csv": self.csv_name,
                "groups": [{"kind": g.kind, "count": g.count, "units": g.units, "shown": g.shown}
                           for g in self.groups]}


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
"""What makes a spreadsheet read a CSV cell as a formula (OWASP's CSV injection list)."""


def spreadsheet_safe(value: Any) -> str:
    """A CSV cell of user data (paths, reasons naming them) that a spreadsheet shows as text: one starting like a
    formula gets a leading apostrophe."""
    text = "" if value is None else str(value)
    return f"'{text}" if text.startswith(FORMULA_STARTS) else text


def failures_section(reader: CacheReader, csv_path: Path) -> FailuresSection:
    """Group the cache's failure records by reason kind (vaecache.cache.failures.reason_kind), most first; write
    every record to `csv_path` as it streams by (no file when there is none)."""
    if reader.version == 1:
        records: Any = iter(reader.failure_records())
    else:
        records = iter_table(reader.table_source(reader.failures_name, reader.failures_path), FAILURE_TABLE,
                             where=reader.failures_path)
    groups: dict[str, FailureGroup] = {}
    section = FailuresSection()
    handle = writer = None
    try:
        for record in records:
            if writer is None:
                handle = open(csv_path, "w", newline="", encoding="utf-8")
                writer = csv.writer(handle)
                writer.writerow(CSV_COLUMNS)
            row = {key: record.get(key) for key in CSV_COLUMNS}
            writer.writerow([spreadsheet_safe(row[key]) for key in CSV_COLUMNS])
            section.count += 1
            kind = reason_kind(str(record.get("reason") or "?"))
            if kind not in groups and len(groups) >= MAX_GROUPS:
                kind = OTHER_KINDS
            group = groups.setdefault(kind, FailureGroup(kind))
            group.count += 1
            unit = "clip" if record.get("clip") else "scene"
            group.units[unit] = group.units.get(unit, 0) + 1
            if len(group.shown) < SHOWN_PER_GROUP:
                group.shown.append(row)
    finally:
        if handle is not None:
            handle.close()
    section.groups = sorted(groups.values(), key=lambda g: (-g.count, g.kind))
    section.csv_name = csv_path.name if section.count else None
    return section


__all__ = ["FailureGroup", "FailuresSection", "failures_section"]
