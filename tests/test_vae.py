"""VAE backends: every supported diffusers family from a tiny random config saved to disk, the python
plugin protocol, dtype rules, tiling, and the out-of-memory backoff (injected, on CPU).

Latents are compared with `torch.equal` against the family's own `vae.encode(x).latent_dist` on the
same decoded frames, one view per forward, in fp32: vaecache calls the same module on the same input,
so anything but bit equality would be a bug.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import diffusers
import pytest
import torch

from vaecache.decode import ViewDecoder
from vaecache.demodata import DemoDataSpec, write_demo_dataset
from vaecache.errors import FrameRuleError, UsageError, VaeSpecError
from vaecache.vae import FAMILIES, INJECT_OOM_ENV, FrameRule, LoadedVae, OomInjector, load_vae

SIZE = 32
SPEC = DemoDataSpec(scenes=1, cameras=2, frames=17, height=SIZE, width=SIZE, fps=10, seed=5)

# Tiny random configs, one per family (shapes chosen so that 32x32 clips need no resize).
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "wan": ("AutoencoderKLWan", dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                                     temperal_downsample=[False, True])),
    "hunyuan": ("AutoencoderKLHunyuanVideo", dict(
        block_out_channels=(8, 8, 8), down_block_types=("HunyuanVideoDownBlock3D",) * 3,
        up_block_types=("HunyuanVideoUpBlock3D",) * 3, latent_channels=4, layers_per_block=1, norm_num_groups=4,
        spatial_compression_ratio=4, temporal_compression_ratio=4, scaling_factor=0.5)),
    "cogvideox": ("AutoencoderKLCogVideoX", dict(
        block_out_channels=(8, 8, 8), down_block_types=("CogVideoXDownBlock3D",) * 3,
        up_block_types=("CogVideoXUpBlock3D",) * 3, latent_channels=4, layers_per_block=1, norm_num_groups=4,
        temporal_compression_ratio=4, scaling_factor=0.7)),
    "ltx": ("AutoencoderKLLTXVideo", dict(
        latent_channels=8, block_out_channels=(8, 16, 32, 64), down_block_types=("LTXVideo095DownBlock3D",) * 4,
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        spatio_temporal_scaling=(True, True, True, False), decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
        decoder_spatio_temporal_scaling=(True, True, False, False), decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4, upsample_factor=(1,) * 4, patch_size=2, patch_size_t=1)),
    "kl": ("AutoencoderKL", dict(
        block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4, sample_size=16,
        shift_factor=0.1, scaling_factor=0.3)),
}
# family -> (temporal factor, spatial factor, frame step, causal, frames to encode, a bad count, its nearest valid)
RULES = {
    "wan": (2, 4, 4, True, 5, 10, "9 and 13"),
    "hunyuan": (4, 4, 4, True, 9, 7, "5 and 9"),
    "cogvideox": (4, 4, 8, True, 9, 13, "9 and 17"),
    "ltx": (4, 8, 4, True, 9, 12, "9 and 13"),
    "kl": (1, 2, 1, False, 3, None, None),
}
LTX_MEAN = torch.linspace(-1, 1, 8)
LTX_STD = torch.linspace(0.5, 2, 8)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vaes")
    paths = {}
    for key, (cls, config) in FAMILY_CONFIGS.items():
        torch.manual_seed(1234)
        module = getattr(diffusers, cls)(**config)
        if key == "ltx":  # LTX keeps its normalization constants as buffers, not config
            module.latents_mean.copy_(LTX_MEAN)
            module.latents_std.copy_(LTX_STD)
        module.save_pretrained(root / key)
        paths[key] = root / key
    return paths


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One scene, 2 cameras x 17 frames of 32x32 h264: DATA/scene_000/cam_{0,1}.mp4."""
    root = tmp_path_factory.mktemp("clips") / "data"
    write_demo_dataset(root, SPEC)
    return root


@pytest.fixture(scope="module")
def views(data_root: Path) -> torch.Tensor:
    """(2 cameras, 3, 17, 32, 32): the real frames decoded exactly as the pipeline does (no resize needed)."""
    decoder = ViewDecoder(SIZE, SIZE)
    return torch.stack([decoder.decode(str(p), list(range(SPEC.frames)))
                        for p in sorted((data_root / "scene_000").glob("*.mp4"))])


def _load(models: dict[str, Path], key: str, **kwargs: Any) -> LoadedVae:
    return load_vae(f"diffusers:{models[key]}", **kwargs)


def _reference(vae: LoadedVae, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's own encode, one view (or one frame) per call."""
    with torch.no_grad():
        if vae.per_frame:
            dists = [[vae.module.encode(view[:, t][None]).latent_dist for t in range(view.shape[1])] for view in x]
            return (torch.stack([torch.stack([d.mean[0] for d in row], 1) for row in dists]),
                    torch.stack([torch.stack([d.logvar[0] for d in row], 1) for row in dists]))
        dists = [vae.module.encode(view[None]).latent_dist for view in x]
        return torch.cat([d.mean for d in dists]), torch.cat([d.logvar for d in dists])


# --------------------------------------------------------------------------- families


@pytest.mark.parametrize("key", list(FAMILY_CONFIGS))
def test_family_loads_with_rule_from_config_and_encodes_like_diffusers(
        models: dict[str, Path], views: torch.Tensor, key: str) -> None:
    vae = _load(models, key)
    temporal, spatial, step, causal, frames, bad, nearest = RULES[key]
    assert vae.family == FAMILY_CONFIGS[key][0]
    assert (vae.rule.temporal_factor, vae.rule.spatial_factor, vae.rule.step, vae.rule.causal) == \
        (temporal, spatial, step, causal)
    vae.rule.check(frames, SIZE, SIZE)
    if bad is not None:
        with pytest.raises(FrameRuleError, match=f"--num-frames {bad} .*{vae.family}.*nearest valid: {nearest}$"):
            vae.rule.check(bad, SIZE, SIZE)
    with pytest.raises(FrameRuleError, match=f"height {SIZE + 1} is not a multiple of {spatial}"):
        vae.rule.check(frames, SIZE + 1, SIZE)

    x = views[:, :, :frames]
    result = vae.encode_views(x)
    mean, logvar = _reference(vae, x)
    assert tuple(result.mean.shape) == (2, *vae.latent_shape(frames, SIZE, SIZE))
    assert torch.equal(result.mean, mean)
    assert result.logvar is not None and torch.equal(result.logvar, logvar)
    assert result.failed == {} and result.tiled == set() and result.backoffs == [] and result.forward_sizes == [1, 1]


@pytest.mark.parametrize("key", list(FAMILY_CONFIGS))
def test_encode_cli_stores_the_family_latents(models: dict[str, Path], data_root: Path, views: torch.Tensor,
                                              tmp_path: Path, run_cli: Any, cache_io: Any, key: str) -> None:
    """Through the CLI on real mp4 clips that need no resize: equal to the family's own encode, fp32, exact."""
    frames = RULES[key][4]
    out = tmp_path / "cache"
    result = run_cli(["encode", data_root, "--out", out, "--vae", f"diffusers:{models[key]}", "--num-frames", frames,
                      "--size", f"{SIZE}x{SIZE}", "--max-clips-per-scene", "1", "--workers", "0", "--no-progress"])
    assert result.exit_code == 0, result.output
    manifest = cache_io.manifest(out)
    assert manifest["vae"]["family"] == FAMILY_CONFIGS[key][0]
    if key == "hunyuan":
        assert manifest["vae"]["normalization"] == {"scaling_factor": 0.5, "formula": "z * scaling_factor"}
    (clip,) = cache_io.clips(out)
    tensors = cache_io.tensors(out)
    mean, logvar = _reference(_load(models, key), views[:, :, :frames])
    assert torch.equal(tensors[clip["tensors"]["mean"]["name"]], mean)
    assert torch.equal(tensors[clip["tensors"]["logvar"]["name"]], logvar)


@pytest.mark.parametrize(("rule", "frames", "nearest"), [
    (FrameRule(4, 8, causal=True), 16, [13, 17]),
    (FrameRule(4, 8, causal=True), 0, [1]),
    (FrameRule(4, 8, causal=True, frame_step=8), 12, [9, 17]),
    (FrameRule(4, 8), 2, [4]),
    (FrameRule(4, 8), 10, [8, 12]),
])
def test_nearest_valid_frame_counts(rule: FrameRule, frames: int, nearest: list[int]) -> None:
    assert not rule.frames_ok(frames) and rule.nearest_frames(frames) == nearest
    assert all(rule.frames_ok(n) for n in nearest)


def test_per_frame_image_vae_takes_any_frame_count(models: dict[str, Path]) -> None:
    vae = _load(models, "kl")
    assert vae.per_frame and vae.latent_shape(5, SIZE, SIZE) == (4, 5, 16, 16)
    vae.rule.check(5, SIZE, SIZE)


def test_normalization_constants_per_family(models: dict[str, Path]) -> None:
    wan = _load(models, "wan").normalization
    assert wan["formula"] == "(z - latents_mean) / latents_std" and len(wan["latents_mean"]) == 16  # config defaults
    ltx = _load(models, "ltx").normalization
    assert ltx["latents_mean"] == pytest.approx(LTX_MEAN.tolist()) and ltx["latents_std"] == pytest.approx(LTX_STD.tolist())
    assert ltx["scaling_factor"] == 1.0 and ltx["formula"] == "(z - latents_mean) * scaling_factor / latents_std"
    assert _load(models, "cogvideox").normalization == {"scaling_factor": 0.7, "formula": "z * scaling_factor"}
    assert _load(models, "hunyuan").normalization == {"scaling_factor": 0.5, "formula": "z * scaling_factor"}
    assert _load(models, "kl").normalization == {"scaling_factor": 0.3, "shift_factor": 0.1,
                                                 "formula": "(z - shift_factor) * scaling_factor"}


def test_unsupported_class_lists_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLMochi"}))
    with pytest.raises(VaeSpecError, match="'AutoencoderKLMochi' is not supported; supported: " + ", ".join(FAMILIES)):
        load_vae(f"diffusers:{tmp_path}")


def test_subfolder_and_pipeline_folder_hint(models: dict[str, Path]) -> None:
    root = models["hunyuan"].parent
    assert load_vae(f"diffusers:{root}#hunyuan").family == "AutoencoderKLHunyuanVideo"
    with pytest.raises(VaeSpecError, match="no config.json"):
        load_vae(f"diffusers:{root}")


# --------------------------------------------------------------------------- dtypes


def test_fp16_refused_for_ltx(models: dict[str, Path]) -> None:
    with pytest.raises(UsageError, match="--dtype fp16 is refused for AutoencoderKLLTXVideo.*bf16"):
        _load(models, "ltx", dtype="fp16")


def test_fp16_upcast_for_force_upcast_families(models: dict[str, Path], views: torch.Tensor) -> None:
    vae = _load(models, "kl", dtype="fp16")
    assert vae.compute_dtype == torch.float32 and vae.dtype == torch.float16
    assert "runs in fp32" in vae.dtype_note and vae.fingerprint()["precision"]["compute"] == "float32"
    x = views[:1, :, :2]
    result = vae.encode_views(x)
    assert result.mean.dtype == torch.float16
    assert torch.equal(result.mean, _load(models, "kl").encode_views(x).mean.half())


def test_bf16_runs_and_stores_bf16(models: dict[str, Path], views: torch.Tensor) -> None:
    vae = _load(models, "hunyuan", dtype="bf16")
    result = vae.encode_views(views[:1, :, :5])
    assert result.mean.dtype == torch.bfloat16 and torch.isfinite(result.mean.float()).all()


# --------------------------------------------------------------------------- tiling

TILES = {"tile_sample_min_height": 16, "tile_sample_min_width": 16,
         "tile_sample_stride_height": 12, "tile_sample_stride_width": 12}


def test_tiling_is_recorded_and_changes_latents(models: dict[str, Path], views: torch.Tensor) -> None:
    plain = _load(models, "hunyuan", tile_options=TILES)
    tiled = _load(models, "hunyuan", tiling=True, tile_options=TILES)
    assert plain.fingerprint()["tiling"]["enabled"] is False and tiled.fingerprint()["tiling"]["enabled"] is True
    assert tiled.fingerprint()["tiling"]["params"]["tile_sample_min_height"] == 16
    assert tiled.fingerprint()["tiling"]["params"]["use_framewise_encoding"] is True
    x = views[:, :, :5]
    a, b = plain.encode_views(x), tiled.encode_views(x)
    assert b.tiled == {0, 1} and a.tiled == set()
    assert a.mean.shape == b.mean.shape and not torch.equal(a.mean, b.mean)


# --------------------------------------------------------------------------- out-of-memory backoff

PLUGIN = '''
import types
import torch


class RowwiseVae(torch.nn.Module):
    """Per-view exact by construction: one conv call per row, so K views per forward give the same bits."""

    vaecache_temporal_factor = 2
    vaecache_spatial_factor = 4

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv3d(3, 6, kernel_size=(2, 4, 4), stride=(2, 4, 4))
        self.calls = []

    def encode(self, x):
        self.calls.append(x.shape[0])
        h = torch.cat([self.conv(torch.cat([row[:, :1], row], 1)[None]) for row in x])
        mean, logvar = h.chunk(2, dim=1)
        return types.SimpleNamespace(mean=mean, logvar=logvar)


class MeanOnly(torch.nn.Module):
    vaecache_spatial_factor = 2
    vaecache_has_logvar = False

    def __init__(self):
        super().__init__()
        self.pool = torch.nn.AvgPool3d((1, 2, 2))

    def encode(self, x):
        return self.pool(x)


def rowwise():
    return RowwiseVae()


def mean_only():
    return MeanOnly()
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "vaecache_test_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "python:vaecache_test_plugin"


def test_plugin_protocol(plugin: str, views: torch.Tensor) -> None:
    vae = load_vae(f"{plugin}:rowwise")
    assert vae.rule == FrameRule(2, 4, causal=True, label="RowwiseVae") and vae.has_logvar
    assert vae.latent_shape(9, SIZE, SIZE) == (3, 5, 8, 8)  # channels found by one dummy encode
    result = vae.encode_views(views[:, :, :9])
    assert tuple(result.mean.shape) == (2, 3, 5, 8, 8) and result.logvar is not None
    mean_only = load_vae(f"{plugin}:mean_only")
    assert not mean_only.has_logvar and mean_only.encode_views(views[:1, :, :2]).logvar is None
    assert mean_only.latent_shape(2, SIZE, SIZE) == (3, 2, 16, 16)


def test_halving_keeps_latents_when_views_are_per_view_exact(plugin: str, views: torch.Tensor) -> None:
    x = torch.cat([views, views.flip(-1)])[:, :, :9]  # 4 distinct views
    reference = load_vae(f"{plugin}:rowwise", max_views_per_forward=4).encode_views(x)
    assert reference.forward_sizes == [4, 4, 4, 4]

    vae = load_vae(f"{plugin}:rowwise", max_views_per_forward=4)
    vae._oom_injector = OomInjector.parse("2>1")  # the first two forwards of 2+ views run out of memory
    result = vae.encode_views(x)
    assert vae.module.calls == [1, 1, 1, 1]  # 4 -> 2 -> 1 (injected forwards never reach the module)
    assert result.forward_sizes == [1, 1, 1, 1] and vae.backoff_counts == {"halved": 2}
    assert len(result.backoffs) == 2 and "micro-batch 4 -> 2" in result.backoffs[0]
    assert result.failed == {} and result.tiled == set()
    assert torch.equal(result.mean, reference.mean) and torch.equal(result.logvar, reference.logvar)

    vae = load_vae(f"{plugin}:rowwise", max_views_per_forward=4)
    vae._oom_injector = OomInjector.parse("1>2")
    result = vae.encode_views(x)
    assert result.forward_sizes == [2, 2, 2, 2] and torch.equal(result.mean, reference.mean)
    vae.encode_views(x)  # the smaller micro-batch sticks for the rest of the run
    assert vae.module.calls == [2, 2, 2, 2]


def test_oom_at_one_view_falls_back_to_tiling(models: dict[str, Path], views: torch.Tensor) -> None:
    x = views[:, :, :5]
    vae = _load(models, "hunyuan", tile_options=TILES)
    vae._oom_injector = OomInjector.parse("*:untiled")
    result = vae.encode_views(x)
    assert result.tiled == {0, 1} and result.failed == {} and vae.backoff_counts == {"tiling": 2}
    assert all("retrying it with the model's tiling" in event for event in result.backoffs)
    assert vae.module.use_tiling is False  # switched on for the retry only
    assert torch.equal(result.mean, _load(models, "hunyuan", tiling=True, tile_options=TILES).encode_views(x).mean)


def test_persistent_oom_marks_views_failed_with_zero_rows(models: dict[str, Path], views: torch.Tensor,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    x = views[:, :, :5]
    good = _load(models, "hunyuan").encode_views(x)
    vae = _load(models, "hunyuan")
    calls = []

    def view_1_never_fits(units: int, tiled: bool) -> bool:
        calls.append(tiled)
        return len(calls) in (2, 3)  # the second view, untiled and then tiled

    vae._oom_injector = view_1_never_fits
    with caplog.at_level("WARNING", logger="vaecache"):
        result = vae.encode_views(x)
    assert list(result.failed) == [1] and "out of memory (one per forward and tiling)" in result.failed[1]
    assert result.mean.shape == good.mean.shape and result.logvar.shape == good.logvar.shape
    assert torch.equal(result.mean[0], good.mean[0]) and torch.equal(result.logvar[0], good.logvar[0])
    assert not result.mean[1].any() and not result.logvar[1].any()
    assert vae.backoff_counts == {"tiling": 1, "failed": 1}
    assert sum("OOM backoff" in r.message for r in caplog.records) == 2


def test_oom_injection_from_the_environment(models: dict[str, Path], views: torch.Tensor,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INJECT_OOM_ENV, "*")
    vae = _load(models, "kl")
    result = vae.encode_views(views[:1, :, :2])
    assert result.failed.keys() == {0} and "frame 0" in result.failed[0] and not result.mean.any()
    monkeypatch.setenv(INJECT_OOM_ENV, "lots")
    with pytest.raises(UsageError, match="COUNT"):
        _load(models, "kl")


def test_builtin_tiny_fingerprint_records_run_settings() -> None:
    vae = load_vae("builtin:tiny", max_views_per_forward=2)
    fingerprint = vae.fingerprint()
    assert fingerprint["family"] == "AutoencoderKLWan" and fingerprint["untrained"] is True
    assert fingerprint["max_views_per_forward"] == 2 and fingerprint["tiling"]["available"] is True
    assert fingerprint["precision"] == {"compute": "float32", "stored": "float32", "note": None}
    with pytest.raises(UsageError, match="--max-views-per-forward must be an integer >= 1"):
        load_vae("builtin:tiny", max_views_per_forward=0)
