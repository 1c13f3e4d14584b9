"""A kind of tensor declared outside vaecache (tests/cache/latent_mean.py) gets everything a built-in kind gets: it
is embedded, verified (a removed tensor named with every hash recomputed), crash-safe, read by LatentCache in a
DataLoader's worker processes and exported to WebDataset, with no change under vaecache/. It is read where an
installed package declares it (a `vaecache.kinds` entry point, tests/cache/installed_kinds.py); what a manifest names
is never imported (tests/cache/test_kind_imports.py)."""

from __future__ import annotations

import hashlib
import io
import json
import shutil

import pytest
import torch

from tests.cache.installed_kinds import child_path, install_kinds
from tests.conftest import run_vaecache
from vaecache.training import LatentCache

KIND = ["--kind", "tests.cache.latent_mean", "--shard-size", "1"]  # one clip per shard: three shards


@pytest.fixture(autouse=True)
def installed(tmp_path, monkeypatch):
    """The package declaring latent-mean installed: on sys.path here (and a spawned DataLoader worker's), on
    PYTHONPATH for child processes."""
    site = install_kinds(tmp_path / "site", {"latent-mean": "tests.cache.latent_mean"})
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", child_path(site))
    return site


def files_of(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def cache(good_cache, tmp_path):
    return shutil.copytree(good_cache, tmp_path / "cache")


def test_a_kind_declared_outside_vaecache_is_embedded_recorded_and_read_by_latentcache(cache, run_cli, tmp_path):
    added = run_cli(["embed", cache, *KIND])
    assert added.exit_code == 0, added.output
    assert "added latent-mean set 'default'" in added.output and "3 item(s) computed" in added.output
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["kinds"] == {"latent-mean": "tests.cache.latent_mean"}
    assert len(manifest["latent-mean"]["default"]["shards"]) == 3
    latents = LatentCache(cache)
    for item in latents:
        assert torch.equal(item["latent-mean/default"], item["mean"].float().mean(dim=2))
    loader = torch.utils.data.DataLoader(LatentCache(cache), batch_size=None, num_workers=1,
                                         multiprocessing_context="spawn")
    assert [sorted(key for key in item.tensors if key.startswith("latent-mean")) for item in loader] == \
        [["latent-mean/default"]] * 3
    checked = run_vaecache("verify", cache, "--json", tmp_path / "report.json")  # another process: it finds the
    assert checked.returncode == 0, checked.stdout + checked.stderr  # kind by the installed entry point
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["summary"]["latent-mean_sets"] == ["default"]
    assert [check["failed"] for check in report["checks"] if check["name"] == "latent-mean set default"] == [0]
    again = run_cli(["embed", cache, *KIND])
    assert again.exit_code == 0 and "up to date" in again.output


def test_verify_names_a_removed_tensor_of_the_declared_kind_with_every_hash_recomputed(cache, run_cli):
    from safetensors.torch import load, save

    assert run_cli(["embed", cache, *KIND]).exit_code == 0
    manifest = json.loads((cache / "manifest.json").read_text())
    entry = manifest["latent-mean"]["default"]["shards"][1]
    shard = cache / entry["file"]
    tensors = load(shard.read_bytes())
    (clip,) = tensors
    forged = save({}, metadata={"vaecache_latent_mean": "default"})
    shard.write_bytes(forged)
    entry.update(bytes=len(forged), sha256=hashlib.sha256(forged).hexdigest())
    (cache / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    report = run_cli(["verify", cache])
    assert report.exit_code == 1
    assert f"holds no tensor for clip {clip}" in report.output


def test_the_declared_kind_links_each_item_to_its_clip(cache, run_cli):
    import pyarrow as pa
    import pyarrow.parquet as pq

    assert run_cli(["embed", cache, *KIND]).exit_code == 0
    manifest = json.loads((cache / "manifest.json").read_text())
    record = manifest["latent-mean"]["default"]
    table_file = cache / record["tables"]["clips"]["file"]
    table = pq.read_table(table_file)
    latents = table.column("latents").to_pylist()
    forged = table.set_column(table.column_names.index("latents"), "latents",
                              pa.array([latents[1], latents[0], *latents[2:]], pa.string()))
    buffer = io.BytesIO()
    pq.write_table(forged, buffer)
    table_file.write_bytes(buffer.getvalue())
    record["tables"]["clips"].update(bytes=len(buffer.getvalue()),
                                     sha256=hashlib.sha256(buffer.getvalue()).hexdigest())
    (cache / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    report = run_cli(["verify", cache])
    assert report.exit_code == 1 and "made from other latents than the clip's" in report.output


@pytest.mark.parametrize("crash_at", [1, 3])  # after the first shard; after the last, before the manifest
def test_a_killed_embed_of_the_declared_kind_resumes_to_the_bytes_of_an_uninterrupted_one(good_cache, run_cli,
                                                                                          tmp_path, crash_at):
    whole, killed = (shutil.copytree(good_cache, tmp_path / name) for name in ("whole", "killed"))
    assert run_cli(["embed", whole, *KIND]).exit_code == 0
    crashed = run_vaecache("embed", killed, *KIND,
                           env={"VAECACHE_FAULT": f"crash-after-set-shard:latent-mean:{crash_at}"})
    assert crashed.returncode == 137, crashed.stderr[-2000:]
    assert "latent-mean" not in json.loads((killed / "manifest.json").read_text())
    assert run_cli(["verify", killed]).exit_code == 1  # what the dead process left is named
    resumed = run_cli(["embed", killed, *KIND])
    assert resumed.exit_code == 0 and f"{crash_at} shard(s) an interrupted run committed kept" in resumed.output
    assert files_of(killed / "latent-mean") == files_of(whole / "latent-mean")
    assert (killed / "manifest.json").read_bytes() == (whole / "manifest.json").read_bytes()
    assert run_cli(["verify", killed]).exit_code == 0


def test_the_webdataset_export_carries_the_declared_kind_decoded_as_latentcache_gives_it(cache, run_cli, tmp_path):
    import webdataset

    from vaecache.export.webdataset import decode_sample

    assert run_cli(["embed", cache, *KIND]).exit_code == 0
    target = tmp_path / "wds"
    exported = run_cli(["export", cache, "--format", "webdataset", "--out", target])
    assert exported.exit_code == 0, exported.output
    latents = LatentCache(cache)
    samples = [decode_sample(sample) for sample in webdataset.WebDataset(
        [str(p) for p in sorted(target.glob("*.tar"))], shardshuffle=False, empty_check=False)]
    assert len(samples) == 3
    for sample in samples:
        clip = sample["record"]["id"]
        assert torch.equal(sample["latent-mean/default"], latents[clip]["latent-mean/default"])
    info = json.loads((target / "export.json").read_text())
    assert "latent-mean.safetensors" in info["sample"]


def test_overwrite_removes_the_declared_kinds_sets_with_the_rest_of_the_cache(demo_data, cache, run_cli):
    from tests.conftest import encode_ok

    assert run_cli(["embed", cache, *KIND]).exit_code == 0
    encode_ok(demo_data, cache, "--overwrite")
    assert not (cache / "latent-mean").exists()
    assert "kinds" not in json.loads((cache / "manifest.json").read_text())
    assert run_cli(["verify", cache]).exit_code == 0


def test_inspect_lists_every_kinds_sets_from_the_manifest(cache, run_cli):
    assert run_cli(["embed", cache, *KIND]).exit_code == 0
    assert run_cli(["embed", cache, "--condition", "first-frame"]).exit_code == 0
    shown = run_cli(["inspect", cache])
    assert shown.exit_code == 0, shown.output
    assert "conditions set first-frame: 3 clips, 1 shard(s)" in shown.output
    assert "latent-mean set default: 3 clips, 3 shard(s)" in shown.output
    assert "(declared by tests.cache.latent_mean)" in shown.output


@pytest.mark.parametrize("name", ["vae", "shards", "kinds", "progress", "a/b", ""])
def test_a_kind_may_not_take_a_name_of_the_caches_own_layout_or_manifest(name):
    from vaecache.cache.kinds import SetKind, register
    from vaecache.errors import UsageError

    class Clashing(SetKind):
        pass

    Clashing.name = name
    with pytest.raises(UsageError, match="set kind"):
        register(Clashing())


def test_embed_kind_names_a_module_that_does_not_import_or_declares_no_kind(cache, run_cli):
    missing = run_cli(["embed", cache, "--kind", "tests.cache.no_such_module"])
    assert missing.exit_code == 2 and "--kind tests.cache.no_such_module: the module does not import" in missing.output
    none = run_cli(["embed", cache, "--kind", "tests.cache.test_set_kinds"])
    assert none.exit_code == 2 and "must register exactly one set kind" in none.output
