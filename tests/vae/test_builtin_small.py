"""builtin:small: the trained AutoencoderKLWan shipped in the package, and the script that trains it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from safetensors import safe_open

from vaecache.demodata import DemoDataSpec, render_clip
from vaecache.errors import VaeSpecError
from vaecache.vae import load_vae
from vaecache.vae.load import BUILTIN_SMALL_WEIGHTS, BUILTIN_TINY_CONFIG

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_builtin_vae.py"
HELDOUT = DemoDataSpec(scenes=3, cameras=2, frames=17, height=64, width=64, fps=10, seed=0)
"""The footage `vaecache demo` writes; the training script never trains on seed 0."""
MIN_PSNR_DB = 18.4
"""Held-out PSNR the shipped weights must keep on scene 0 camera 0, frames 0-8: 19.47 dB measured, minus 1 dB.
The issue's target is 25 dB; the shipped weights do not reach it (docs/vaes.md: 19.94 dB mean)."""
WEIGHTS_SHA256 = "54c5d6bdea640e8fa5ede1aa25df612abb9a3ca03653cea5920c2bf42dd456e5"
"""weights_sha256 of the shipped file loaded to fp32; changes only when the weights are retrained."""


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_train_builtin_vae", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is being built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def small():
    return load_vae("builtin:small")


def test_builtin_small_loads_trained_from_the_package_file(small) -> None:
    assert BUILTIN_SMALL_WEIGHTS.is_file() and BUILTIN_SMALL_WEIGHTS.stat().st_size <= 2 * 1024 * 1024
    fingerprint = small.model.fingerprint()
    assert fingerprint["family"] == "AutoencoderKLWan" and fingerprint["untrained"] is False
    assert fingerprint["spec"] == "builtin:small" and small.model.rule.temporal_factor == 4
    with safe_open(str(BUILTIN_SMALL_WEIGHTS), framework="pt") as handle:
        meta = handle.metadata()
    config = json.loads(meta["config"])
    assert {k: fingerprint["config"][k] for k in config} == config and json.loads(meta["train_args"])
    assert all(p.dtype == torch.float32 for p in small.model.module.parameters())
    # Stable: a second load hashes the same, and builtin:tiny is a different (untrained) model.
    assert fingerprint["weights_sha256"] == WEIGHTS_SHA256
    assert load_vae("builtin:small").model.fingerprint()["weights_sha256"] == WEIGHTS_SHA256
    tiny = load_vae("builtin:tiny")
    assert tiny.model.fingerprint()["untrained"] is True and tiny.model.weights_sha256 != small.model.weights_sha256
    assert {k: tiny.model.config[k] for k in BUILTIN_TINY_CONFIG} == BUILTIN_TINY_CONFIG


def test_unknown_builtin_names_both() -> None:
    with pytest.raises(VaeSpecError, match=r"unknown builtin VAE 'huge'.*the builtins are builtin:tiny, builtin:small"):
        load_vae("builtin:huge")


def test_a_heldout_demo_clip_round_trips(small) -> None:
    clip = render_clip(HELDOUT, 0, 0)[:9]  # scene 0, camera 0: what `vaecache demo` encodes first
    x = torch.from_numpy(clip).permute(3, 0, 1, 2).float().div(127.5).sub(1.0)[None]
    result = small.encode_views(x)
    assert result.mean.shape == (1, 16, 3, 8, 8) and result.logvar is not None
    assert torch.isfinite(result.logvar).all() and -30 < float(result.logvar.mean()) < 2
    with torch.no_grad():
        out = small.model.module.decode(result.mean.float()).sample
    pixels = ((out.clamp(-1, 1) + 1) * 127.5).round()[0].permute(1, 2, 3, 0).numpy()
    mse = float(np.mean((pixels - clip.astype(np.float64)) ** 2))
    assert 10 * np.log10(255.0 ** 2 / mse) >= MIN_PSNR_DB


def test_the_training_script_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "w.safetensors"
    argv = ["--steps", "2", "--pool", "2", "--batch", "1", "--frames", "5", "--crop", "32", "--heldout-scenes", "1",
            "--out", str(out)]
    assert _script().main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out.is_file() and result["bytes"] == out.stat().st_size and result["args"]["steps"] == 2
    assert len(result["heldout"]["per_view"]) == HELDOUT.cameras  # --heldout-scenes 1
    with safe_open(str(out), framework="pt") as handle:
        assert json.loads(handle.metadata()["config"])["base_dim"] == result["config"]["base_dim"]
