"""The per-rank progress logs: one line per committed shard, appended and fsynced by the shard writer; and their
one parser. A line is `{"shard": record, "ids": [clip ids], "clips": [clip records]}`, the shard record and the ids
first, so that a resume reads them without parsing the records (progress_line_head); finalize reads whole lines
(progress_entries). Lines written before ids led (keys sorted, clips first) are parsed whole by both."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol

from vaecache.cache.io import STRICT_JSON, loads, whole_lines
from vaecache.cache.layout import PROGRESS_DIR
from vaecache.errors import ManifestError


@dataclass(frozen=True)
class ProgressEntry:
    """One committed shard, as its rank's progress log recorded it: the shard record and its clip records."""

    log: Path
    shard: dict[str, Any]
    clips: list[dict[str, Any]]

    def __post_init__(self) -> None:
        if not isinstance(self.shard, dict) or "file" not in self.shard or not isinstance(self.clips, list):
            raise ManifestError(f"{self.log}: progress entry without a shard record or clip list")


def progress_logs(out: Path) -> list[Path]:
    """Every rank's progress log in OUT, in rank order."""
    folder = Path(out) / PROGRESS_DIR
    return sorted(folder.glob("rank-*.jsonl")) if folder.is_dir() else []


def progress_line(shard: dict[str, Any], clips: list[dict[str, Any]]) -> str:
    """One progress log line: the shard record, then its clip ids, then the clip records. The first two come
    first so that a resume reads them without parsing the records (scan_committed). A non-finite
    number (which JSON cannot hold: the line could never be read back) is a ValueError, before anything is written;
    the writer stores pass-through metadata's as null (replace_non_finite), so none should reach here."""
    return ('{"shard":' + json.dumps(shard, sort_keys=True, separators=(",", ":"), allow_nan=False)
            + ',"ids":' + json.dumps([clip["id"] for clip in clips], separators=(",", ":"))
            + ',"clips":' + json.dumps(clips, sort_keys=True, separators=(",", ":"), allow_nan=False) + "}")


@dataclass(frozen=True)
class CommittedLine:
    """Where one committed shard's progress line lies in its log, and what a resume needs of it."""

    offset: int
    length: int
    shard: dict[str, Any]
    clips: int


_SHARD_HEAD, _IDS_HEAD = '{"shard":', ',"ids":'
_LINE_HEAD = _SHARD_HEAD.encode()


def parse_progress_line(log: Path, offset: int, line: bytes) -> ProgressEntry:
    """A whole progress line (a ManifestError naming the log and the byte offset when it does not parse)."""
    try:
        entry = loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{log}: line at byte {offset} does not parse ({exc})") from None
    if not isinstance(entry, dict):
        raise ManifestError(f"{log}: line at byte {offset} is not a progress entry")
    return ProgressEntry(log, entry.get("shard"), entry.get("clips"))


def progress_line_head(log: Path, offset: int, line: bytes) -> tuple[dict[str, Any], list[str]]:
    """The shard record and clip ids of a progress line, read from its head; an older line is parsed whole."""
    try:
        text = line.decode("utf-8")
        if text.startswith(_SHARD_HEAD):
            shard, end = STRICT_JSON.raw_decode(text, len(_SHARD_HEAD))
            if text.startswith(_IDS_HEAD, end):
                ids, _ = STRICT_JSON.raw_decode(text, end + len(_IDS_HEAD))
                if isinstance(shard, dict) and "file" in shard and isinstance(ids, list) \
                        and all(type(clip_id) is str for clip_id in ids):
                    return shard, ids
    except (json.JSONDecodeError, UnicodeDecodeError):
        pass  # parse_progress_line names the problem
    found = parse_progress_line(log, offset, line)
    return found.shard, [committed_clip_id(log, clip) for clip in found.clips]


def scan_committed(log: Path) -> Iterator[tuple[CommittedLine, list[str]]]:
    """Each complete line of a progress log as (where it is, its shard record and clip count) and its clip
    ids; a torn last line is ignored."""
    for offset, line in whole_lines(log):
        shard, ids = progress_line_head(log, offset, line)
        yield CommittedLine(offset, len(line), shard, len(ids)), ids


def committed_shards(out: Path) -> list[dict[str, Any]]:
    """The shard record of every committed shard in every rank's progress log (clip records not parsed)."""
    return [line.shard for log in progress_logs(out) for line, _ in scan_committed(log)]


class CommittedIds(Protocol):
    """What a resume tells about committed clips as it reads them (planning.DoneMaskBuilder)."""

    def add(self, clip_ids: list[str]) -> None: ...

    def discard(self, clip_ids: list[str]) -> None: ...


def committed_ids(out: Path, committed: CommittedIds | None) -> int:
    """Tell `committed` the clip ids of every committed shard; returns how many there were."""
    count = 0
    for log in progress_logs(out):
        for _, ids in scan_committed(log):
            if committed is not None:
                committed.add(ids)
            count += len(ids)
    return count


def progress_entries(log: Path, only: frozenset[str] | None = None) -> Iterator[tuple[int, ProgressEntry]]:
    """(byte offset, entry) of every complete line of a progress log (of the shard files in `only`, if given: a line
    of another shard that leads with its shard record is skipped by its head, an older line is parsed once); a torn
    last line is ignored."""
    for offset, line in whole_lines(log):
        if only is not None and line.startswith(_LINE_HEAD):
            if progress_line_head(log, offset, line)[0]["file"] not in only:
                continue
        entry = parse_progress_line(log, offset, line)
        if only is None or entry.shard["file"] in only:
            yield offset, entry


def committed_clip_id(log: Path, clip: Any) -> str:
    if not isinstance(clip, dict) or not isinstance(clip.get("id"), str):
        raise ManifestError(f"{log}: a committed clip record has no id")
    return clip["id"]


def progress_counts(out: Path) -> tuple[int, int]:
    """(committed clips, committed shards) in every rank's progress log, counted as they stream."""
    clips = shards = 0
    for log in progress_logs(out):
        for line, _ in scan_committed(log):
            shards += 1
            clips += line.clips
    return clips, shards
