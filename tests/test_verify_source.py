"""verify --dataset (coverage against the source) and --reencode (spot check with the recorded VAE)."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import textwrap

from safetensors.torch import load_file, save_file

from vaecache.demodata import DemoDataSpec, write_demo_dataset
from vaecache.format.reader import CacheReader
from vaecache.format.table import CLIP_TABLE, write_table
from vaecache.format.writer import tensor_stats


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
            vae = load_vae("builtin:tiny").module
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
    strict = run_cli(["verify", out, "--reencode", "2"])
    assert strict.exit_code == 1 and "re-encoded latents differ by" in strict.output and "tolerance 1e-06" in strict.output
    assert run_cli(["verify", out, "--reencode", "2", "--tolerance", "0.1"]).exit_code == 0
    assert run_cli(["verify", out, "--reencode", "1", "--tolerance", "-1"]).exit_code == 2
