"""The one storage interface under a cache: a folder and an S3 bucket (a real S3-protocol server) answer every
operation the cache needs alike, and each refuses what it must (a symlink out of OUT, a second create)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save

from tests.s3 import make_bucket
from vaecache.cache.store import LocalStore, ObjectStore, Store, open_store
from vaecache.errors import ShardHeaderError, UnsafePathError, UsageError


@pytest.fixture(params=["folder", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "folder":
        return open_store(tmp_path / "out")
    s3 = request.getfixturevalue("s3")
    make_bucket(s3, "store-ops")
    s3.rm("store-ops/out", recursive=True) if s3.exists("store-ops/out") else None
    return open_store("s3://store-ops/out")


def test_both_stores_answer_every_operation_alike(store: Store) -> None:
    assert isinstance(store, ObjectStore if str(store.location).startswith("s3://") else LocalStore)
    assert store.listing("shards") == {} and not store.exists("manifest.json")
    with pytest.raises(FileNotFoundError):
        store.read("manifest.json")
    assert store.read_if_present("manifest.json") is None
    store.write("shards/a.bin", b"0123456789")
    store.write("progress/commits/a.json", b"{}\n")
    store.write("shards/a.bin", b"abcdefghij")  # a whole new object in place of the old
    assert store.read("shards/a.bin") == b"abcdefghij" and store.size("shards/a.bin") == 10
    assert store.read_range("shards/a.bin", 2, 5) == b"cde"
    with store.open("shards/a.bin") as handle:
        handle.seek(8)
        assert handle.read() == b"ij"
    assert store.listing("shards") == {"shards/a.bin": 10}
    assert store.listing("progress") == {"progress/commits/a.json": 3}
    store.create(".lock", b"mine")
    with pytest.raises(FileExistsError):
        store.create(".lock", b"theirs")
    assert store.read(".lock") == b"mine"
    assert store.sha256("shards/a.bin") == "72399361da6a7754fec986dca5b7cbaf1c810a28ded4abaf56b2106d06cb78b0"
    store.delete(["shards/a.bin", "shards/never-there.bin"])
    assert store.listing("shards") == {} and not store.exists("shards/a.bin")


def test_a_shard_reads_alike_from_both_stores(store: Store) -> None:
    tensors = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)}
    store.write("shards/s.safetensors", save(tensors))
    shard = store.shard("shards/s.safetensors")
    assert sorted(shard.keys()) == ["a", "b"]
    for name, tensor in tensors.items():
        assert torch.equal(shard.get_tensor(name), tensor) and shard.get_tensor(name).dtype == tensor.dtype
    store.write("shards/bad.safetensors", b"\xff" * 16)
    with pytest.raises(ShardHeaderError, match="bad.safetensors"):
        store.shard("shards/bad.safetensors").keys()


def test_a_folder_refuses_a_name_that_leads_out_through_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "elsewhere.bin").write_bytes(b"secret")
    store = LocalStore(tmp_path / "out")
    (tmp_path / "out" / "shards").mkdir(parents=True)
    os.symlink(tmp_path / "elsewhere.bin", tmp_path / "out" / "shards" / "x.safetensors")
    with pytest.raises(UnsafePathError, match="through a symlink"):
        store.read("shards/x.safetensors")
    with pytest.raises(UnsafePathError, match="leaves"):
        store.write("../escape.bin", b"")
    with pytest.raises(UsageError, match="no such folder"):
        LocalStore(tmp_path / "nope").check_present()
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(UsageError, match="not a folder"):
        LocalStore(tmp_path / "file").check_present()


def test_the_store_is_chosen_once_from_out(tmp_path: Path, s3: Any) -> None:
    assert isinstance(open_store(tmp_path), LocalStore) and isinstance(open_store(str(tmp_path)), LocalStore)
    remote = open_store("s3://some-bucket/cache/")
    assert isinstance(remote, ObjectStore) and str(remote.location) == "s3://some-bucket/cache"
    assert open_store(remote) is remote


def test_one_listing_answers_from_one_request_and_follows_this_process_s_writes(s3: Any) -> None:
    make_bucket(s3, "one-listing")
    store = open_store("s3://one-listing/out")
    store.write("progress/commits/a.json", b"{}\n")
    store.write("run.json", b"")  # an empty object reads whole (S3 answers its range 0- with 416)
    assert store.read("run.json") == b"" and store.read_many(["run.json"]) == {"run.json": b""}
    calls = []
    find = store.fs.find
    store.fs.find = lambda *args, **kwargs: calls.append(args) or find(*args, **kwargs)
    with store.one_listing():
        assert store.listing("progress") == {"progress/commits/a.json": 3} and store.listing("shards") == {}
        assert store.entries() == {"progress", "run.json"} and not store.exists("manifest.json")
        with pytest.raises(FileNotFoundError):
            store.read("manifest.json")
        store.write("shards/s.safetensors", b"12345")
        store.delete(["progress/commits/a.json", "never-there"])
        assert store.listing("shards") == {"shards/s.safetensors": 5} and store.listing("progress") == {}
    assert len(calls) == 1  # the one listing, whatever was asked inside
    assert store.listing("shards") == {"shards/s.safetensors": 5} and store.listing("progress") == {}


def test_out_s_top_level_is_one_request_even_where_it_holds_nothing(s3: Any, s3_endpoint: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.s3 import StoreProxy
    from vaecache.cache.objects import check_object_out
    from vaecache.errors import OutputError

    make_bucket(s3, "top-level")
    s3.pipe_file("top-level/full/run.json", b"{}")
    counting = StoreProxy(s3_endpoint, {})
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", counting.endpoint)
        full, empty, no_bucket = (open_store(url) for url in ("s3://top-level/full", "s3://top-level/empty",
                                                              "s3://no-such-bucket-here/out"))
        assert full.entries() == {"run.json"}
        listed = len(counting.paths)
        with pytest.raises(FileNotFoundError):
            empty.entries()
        assert [path.split("&")[0] for _, path in counting.paths[listed:]] == ["/top-level?list-type=2"]
        assert check_object_out(empty) == set()
        with pytest.raises(OutputError, match=r"s3://no-such-bucket-here/out: no such bucket"):
            check_object_out(no_bucket)
    finally:
        counting.close()


def test_a_file_url_is_the_local_folder_it_names(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/my%20cache")
    assert isinstance(store, LocalStore) and store.folder == tmp_path / "my cache"
    assert open_store(f"file://localhost{tmp_path}").folder == tmp_path  # type: ignore[attr-defined]
    with pytest.raises(UsageError, match=r"file://host/x: a file:// URL names a path on this machine"):
        open_store("file://host/x")


@pytest.mark.parametrize("protocol", ["DiskOut", "ObjectOut"])
def test_both_commit_protocols_offer_every_operation_a_run_asks_of_out(protocol: str) -> None:
    """A run and the shard writer hold OUT as a CacheOut: each protocol must take every operation with the same
    parameters, or a run on the other store fails at its first call of it (hours in)."""
    import inspect

    from vaecache.cache import commits

    implementation = {"DiskOut": commits.DiskOut, "ObjectOut": commits.ObjectOut}[protocol]
    operations = [name for name, member in vars(commits.CacheOut).items()
                  if callable(member) and not name.startswith("_")]
    assert len(operations) > 15
    for name in operations:
        wanted = inspect.signature(getattr(commits.CacheOut, name))
        found = inspect.signature(getattr(implementation, name))
        assert list(found.parameters) == list(wanted.parameters), (protocol, name, found, wanted)
        assert [p.default for p in found.parameters.values()] == [p.default for p in wanted.parameters.values()]
