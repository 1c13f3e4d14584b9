"""The training-side reader: LatentCache, LatentDataset in DataLoader workers, ShapeBatchSampler, metadata
passthrough from the index, and the training loop of docs/training.md (run from the file it quotes)."""

from __future__ import annotations

import gc
import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open

from vaecache import LatentCache, LatentDataset, ShapeBatchSampler, collate_latents
from vaecache.errors import IncompleteCacheError, ManifestError, NormalizationError, ShardChecksumError

ROOT = Path(__file__).resolve().parents[1]


def stored(out: Path, record: dict) -> dict[str, torch.Tensor]:
    """A clip's tensors read straight from its shard by safetensors."""
    with safe_open(str(out / "shards" / record["shard"]), "pt") as handle:
        return {key: handle.get_tensor(entry["name"]) for key, entry in record["tensors"].items()}


def test_import_vaecache_stays_light() -> None:
    code = ("import sys, vaecache; assert 'torch' not in sys.modules; vaecache.LatentCache; "
            "assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_cache_len_index_by_position_and_id_and_iterate(caption_cache: Path, index_metadata) -> None:
    cache = LatentCache(caption_cache)
    assert len(cache) == 3
    assert cache.ids() == ["scene_000/000000-000008", "scene_001/000000-000008", "scene_002/000000-000008"]
    item = cache["scene_001/000000-000008"]
    assert item.id == cache[1].id == cache[-2].id == "scene_001/000000-000008"
    assert (item.scene, item.cameras, item.frames, item.fps) == ("scene_001", ["cam_0", "cam_1"], list(range(9)), 10.0)
    assert [Path(s).name for s in item.sources] == ["cam_0.mp4", "cam_1.mp4"] and item.bucket is None
    assert item.metadata == index_metadata("scene_001")
    assert sorted(item.tensors) == ["logvar", "mean"] and item.mean.shape == (2, 16, 3, 8, 8)
    for key, tensor in stored(caption_cache, item.record).items():
        assert torch.equal(item[key], tensor)
    assert [it.id for it in cache] == cache.ids()
    with pytest.raises(KeyError, match="no clip 'nope'"):
        cache["nope"]
    with pytest.raises(IndexError):
        cache[3]


def test_metadata_round_trips_through_the_clip_table(caption_cache: Path, index_metadata) -> None:
    """Index keys other than id/path/cameras/frames/probe come back from the reader and from clips.parquet's
    JSON column; the known keys do not leak into metadata."""
    table = pq.read_table(caption_cache / "clips.parquet", columns=["id", "scene", "extra"]).to_pylist()
    for row in table:
        extra = json.loads(row["extra"])
        assert extra["metadata"] == index_metadata(row["scene"])
        assert not {"id", "cameras", "path", "frames", "probe"} & set(extra["metadata"])
    assert [item.metadata["caption"] for item in LatentCache(caption_cache)] == \
        ["a red cube ☃", "two cameras, one road", "night\nline two"]


def test_dataset_in_two_dataloader_workers_equals_the_shard_bytes(caption_cache: Path) -> None:
    dataset = LatentDataset(caption_cache, verify="sha256")
    sampler = dataset.batch_sampler(batch_size=1, shuffle=False)
    # This process ran encodes: a PyAV decoder left as cyclic garbage would hang a forked worker's collector
    # (see vaecache/encode/loop.py:workers_started). A trainer that decodes no video has none; collect here, and fail,
    # never hang.
    gc.collect()
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2, collate_fn=collate_latents,
                                         timeout=120)
    seen = []
    for batch in loader:
        (record,) = batch["record"]
        seen.append(batch["id"][0])
        for key, tensor in stored(caption_cache, record).items():
            assert batch[key].dtype == tensor.dtype and torch.equal(batch[key][0], tensor), (record["id"], key)
    assert seen == LatentCache(caption_cache).ids()


def test_tampered_shard_raises_on_first_open_with_sha256(cache_copy: Path) -> None:
    shard = next((cache_copy / "shards").iterdir())
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # same size: only the hash tells
    shard.write_bytes(bytes(data))
    assert LatentCache(cache_copy, verify="size")[0].mean is not None  # the size check cannot see it
    cache = LatentCache(cache_copy, verify="sha256")  # opening reads no shard
    with pytest.raises(ShardChecksumError, match=rf"{re.escape(shard.name)}: sha256 .* manifest.json records"):
        cache[0]


def test_sha256_is_checked_once_per_shard(sharded_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import vaecache.cache.io as io_module

    calls = []
    real = io_module.sha256_file
    monkeypatch.setattr(io_module, "sha256_file", lambda path, *a: calls.append(Path(path).name) or real(path, *a))
    cache = LatentCache(sharded_cache, verify="sha256")
    [cache[i] for i in range(len(cache))] + [cache[0]]
    shards = sorted(p.name for p in (sharded_cache / "shards").iterdir())
    assert len(shards) == 2 and calls.count("clips.parquet") == 1
    assert sorted(c for c in calls if c.endswith(".safetensors")) == shards  # each once, however often read


def test_refuses_unknown_versions_and_incomplete_caches(cache_copy: Path) -> None:
    manifest = json.loads((cache_copy / "manifest.json").read_text())
    (cache_copy / "clips.parquet").rename(cache_copy / "clips.moved")
    with pytest.raises(IncompleteCacheError, match=r"clips.parquet: missing"):
        LatentCache(cache_copy)
    (cache_copy / "clips.moved").rename(cache_copy / "clips.parquet")
    (cache_copy / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(ManifestError, match=r"manifest.json: format version 99 is not supported"):
        LatentCache(cache_copy)
    (cache_copy / "manifest.json").unlink()
    with pytest.raises(ManifestError, match=r"manifest.json: no manifest"):
        LatentCache(cache_copy)
    with pytest.raises(ValueError, match="verify must be one of"):
        LatentCache(cache_copy, verify="md5")


def _point_shard_at(cache: Path, shard: str, manifest_file: str | None = None) -> None:
    """Every record names `shard`; the manifest's one shard entry names `manifest_file` (hashes recomputed)."""
    import hashlib

    from vaecache.cache.reader import CacheReader
    from vaecache.cache.table import CLIP_TABLE, write_table

    records = list(CacheReader(cache).clip_records())
    for record in records:
        record["shard"] = shard
    written = write_table(cache / "clips.parquet", CLIP_TABLE, records)
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["clips"]["sha256"] = written.sha256
    if manifest_file is not None:
        manifest["shards"][0]["file"] = manifest_file
    (cache / "manifest.json").write_text(json.dumps(manifest))
    assert hashlib.sha256((cache / "clips.parquet").read_bytes()).hexdigest() == written.sha256


def test_reader_never_reads_outside_the_cache(cache_copy: Path, tmp_path: Path) -> None:
    """A shard named outside OUT (`..`, an absolute path) or reached through a symlink out, and ids encode refuses,
    are refused by name; the file outside is never read (it is not even a safetensors file here)."""
    from vaecache.errors import UnsafePathError

    name = next((cache_copy / "shards").iterdir()).name
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / name).write_bytes(b"not yours")
    _point_shard_at(cache_copy, f"../../elsewhere/{name}", f"shards/../../elsewhere/{name}")
    for verify in ("size", "none"):
        with pytest.raises(UnsafePathError, match=r"clips.parquet: shard '../../elsewhere/.*' is not a plain"):
            LatentCache(cache_copy, verify=verify)[0]
    _point_shard_at(cache_copy, name, f"shards/{name}")
    (cache_copy / "shards" / name).rename(elsewhere / "real.safetensors")
    (cache_copy / "shards" / name).symlink_to(elsewhere / "real.safetensors")
    with pytest.raises(UnsafePathError, match="leads out of .* through a symlink"):
        LatentCache(cache_copy, verify="none")[0]
    (cache_copy / "shards" / name).unlink()
    (elsewhere / "real.safetensors").rename(cache_copy / "shards" / name)
    assert LatentCache(cache_copy)[0].mean is not None  # back inside: reads again
    manifest = json.loads((cache_copy / "manifest.json").read_text())
    manifest["clips"]["file"] = "/etc/passwd"
    (cache_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UnsafePathError, match="manifest.json: clips.file: '/etc/passwd' is not a path inside"):
        LatentCache(cache_copy)


def test_reader_refuses_ids_encode_refuses(cache_copy: Path) -> None:
    from vaecache.cache.reader import CacheReader
    from vaecache.cache.table import CLIP_TABLE, write_table
    from vaecache.errors import UnsafePathError

    records = list(CacheReader(cache_copy).clip_records())
    records[0].update(id="../../x/000000-000008", scene="../../x")
    records[1].update(id="scene_001/000000-000008", scene="scene_000")
    write_table(cache_copy / "clips.parquet", CLIP_TABLE, sorted(records, key=lambda r: r["id"]))
    cache = LatentCache(cache_copy)
    with pytest.raises(UnsafePathError, match=r"clip id '../../x/000000-000008': its scene id is a name with '/'"):
        cache[0]
    with pytest.raises(UnsafePathError, match="does not belong to its record's scene 'scene_000'"):
        cache["scene_001/000000-000008"]
    with pytest.raises(UnsafePathError):
        list(cache.records())
    assert cache[2].id == "scene_002/000000-000008"  # the clips that are what encode writes still read


def test_normalize_follows_the_recorded_constants(cache_copy: Path) -> None:
    cache = LatentCache(cache_copy)
    norm = cache.manifest["vae"]["normalization"]
    assert norm["formula"] == "(z - latents_mean) / latents_std"  # Wan, from the diffusers config
    z = cache[0].mean
    mean = torch.tensor(norm["latents_mean"]).view(-1, 1, 1, 1)
    std = torch.tensor(norm["latents_std"]).view(-1, 1, 1, 1)
    # bitwise the pipelines' arithmetic: the float32 reciprocal of latents_std, multiplied (pipeline_wan_i2v.py
    # prepare_latents), and on the way back divided by that reciprocal (pipeline_wan.py's decode)
    assert torch.equal(cache.normalize(z), (z - mean) * (1.0 / std))
    assert torch.equal(cache.denormalize(z), z / (1.0 / std) + mean)
    assert torch.allclose(cache.denormalize(cache.normalize(z)), z, atol=1e-6)
    batch = torch.stack([z, z])  # (B, cameras, C, F, H, W): the channel axis is -4 whatever leads it
    assert torch.equal(cache.normalize(batch)[1], (z - mean) * (1.0 / std))
    manifest = json.loads((cache_copy / "manifest.json").read_text())
    del manifest["vae"]["normalization"]["latents_std"]
    (cache_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(NormalizationError, match="manifest.json: normalization .* needs latents_std"):
        LatentCache(cache_copy).normalize(z)


def test_sample_draws_from_the_posterior(good_cache: Path) -> None:
    cache = LatentCache(good_cache)
    item = cache[0]
    drawn = cache.sample(item, torch.Generator().manual_seed(7))
    eps = torch.randn(item.mean.shape, generator=torch.Generator().manual_seed(7))
    assert torch.allclose(drawn, item.mean + torch.exp(0.5 * item.logvar) * eps)
    assert not torch.equal(drawn, cache.sample(item, torch.Generator().manual_seed(8)))


def test_batch_sampler_keeps_one_shape_per_batch_and_splits_ranks_evenly() -> None:
    shapes = [("a",)] * 7 + [("b",)] * 4 + [("c",)]
    def batches(rank: int, world: int, epoch: int = 0, seed: int = 0) -> list[list[int]]:
        sampler = ShapeBatchSampler(shapes, 3, seed=seed, rank=rank, world_size=world)
        sampler.set_epoch(epoch)
        assert len(list(sampler)) == len(sampler)
        return list(sampler)
    for batch in batches(0, 1):
        assert len({shapes[i] for i in batch}) == 1 and len(batch) <= 3
    assert sorted(i for b in batches(0, 1) for i in b) == list(range(12))
    per_rank = [batches(rank, 3) for rank in range(3)]
    assert len({len(b) for b in per_rank}) == 1  # every DDP rank takes the same number of steps
    assert {i for b in per_rank for batch in b for i in batch} == set(range(12))
    assert batches(0, 1) == batches(0, 1) and batches(0, 1) != batches(0, 1, epoch=1)
    assert batches(0, 1, seed=1) != batches(0, 1)


def test_docs_training_example_is_the_file_and_runs(caption_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    example = ROOT / "examples" / "train_latents.py"
    page = (ROOT / "docs" / "training.md").read_text()
    assert f"```python\n{example.read_text()}```" in page, ("docs/training.md's example differs from "
                                                            "examples/train_latents.py")
    monkeypatch.setattr(sys, "argv", [str(example), str(caption_cache)])
    gc.collect()  # the example forks two DataLoader workers (see the test above)
    runpy.run_path(str(example), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["rank 0 epoch 0", "rank 0 epoch 1"]
    assert "2 batches" in lines[0] and "nan" not in lines[1]


def test_example_without_a_cache_says_how_to_run_it() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_latents.py")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("usage: python examples/train_latents.py OUT")
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_example_under_torchrun_splits_the_batches_between_the_ranks(caption_cache: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "examples" / "train_latents.py"), str(caption_cache)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert [line.split(":")[0] for line in lines] == ["rank 0 epoch 0", "rank 0 epoch 1", "rank 1 epoch 0",
                                                      "rank 1 epoch 1"], proc.stdout
    assert all("1 batches" in line for line in lines)  # 2 batches in all: one per rank, not both on each
