"""Caches for the report's tests: the demo data encoded by a trained VAE whose normalization constants fit its
latents (so a right scale reads as right), and helpers that rewrite a cache the way a person could and rehash it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tests.conftest import encode_ok
from vaecache.cache.reader import CacheReader


def fitted_moments(cache: Path) -> tuple[list[float], list[float]]:
    """Per channel, the mean and std of every stored posterior mean of `cache` (computed from the tensors)."""
    reader = CacheReader(cache)
    values = torch.cat([reader.clip_tensors(record)["mean"].double().transpose(0, 1).reshape(16, -1)
                        for record in reader.clip_records()], 1)
    return values.mean(1).tolist(), values.std(1, correction=0).tolist()


@pytest.fixture(scope="session")
def fitted_vae(demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """builtin:small saved as a diffusers folder whose config's latents_mean and latents_std are the moments of its
    posterior means over the demo data: a VAE whose published statistics are right for these clips (builtin:small
    itself records Wan 2.1's, measured for another latent space)."""
    from vaecache.vae.load import load_vae

    root = tmp_path_factory.mktemp("fitted")
    encode_ok(demo_data, root / "measure", "--vae", "builtin:small")
    mean, std = fitted_moments(root / "measure")
    module = load_vae("builtin:small").model.module
    module.register_to_config(latents_mean=[round(m, 6) for m in mean], latents_std=[round(s, 6) for s in std])
    module.save_pretrained(root / "vae", safe_serialization=True)
    return root / "vae"


@pytest.fixture(scope="session")
def fitted_cache(demo_data: Path, fitted_vae: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo data encoded by `fitted_vae`. Read-only."""
    out = tmp_path_factory.mktemp("fitted-cache") / "cache"
    encode_ok(demo_data, out, "--vae", f"diffusers:{fitted_vae}")
    return out


def rehash_fingerprint(cache: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply `edit` to the VAE record of the manifest and of run.json's fingerprint alike, and recompute the
    manifest's fingerprint_sha256 as encode computes it: every hash verify checks agrees afterwards."""
    run = json.loads((cache / "run.json").read_text())
    manifest = json.loads((cache / "manifest.json").read_text())
    edit(run["fingerprint"]["vae"])
    edit(manifest["vae"])
    manifest["fingerprint_sha256"] = hashlib.sha256(json.dumps(run["fingerprint"], sort_keys=True).encode()).hexdigest()
    (cache / "run.json").write_text(json.dumps(run, indent=2))
    (cache / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def rewrite_clips(cache: Path, edit: Callable[[dict[str, Any]], None], drop_channel_column: bool = False) -> None:
    """Rewrite the clip table with `edit` applied to every record (and, with `drop_channel_column`, without the
    per-channel statistics column, as vaecache 0.6.0 wrote it), and record its new sha256 in the manifest."""
    import pyarrow.parquet as pq

    from vaecache.cache.table import CLIP_TABLE, write_table

    records = list(CacheReader(cache).clip_records())
    for record in records:
        edit(record)
    write_table(cache / "clips.parquet", CLIP_TABLE, records)
    if drop_channel_column:
        table = pq.read_table(cache / "clips.parquet").drop_columns(["tensor_channel_stats"])
        pq.write_table(table, cache / "clips.parquet", compression="zstd")
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["clips"]["sha256"] = hashlib.sha256((cache / "clips.parquet").read_bytes()).hexdigest()
    (cache / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
