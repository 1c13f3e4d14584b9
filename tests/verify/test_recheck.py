"""verify --dataset (coverage against the source) and --reencode (spot check with the recorded VAE)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import textwrap

from safetensors.torch import load_file, save_file

from vaecache.cache.reader import CacheReader
from vaecache.cache.table import CLIP_TABLE, write_table
from vaecache.cache.writer import channel_stats, tensor_stats
from vaecache.demodata import DemoDataSpec, write_demo_dataset


def test_coverage_names_missing_and_vanished_clips(good_cache, demo_data, tmp_path, run_cli):
    source = shutil.copytree(demo_data, tmp_path / "data")
    assert run_cli(["verify", good_cache, "--dataset", source]).exit_code == 0
    shutil.rmtree(source / "scene_002")
    write_demo_dataset(tmp_path / "extra", DemoDataSpec(scenes=1, cameras=2, frames=17, seed=9))
    shutil.move(tmp_path / "extra" / "scene_000", source / "scene_new")
    result = run_cli(["verify", good_cache, "--dataset", source])
    assert result.exit_code == 1
    assert "scene_new/000000-000008: in the source, missing from the cache" in result.output
    assert "scene_002/000000-000008: in the cache, no longer in the source" in result.output


def test_reencode_matches_exactly_on_the_same_machine(good_cache, run_cli, tmp_path):
    report = tmp_path / "report.json"
    result = run_cli(["verify", good_cache, "--reencode", "2", "--seed", "1", "--json", report])
    assert result.exit_code == 0, result.output
    row = [c for c in json.loads(report.read_text())["checks"] if c["name"].startswith("re-encode")][0]
    assert (row["passed"], row["failed"]) == (2, 0)
    assert row["note"].startswith("max abs difference 0, 0 of the stored max")


def test_reencode_catches_a_tensor_altered_with_every_hash_and_stat_recomputed(cache_copy, run_cli):
    records = list(CacheReader(cache_copy).clip_records())
    victim = records[0]
    shard_path = cache_copy / "shards" / victim["shard"]
    tensors = load_file(shard_path)
    name = victim["tensors"]["mean"]["name"]
    tensors[name] = tensors[name] * 1.5  # plausible values, all finite
    save_file(tensors, shard_path, metadata={"format": "vaecache/1"})
    victim["tensors"]["mean"]["stats"] = tensor_stats(tensors[name])
    victim["tensors"]["mean"]["channel_stats"] = channel_stats(tensors[name])
    written = write_table(cache_copy / "clips.parquet", CLIP_TABLE, records)
    manifest = json.loads((cache_copy / "manifest.json").read_text())
    manifest["clips"]["sha256"] = written.sha256
    for shard in manifest["shards"]:
        if shard["file"].endswith(victim["shard"]):
            shard["bytes"] = shard_path.stat().st_size
            shard["sha256"] = hashlib.sha256(shard_path.read_bytes()).hexdigest()
    (cache_copy / "manifest.json").write_text(json.dumps(manifest))
    assert run_cli(["verify", cache_copy]).exit_code == 0  # integrity checks cannot see it
    result = run_cli(["verify", cache_copy, "--reencode", "3"])
    assert result.exit_code == 1
    assert f"clip {victim['id']}: re-encoded latents differ" in result.output


def test_reencode_with_another_vae_is_refused(good_cache, run_cli, tmp_path, monkeypatch):
    (tmp_path / "other_vae.py").write_text(textwrap.dedent("""
        import torch
        from vaecache.vae import load_vae

        def make():
            vae = load_vae("builtin:tiny").model.module
            with torch.no_grad():
                next(vae.parameters()).add_(1.0)
            return vae
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("other_vae", None)
    result = run_cli(["verify", good_cache, "--reencode", "1", "--vae", "python:other_vae:make"])
    assert result.exit_code == 2
    assert "does not match the VAE recorded" in result.output


def test_reencode_fails_a_vae_that_is_not_reproducible(demo_data, tmp_path, run_cli, monkeypatch):
    """A VAE adding 1e-3 of noise gives other latents on every run; the default tolerance (1e-6 of the stored
    max for fp32) fails it, and only an explicit --tolerance lets it pass."""
    (tmp_path / "noisy_vae.py").write_text(textwrap.dedent("""
        import types
        import torch

        class Noisy(torch.nn.Module):
            vaecache_spatial_factor = 2
            vaecache_latent_channels = 4

            def __init__(self):
                super().__init__()
                self.pool = torch.nn.AvgPool3d((1, 2, 2))

            def encode(self, x):
                mean = self.pool(torch.cat([x, x[:, :1]], 1)) + 1e-3 * torch.randn(1)
                return types.SimpleNamespace(mean=mean, logvar=torch.zeros_like(mean))

        def make():
            return Noisy()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("noisy_vae", None)
    out = tmp_path / "cache"
    encoded = run_cli(["encode", demo_data, "--out", out, "--vae", "python:noisy_vae:make", "--num-frames", "9",
                       "--size", "64x64", "--workers", "0", "--no-progress"])
    assert encoded.exit_code == 0, encoded.output
    given = ["--vae", "python:noisy_vae:make"]  # a recorded python: VAE loads only when given again
    strict = run_cli(["verify", out, "--reencode", "2", *given])
    assert (strict.exit_code == 1 and "re-encoded latents differ by" in strict.output
            and "tolerance 1e-06" in strict.output)
    assert run_cli(["verify", out, "--reencode", "2", "--tolerance", "0.1", *given]).exit_code == 0
    assert run_cli(["verify", out, "--reencode", "1", "--tolerance", "-1", *given]).exit_code == 2


def test_identity_change_names_what_changed() -> None:
    from vaecache.cache.provenance import identity_change

    old = {"size": 10, "mtime_ns": 1_700_000_000_000_000_000}
    assert identity_change(old, dict(old)) is None
    assert identity_change(old, None) == "missing or unreadable"
    assert identity_change(old, {**old, "size": 12}) == "size 10 -> 12 bytes"
    assert identity_change(old, {**old, "mtime_ns": 1_700_000_060_000_000_000}) == (
        "modified (mtime 2023-11-14T22:13:20+00:00 -> 2023-11-14T22:14:20+00:00)")
    hashed = {**old, "sha256": "a" * 64}
    assert identity_change(hashed, {**hashed, "mtime_ns": 5}) is None  # touched, same content
    assert identity_change(hashed, {**hashed, "sha256": "b" * 64}) == "content differs (sha256)"


def test_verify_dataset_reports_sources_changed_since_encoding(tmp_path, run_cli, cache_io):
    """Each clip records its sources' size, mtime and (--hash-sources) sha256; verify --dataset names the
    files changed since, what changed and how many clips are stale. A file only touched is not stale."""
    data = tmp_path / "data"
    write_demo_dataset(data, DemoDataSpec(scenes=3, cameras=1, frames=5, height=32, width=32))
    out = tmp_path / "cache"
    encoded = run_cli(["encode", data, "--out", out, "--vae", "builtin:tiny", "--num-frames", "5", "--size", "32x32",
                       "--workers", "0", "--no-progress", "--hash-sources"])
    assert encoded.exit_code == 0, encoded.output
    first = cache_io.clips(out)[0]
    path = first["sources"][0]
    stat = os.stat(path)
    assert first["source_identity"] == [{"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                                         "sha256": hashlib.sha256(open(path, "rb").read()).hexdigest()}]
    assert run_cli(["verify", out, "--dataset", data]).exit_code == 0
    touched, edited, grown = (data / f"scene_00{i}" / "cam_0.mp4" for i in range(3))
    os.utime(touched, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    content = bytearray(edited.read_bytes())
    content[-1] ^= 0xFF  # same size, same mtime: only the hash tells
    edited.write_bytes(bytes(content))
    os.utime(edited, ns=(os.stat(edited).st_atime_ns, cache_io.clips(out)[1]["source_identity"][0]["mtime_ns"]))
    with open(grown, "ab") as handle:
        handle.write(b"\0" * 7)
    report = tmp_path / "report.json"
    result = run_cli(["verify", out, "--dataset", data, "--json", report])
    assert result.exit_code == 1
    assert f"scene scene_001: {edited.resolve()}: content differs (sha256) since it was encoded; 1 clip(s) stale " \
           "(first scene_001/000000-000004)" in result.output
    size = os.stat(grown).st_size
    assert f"scene scene_002: {grown.resolve()}: size {size - 7} -> {size} bytes since it was encoded" in result.output
    (row,) = [c for c in json.loads(report.read_text())["checks"] if c["name"] == "sources unchanged since encoded"]
    assert (row["passed"], row["failed"]) == (1, 2)
    assert row["note"] == "2 of 3 source file(s) changed since encoding, 2 clip(s) with stale latents"
