"""NaN, Infinity and 1e999 in metadata passed through (a tar sample's .json, a Parquet float column, a list column
split along Panda-70M's ranges, an index written from them): stored as null, named in the clip record's
`non_finite`, the run finishes and the cache verifies and reads. JSON has no such numbers; before this rule the
progress log held NaN tokens no strict reader accepts, and every finalize of the cache failed."""

from __future__ import annotations

import io
import json
import math
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import ENCODE_ARGS, invoke, read_clips
from tests.videos import LAYOUTS, write_video
from vaecache.cache.io import replace_non_finite
from vaecache.cache.progress import progress_line
from vaecache.cache.table import clip_record, clip_row, loads_extra
from vaecache.training import LatentCache


def test_non_finite_values_become_null_and_are_named_by_path():
    value = {"a": 1.0, "b": [0.5, float("nan"), {"c": float("-inf")}], "d": json.loads("1e999"), "e": "NaN"}
    clean, replaced = replace_non_finite(value, "metadata")
    assert clean == {"a": 1.0, "b": [0.5, None, {"c": None}], "d": None, "e": "NaN"}
    assert replaced == ["metadata.b[1]", "metadata.b[2].c", "metadata.d"]
    deep = inner = {}
    for _ in range(5000):  # deeper than Python's recursion limit: the walk must not recurse
        inner["a"] = inner = {}
    inner["x"] = float("nan")
    assert replace_non_finite(deep)[1] == [".".join(["a"] * 5000 + ["x"])]
    finite = {"a": [1, 2.5, None, "x"]}
    assert replace_non_finite(finite) == (finite, []) and replace_non_finite(finite)[0] is finite


def test_a_progress_line_is_never_written_with_a_number_json_cannot_hold():
    with pytest.raises(ValueError):
        progress_line({"file": "shards/s.safetensors"}, [{"id": "c", "fps": float("nan")}])


def test_a_clip_row_written_by_0_5_0_with_nan_is_read_as_null_and_named():
    row = clip_row({"id": "c", "scene": "s", "metadata": {"caption": "x"}})
    row["extra"] = '{"metadata":{"caption":"x","score":NaN,"ranges":[Infinity,1.0]}}'
    record = clip_record(row)
    assert record["metadata"] == {"caption": "x", "score": None, "ranges": [None, 1.0]}
    assert record["non_finite"] == ["metadata.score", "metadata.ranges[0]"]
    assert loads_extra('{"a":1}') == {"a": 1}


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("non-finite-videos")
    for name in ("a", "b"):
        write_video(root / f"{name}.mp4", LAYOUTS["h264-open-gop"], frames=24, height=48, width=64, fps=24)
    return root


def _records(out: Path) -> dict[str, dict]:
    cache = LatentCache(out)
    return {clip_id: cache.record(clip_id) for clip_id in cache.ids()}


def test_a_parquet_table_with_nan_cells_and_a_split_list_column_encodes_and_verifies(videos, tmp_path):
    table = pq.write_table(pa.table({
        "path": [str(videos / "a.mp4"), str(videos / "b.mp4")],
        "score": [float("nan"), 1.5],
        "timestamp": [[["0:00:00.000", "0:00:00.500"], ["0:00:00.500", "0:00:01.000"]],
                      [["0:00:00.000", "0:00:00.500"]]],
        "matching_score": [[float("inf"), 0.25], [float("-inf")]],  # Panda-70M's per-range list: split with them
    }), tmp_path / "panda.parquet") or tmp_path / "panda.parquet"
    direct = invoke(["encode", table, "--out", tmp_path / "direct", *ENCODE_ARGS])
    assert direct.exit_code == 0, direct.output
    assert invoke(["verify", tmp_path / "direct"]).exit_code == 0
    records = _records(tmp_path / "direct")
    assert len(records) == 3
    by_range = {record["scene"].rsplit("~", 1)[-1]: record for record in records.values()}
    first = by_range["a.mp4@0.000-0.500"]
    assert first["metadata"]["score"] is None and first["metadata"]["matching_score"] is None
    assert first["non_finite"] == ["metadata.matching_score", "metadata.score"]
    second = by_range["a.mp4@0.500-1.000"]
    assert second["metadata"]["matching_score"] == 0.25 and second["non_finite"] == ["metadata.score"]
    assert by_range["b.mp4@0.000-0.500"]["metadata"]["score"] == 1.5

    index = tmp_path / "panda.jsonl"
    assert invoke(["index", table, "-o", index, "--no-progress"]).exit_code == 0
    lines = [json.loads(line) for line in index.read_text().splitlines()]  # strict JSON: no NaN token
    assert all(not isinstance(v, float) or math.isfinite(v) for line in lines for v in line.values())
    assert sorted(lines[0]["non_finite"]) == ["matching_score", "score"]
    from_index = invoke(["encode", index, "--out", tmp_path / "from-index", *ENCODE_ARGS])
    assert from_index.exit_code == 0, from_index.output
    indexed = {record["scene"].rsplit("~", 1)[-1]: record for record in _records(tmp_path / "from-index").values()}
    assert indexed["a.mp4@0.000-0.500"]["metadata"] == first["metadata"]
    assert indexed["a.mp4@0.000-0.500"]["non_finite"] == ["index line: matching_score", "index line: score"]
    assert indexed["b.mp4@0.000-0.500"]["non_finite"] == ["index line: matching_score"]


def test_a_tar_sample_json_with_nan_and_1e999_encodes_and_its_record_names_them(videos, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    with tarfile.open(shards / "data-000000.tar", "w") as tar:
        for name, data in (("s0.mp4", (videos / "a.mp4").read_bytes()),
                           ("s0.json", b'{"caption": "x", "aesthetic": NaN, "size": [1e999, 2]}')):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    result = invoke(["encode", shards, "--out", tmp_path / "out", *ENCODE_ARGS])
    assert result.exit_code == 0, result.output
    assert invoke(["verify", tmp_path / "out"]).exit_code == 0
    record = read_clips(tmp_path / "out")[0]
    assert record["metadata"]["aesthetic"] is None and record["metadata"]["size"] == [None, 2]
    assert record["non_finite"] == ["metadata.aesthetic", "metadata.size[0]"]


def test_the_writer_refuses_a_shard_whose_record_json_cannot_hold_and_writes_nothing_of_it(tmp_path):
    import dataclasses

    import torch

    from tests.cache.test_writer import UNTILED, _clip
    from vaecache.cache.commits import open_out
    from vaecache.cache.io import AppendLog
    from vaecache.cache.store import open_store
    from vaecache.cache.writer import ShardWriter
    from vaecache.errors import OutputError

    (tmp_path / "shards").mkdir()
    progress = AppendLog(tmp_path / "progress.jsonl")
    clip = dataclasses.replace(_clip(0), fps=float("nan"))  # not metadata: no rule stores it as null
    with pytest.raises(OutputError, match=r"shards/.*: a clip record JSON cannot write .*"
                                          r"nothing of this shard was written"):
        with ShardWriter(open_out(open_store(tmp_path)), rank=0, attempt=0, shard_size=2**20,
                         progress=progress) as writer:
            writer.add(clip, {"mean": torch.ones(4)}, [UNTILED])
    progress.close()
    assert list((tmp_path / "shards").iterdir()) == [] and (tmp_path / "progress.jsonl").read_bytes() == b""
