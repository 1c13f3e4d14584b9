"""VaeRunner: micro-batching, the out-of-memory backoff (injected, on CPU), the tiling fallback, and
non-finite latents failed at encode time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.vae.tiny_vaes import TILES
from vaecache.cache.reader import CacheReader
from vaecache.errors import UsageError
from vaecache.faults import FAULT_ENV, OomFault, OomInjector
from vaecache.vae import VaeRunner, load_vae


def _load(models: dict[str, Path], key: str, **kwargs: Any) -> VaeRunner:
    return load_vae(f"diffusers:{models[key]}", **kwargs)


def test_halving_keeps_latents_when_views_are_per_view_exact(plugin: str, views: torch.Tensor) -> None:
    x = torch.cat([views, views.flip(-1)])[:, :, :9]  # 4 distinct views
    reference = load_vae(f"{plugin}:rowwise", views_per_forward=4).encode_views(x)
    assert reference.forward_sizes == [4, 4, 4, 4]

    vae = load_vae(f"{plugin}:rowwise", views_per_forward=4)
    assert vae.latent_channels and vae.model.module.calls == [1]  # the plugin declares no channels: one probe forward
    vae.model.module.calls.clear()
    vae.inject_oom = OomInjector(OomFault(2, more_than=1))  # the first two forwards of 2+ views run out of memory
    result = vae.encode_views(x)
    assert vae.model.module.calls == [1, 1, 1, 1]  # 4 -> 2 -> 1 (injected forwards never reach the module)
    assert result.forward_sizes == [1, 1, 1, 1] and vae.backoff_counts == {"halved": 2}
    assert len(result.backoffs) == 2 and "micro-batch 4 -> 2" in result.backoffs[0]
    assert result.failed == {} and result.tiled == set()
    assert torch.equal(result.mean, reference.mean) and torch.equal(result.logvar, reference.logvar)

    vae = load_vae(f"{plugin}:rowwise", views_per_forward=4)
    vae.latent_channels  # the probe forward, before the counted ones
    vae.model.module.calls.clear()
    vae.inject_oom = OomInjector(OomFault(1, more_than=2))
    result = vae.encode_views(x)
    assert result.forward_sizes == [2, 2, 2, 2] and torch.equal(result.mean, reference.mean)
    vae.encode_views(x)  # the smaller micro-batch sticks for the rest of the run
    assert vae.model.module.calls == [2, 2, 2, 2]


def test_a_forward_never_crosses_a_group_of_k_views(plugin: str, views: torch.Tensor) -> None:
    """K consecutive views per forward, the last group shorter; halving on out-of-memory stays inside a group."""
    x = torch.cat([views, views.flip(-1), views.flip(-2)])[:, :, :9]  # 6 distinct views
    vae = load_vae(f"{plugin}:rowwise", views_per_forward=3)
    vae.latent_channels
    vae.model.module.calls.clear()
    assert vae.encode_views(x).forward_sizes == [3] * 6 and vae.model.module.calls == [3, 3]
    vae.model.module.calls.clear()
    vae.encode_views(x[:5])
    assert vae.model.module.calls == [3, 2]
    vae = load_vae(f"{plugin}:rowwise", views_per_forward=3)
    vae.latent_channels
    vae.model.module.calls.clear()
    vae.inject_oom = OomInjector(OomFault(1, more_than=2))
    result = vae.encode_views(x)
    # 3 -> 1, never 1 + 2 across
    assert vae.model.module.calls == [1, 1, 1, 1, 1, 1] and result.forward_sizes == [1] * 6


def test_oom_at_one_view_falls_back_to_tiling(models: dict[str, Path], views: torch.Tensor) -> None:
    x = views[:, :, :5]
    vae = _load(models, "hunyuan", tile_options=TILES)
    vae.inject_oom = OomInjector(OomFault(None, untiled_only=True))
    result = vae.encode_views(x)
    assert result.tiled == {0, 1} and result.failed == {} and vae.backoff_counts == {"tiling": 2}
    assert all("retrying it with the model's tiling" in event for event in result.backoffs)
    assert vae.model.module.use_tiling is False  # switched on for the retry only
    assert torch.equal(result.mean, _load(models, "hunyuan", tiling=True, tile_options=TILES).encode_views(x).mean)


def test_a_forward_that_runs_out_of_memory_halfway_leaves_no_cached_frames_for_the_retry(
        models: dict[str, Path], views: torch.Tensor) -> None:
    x = views[:, :, :9]
    reference = _load(models, "wan").encode_views(x)
    vae = _load(models, "wan", views_per_forward=2)
    module = vae.model.module
    deep = module.encoder.down_blocks[-1]

    def out_of_memory_with_two_views(layer: Any, inputs: Any) -> None:  # a real failure mid-forward
        if inputs[0].shape[0] > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (raised halfway through the encoder)")

    cached_at_retry: list[int] = []
    vae.inject_oom = lambda units, tiled: cached_at_retry.append(
        sum(t is not None for t in getattr(module, "_enc_feat_map", []))) or False
    handle = deep.register_forward_pre_hook(out_of_memory_with_two_views)
    try:
        result = vae.encode_views(x)
    finally:
        handle.remove()
    assert vae.backoff_counts == {"halved": 1} and result.forward_sizes == [1, 1]
    assert cached_at_retry == [0, 0, 0]  # the failed 2-view forward's frames were dropped before each retry
    assert torch.equal(result.mean, reference.mean)


def test_persistent_oom_marks_views_failed_with_zero_rows(models: dict[str, Path], views: torch.Tensor,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    x = views[:, :, :5]
    good = _load(models, "hunyuan").encode_views(x)
    vae = _load(models, "hunyuan")
    calls = []

    def view_1_never_fits(units: int, tiled: bool) -> bool:
        calls.append(tiled)
        return len(calls) in (2, 3)  # the second view, untiled and then tiled

    vae.inject_oom = view_1_never_fits
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
    monkeypatch.setenv(FAULT_ENV, "oom:*")
    vae = _load(models, "kl")
    result = vae.encode_views(views[:1, :, :2])
    assert result.failed.keys() == {0} and "frame 0" in result.failed[0] and not result.mean.any()
    monkeypatch.setenv(FAULT_ENV, "oom:lots")
    with pytest.raises(UsageError, match="COUNT"):
        _load(models, "kl")
    monkeypatch.setenv(FAULT_ENV, "crash-after-commit:3@1")  # a shard fault alone injects no out-of-memory
    assert _load(models, "kl").inject_oom is None


def test_non_finite_latent_fails_its_view_only(plugin: str, views: torch.Tensor,
                                               caplog: pytest.LogCaptureFixture) -> None:
    x = torch.cat([views, views.flip(-1)])[:3, :, :2]
    clean = load_vae(f"{plugin}:mean_only").encode_views(x)
    vae = load_vae(f"{plugin}:overflowing", views_per_forward=3)
    with caplog.at_level("ERROR", logger="vaecache"):
        result = vae.encode_views(x)
    assert result.failed == {1: f"non-finite latent (1 NaN, 2 inf) from {plugin}:overflowing"}
    assert torch.isfinite(result.mean).all() and not result.mean[1].any() and not result.logvar[1].any()
    assert torch.equal(result.mean[0], clean.mean[0]) and torch.equal(result.mean[2], clean.mean[2])
    assert result.backoffs == [] and vae.backoff_counts == {}
    assert any("view 1 failed: non-finite latent" in r.message for r in caplog.records)


def test_non_finite_clip_is_a_failed_clip_end_to_end(plugin: str, demo_data: Path, tmp_path: Path,
                                                     run_cli: Any, cache_io: Any) -> None:
    """The plugin's second encoded row (clip 0, its second camera) holds a NaN: that clip is recorded as
    failed with the camera and the VAE named, the others are stored, and encode exits 3."""
    out = tmp_path / "cache"
    spec = f"{plugin}:overflowing"
    result = run_cli(["encode", demo_data, "--out", out, "--vae", spec, "--num-frames", "9", "--size", "64x64",
                      "--workers", "0", "--no-progress"])
    assert result.exit_code == 3, result.output
    failures = CacheReader(out).failure_records()
    assert len(failures) == 1
    assert "camera cam_1: non-finite latent (1 NaN, 2 inf) from " + spec in failures[0]["reason"]
    clips = cache_io.clips(out)
    assert [clip["id"] for clip in clips] == ["scene_001/000000-000008", "scene_002/000000-000008"]
    assert all(torch.isfinite(t.float()).all() for t in cache_io.tensors(out).values())


def test_a_sample_that_overflows_is_a_failed_clip_and_the_cache_stays_readable(
        plugin: str, demo_data: Path, tmp_path: Path, run_cli: Any, cache_io: Any) -> None:
    """--store sample of a posterior whose std is not finite (logvar 1000 on clip 0's second camera): that clip is
    a recorded failure naming the camera, the others are stored, finalize and verify read every record back."""
    out = tmp_path / "cache"
    spec = f"{plugin}:wide_posterior"
    result = run_cli(["encode", demo_data, "--out", out, "--vae", spec, "--num-frames", "9", "--size", "64x64",
                      "--workers", "0", "--no-progress", "--store", "sample"])
    assert result.exit_code == 3, result.output
    (failure,) = CacheReader(out).failure_records()
    assert failure["clip"] == "scene_000/000000-000008" and failure["camera"] == "cam_1"
    assert failure["reason"] == ("camera cam_1: the sampled latent is not finite in float32 "
                                 "(mean + exp(logvar / 2) * noise overflows)")
    assert [clip["id"] for clip in cache_io.clips(out)] == ["scene_001/000000-000008", "scene_002/000000-000008"]
    assert all(torch.isfinite(t).all() for t in cache_io.tensors(out).values())
    assert run_cli(["verify", out]).exit_code == 0


@pytest.mark.parametrize("factory", ["short_row", "one_frame", "three_channels"])
@pytest.mark.parametrize("cameras", ["cam_0", "cam_0,cam_1"])
def test_a_latent_of_the_wrong_shape_is_a_failed_clip_not_stored(plugin: str, factory: str, cameras: str,
                                                                 demo_data: Path, tmp_path: Path, run_cli: Any,
                                                                 cache_io: Any) -> None:
    """The plugin's second forward returns a misshapen latent: that view's clip is recorded as failed, naming
    the VAE, the clip and the camera, and the cache holds only right-shaped latents that verify accepts."""
    out = tmp_path / "cache"
    spec = f"{plugin}:{factory}"
    result = run_cli(["encode", demo_data, "--out", out, "--vae", spec, "--num-frames", "9", "--size", "64x64",
                      "--workers", "0", "--no-progress", "--cameras", cameras, "--views-per-forward", "1"])
    assert result.exit_code == 3, result.output
    (failure,) = CacheReader(out).failure_records()
    second_camera = cameras.split(",")[1 % len(cameras.split(","))]
    assert failure["camera"] == second_camera and failure["clip"] is not None
    assert f"{spec} returned a latent of shape" in failure["reason"] and "expected (4, 9, 32, 32)" in failure["reason"]
    shape = cache_io.manifest(out)["latent"]["shape"]["mean"]
    assert all(list(t.shape) == shape for name, t in cache_io.tensors(out).items() if name.endswith("/mean"))
    assert len(cache_io.clips(out)) == 2
    assert run_cli(["verify", out]).exit_code == 0


def test_an_error_on_one_input_is_a_failed_clip_and_the_run_goes_on(plugin: str, demo_data: Path, tmp_path: Path,
                                                                    run_cli: Any, cache_io: Any) -> None:
    out = tmp_path / "cache"
    spec = f"{plugin}:exploding"
    result = run_cli(["encode", demo_data, "--out", out, "--vae", spec, "--num-frames", "9", "--size", "64x64",
                      "--workers", "0", "--no-progress", "--views-per-forward", "1"])
    assert result.exit_code == 3, result.output
    (failure,) = CacheReader(out).failure_records()
    assert failure["clip"] == "scene_001/000000-000008" and failure["camera"] == "cam_0"
    assert f"{spec} raised RuntimeError: plugin exploded on call 3" in failure["reason"]
    assert [clip["id"] for clip in cache_io.clips(out)] == ["scene_000/000000-000008", "scene_002/000000-000008"]
    assert cache_io.manifest(out)["counts"]["oom_backoffs"] == 0
    assert run_cli(["verify", out]).exit_code == 0


def test_a_vae_that_fails_on_every_input_stops_the_run(plugin: str, demo_data: Path, tmp_path: Path,
                                                       run_cli: Any) -> None:
    result = run_cli(["encode", demo_data, "--out", tmp_path / "cache", "--vae", f"{plugin}:always_exploding",
                      "--num-frames", "9", "--size", "64x64", "--workers", "0", "--no-progress",
                      "--frame-stride", "1", "--window-stride", "1"])
    assert result.exit_code == 1, result.output
    assert "failed on 8 inputs in a row" in result.output and "plugin exploded" in result.output
    assert not (tmp_path / "cache" / "manifest.json").exists()


def test_compile_runs_the_encoder_through_torch_compile_and_is_recorded(plugin: str, views: torch.Tensor,
                                                                        demo_data: Path, tmp_path: Path,
                                                                        run_cli: Any, cache_io: Any) -> None:
    x = torch.cat([views, views.flip(-1)])[:, :, :9]
    eager = load_vae(f"{plugin}:rowwise", views_per_forward=2)
    compiled = load_vae(f"{plugin}:rowwise", views_per_forward=2, compiled=True)
    assert compiled.model.fingerprint() == {**eager.model.fingerprint(), "compile": True}
    # torch.compile generates its own kernels for everything but the convolution: equal up to rounding
    assert torch.allclose(compiled.encode_views(x).mean, eager.encode_views(x).mean, rtol=0, atol=1e-6)

    out = tmp_path / "cache"
    args = ["encode", demo_data, "--out", out, "--vae", f"{plugin}:rowwise", "--num-frames", "9", "--size", "64x64",
            "--workers", "0", "--no-progress", "--max-clips-per-scene", "1"]
    assert run_cli([*args, "--compile"]).exit_code == 0
    manifest = cache_io.manifest(out)
    assert manifest["settings"]["compile"] is True and manifest["vae"]["compile"] is True
    refused = run_cli(args)
    assert refused.exit_code == 2 and "compile" in refused.output and "made with other settings" in refused.output


def test_channels_last_converts_weights_and_inputs_and_is_recorded(views: torch.Tensor, demo_data: Path,
                                                                   tmp_path: Path, run_cli: Any, cache_io: Any) -> None:
    x = views[:, :, :9]
    plain, last = load_vae("builtin:tiny", views_per_forward=2), load_vae("builtin:tiny", views_per_forward=2,
                                                                        channels_last=True)
    assert last.model.fingerprint() == {**plain.model.fingerprint(), "channels_last": True}
    conv_weights = [p for p in last.model.module.parameters() if p.dim() == 5]
    assert conv_weights and all(p.is_contiguous(memory_format=torch.channels_last_3d) for p in conv_weights)
    # other convolution kernels: equal up to float32 rounding (measured ~1e-6 of the latent's scale)
    reference = plain.encode_views(x).mean
    assert torch.allclose(last.encode_views(x).mean, reference, rtol=0, atol=1e-5 * float(reference.abs().max()))

    out = tmp_path / "cache"
    args = ["encode", demo_data, "--out", out, "--vae", "builtin:tiny", "--num-frames", "9", "--size", "64x64",
            "--workers", "0", "--no-progress", "--max-clips-per-scene", "1"]
    assert run_cli([*args, "--channels-last"]).exit_code == 0
    manifest = cache_io.manifest(out)
    assert manifest["settings"]["channels_last"] is True and manifest["vae"]["channels_last"] is True
    assert run_cli(["verify", out]).exit_code == 0
    refused = run_cli(args)
    assert refused.exit_code == 2 and "channels_last" in refused.output
