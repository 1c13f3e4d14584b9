"""Reading a cache from object storage: a real S3-protocol server process (moto's standalone server, which s3fs's own
tests run against) on a loopback port; the reader over S3 equals the reader over the local copy, checks the same
sizes and hashes, and works in DataLoader workers."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import torch

from vaecache import LatentCache, LatentDataset, collate_latents
from vaecache.errors import ManifestError, ShardChecksumError

pytest.importorskip("moto.server", reason="moto[server] is in the test extras: pip install -e '.[test]'")
s3fs = pytest.importorskip("s3fs")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server in its own process on a free loopback port, for this module's tests."""
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=2).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not start on {endpoint}") from None
                time.sleep(0.2)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch):
    """An s3fs filesystem on the server, with the AWS environment a user would set for such a store."""
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_ENDPOINT_URL_S3", s3_endpoint)):
        monkeypatch.setenv(name, value)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    return fs


def upload(fs, local: Path, bucket: str) -> str:
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    fs.put(str(local), f"{bucket}/cache", recursive=True)
    return f"s3://{bucket}/cache"


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
