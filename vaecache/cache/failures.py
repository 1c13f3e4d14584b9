"""Failure records: inputs that produced no clip, as the ranks log them and as the failure table holds them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vaecache.cache.io import iter_jsonl
from vaecache.cache.layout import PROGRESS_DIR


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
