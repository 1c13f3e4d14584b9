"""Reading a cache from object storage: a real S3-protocol server process (moto's standalone server, which s3fs's own
tests run against) on a loopback port; the reader over S3 equals the reader over the local copy, checks the same
sizes and hashes, and works in DataLoader workers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.s3 import upload
from vaecache import LatentCache, LatentDataset, collate_latents
from vaecache.cache.reader import CacheReader
from vaecache.errors import ClipTableError, ManifestError, ShardChecksumError


def test_the_reader_over_s3_equals_the_reader_over_the_local_copy(s3, good_cache: Path) -> None:
    url = upload(s3, good_cache, "equal")
    local, remote = LatentCache(good_cache, verify="sha256"), LatentCache(url, verify="sha256")
    assert remote.ids() == local.ids() and remote.manifest == local.manifest and len(remote) == len(local)
    for clip_id in local.ids():
        mine, theirs = remote[clip_id], local[clip_id]
        assert mine.record == theirs.record and sorted(mine.tensors) == sorted(theirs.tensors)
        for key in theirs.tensors:
            assert torch.equal(mine.tensors[key], theirs.tensors[key])
    assert str(remote.out) == url and torch.equal(remote.normalize(local[0].mean), local.normalize(local[0].mean))


def test_a_changed_or_missing_object_is_named(s3, good_cache: Path, tmp_path: Path) -> None:
    url = upload(s3, good_cache, "damaged")
    shard = sorted(s3.ls("damaged/cache/shards"))[0]
    data = bytearray(s3.cat_file(shard))
    data[-1] ^= 0xFF  # same size, other bytes
    s3.pipe_file(shard, bytes(data))
    assert len(LatentCache(url, verify="size")[0].tensors) > 0  # the size still matches
    with pytest.raises(ShardChecksumError, match=f"{shard.split('/')[-1]}: sha256"):
        LatentCache(url, verify="sha256")[0]
    s3.pipe_file(shard, bytes(data[:-8]))
    with pytest.raises(ShardChecksumError, match="bytes, manifest.json records"):
        LatentCache(url, verify="size")[0]
    s3.rm("damaged/cache/failures.parquet")
    with pytest.raises(ClipTableError, match=f"^{url}/failures.parquet: missing$"):
        CacheReader(url).failure_records()
    s3.rm("damaged/cache/clips.parquet")
    with pytest.raises(ClipTableError, match=f"^{url}/clips.parquet: missing$"):
        next(CacheReader(url).clip_records())
    s3.rm("damaged/cache/manifest.json")
    with pytest.raises(ManifestError, match=f"{url}/manifest.json: no manifest"):
        LatentCache(url)
    with pytest.raises(ManifestError, match="s3://no-such-bucket/cache: no such bucket"):
        LatentCache("s3://no-such-bucket/cache")


def test_dataloader_workers_read_s3_each_with_its_own_filesystem(s3, good_cache: Path) -> None:
    url = upload(s3, good_cache, "workers")
    dataset = LatentDataset(url, verify="sha256")
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=dataset.batch_sampler(1, shuffle=False),
                                         num_workers=2, collate_fn=collate_latents)
    local = LatentCache(good_cache)
    seen = 0
    for batch in loader:
        assert torch.equal(batch["mean"][0], local[batch["id"][0]].mean)
        seen += 1
    assert seen == len(local)
