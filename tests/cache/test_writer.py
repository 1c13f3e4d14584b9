"""What `vaecache encode` writes: the manifest contract, clip records, tensor names and shapes, shards and
their rollover, --store modes, and bit-for-bit reproducibility across runs, batch sizes and workers."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any, Callable

import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open

from vaecache.cache.commits import open_out
from vaecache.cache.io import AppendLog
from vaecache.cache.layout import CLIPS, FAILURES
from vaecache.cache.manifest import read_manifest, write_manifest_last
from vaecache.cache.store import open_store
from vaecache.cache.table import CLIP_TABLE, FAILURE_TABLE, write_table
from vaecache.cache.writer import ShardWriter, channel_stats
from vaecache.errors import ManifestError, UsageError
from vaecache.planning.clips import Clip
from vaecache.settings.parts import OutConfig

SCENES = ["scene_000", "scene_001", "scene_002"]
LATENT = [2, 16, 3, 8, 8]
"""(cameras, channels, 1 + (9 - 1) // 4, 64 / 8, 64 / 8) for the standard encode of the demo data."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tensor_bytes(out: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every stored tensor's dtype, shape and raw bytes, by name (for byte-for-byte comparisons)."""
    found = {}
    for path in sorted((out / "shards").glob("*.safetensors")):
        with safe_open(path, "pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                found[name] = (str(tensor.dtype), tuple(tensor.shape), tensor.numpy().tobytes())
    return found


@pytest.fixture(scope="module")
def encoded(demo_data: Path, tmp_path_factory: pytest.TempPathFactory, encode_cli: Callable) -> Callable[..., Path]:
    """`encoded(*flags)`: the demo data encoded with the standard settings plus flags, once per module."""
    made: dict[tuple[str, ...], Path] = {}

    def get(*flags: str) -> Path:
        if flags not in made:
            out = tmp_path_factory.mktemp("enc") / "cache"
            encode_cli(demo_data, out, *flags)
            made[flags] = out
        return made[flags]

    return get


# --------------------------------------------------------------------------- files and manifest


def test_encode_writes_the_documented_layout(good_cache: Path) -> None:
    for name in ("manifest.json", "clips.parquet", "failures.parquet", "logs/rank-00000.log"):
        assert (good_cache / name).is_file(), name
    assert len(list((good_cache / "shards").glob("*.safetensors"))) == 1
    assert pq.read_table(good_cache / "failures.parquet").num_rows == 0
    assert pq.read_table(good_cache / "clips.parquet").num_rows == 3
    log = (good_cache / "logs" / "rank-00000.log").read_text()
    assert "rank 0/1" in log and "done: 3 clips, 6 views" in log
    assert not list(good_cache.rglob("*.tmp")) and not (good_cache / ".lock").exists()


def test_manifest_records_version_vae_and_settings(good_cache: Path, cache_io: Any) -> None:
    manifest = cache_io.manifest(good_cache)
    assert manifest["format"] == "vaecache" and manifest["format_version"] == 2
    vae = manifest["vae"]
    assert vae["family"] == "AutoencoderKLWan"
    assert vae["config"]["z_dim"] == 16 and vae["config"]["base_dim"] == 8
    assert re.fullmatch(r"[0-9a-f]{64}", vae["weights_sha256"])
    settings = manifest["settings"]
    expected = {"num_frames": 9, "frame_stride": 1, "window_stride": 9, "height": 64, "width": 64, "dtype": "fp32",
                "store": "mean-logvar", "vae_spec": "builtin:tiny"}
    assert {key: settings[key] for key in expected} == expected
    assert manifest["clips"]["count"] == 3
    assert manifest["clips"] == {"file": "clips.parquet", "count": 3, "sha256": _sha256(good_cache / "clips.parquet")}
    assert manifest["failures"]["count"] == 0
    assert manifest["latent"]["shape"] == {"mean": LATENT, "logvar": LATENT}


def test_read_manifest_refuses_what_it_does_not_know(cache_copy: Path) -> None:
    path = cache_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    assert read_manifest(cache_copy)["format_version"] == 2
    path.write_text(json.dumps({**manifest, "format_version": 3}))
    with pytest.raises(ManifestError, match="format version 3 is not supported"):
        read_manifest(cache_copy)
    path.write_text(json.dumps({**manifest, "format": "webdataset"}))
    with pytest.raises(ManifestError, match="not a vaecache manifest"):
        read_manifest(cache_copy)
    path.write_text("{")
    with pytest.raises(ManifestError, match="does not parse"):
        read_manifest(cache_copy)
    path.unlink()
    with pytest.raises(ManifestError, match="no manifest"):
        read_manifest(cache_copy)


def test_clip_records_describe_each_clip(good_cache: Path, demo_data: Path, cache_io: Any) -> None:
    records = cache_io.clips(good_cache)
    assert [r["id"] for r in records] == [f"{s}/000000-000008" for s in SCENES]
    shard_files = {p.name for p in (good_cache / "shards").iterdir()}
    for record, scene in zip(records, SCENES):
        assert record["scene"] == scene
        assert record["cameras"] == ["cam_0", "cam_1"]
        assert record["sources"] == [str((demo_data / scene / f"{c}.mp4").resolve()) for c in ("cam_0", "cam_1")]
        assert record["frames"] == list(range(9))
        assert record["fps"] == 10.0
        assert record["shard"] in shard_files
        assert set(record["tensors"]) == {"mean", "logvar"}
        for key, entry in record["tensors"].items():
            assert entry["name"] == f"{scene}/000000-000008/{key}"
            assert entry["shape"] == LATENT and entry["dtype"] == "float32"


def test_tensors_are_named_and_shaped_per_clip(good_cache: Path, cache_io: Any) -> None:
    tensors = cache_io.tensors(good_cache)
    assert sorted(tensors) == sorted(f"{s}/000000-000008/{k}" for s in SCENES for k in ("mean", "logvar"))
    for name, tensor in tensors.items():
        assert tuple(tensor.shape) == tuple(LATENT) and tensor.dtype == torch.float32, name
        assert torch.isfinite(tensor).all()
    # Different scenes and different cameras give different latents.
    assert not torch.equal(tensors["scene_000/000000-000008/mean"], tensors["scene_001/000000-000008/mean"])
    mean = tensors["scene_000/000000-000008/mean"]
    assert not torch.equal(mean[0], mean[1])


def test_shards_roll_over_at_the_size_limit(sharded_cache: Path, good_cache: Path, cache_io: Any) -> None:
    manifest = cache_io.manifest(sharded_cache)
    shards = manifest["shards"]
    assert len(shards) == 2
    records = cache_io.clips(sharded_cache)
    on_disk = sorted(f"shards/{p.name}" for p in (sharded_cache / "shards").glob("*.safetensors"))
    assert sorted(s["file"] for s in shards) == on_disk
    for shard in shards:
        path = sharded_cache / shard["file"]
        assert shard["bytes"] == path.stat().st_size
        assert shard["sha256"] == _sha256(path)
        mine = [r for r in records if f"shards/{r['shard']}" == shard["file"]]
        assert shard["clips"] == len(mine)
        with safe_open(path, "pt") as handle:
            assert sorted(handle.keys()) == sorted(e["name"] for r in mine for e in r["tensors"].values())
    assert sorted(s["clips"] for s in shards) == [1, 2]
    assert manifest["settings"]["shard_size"] == 50000
    # Where a clip lands does not change its values.
    cache_io.same_tensors(cache_io.tensors(sharded_cache), cache_io.tensors(good_cache))


# --------------------------------------------------------------------------- --store


def test_store_mean_stores_only_the_mean(encoded: Callable, cache_io: Any) -> None:
    out = encoded("--store", "mean", "--num-frames", "5", "--size", "32x64")  # non-square: (h, w) not swapped
    tensors = cache_io.tensors(out)
    assert sorted(tensors) == [f"{s}/{w}/mean" for s in SCENES for w in ("000000-000004", "000005-000009",
                                                                         "000010-000014")]
    assert {tuple(t.shape) for t in tensors.values()} == {(2, 16, 2, 4, 8)}
    record = cache_io.clips(out)[0]
    assert list(record["tensors"]) == ["mean"] and record["frames"] == [0, 1, 2, 3, 4]
    assert cache_io.manifest(out)["latent"]["store"] == ["mean"]


def test_store_sample_is_seeded_and_reproducible(encoded: Callable, good_cache: Path, cache_io: Any) -> None:
    first, again = encoded("--store", "sample"), encoded("--store", "sample", "--seed", "0")
    other_seed = encoded("--store", "sample", "--seed", "1")
    assert _tensor_bytes(first) == _tensor_bytes(again)
    samples, other = cache_io.tensors(first), cache_io.tensors(other_seed)
    assert sorted(samples) == [f"{s}/000000-000008/sample" for s in SCENES]
    good = cache_io.tensors(good_cache)
    for name, sample in samples.items():
        assert tuple(sample.shape) == tuple(LATENT)
        assert not torch.equal(sample, other[name])
        # A draw from the posterior: (sample - mean) / std is standard normal noise.
        clip = name.rsplit("/", 1)[0]
        noise = (sample - good[f"{clip}/mean"]) / torch.exp(0.5 * good[f"{clip}/logvar"])
        assert abs(float(noise.mean())) < 0.1 and abs(float(noise.std()) - 1.0) < 0.1
        assert not torch.equal(noise[0], noise[1])  # each camera has its own noise


# --------------------------------------------------------------------------- reproducibility


def test_same_command_twice_gives_byte_identical_tensors(encoded: Callable, good_cache: Path, cache_io: Any) -> None:
    again = encoded()  # the good cache's command again, into another OUT
    assert _tensor_bytes(again) == _tensor_bytes(good_cache)
    assert [r["id"] for r in cache_io.clips(again)] == [r["id"] for r in cache_io.clips(good_cache)]


def test_identical_shards_have_identical_bytes(tmp_path: Path) -> None:
    digests = set()
    for attempt in range(12):
        out = tmp_path / str(attempt)
        (out / "shards").mkdir(parents=True)
        progress = AppendLog(out / "progress.jsonl")
        with ShardWriter(open_out(open_store(out)), rank=0, attempt=0, shard_size=2**20,
                         progress=progress) as writer:
            writer.add(_clip(0), {"mean": torch.ones(4)}, [UNTILED])
        progress.close()
        digests.add(_sha256(out / "shards" / "a000-r00000-000000.safetensors"))
    assert len(digests) == 1


def test_batch_size_does_not_change_latents(encoded: Callable, good_cache: Path, cache_io: Any) -> None:
    cache_io.same_tensors(cache_io.tensors(encoded("--batch-size", "3")), cache_io.tensors(good_cache))


def test_decode_workers_do_not_change_latents(encoded: Callable, good_cache: Path, cache_io: Any) -> None:
    cache_io.same_tensors(cache_io.tensors(encoded("--workers", "2")), cache_io.tensors(good_cache))


# --------------------------------------------------------------------------- writer and manifest units

UNTILED = {"tiled": False, "units_per_forward": 1}


def _clip(i: int) -> Clip:
    return Clip(f"s/{i:06d}-{i:06d}", "s", ("cam",), ("/d/s/cam.mp4",), (i,), 10.0)


def test_shard_writer_rolls_commits_and_logs(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    progress = AppendLog(tmp_path / "progress.jsonl")
    with ShardWriter(open_out(open_store(tmp_path)), rank=3, attempt=1, shard_size=3 * 16 * 4,
                     progress=progress) as writer:
        for i in range(5):
            writer.add(_clip(i), {"mean": torch.full((4, 4), float(i))}, [UNTILED])
    progress.close()
    files = sorted(p.name for p in (tmp_path / "shards").iterdir())
    assert files == ["a001-r00003-000000.safetensors", "a001-r00003-000001.safetensors"]  # 3 clips, then 2
    logged = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert [len(entry["clips"]) for entry in logged] == [3, 2]
    for entry in logged:
        path = tmp_path / entry["shard"]["file"]
        assert entry["shard"]["bytes"] == path.stat().st_size and entry["shard"]["sha256"] == _sha256(path)
        for clip in entry["clips"]:
            assert clip["shard"] == path.name
            value = float(clip["frames"][0])
            assert clip["tensors"]["mean"] == {"name": f"{clip['id']}/mean", "shape": [4, 4], "dtype": "float32",
                                               "stats": {"min": value, "max": value, "mean": value, "std": 0.0},
                                               "channel_stats": {"mean": [value] * 4, "std": [0.0] * 4}}
            assert clip["encode"] == {"tiled": False, "tiled_cameras": [], "units_per_forward": 1}


def test_channel_stats_are_each_channels_mean_and_std_over_cameras_frames_and_pixels() -> None:
    torch.manual_seed(0)
    latents = torch.randn(2, 5, 3, 4, 6) * torch.arange(1, 6).view(1, 5, 1, 1, 1) + torch.arange(5).view(1, 5, 1, 1, 1)
    stats = channel_stats(latents.to(torch.bfloat16))
    per_channel = latents.to(torch.bfloat16).double().transpose(0, 1).reshape(5, -1)
    assert stats["mean"] == pytest.approx(per_channel.mean(1).tolist(), rel=1e-12)
    assert stats["std"] == pytest.approx(per_channel.std(1, correction=0).tolist(), rel=1e-12)
    assert channel_stats(torch.zeros(1, 3, 1, 1, 1)) == {"mean": [0.0] * 3, "std": [0.0] * 3}
    broken = latents.clone()
    broken[1, 2, 0, 0, 0] = float("inf")
    found = channel_stats(broken)
    assert math.isnan(found["mean"][2]) and math.isnan(found["std"][2]) and math.isfinite(found["mean"][3])


def test_a_shard_is_committed_after_commit_every_seconds_whatever_its_size(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    progress = AppendLog(tmp_path / "progress.jsonl")
    now = [0.0]
    with ShardWriter(open_out(open_store(tmp_path)), rank=0, attempt=0, shard_size=2**30, progress=progress,
                     commit_every_s=300.0,
                     clock=lambda: now[0]) as writer:
        for i, t in enumerate((10.0, 200.0, 310.0, 400.0, 650.0)):  # a shard at 310 s, the next at 650 s
            now[0] = t
            writer.add(_clip(i), {"mean": torch.full((4, 4), float(i))}, [UNTILED])
        # shards handed to the commit thread before close (each is in _futures from submit on; `committed` also
        # counts the ones already done, so committed + futures counted a finished shard twice on a loaded machine)
        committed_before_close = len(writer._futures)
    progress.close()
    logged = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert committed_before_close == 2 and [len(entry["clips"]) for entry in logged] == [3, 2]
    with pytest.raises(UsageError, match="--commit-every must be seconds >= 0"):
        OutConfig(tmp_path / "o", commit_every_s=-1.0)


def test_manifest_records_both_tables_counts_and_hashes(tmp_path: Path) -> None:
    clips = write_table(tmp_path / CLIPS, CLIP_TABLE, [{"id": "a/1", "shard": "x"}, {"id": "b/1", "shard": "x"}])
    failures = write_table(tmp_path / FAILURES, FAILURE_TABLE,
                           [{"scene": "s", "clip": None, "camera": None, "path": None, "reason": "too short"}])
    manifest = write_manifest_last(tmp_path, {"settings": {}}, [{"file": "shards/x", "bytes": 1}], clips, failures)
    assert pq.read_table(tmp_path / "clips.parquet", columns=["id"]).column("id").to_pylist() == ["a/1", "b/1"]
    assert manifest == read_manifest(tmp_path)
    assert manifest["clips"]["count"] == 2 and manifest["failures"]["count"] == 1
    assert manifest["clips"]["sha256"] == _sha256(tmp_path / "clips.parquet")
    assert manifest["failures"]["sha256"] == _sha256(tmp_path / "failures.parquet")


def test_a_clip_record_keeps_a_cut_of_a_constant_rate_timeline_only() -> None:
    """A variable-frame-rate video's timeline packs every frame's time: a cut of it would repeat them whole in every
    clip record, so none is kept (its re-reads index the video, as before)."""
    from types import SimpleNamespace

    from vaecache.cache.writer import _source_timelines
    from vaecache.video.timeline import Keyframe, Timeline

    constant = Timeline.build(list(range(0, 4800, 100)),
                              [Keyframe(f, f * 100, f * 100, f * 10, f * 10 + 120) for f in range(0, 48, 12)])
    varying = Timeline.build([0, 33, 67, 100, 133, 167], [Keyframe(0, 0, 0, 0, 50)])
    clip = SimpleNamespace(cameras=("a", "b", "c"), paths=("a.mp4", "b.mp4", "c.mp4"), frames=(13, 14, 15),
                           timelines=(constant, varying, None))
    assert _source_timelines(clip, {})["source_timelines"] == [constant.for_frames(13, 15).to_json(), None, None]
    synced = _source_timelines(clip, {"camera_frames": {"a": [30, 31, 32]}})["source_timelines"]
    assert synced[0] == constant.for_frames(30, 32).to_json()  # --sync timestamps: the camera's own frames
    assert _source_timelines(SimpleNamespace(cameras=("b",), paths=("b.mp4",), frames=(0, 1), timelines=(varying,)),
                             {}) == {}
    # one episode of a file: its probe's timeline is the file's cut to the episode (file frame numbers), kept as it is
    episode = constant.for_frames(24, 40)
    span = SimpleNamespace(cameras=("a",), paths=("f.mp4#from_ns=2400000000&frames=17&fps=10.0",), frames=(0, 1, 2),
                           timelines=(episode,))
    assert _source_timelines(span, {})["source_timelines"] == [episode.to_json()]
