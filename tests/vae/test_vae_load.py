"""Loading: spec resolution, diffusers folders (safetensors only unless pickle is allowed), the python
plugin protocol, dtype rules, tiling setup, and the fingerprint of what was loaded."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import diffusers
import pytest
import torch

from tests.vae.tiny_vaes import FAMILY_CONFIGS, SIZE, TILES
from vaecache.errors import UsageError, VaeSpecError
from vaecache.models.rules import FrameRule
from vaecache.vae import VaeModel, VaeRunner, fingerprint, load_vae


def _load(models: dict[str, Path], key: str, **kwargs: Any) -> VaeRunner:
    return load_vae(f"diffusers:{models[key]}", **kwargs)


def test_subfolder_and_pipeline_folder_hint(models: dict[str, Path]) -> None:
    root = models["hunyuan"].parent
    assert load_vae(f"diffusers:{root}#hunyuan").model.family == "AutoencoderKLHunyuanVideo"
    with pytest.raises(VaeSpecError, match="no config.json"):
        load_vae(f"diffusers:{root}")


@pytest.fixture(scope="module")
def pickled_wan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A tiny AutoencoderKLWan saved with pickled weights only (diffusion_pytorch_model.bin)."""
    folder = tmp_path_factory.mktemp("pickled") / "wan"
    cls, config = FAMILY_CONFIGS["wan"]
    torch.manual_seed(7)
    module = getattr(diffusers, cls)(**config)
    module.save_pretrained(folder, safe_serialization=False)
    assert [p.name for p in folder.glob("*.bin")] and not list(folder.glob("*.safetensors"))
    return folder, module


def test_pickled_weights_are_refused_unless_allowed(pickled_wan: tuple[Path, torch.nn.Module]) -> None:
    folder, module = pickled_wan
    with pytest.raises(VaeSpecError, match=rf"^{folder}: holds only pickled weights \(diffusion_pytorch_model.bin\)"
                                           r".*--allow-pickle-weights"):
        load_vae(f"diffusers:{folder}")
    vae = load_vae(f"diffusers:{folder}", allow_pickle_weights=True)
    assert torch.equal(vae.model.module.encoder.conv_in.weight, module.encoder.conv_in.weight)


def test_safetensors_folder_loads_without_the_pickle_flag(models: dict[str, Path]) -> None:
    vae = _load(models, "wan")
    assert vae.model.family == "AutoencoderKLWan" and list(models["wan"].glob("*.safetensors"))


def test_plugin_protocol(plugin: str, views: torch.Tensor) -> None:
    vae = load_vae(f"{plugin}:rowwise")
    assert vae.model.rule == FrameRule(2, 4, causal=True, label="RowwiseVae") and vae.model.has_logvar
    assert vae.latent_shape(9, SIZE, SIZE) == (3, 5, 8, 8)  # channels found by one dummy encode
    result = vae.encode_views(views[:, :, :9])
    assert tuple(result.mean.shape) == (2, 3, 5, 8, 8) and result.logvar is not None
    mean_only = load_vae(f"{plugin}:mean_only")
    assert not mean_only.model.has_logvar and mean_only.encode_views(views[:1, :, :2]).logvar is None
    assert mean_only.latent_shape(2, SIZE, SIZE) == (3, 2, 16, 16)


def test_fp16_refused_for_ltx(models: dict[str, Path]) -> None:
    with pytest.raises(UsageError, match="--dtype fp16 is refused for AutoencoderKLLTXVideo.*bf16"):
        _load(models, "ltx", dtype="fp16")


def test_unknown_dtype_is_refused(models: dict[str, Path]) -> None:
    with pytest.raises(UsageError, match="--dtype must be one of fp32, bf16, fp16, got 'float64'"):
        _load(models, "kl", dtype="float64")


def test_fp16_upcast_for_force_upcast_families(models: dict[str, Path], views: torch.Tensor) -> None:
    vae = _load(models, "kl", dtype="fp16")
    assert vae.model.compute_dtype == torch.float32 and vae.model.dtype == torch.float16
    assert "runs in fp32" in vae.model.dtype_note and vae.model.fingerprint()["precision"]["compute"] == "float32"
    x = views[:1, :, :2]
    result = vae.encode_views(x)
    assert result.mean.dtype == torch.float16
    assert torch.equal(result.mean, _load(models, "kl").encode_views(x).mean.half())


def test_bf16_runs_and_stores_bf16(models: dict[str, Path], views: torch.Tensor) -> None:
    vae = _load(models, "hunyuan", dtype="bf16")
    result = vae.encode_views(views[:1, :, :5])
    assert result.mean.dtype == torch.bfloat16 and torch.isfinite(result.mean.float()).all()
    assert vae.model.fingerprint()["precision"] == {"compute": "bfloat16", "stored": "bfloat16", "note": None}


def test_tiling_is_recorded_and_changes_latents(models: dict[str, Path], views: torch.Tensor) -> None:
    plain = _load(models, "hunyuan", tile_options=TILES)
    tiled = _load(models, "hunyuan", tiling=True, tile_options=TILES)
    tiling = tiled.model.fingerprint()["tiling"]
    assert plain.model.fingerprint()["tiling"]["enabled"] is False and tiling["enabled"] is True
    assert tiling["params"]["tile_sample_min_height"] == 16 and tiling["params"]["use_framewise_encoding"] is True
    x = views[:, :, :5]
    a, b = plain.encode_views(x), tiled.encode_views(x)
    assert b.tiled == {0, 1} and a.tiled == set()
    assert a.mean.shape == b.mean.shape and not torch.equal(a.mean, b.mean)


def test_tiling_refused_for_a_module_without_it(plugin: str) -> None:
    with pytest.raises(UsageError, match="--tiling: python:vaecache_test_plugin:rowwise .* has no enable_tiling"):
        load_vae(f"{plugin}:rowwise", tiling=True)


def test_builtin_tiny_fingerprint_records_run_settings() -> None:
    vae = load_vae("builtin:tiny", views_per_forward=2)
    fingerprint = vae.model.fingerprint()
    assert fingerprint["family"] == "AutoencoderKLWan" and fingerprint["untrained"] is True
    assert fingerprint["views_per_forward"] == 2 and fingerprint["tiling"]["available"] is True
    assert fingerprint["precision"] == {"compute": "float32", "stored": "float32", "note": None}
    with pytest.raises(UsageError, match="--views-per-forward must be an integer >= 1"):
        load_vae("builtin:tiny", views_per_forward=0)


def test_the_description_is_frozen_and_the_fingerprint_a_function_of_it() -> None:
    vae = load_vae("builtin:tiny")
    assert isinstance(vae.model, VaeModel) and vae.model.fingerprint() == fingerprint(vae.model)
    with pytest.raises(dataclasses.FrozenInstanceError):
        vae.model.dtype = torch.float16  # type: ignore[misc]
    other = dataclasses.replace(vae.model, views_per_forward=3)
    assert fingerprint(other) == {**fingerprint(vae.model), "views_per_forward": 3}
    with pytest.raises(ValueError, match="views_per_forward must be >= 1"):
        dataclasses.replace(vae.model, views_per_forward=0)


def test_the_cli_flag_lets_pickled_weights_load(pickled_wan: tuple[Path, torch.nn.Module], demo_data: Path,
                                                tmp_path: Path, run_cli) -> None:
    folder, _ = pickled_wan
    args = ["encode", demo_data, "--out", tmp_path / "out", "--vae", f"diffusers:{folder}", "--num-frames", "9",
            "--size", "64x64", "--workers", "0", "--no-progress", "--max-clips-per-scene", "1"]
    refused = run_cli(args)
    assert refused.exit_code == 2 and "--allow-pickle-weights" in refused.output
    assert run_cli([*args, "--allow-pickle-weights"]).exit_code == 0
    assert run_cli(["verify", tmp_path / "out"]).exit_code == 0


def test_cuda_numerics_are_exact_and_recorded_cpu_untouched() -> None:
    """cuDNN autotuning, nondeterministic algorithms and TF32 would make fp32 latents differ from process to
    process (or not be fp32): off on CUDA; on CPU nothing is changed."""
    from vaecache.vae.load import exact_cuda_numerics

    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32,
             torch.backends.cuda.matmul.allow_tf32)
    try:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = True, True
        assert exact_cuda_numerics("cpu") == {} and torch.backends.cudnn.benchmark
        assert exact_cuda_numerics("cuda:0") == {"cudnn_benchmark": False, "cudnn_deterministic": True, "tf32": False}
        assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    finally:
        (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32,
         torch.backends.cuda.matmul.allow_tf32) = saved
