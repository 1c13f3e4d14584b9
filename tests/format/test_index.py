"""Progress logs, failure records and finalize: one parser for resume-repair and finalize, failures deduped
by what failed, an empty result refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vaecache.errors import EmptyCacheError
from vaecache.format.index import describe_failures, finalize, iter_progress, read_failures, repair_progress
from vaecache.format.io import AppendLog
from vaecache.format.layout import failures_path, progress_path
from vaecache.format.writer import failure_record

HEADER = {"settings": {}, "latent": {"store": ["mean"], "dtype": "float32", "layout": "x"}, "planned_clips": 4,
          "oom_backoffs": 0}


def _log(path: Path, *records: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    log = AppendLog(path)
    for record in records:
        log.append(record)
    log.close()


def test_failure_record_is_the_documented_record() -> None:
    assert failure_record("s", "camera 'cam_1' is missing", camera="cam_1") == {
        "scene": "s", "clip": None, "camera": "cam_1", "path": None, "reason": "camera 'cam_1' is missing"}


def test_failures_are_deduped_by_what_failed_across_ranks(tmp_path: Path) -> None:
    short = failure_record("a", "too short: 5 usable frames", path=None)
    bad = failure_record("b", "not a readable video (x)", clip="b/0-8", camera="cam_0", path="/d/b/cam_0.mp4")
    other_camera = failure_record("b", "not a readable video (y)", clip="b/0-8", camera="cam_1", path="/d/b/cam_1.mp4")
    _log(failures_path(tmp_path, 0), short, bad)
    _log(failures_path(tmp_path, 1), short, bad, other_camera)
    assert read_failures(tmp_path) == [short, bad, other_camera]
    assert all("key" not in f for f in read_failures(tmp_path))


def test_describe_failures_counts_by_unit_and_kind() -> None:
    failures = [failure_record(s, "too short: 5 usable frames, one clip needs 9") for s in "abc"]
    failures.append(failure_record("d", "not a readable video (moov atom not found)", clip="d/0-8"))
    assert describe_failures(failures) == "3 scenes too short, 1 clip not a readable video"


def test_finalize_refuses_an_empty_result_and_writes_no_manifest(tmp_path: Path) -> None:
    _log(failures_path(tmp_path, 0), *[failure_record(s, "too short: 5 usable frames") for s in "ab"])
    with pytest.raises(EmptyCacheError, match="no clips encoded: 2 scenes too short"):
        finalize(tmp_path, HEADER)
    assert not (tmp_path / "manifest.json").exists()


def test_finalize_records_the_planned_clip_count(tmp_path: Path) -> None:
    clip = {"id": "s/0", "cameras": ["c"], "frames": [0], "tensors": {"mean": {"shape": [1, 2]}}}
    _log(progress_path(tmp_path, 0), {"shard": {"file": "shards/x", "bytes": 1}, "clips": [clip]})
    manifest = finalize(tmp_path, HEADER)
    assert manifest["counts"]["planned_clips"] == 4 and manifest["counts"]["clips"] == 1
    assert "planned_clips" not in manifest and manifest["latent"]["shape"] == {"mean": [1, 2]}


def test_repair_and_finalize_read_the_same_entries(tmp_path: Path) -> None:
    """Resume-repair keeps exactly the entries whose shard is intact; a torn last line is dropped by both."""
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "good.safetensors").write_bytes(b"12345")
    (tmp_path / "shards" / "short.safetensors").write_bytes(b"12")
    good = {"shard": {"file": "shards/good.safetensors", "bytes": 5}, "clips": [{"id": "g"}]}
    short = {"shard": {"file": "shards/short.safetensors", "bytes": 5}, "clips": [{"id": "s"}]}
    _log(progress_path(tmp_path, 0), good, short)
    with open(progress_path(tmp_path, 0), "a") as handle:
        handle.write('{"shard": {"file": "shards/torn')
    assert [e.shard["file"] for e in iter_progress(tmp_path)] == ["shards/good.safetensors", "shards/short.safetensors"]
    done, discarded, damaged = repair_progress(tmp_path)
    assert done == {"g"} and discarded == 1 and damaged == {"shards/short.safetensors": "2 bytes, 5 recorded"}
    assert [json.loads(line) for line in progress_path(tmp_path, 0).read_text().splitlines()] == [good]
