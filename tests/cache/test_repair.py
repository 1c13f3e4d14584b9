"""Progress logs, failure records and finalize: one parser for resume-repair and finalize, failures deduped
by what failed, an empty result refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vaecache.cache.failures import describe_failures, read_failures
from vaecache.cache.finalize import finalize
from vaecache.cache.io import AppendLog
from vaecache.cache.layout import failures_path, progress_path
from vaecache.cache.progress import progress_entries, progress_line, progress_logs, scan_committed
from vaecache.cache.repair import repair_progress
from vaecache.cache.writer import failure_record
from vaecache.errors import EmptyCacheError, ManifestError

HEADER = {"settings": {}, "latent": {"store": ["mean"], "dtype": "float32", "layout": "x"}, "planned_clips": 4,
          "oom_backoffs": 0}


class _Tally:
    """What repair_progress tells a resume: ids as read, then those of damaged shards taken back."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.dropped: list[str] = []

    def add(self, clip_ids: list[str]) -> None:
        self.ids.extend(clip_ids)

    def discard(self, clip_ids: list[str]) -> None:
        self.dropped.extend(clip_ids)
        taken_back = set(clip_ids)
        self.ids = [clip_id for clip_id in self.ids if clip_id not in taken_back]


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
    entries = [entry for log in progress_logs(tmp_path) for _, entry in progress_entries(log)]
    assert [e.shard["file"] for e in entries] == ["shards/good.safetensors", "shards/short.safetensors"]
    seen = _Tally()
    kept, discarded, damaged = repair_progress(tmp_path, seen)
    assert kept == 1 and seen.ids == ["g"] and seen.dropped == ["s"] and discarded == 1
    assert damaged == {"shards/short.safetensors": "2 bytes, 5 recorded"}
    assert [json.loads(line) for line in progress_path(tmp_path, 0).read_text().splitlines()] == [good]


def test_a_resume_reads_shard_and_ids_first_and_older_lines_whole(tmp_path: Path) -> None:
    """Lines lead with the shard record and clip ids (progress_line); lines of caches written before (keys
    sorted, clip records first) still resume."""
    shard = {"file": "shards/a.safetensors", "bytes": 3, "sha256": "x" * 64, "clips": 2, "tensors": 2}
    clips = [{"id": "s/000000-000004", "tensors": {}, "scene": "s"}, {"id": "s/000005-000009", "scene": "s"}]
    line = progress_line(shard, clips)
    assert line.startswith('{"shard":') and json.loads(line) == {"shard": shard, "ids": [c["id"] for c in clips],
                                                               "clips": clips}
    log = progress_path(tmp_path, 0)
    log.parent.mkdir(parents=True)
    older = json.dumps({"shard": {**shard, "file": "shards/b.safetensors"}, "clips": [{"id": "t/000000-000004"}]},
                       sort_keys=True)
    log.write_text(line + "\n" + older + "\n")
    found = list(scan_committed(log))
    assert [(c.shard["file"], c.clips, ids) for c, ids in found] == [
        ("shards/a.safetensors", 2, ["s/000000-000004", "s/000005-000009"]),
        ("shards/b.safetensors", 1, ["t/000000-000004"])]
    assert found[1][0].offset == len(line) + 1 and found[1][0].length == len(older) + 1
    log.write_text(line + "\n" + '{"shard":{"file":"x"},"ids":["a"],"clips":[{"id": "a"}  \n')  # the rest is not read
    assert [ids for _, ids in scan_committed(log)] == [[c["id"] for c in clips], ["a"]]
    log.write_text('{"clips": 3}\n')
    with pytest.raises(ManifestError, match="rank-00000.jsonl: progress entry without a shard record"):
        list(scan_committed(log))


def test_repair_leaves_intact_logs_as_they_are_and_cuts_a_torn_tail(tmp_path: Path) -> None:
    """A resume rewrites a log only when one of its shards is damaged (kept lines byte for byte)."""
    shards = tmp_path / "shards"
    shards.mkdir()
    lines = []
    for rank, name in enumerate(("a", "b", "c")):
        (shards / f"{name}.safetensors").write_bytes(b"123")
        shard = {"file": f"shards/{name}.safetensors", "bytes": 3}
        lines.append(progress_line(shard, [{"id": f"{name}/000000-000004"}]))
    first, second = progress_path(tmp_path, 0), progress_path(tmp_path, 1)
    first.parent.mkdir()
    first.write_text(lines[0] + "\n" + lines[1] + "\n")
    second.write_text(lines[2] + "\n" + '{"shard":{"file":"shards/to')
    (shards / "b.safetensors").write_bytes(b"12")  # damaged: a's log is rewritten without it
    inode = second.stat().st_ino
    seen = _Tally()
    kept, discarded, damaged = repair_progress(tmp_path, seen)
    assert (kept, discarded, list(damaged)) == (2, 1, ["shards/b.safetensors"])
    assert seen.ids == ["a/000000-000004", "c/000000-000004"] and seen.dropped == ["b/000000-000004"]
    assert first.read_text() == lines[0] + "\n"
    assert second.read_text() == lines[2] + "\n" and second.stat().st_ino == inode  # cut, not rewritten


def _clip(scene: str, first: int, shard: str) -> dict[str, Any]:
    return {"id": f"{scene}/{first:06d}-{first + 4:06d}", "scene": scene, "shard": shard, "cameras": ["a", "b"],
            "frames": list(range(first, first + 5)), "fps": 10.0,
            "tensors": {key: {"name": f"{scene}/{first:06d}-{first + 4:06d}/{key}", "shape": [2, 4, 2, 2, 2],
                              "dtype": "float32", "stats": {"min": -1.0, "max": 1.0, "mean": 0.0, "std": 0.5}}
                        for key in ("mean", "logvar")},
            "metadata": {"caption": f"clip {first}"}}


def _commit(out: Path, rank: int, rows: Any, name: str, clips: list[dict[str, Any]], line: bool = True) -> None:
    """What the shard writer does: rows of the records as the progress line gives them back, then the line."""
    text = progress_line({"file": f"shards/{name}", "bytes": 1, "sha256": "0" * 64, "clips": len(clips),
                          "tensors": len(clips)}, clips)
    rows.append(json.loads(text)["clips"])
    if line:
        log = AppendLog(progress_path(out, rank))
        log.append_line(text)
        log.close()


def test_finalize_merges_row_logs_to_the_table_the_progress_lines_give(tmp_path: Path) -> None:
    """The clip table from the writers' row logs equals, byte for byte, the one parsed from the progress lines
    (a cache written before row logs); rows of a shard without a progress line, a torn last batch and a
    shard committed twice are not counted."""
    from vaecache.cache.layout import rows_name
    from vaecache.cache.table import CLIP_TABLE, RowLog, iter_table

    (tmp_path / "progress").mkdir()
    for rank in (0, 1):
        rows = RowLog(tmp_path / "progress" / rows_name(rank, 0))
        for seq in range(3):
            scene = f"s{rank}"
            _commit(tmp_path, rank, rows, f"a000-r{rank:05d}-{seq:06d}.safetensors",
                    [_clip(scene, 5 * (2 * seq + i), f"a000-r{rank:05d}-{seq:06d}.safetensors") for i in range(2)])
        _commit(tmp_path, rank, rows, f"a000-r{rank:05d}-000009.safetensors",
                [_clip("lost", 0, f"a000-r{rank:05d}-000009.safetensors")], line=False)  # crashed before its line
        rows.close()
    torn = tmp_path / "progress" / rows_name(1, 0)
    torn.write_bytes(torn.read_bytes()[:-40])  # no end-of-stream, last batch cut
    older = {"shard": {"file": "shards/older.safetensors", "bytes": 1, "sha256": "0" * 64, "clips": 1, "tensors": 1},
             "clips": [_clip("s0", 100, "older.safetensors")]}  # a 0.3.0 line (keys sorted), no row log
    _log(progress_path(tmp_path, 0), older)
    from_rows = finalize(tmp_path, HEADER)
    table_from_rows = (tmp_path / "clips.parquet").read_bytes()
    assert from_rows["counts"]["clips"] == 13 and from_rows["counts"]["views"] == 26
    assert from_rows["counts"]["frames"] == 130 and from_rows["latent"]["shape"] == {"logvar": [2, 4, 2, 2, 2],
                                                                          "mean": [2, 4, 2, 2, 2]}
    records = list(iter_table(tmp_path / "clips.parquet", CLIP_TABLE))
    assert ([r["id"] for r in records] == sorted(r["id"] for r in records)
            and "lost" not in {r["scene"] for r in records})
    assert records[0]["metadata"] == {"caption": "clip 0"}
    for path in (tmp_path / "progress").glob("rows-*"):
        path.unlink()
    from_lines = finalize(tmp_path, HEADER)
    assert (tmp_path / "clips.parquet").read_bytes() == table_from_rows
    assert {k: v for k, v in from_lines.items() if k != "created_at"} == {k: v for k, v in from_rows.items()
                                                                         if k != "created_at"}
