"""Fixtures for the VAE tests: every family saved to disk from a tiny random config, real decoded frames,
and an importable python-plugin module."""

from __future__ import annotations

import textwrap
from pathlib import Path

import diffusers
import pytest
import torch

from tests.vae.tiny_vaes import FAMILY_CONFIGS, LTX_MEAN, LTX_STD, PLUGIN_SOURCE, SIZE
from vaecache.demodata import DemoDataSpec, write_demo_dataset
from vaecache.video.dataset import ViewDecoder

SPEC = DemoDataSpec(scenes=1, cameras=2, frames=17, height=SIZE, width=SIZE, fps=10, seed=5)


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vaes")
    paths = {}
    for key, (cls, config) in FAMILY_CONFIGS.items():
        torch.manual_seed(1234)
        module = getattr(diffusers, cls)(**config)
        if key in ("ltx", "ltx2"):  # LTX keeps its normalization constants as buffers, not config
            module.latents_mean.copy_(LTX_MEAN)
            module.latents_std.copy_(LTX_STD)
        module.save_pretrained(root / key)
        paths[key] = root / key
    return paths


@pytest.fixture(scope="session")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One scene, 2 cameras x 17 frames of 32x32 h264: DATA/scene_000/cam_{0,1}.mp4."""
    root = tmp_path_factory.mktemp("clips") / "data"
    write_demo_dataset(root, SPEC)
    return root


@pytest.fixture(scope="session")
def views(data_root: Path) -> torch.Tensor:
    """(2 cameras, 3, 17, 32, 32): the real frames decoded exactly as the pipeline does (no resize needed)."""
    decoder = ViewDecoder(SIZE, SIZE)
    return torch.stack([decoder.decode(str(p), list(range(SPEC.frames)))
                        for p in sorted((data_root / "scene_000").glob("*.mp4"))])


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """`python:vaecache_test_plugin` + `:rowwise`, `:mean_only` or `:overflowing` (see tiny_vaes.PLUGIN_SOURCE)."""
    (tmp_path / "vaecache_test_plugin.py").write_text(textwrap.dedent(PLUGIN_SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "python:vaecache_test_plugin"
