"""Format version 1 (vaecache 0.1 to 0.3): the clip and failure records as JSON Lines, `clips.jsonl` and
`failures.jsonl`, sorted like today's tables. Read (verify, the readers), never written; a version-1 cache is
not resumed or grown (its format version is part of the run fingerprint)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator

from vaecache.cache.io import iter_jsonl, loads

CLIPS_V1 = "clips.jsonl"
FAILURES_V1 = "failures.jsonl"


def v1_records(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a version-1 clips.jsonl or failures.jsonl (a torn last line is ignored)."""
    return iter_jsonl(path)


def iter_v1_clip_records(path: Path, on_bad_line: Callable[[int], None]) -> Iterator[dict[str, Any]]:
    """verify's reading of clips.jsonl: a line that does not parse is reported (`on_bad_line(lineno)`), the rest
    go on."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                yield loads(line)
            except json.JSONDecodeError:
                on_bad_line(lineno)
