"""Size and length buckets end to end: real videos of five aspect ratios in one folder, three size buckets and two
frame buckets. Each video's latents must equal a one-size run of that video at its bucket's size."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import tomllib
from safetensors import safe_open

from tests.conftest import BASE, FRAMES, SIZES, VIDEOS


def test_each_video_lands_in_its_nearest_bucket(bucket_cache: Path, cache_io: Any) -> None:
    clips = cache_io.clips(bucket_cache)
    found = {clip["scene"]: {c["bucket"]["name"] for c in clips if c["scene"] == clip["scene"]} for clip in clips}
    assert found == {name: {bucket} for name, (_, bucket) in VIDEOS.items()}
    cinema = [c for c in clips if c["scene"] == "cinema235"]
    assert [c["id"] for c in cinema] == ["cinema235/000000-000008", "cinema235/000009-000017"]
    assert cinema[0]["bucket"] == {"name": "32x56x9", "height": 32, "width": 56, "num_frames": 9}
    # cover: 94x40 is resized to 75x32 (scale 0.8), columns 9..65 are kept: 9 and 65 x 94/75 in source pixels
    assert cinema[0]["crop"] == [{"source": [94, 40], "box": [11.28, 0.0, 81.4667, 40.0], "pad": [0, 0, 0, 0]}]


def test_latents_equal_a_one_size_run_at_the_bucket_size(bucket_videos: Path, bucket_cache: Path, tmp_path: Path,
                                                          run_cli: Any, cache_io: Any) -> None:
    bucketed = cache_io.tensors(bucket_cache)
    by_bucket: dict[str, list[str]] = {}
    for name, (_, bucket) in VIDEOS.items():
        by_bucket.setdefault(bucket, []).append(name)
    reference: dict[str, Any] = {}
    for bucket, names in by_bucket.items():
        height, width, frames = bucket.split("x")
        data = tmp_path / f"data-{bucket}"
        data.mkdir()
        for name in names:
            shutil.copy(bucket_videos / f"{name}.mp4", data / f"{name}.mp4")
        out = tmp_path / f"one-{bucket}"
        result = run_cli(["encode", data, "--out", out, "--size", f"{height}x{width}", "--num-frames", frames, *BASE])
        assert result.exit_code == 0, result.output
        assert "bucket" not in cache_io.clips(out)[0]  # a one-size run writes the records it always did
        reference.update(cache_io.tensors(out))
    cache_io.same_tensors(bucketed, reference)


def test_every_shard_holds_one_bucket_and_the_manifest_lists_buckets(bucket_cache: Path, cache_io: Any) -> None:
    manifest = cache_io.manifest(bucket_cache)
    shapes_per_shard: dict[str, set] = {}
    for shard in manifest["shards"]:
        with safe_open(str(bucket_cache / shard["file"]), framework="pt") as handle:
            shapes_per_shard[shard["file"]] = {tuple(handle.get_slice(key).get_shape()[1:]) for key in handle.keys()
                                               if key.endswith("/mean")}
    assert all(len(shapes) == 1 for shapes in shapes_per_shard.values()), shapes_per_shard
    assert len(shapes_per_shard) == 4  # four non-empty buckets, each small enough for one shard
    buckets = {bucket["name"]: bucket for bucket in manifest["buckets"]}
    assert list(buckets) == ["32x56x9", "32x56x5", "56x32x9", "56x32x5", "40x40x9", "40x40x5"]
    assert {name: b["clips"] for name, b in buckets.items()} == {
        "32x56x9": 3, "32x56x5": 0, "56x32x9": 1, "56x32x5": 1, "40x40x9": 0, "40x40x5": 1}
    assert buckets["32x56x9"]["view_shape"] == [16, 3, 4, 7]  # (c, 1 + 8/4, 32/8, 56/8)
    assert buckets["32x56x9"]["shape"]["mean"] == [1, 16, 3, 4, 7]
    assert buckets["32x56x5"]["shape"] is None
    assert manifest["latent"]["shape"] is None  # several shapes: see "buckets"
    assert manifest["settings"]["sizes"] == [[32, 56], [56, 32], [40, 40]]
    assert manifest["settings"]["frame_buckets"] == [9, 5]


def test_verify_names_a_clip_whose_shape_is_not_its_buckets(bucket_cache: Path, cache_io: Any) -> None:
    from vaecache.verify.integrity import manifest_record_problem

    manifest = cache_io.manifest(bucket_cache)
    record = next(c for c in cache_io.clips(bucket_cache) if c["bucket"]["name"] == "56x32x5")
    assert manifest_record_problem(record, manifest) is None
    record["bucket"] = {**record["bucket"], "name": "32x56x5"}
    assert manifest_record_problem(record, manifest) == ("logvar has shape [1, 16, 2, 7, 4], bucket 32x56x5's "
                                                         "latent shape is [1, 16, 2, 4, 7]")
    record["bucket"]["name"] = "1x1x1"
    assert "bucket '1x1x1' is not one of the manifest's buckets" in manifest_record_problem(record, manifest)


def test_verify_and_coverage_pass(bucket_cache: Path, bucket_videos: Path, run_cli: Any) -> None:
    result = run_cli(["verify", bucket_cache, "--dataset", bucket_videos, "--json", "-"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{"):])
    coverage = next(c for c in report["checks"] if c["name"].startswith("coverage"))
    assert coverage["passed"] == 6 and not coverage["problems"]


def test_resume_of_a_complete_bucketed_cache_changes_nothing(bucket_cache: Path, bucket_videos: Path, tmp_path: Path,
                                                            run_cli: Any) -> None:
    out = Path(shutil.copytree(bucket_cache, tmp_path / "cache"))
    before = (out / "manifest.json").read_bytes()
    again = run_cli(["encode", bucket_videos, "--out", out, "--size", SIZES, "--num-frames", FRAMES, *BASE,
                     "--batch-size", "2", "--shard-size", "1MB"])
    assert again.exit_code == 0, again.output
    assert "already complete" in again.output
    assert (out / "manifest.json").read_bytes() == before
    other = run_cli(["encode", bucket_videos, "--out", out, "--size", SIZES, "--num-frames", FRAMES, *BASE,
                     "--fit", "contain"])
    assert other.exit_code != 0 and "fit" in other.output


def test_plan_shows_the_bucket_histogram_and_empty_buckets(bucket_videos: Path, run_cli: Any) -> None:
    result = run_cli(["plan", bucket_videos, "--vae", "builtin:tiny", "--size", SIZES, "--num-frames", FRAMES,
                      "--no-measure", "--json", "-"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{"):])
    rows = {row["name"]: row for row in report["buckets"]}
    assert {name: row["clips"] for name, row in rows.items()} == {
        "32x56x9": 3, "32x56x5": 0, "56x32x9": 1, "56x32x5": 1, "40x40x9": 0, "40x40x5": 1}
    assert rows["32x56x9"]["view_shape"] == [16, 3, 4, 7]
    assert rows["32x56x9"]["views"] == 3 and rows["32x56x9"]["bytes"] == 3 * 2 * 16 * 3 * 4 * 7 * 4  # mean+logvar fp32
    # cover: 64x36 is resized to 57x32 and keeps 56 of 57 columns; 94x40 (two clips) to 75x32 and keeps 56 of 75
    assert rows["32x56x9"]["mean_kept"] == pytest.approx((56 / 57 + 2 * 56 / 75) / 3, abs=1e-4)
    assert rows["32x56x9"]["mean_padded"] == 0.0 and rows["32x56x9"]["max_distortion"] == 1.0
    assert rows["32x56x5"]["mean_kept"] is None
    assert "bucket 32x56x5 is empty" in " ".join(report["notes"])
    assert "empty" in result.stderr  # the histogram table marks it


@pytest.mark.slow
def test_torchrun_two_ranks_equal_one_process(bucket_videos: Path, bucket_cache: Path, tmp_path: Path, procs: Any,
                                              cache_io: Any) -> None:
    out = tmp_path / "out"
    result = procs.torchrun(2, "encode", bucket_videos, "--out", out, "--size", SIZES, "--num-frames", FRAMES, *BASE,
                            "--shard-size", "1MB")
    assert result.returncode == 0, result.stderr[-3000:]
    cache_io.same_tensors(cache_io.tensors(out), cache_io.tensors(bucket_cache))
    assert cache_io.manifest(out)["buckets"] == cache_io.manifest(bucket_cache)["buckets"]
    strip = ("shard", "source_identity")
    assert ([{k: v for k, v in c.items() if k not in strip} for c in cache_io.clips(out)]
            == [{k: v for k, v in c.items() if k not in strip} for c in cache_io.clips(bucket_cache)])


@pytest.mark.slow  # two child-process encodes; the resume arithmetic is unit-tested in tests/settings/test_buckets.py
def test_all_lengths_resume_after_a_crash(bucket_videos: Path, bucket_cache: Path, tmp_path: Path, procs: Any,
                                          run_cli: Any, cache_io: Any) -> None:
    out = tmp_path / "all"
    args = ("encode", bucket_videos, "--out", out, "--size", SIZES, "--num-frames", FRAMES, "--frames-policy", "all",
            *BASE, "--shard-size", "1")
    crashed = procs.vaecache(*args, env={"VAECACHE_FAULT": "crash-after-commit:4"})
    assert crashed.returncode == 137, crashed.stderr[-2000:]
    rerun = procs.vaecache(*args)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "attempt 1, 4 clips already committed" in (out / "logs" / "rank-00000.log").read_text()
    clips = cache_io.clips(out)
    ids = [c["id"] for c in clips]
    assert len(ids) == len(set(ids)) == 13  # 9- and 5-frame windows of one scene never share an id
    assert sorted(c["id"] for c in clips if c["scene"] == "wide16x9") == [
        "wide16x9/000000-000004", "wide16x9/000000-000008", "wide16x9/000005-000009"]
    longest = cache_io.tensors(bucket_cache)  # every clip of the longest policy is also cut here, equal
    found = cache_io.tensors(out)
    cache_io.same_tensors({name: found[name] for name in longest}, longest)
    verified = run_cli(["verify", out, "--dataset", bucket_videos])
    assert verified.exit_code == 0, verified.output


def test_reader_sampler_inspect_and_export_understand_buckets(bucket_cache: Path, tmp_path: Path) -> None:
    """What a trainer touches, over a cache of several latent shapes: every item's tensors have its bucket's
    shape, a batch never mixes shapes, inspect lists each shape, and the musubi export names each file with
    its bucket's pixel size."""
    from vaecache import LatentCache
    from vaecache.cache.inspect import inspect_cache
    from vaecache.export import export_musubi
    from vaecache.training import ShapeBatchSampler

    cache = LatentCache(bucket_cache, verify="sha256")
    manifest = json.loads((bucket_cache / "manifest.json").read_text())
    shape_of = {b["name"]: b["shape"] for b in manifest["buckets"] if b["clips"]}
    assert len(shape_of) >= 2
    for item in cache:
        assert list(item["mean"].shape) == shape_of[item.bucket["name"]]["mean"]
    shapes = cache.shapes()
    batches = list(ShapeBatchSampler(shapes, batch_size=2, seed=0, rank=0, world_size=1))
    assert sorted(p for batch in batches for p in batch) == list(range(len(cache)))
    assert all(len({shapes[p] for p in batch}) == 1 for batch in batches)
    report = inspect_cache(bucket_cache)
    assert len(report["shapes"]) == len(shape_of) and report["buckets"] == manifest["buckets"]
    export_musubi(bucket_cache, tmp_path / "musubi")
    sizes = {re.search(r"_(\d{4})x(\d{4})_", p.name).groups() for p in (tmp_path / "musubi").rglob("*.safetensors")}
    assert sizes == {(f"{b['width']:04d}", f"{b['height']:04d}") for b in manifest["buckets"] if b["clips"]}
    # musubi-tuner's training buckets each cached file by BucketSelector.get_bucket_resolution of its size:
    # with bucket_no_upscale, floored to multiples of 16 when its area is at most resolution's.
    config = tomllib.loads((tmp_path / "musubi" / "dataset.toml").read_text())["general"]
    assert config["enable_bucket"] is True and config["bucket_no_upscale"] is True
    area = config["resolution"][0] * config["resolution"][1]
    buckets = {}
    for width, height in ((int(w), int(h)) for w, h in sizes):
        assert width * height <= area
        buckets[(width // 16 * 16, height // 16 * 16)] = (width, height)
    assert len(buckets) == len(sizes)  # one musubi bucket per size: a batch never stacks two shapes
