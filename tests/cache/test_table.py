"""The clip table (clips.parquet, format version 2): records round-trip exactly, finalize merges the per-rank
progress logs in id order whatever order they were committed in, pyarrow reads it, a version-1 cache still
verifies and reads."""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vaecache.cache import finalize as finalize_module
from vaecache.cache.finalize import finalize
from vaecache.cache.io import AppendLog
from vaecache.cache.layout import progress_path
from vaecache.cache.reader import CacheReader
from vaecache.cache.table import CLIP_TABLE, iter_table, write_table
from vaecache.errors import ClipTableError
from vaecache.verify.integrity import verify_cache

HEADER = {"settings": {}, "latent": {"store": ["mean"], "dtype": "float32", "layout": "x"}, "planned_clips": 0,
          "oom_backoffs": 0}


def _record(clip_id: str, shard: str = "a000-r00000-000000.safetensors", **extra: Any) -> dict[str, Any]:
    """A clip record as the shard writer completes it (two cameras, mean and logvar, stats, provenance)."""
    scene = clip_id.split("/")[0]
    tensors = {key: {"name": f"{clip_id}/{key}", "shape": [2, 16, 3, 8, 8], "dtype": "float32",
                     "stats": {"min": -1.5, "max": 2.25, "mean": 0.125, "std": 0.75}} for key in ("mean", "logvar")}
    return {"id": clip_id, "scene": scene, "cameras": ["cam_0", "cam_1"],
            "sources": [f"/data/{scene}/cam_0.mp4", f"/data/{scene}/cam_1.mp4"],
            "source_identity": [{"size": 1000, "mtime_ns": 1_700_000_000_123_456_789},
                                {"size": 2000, "mtime_ns": 1_700_000_000_000_000_000, "sha256": "ab" * 32}],
            "frames": list(range(9)), "fps": 10.0, "times": [round(i / 10, 6) for i in range(9)],
            "tensors": tensors, "encode": {"tiled": False, "tiled_cameras": [], "units_per_forward": 1},
            "shard": shard, **extra}


def test_a_record_read_back_equals_the_record_written(tmp_path: Path) -> None:
    plain = _record("s/000000-000008")
    with_metadata = _record("t/000000-000008", caption="a car turns left", tags=["night", {"k": [1, None]}])
    nan_stats = _record("u/000000-000008")
    nan_stats["tensors"]["mean"]["stats"] = {"min": -math.inf, "max": math.nan, "mean": math.nan, "std": math.nan}
    odd = {"id": "v/0", "fps": 25, "frames": [True], "tensors": {"mean": {"shape": [1, 2], "note": "x"}},
           "source_identity": [{"size": -1}], "cameras": None}  # values that fit no column: kept in `extra`
    records = [plain, with_metadata, nan_stats, odd]
    written = write_table(tmp_path / "clips.parquet", CLIP_TABLE, records)
    assert (written.count == 4
            and written.sha256 == hashlib.sha256((tmp_path / "clips.parquet").read_bytes()).hexdigest())
    back = list(iter_table(tmp_path / "clips.parquet", CLIP_TABLE))
    assert back[0] == plain and back[1] == with_metadata and back[3] == odd
    assert json.dumps(back[2], sort_keys=True) == json.dumps(nan_stats, sort_keys=True)  # NaN != NaN, text is equal
    assert list(tmp_path.iterdir()) == [tmp_path / "clips.parquet"]  # no temp file left


def test_a_table_written_before_per_channel_stats_reads_as_records_without_them(tmp_path: Path) -> None:
    with_channels = _record("s/000000-000008")
    with_channels["tensors"]["mean"]["channel_stats"] = {"mean": [0.5, -0.25], "std": [1.0, 0.75]}
    write_table(tmp_path / "clips.parquet", CLIP_TABLE, [with_channels, _record("t/000000-000008")])
    assert [r["tensors"]["mean"].get("channel_stats") for r in iter_table(tmp_path / "clips.parquet", CLIP_TABLE)] \
        == [{"mean": [0.5, -0.25], "std": [1.0, 0.75]}, None]
    old = pq.read_table(tmp_path / "clips.parquet").drop_columns(["tensor_channel_stats"])  # as 0.6.0 wrote it
    pq.write_table(old, tmp_path / "old.parquet")
    back = list(iter_table(tmp_path / "old.parquet", CLIP_TABLE))
    assert back == [_record("s/000000-000008"), _record("t/000000-000008")]
    with pytest.raises(ClipTableError, match="no column tensor_stats"):  # a column that was always there is required
        pq.write_table(old.drop_columns(["tensor_stats"]), tmp_path / "broken.parquet")
        list(iter_table(tmp_path / "broken.parquet", CLIP_TABLE))


def test_the_columns_a_trainer_reads_load_alone(tmp_path: Path) -> None:
    write_table(tmp_path / "clips.parquet", CLIP_TABLE, [_record("s/000000-000008", caption="hi")])
    table = pq.read_table(tmp_path / "clips.parquet", columns=["id", "shard", "tensor_names", "tensor_shapes"])
    assert table.to_pylist() == [{"id": "s/000000-000008", "shard": "a000-r00000-000000.safetensors",
                                  "tensor_names": ["s/000000-000008/mean", "s/000000-000008/logvar"],
                                  "tensor_shapes": [[2, 16, 3, 8, 8], [2, 16, 3, 8, 8]]}]
    row = pq.read_table(tmp_path / "clips.parquet").to_pylist()[0]
    assert row["source_sizes"] == [1000, 2000] and row["source_sha256"] == [None, "ab" * 32]
    assert json.loads(row["extra"]) == {"caption": "hi", "encode": {"tiled": False, "tiled_cameras": [],
                                                                     "units_per_forward": 1}}


def test_a_file_that_is_not_a_clip_table_is_named(tmp_path: Path) -> None:
    (tmp_path / "clips.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ClipTableError, match=r"clips.parquet: not a readable Parquet file"):
        list(iter_table(tmp_path / "clips.parquet", CLIP_TABLE))


def _log(path: Path, *entries: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    log = AppendLog(path)
    for entry in entries:
        log.append(entry)
    log.close()


def _entry(shard: str, clip_ids: list[str]) -> dict[str, Any]:
    return {"shard": {"file": f"shards/{shard}", "bytes": 10, "sha256": "0" * 64, "clips": len(clip_ids)},
            "clips": [_record(clip_id, shard) for clip_id in clip_ids]}


@pytest.mark.parametrize("fallback", [False, True], ids=["runs", "small-chunks-merge-rounds"])
def test_finalize_merges_every_ranks_runs_in_id_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      fallback: bool) -> None:
    """Two ranks, each a block in plan order; a resumed attempt appends later blocks to the same logs, and a
    scene id with '-' (below '/') breaks plan order. The table is sorted by id and holds every record once."""
    ids = [f"s{i:03d}/{w:06d}-{w + 8:06d}" for i in range(12) for w in (0, 9)]
    _log(progress_path(tmp_path, 0), _entry("a000-r00000-000000.safetensors", ids[0:3]),
         _entry("a000-r00000-000001.safetensors", ids[3:5]),
         _entry("a001-r00000-000000.safetensors", ids[14:18] + ["s013/000000-000008"]))
    _log(progress_path(tmp_path, 1), _entry("a000-r00001-000000.safetensors", ids[8:12]),
         _entry("a001-r00001-000000.safetensors", ids[5:8] + ["s005-b/000000-000008"]),
         _entry("a001-r00001-000001.safetensors", ids[12:14] + ids[18:]))
    if fallback:  # records sorted in chunks of 3 into many runs, merged in rounds of 2 files
        monkeypatch.setattr(finalize_module, "RUN_CHUNK_ROWS", 3)
        monkeypatch.setattr(finalize_module, "MAX_OPEN_RUNS", 2)
        monkeypatch.setattr(finalize_module, "PARALLEL_SCAN_BYTES", 0)
    monkeypatch.setattr("vaecache.cache.table.ROW_GROUP_ROWS", 5)  # the writer's row groups
    monkeypatch.setattr("vaecache.cache.finalize.ROW_GROUP_ROWS", 5)  # the merge's batches
    manifest = finalize(tmp_path, HEADER, workers=2 if fallback else 1)  # two processes scan the two logs
    expected = sorted([*ids, "s013/000000-000008", "s005-b/000000-000008"])
    records = list(CacheReader(tmp_path).clip_records())
    assert [r["id"] for r in records] == expected
    assert records[0] == _record(expected[0])
    assert manifest["counts"]["clips"] == len(expected) == manifest["clips"]["count"]
    assert manifest["counts"]["views"] == 2 * len(expected) and manifest["counts"]["shards"] == 6
    assert manifest["latent"]["shape"] == {"mean": [2, 16, 3, 8, 8], "logvar": [2, 16, 3, 8, 8]}
    assert pq.ParquetFile(tmp_path / "clips.parquet").metadata.num_row_groups == math.ceil(len(expected) / 5)
    assert not [p.name for p in (tmp_path / "progress").iterdir() if p.name.endswith(".tmp")]


def jsonl_bytes(records: Iterable[dict[str, Any]]) -> bytes:
    """JSON Lines as format version 1 wrote them (sorted keys, compact)."""
    return b"".join(json.dumps(r, sort_keys=True, separators=(",", ":"), allow_nan=False).encode() + b"\n"
                    for r in records)


def downgrade_to_v1(cache: Path) -> None:
    """Rewrite a version-2 cache as version 1 wrote it: clips.jsonl and failures.jsonl, format_version 1."""
    reader = CacheReader(cache)
    records = [{k: v for k, v in r.items() if k != "source_identity"} for r in reader.clip_records()]
    clip_bytes, failure_bytes = jsonl_bytes(records), jsonl_bytes(reader.failure_records())
    (cache / "clips.jsonl").write_bytes(clip_bytes)
    (cache / "failures.jsonl").write_bytes(failure_bytes)
    (cache / "clips.parquet").unlink()
    (cache / "failures.parquet").unlink()
    manifest = {**reader.manifest, "format_version": 1,
                "clips": {"file": "clips.jsonl", "count": len(records),
                          "sha256": hashlib.sha256(clip_bytes).hexdigest()},
                "failures": {"file": "failures.jsonl", "count": 0, "sha256": hashlib.sha256(failure_bytes).hexdigest()}}
    (cache / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def test_a_version_1_cache_still_verifies_and_reads(good_cache: Path, tmp_path: Path, run_cli: Any) -> None:
    cache = Path(shutil.copytree(good_cache, tmp_path / "v1"))
    downgrade_to_v1(cache)
    result = run_cli(["verify", cache])
    assert result.exit_code == 0, result.output
    reader = CacheReader(cache)
    assert reader.version == 1 and reader.clips_path.name == "clips.jsonl"
    expected = [{k: v for k, v in r.items() if k != "source_identity"} for r in CacheReader(good_cache).clip_records()]
    assert list(reader.clip_records()) == expected and reader.failure_records() == []
    lines = (cache / "clips.jsonl").read_text().splitlines(keepends=True)
    (cache / "clips.jsonl").write_text("".join(lines[:2] + ["{not json\n"]))
    report = verify_cache(cache, quick=True)
    problems = [p for check in report.checks for p in check.problems]
    assert "clips.jsonl: sha256 differs from the manifest (records were edited or truncated)" in problems
    assert "clips.jsonl:3: does not parse" in problems


def test_the_table_holds_exactly_what_the_writer_committed(good_cache: Path) -> None:
    """Finalize passes the records of the progress logs through unchanged (provenance included)."""
    committed = [clip for line in (good_cache / "progress" / "rank-00000.jsonl").read_text().splitlines()
                 for clip in json.loads(line)["clips"]]
    assert list(CacheReader(good_cache).clip_records()) == sorted(committed, key=lambda c: c["id"])
    assert all(len(c["source_identity"]) == len(c["sources"]) == 2 for c in committed)


def test_a_malformed_row_is_a_named_failure_not_a_crash(cache_copy: Path, run_cli: Any) -> None:
    """A table that reads as Parquet but holds a row no writer of ours made (here an `extra` cell that is not
    JSON): verify reports the file and the row, exit 1, no traceback."""
    path = cache_copy / "clips.parquet"
    table = pq.read_table(path)
    extra = table.column("extra").to_pylist()
    extra[0] = "{not json"
    pq.write_table(table.set_column(table.schema.get_field_index("extra"), "extra",
                                    pa.array(extra, type=table.schema.field("extra").type)), path)
    with pytest.raises(ClipTableError, match=r"clips.parquet: row 0 is malformed \(JSONDecodeError"):
        list(iter_table(path, CLIP_TABLE))
    result = run_cli(["verify", cache_copy])
    assert result.exit_code == 1 and "row 0 is malformed" in result.output and "unexpected" not in result.output


def test_table_bytes_depend_on_the_rows_not_on_how_they_were_chunked(tmp_path: Path) -> None:
    """A resumed run's merge slices rows differently from an uninterrupted run's: same rows, same bytes."""
    from vaecache.cache.table import CLIP_TABLE, clip_row, schema_of, write_tables

    # long unique tensor names fill the column's 1 MB dictionary page: where the writer falls back to plain
    # encoding followed the chunk boundaries
    rows = [clip_row(_record(f"fleet/2024-05-01/drive_{i:07d}/000000-000008")) for i in range(16384)]
    whole = pa.Table.from_pylist(rows, schema=schema_of(CLIP_TABLE))
    cuts = [0, *sorted(random.Random(0).sample(range(1, 16384), 40)), 16384]
    sliced = pa.Table.from_batches([b for lo, hi in zip(cuts, cuts[1:]) for b in whole.slice(lo, hi - lo).to_batches()])
    assert sliced.column("id").num_chunks == 41
    first = write_tables(tmp_path / "a.parquet", CLIP_TABLE, [whole])
    second = write_tables(tmp_path / "b.parquet", CLIP_TABLE, [sliced])
    assert first.sha256 == second.sha256
