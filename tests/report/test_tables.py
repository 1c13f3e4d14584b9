"""What the report reads from the tables without a shard: the streamed summary of the clip table (scenes, cameras,
lengths, per-channel moments) against the records themselves, the sample's positions and rows, the frequent-items
counting of prompts against an exact count, the failures grouped and written out whole."""

from __future__ import annotations

import csv
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from vaecache.cache.reader import CacheReader
from vaecache.cache.table import CLIP_TABLE, FAILURE_TABLE, write_table
from vaecache.report.clips import strip_positions
from vaecache.report.failures import SHOWN_PER_GROUP, failures_section, spreadsheet_safe
from vaecache.report.tables import records_at, sample_positions, summarize_clip_table
from vaecache.report.text import caption_section, frequent_items


def _record(scene: str, first: int, frames: int, cameras: int, rng: np.random.Generator,
            caption: str | None = None) -> dict[str, Any]:
    clip = f"{scene}/{first:06d}-{first + frames - 1:06d}"
    shape = [cameras, 4, 1 + (frames - 1) // 4, 2, 3]
    channel_stats = {"mean": rng.normal(size=4).tolist(), "std": rng.uniform(0.5, 2, size=4).tolist()}
    stats = {"min": -1.0, "max": 1.0, "mean": 0.0, "std": 1.0}
    return {"id": clip, "scene": scene, "cameras": [f"cam_{c}" for c in range(cameras)],
            "sources": [f"/d/{scene}/cam_{c}.mp4" for c in range(cameras)],
            "frames": list(range(first, first + frames)),
            "fps": 10.0 if frames < 17 else 25.0, "shard": "a000-r00000-000000.safetensors",
            "tensors": {"mean": {"name": f"{clip}/mean", "shape": shape, "dtype": "float32", "stats": stats,
                                 "channel_stats": channel_stats},
                        "logvar": {"name": f"{clip}/logvar", "shape": shape, "dtype": "float32", "stats": stats}},
            **({"metadata": {"caption": caption}} if caption is not None else {})}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[dict[str, Any]]]:
    """A cache's tables alone: 190 clips of 40 scenes (1 to 9 clips each), 1 to 3 cameras, two lengths, in row
    groups of 50 rows; captions with repeats and blanks; failures of three kinds."""
    rng = np.random.default_rng(1)
    records = []
    for s in range(40):
        scene = f"s{s:03d}" if s != 7 else "s007-b"  # '-' sorts before '/': the scene's clips stay one run
        for k in range(1 + s % 9):
            frames = 9 if (s + k) % 3 else 17
            caption = ["a red car", "", None, f"scene {s} take {k}", "a red car", "two people"][(s + k) % 6]
            records.append(_record(scene, k * 20, frames, 1 + s % 3, rng, caption))
    records.sort(key=lambda r: r["id"])
    monkeypatch.setattr("vaecache.cache.table.ROW_GROUP_ROWS", 50)
    write_table(tmp_path / "clips.parquet", CLIP_TABLE, records)
    failures = [{"scene": f"x{i:02d}", "clip": None, "camera": None, "path": None,
                 "reason": "too short: 5 usable frames, one clip needs 9"} for i in range(30)]
    failures += [{"scene": "y", "clip": "y/000000-000008", "camera": "cam_0", "path": "=HYPERLINK(\"x\")",
                  "reason": "not a readable video (moov atom not found)"},
                 {"scene": "z", "clip": None, "camera": "cam_1", "path": None, "reason": "missing camera cam_1"}]
    write_table(tmp_path / "failures.parquet", FAILURE_TABLE, failures)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "vaecache", "format_version": 2,
                                                        "clips": {"file": "clips.parquet", "count": len(records)}}))
    return tmp_path, records


def test_the_summary_streams_what_the_records_hold(cache: tuple[Path, list[dict[str, Any]]]) -> None:
    out, records = cache
    summary = summarize_clip_table(CacheReader(out))
    assert summary.clips == len(records) == 190
    assert summary.scenes == len({r["scene"] for r in records}) == 40
    assert summary.views == sum(len(r["cameras"]) for r in records)
    assert summary.frames == sum(len(r["cameras"]) * len(r["frames"]) for r in records)
    assert dict(summary.cameras.counts) == Counter(c for r in records for c in r["cameras"])
    assert dict(summary.cameras_per_clip.counts) == Counter(len(r["cameras"]) for r in records)
    assert dict(summary.lengths.counts) == Counter((len(r["frames"]), r["fps"]) for r in records)
    assert summary.scale_key == "mean" and summary.with_channel_stats == 190
    weights = [float(np.prod(r["tensors"]["mean"]["shape"])) / 4 for r in records]
    means = np.asarray([r["tensors"]["mean"]["channel_stats"]["mean"] for r in records])
    stds = np.asarray([r["tensors"]["mean"]["channel_stats"]["std"] for r in records])
    total = sum(weights)
    mean = (np.asarray(weights)[:, None] * means).sum(0) / total
    second = (np.asarray(weights)[:, None] * (stds ** 2 + means ** 2)).sum(0) / total
    got_mean, got_std = summary.moments.moments()
    assert got_mean == pytest.approx(mean.tolist(), rel=1e-12)
    assert got_std == pytest.approx(np.sqrt(second - mean ** 2).tolist(), rel=1e-10)


def test_a_table_without_channel_statistics_sums_none(cache: tuple[Path, list[dict[str, Any]]]) -> None:
    out, _ = cache
    table = pq.read_table(out / "clips.parquet").drop_columns(["tensor_channel_stats"])
    pq.write_table(table, out / "clips.parquet", row_group_size=50)
    summary = summarize_clip_table(CacheReader(out))
    assert summary.clips == 190 and summary.with_channel_stats == 0 and summary.moments is None
    assert summary.scale_key == "mean"


def test_the_sample_is_a_pure_function_of_count_size_and_seed(cache: tuple[Path, list[dict[str, Any]]]) -> None:
    out, records = cache
    first = sample_positions(190, 12, seed=3)
    assert first == sample_positions(190, 12, seed=3) == sorted(set(first)) and len(first) == 12
    assert first != sample_positions(190, 12, seed=4)
    assert sample_positions(5, 12, 0) == [0, 1, 2, 3, 4] and sample_positions(0, 12, 0) == []
    assert records_at(CacheReader(out), first) == [records[p] for p in first]  # from 5 row groups of 50
    assert records_at(CacheReader(out), [0, 49, 50, 189]) == [records[p] for p in (0, 49, 50, 189)]


def test_frequent_items_counts_the_most_common_exactly_in_bounded_counters() -> None:
    rng = random.Random(0)
    stream = [f"rare {i}" for i in range(20000)] + ["a"] * 900 + ["b"] * 700 + ["c"] * 650 + ["d"] * 30
    rng.shuffle(stream)
    top, total = frequent_items(lambda: iter(stream), top=3, capacity=16)  # 16 counters for 20,004 distinct items
    assert total == len(stream)
    assert top == [("a", 900), ("b", 700), ("c", 650)]
    assert frequent_items(lambda: iter(stream), top=4, capacity=8192)[0] == Counter(stream).most_common(4)


def test_captions_repeated_and_empty(cache: tuple[Path, list[dict[str, Any]]]) -> None:
    out, records = cache
    section = caption_section(CacheReader(out))
    captions = [(r.get("metadata") or {}).get("caption") for r in records]
    expected = Counter(c for c in captions if c)
    assert [(p.text, p.clips) for p in section.repeated] == [(t, n) for t, n in expected.most_common() if n > 1]
    assert section.empty_clips == sum(1 for c in captions if not c) and section.clips == 190
    assert section.empty_examples == [r["id"] for r, c in zip(records, captions) if not c][:10]


def test_failures_grouped_by_kind_and_every_one_in_the_csv(cache: tuple[Path, list[dict[str, Any]]],
                                                          tmp_path: Path) -> None:
    out, _ = cache
    section = failures_section(CacheReader(out), tmp_path / "failures.csv")
    assert section.count == 32 and section.csv_name == "failures.csv"
    assert [(g.kind, g.count, g.units) for g in section.groups] == [
        ("too short", 30, {"scene": 30}), ("missing camera cam_1", 1, {"scene": 1}),
        ("not a readable video", 1, {"clip": 1})]
    assert len(section.groups[0].shown) == SHOWN_PER_GROUP
    rows = list(csv.DictReader((tmp_path / "failures.csv").open()))
    assert len(rows) == 32 and rows[30]["path"] == "'=HYPERLINK(\"x\")"  # shown as text by a spreadsheet
    assert spreadsheet_safe("-1+2") == "'-1+2" and spreadsheet_safe("scene/0") == "scene/0"


def test_strip_positions_spread_over_the_clip() -> None:
    assert strip_positions(9, 8) == [0, 1, 2, 3, 5, 6, 7, 8]
    assert strip_positions(81, 8) == [0, 11, 23, 34, 46, 57, 69, 80]
    assert strip_positions(3, 8) == [0, 1, 2] and strip_positions(1, 8) == [0] and strip_positions(0, 8) == []
