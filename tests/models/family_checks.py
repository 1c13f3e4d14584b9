"""What every model family added as one module is checked for: its stored posteriors are diffusers' own encode of
the frames vaecache read, `verify --reencode` passes, a killed encode resumes to the same bytes, and the WebDataset
export carries the same tensors. Shared by the tests of each family (test_mochi.py, test_qwenimage.py, ...)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import webdataset
from safetensors.torch import load as safetensors_load

from tests.conftest import invoke, load_tensors, subprocess_env
from vaecache.demodata import DemoDataSpec, write_demo_dataset
from vaecache.training import LatentCache


def write_data(root: Path, frames: int, size: int, seed: int = 5) -> Path:
    """Two scenes of one camera, `frames` frames of size x size h264."""
    write_demo_dataset(root, DemoDataSpec(scenes=2, cameras=1, frames=frames, height=size, width=size, fps=10,
                                          seed=seed))
    return root


def encode_args(data: Path, out: Path, vae: Path, num_frames: int, size: int) -> list[str]:
    return ["encode", str(data), "--out", str(out), "--vae", f"diffusers:{vae}", "--num-frames", str(num_frames),
            "--size", f"{size}x{size}", "--workers", "0", "--no-progress", "--shard-size", "1"]


def encode(data: Path, out: Path, vae: Path, num_frames: int, size: int) -> LatentCache:
    result = invoke(encode_args(data, out, vae, num_frames, size))
    assert result.exit_code == 0, result.output
    return LatentCache(out)


def assert_diffusers_latents(cache: LatentCache, module: Any) -> int:
    """Every stored mean and logvar torch.equal to diffusers' own encode of the frames vaecache read, by the module
    frozen as trainers freeze it (`requires_grad_(False)`: Mochi's encoder takes another kernel path, an ulp away,
    while its parameters require grad, even under no_grad); the count."""
    module.eval().requires_grad_(False)
    count = 0
    for item in cache:
        frames = cache.source_frames(item.id)
        with torch.no_grad():
            posterior = module.encode(frames).latent_dist
        assert torch.equal(item.mean, posterior.mean), item.id
        assert torch.equal(item.tensors["logvar"], posterior.logvar), item.id
        count += 1
    assert count > 0
    return count


def assert_reencode_passes(out: Path, clips: int) -> None:
    result = invoke(["verify", out, "--reencode", str(clips)])
    assert result.exit_code == 0, result.output


def assert_webdataset_export(cache_dir: Path, target: Path) -> None:
    result = invoke(["export", cache_dir, "--format", "webdataset", "--out", target, "--energon", "off"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((target / "export.json").read_text())
    cache = LatentCache(cache_dir)
    samples = list(webdataset.WebDataset([str(target / name) for name in manifest["shards"]],
                                         shardshuffle=False).decode())
    assert len(samples) == len(cache)
    items = {item.id: item for item in cache}
    for sample in samples:
        item = items[sample["json"]["id"]]
        tensors = safetensors_load(sample["latents.safetensors"])
        assert torch.equal(tensors["mean"], item.mean) and torch.equal(tensors["logvar"], item.tensors["logvar"])


def assert_resume_after_kill(data: Path, out: Path, vae: Path, num_frames: int, size: int, uninterrupted: Path) -> None:
    """A child encode killed (os._exit) right after its first commit, then rerun: the bytes of an uninterrupted one."""
    crashed = subprocess.run([sys.executable, "-m", "vaecache", *encode_args(data, out, vae, num_frames, size)],
                             capture_output=True, text=True, timeout=300,
                             env=subprocess_env(VAECACHE_FAULT="crash-after-commit:1"))
    assert crashed.returncode == 137, crashed.stderr
    assert not (out / "manifest.json").exists()
    rerun = invoke(encode_args(data, out, vae, num_frames, size), env={"VAECACHE_FAULT": None})
    assert rerun.exit_code == 0, rerun.output
    assert "1 clips already committed" in (out / "logs" / "rank-00000.log").read_text()
    done, reference = load_tensors(out), load_tensors(uninterrupted)
    assert sorted(done) == sorted(reference)
    assert all(torch.equal(done[name], reference[name]) for name in done)
