"""vaecache/models/_wan_fast.py against diffusers' own AutoencoderKLWan._encode, on CPU in fp32: the same latents within
1e-5 of their largest magnitude for every frame count (1 + 4k and not), batch of views, temporal chunk and memory
format, for Wan 2.1's and Wan 2.2's (residual, patchified) encoders."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from diffusers import AutoencoderKLWan

from vaecache.models._wan_fast import (
    EAGER,
    CompiledRowKernels,
    Kernels,
    WanFastEncoder,
    add_eager,
    chunk_bounds,
    norm_silu_eager,
)

CONFIGS = {
    "wan2.1": dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                   temperal_downsample=[False, True, True]),
    "wan2.2": dict(base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                   temperal_downsample=[False, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                   scale_factor_spatial=8, scale_factor_temporal=2, latents_mean=[0.0] * 4, latents_std=[1.0] * 4),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def vae(request) -> AutoencoderKLWan:
    torch.manual_seed(7)
    return AutoencoderKLWan(**CONFIGS[request.param]).eval().requires_grad_(False)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("frames", [1, 5, 11, 17])
def test_fast_encode_equals_diffusers_within_fp32_rounding(vae, frames):
    x = torch.rand(2, 3, frames, 32, 48, generator=torch.Generator().manual_seed(frames)) * 2 - 1
    reference = vae._encode(x)
    for chunk in (4, 8, 16):
        moments = WanFastEncoder(vae, chunk_frames=chunk).moments(x)
        assert moments.shape == reference.shape and moments.is_contiguous()
        assert relative(moments, reference) < 1e-5
    contiguous = WanFastEncoder(vae, channels_last=False).moments(x)
    assert relative(contiguous, reference) < 1e-5


def test_views_are_encoded_independently_of_their_batch(vae):
    x = torch.rand(3, 3, 9, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    encoder = WanFastEncoder(vae)
    together = encoder.moments(x)
    alone = torch.cat([encoder.moments(x[i:i + 1]) for i in range(3)])
    assert relative(together, alone) < 1e-6


FOLDED = Kernels("folded", norm_silu_eager, add_eager, fold_bias=True, rows=True)
"""The compiled kernels' arithmetic (biases folded into the norm and the residual sum), run eagerly."""


@pytest.mark.parametrize("kernels", [EAGER, FOLDED], ids=["eager", "folded"])
def test_padded_channels_and_folded_biases_change_nothing_but_rounding(vae, kernels):
    x = torch.rand(2, 3, 9, 32, 32, generator=torch.Generator().manual_seed(2)) * 2 - 1
    reference = vae._encode(x)
    widths = sorted({m.out_channels for m in vae.encoder.modules() if isinstance(m, torch.nn.Conv3d)})
    attention = {m.dim for m in vae.encoder.modules() if type(m).__name__ == "WanAttentionBlock"}
    pads = {c: c + 5 for c in widths if c not in attention}  # odd widths: nothing relies on a multiple of 8
    encoder = WanFastEncoder(vae, kernels=kernels, pad_channels=pads)
    moments = encoder.moments(x)
    assert moments.shape == reference.shape and relative(moments, reference) < 1e-5
    assert "pad" in encoder.description and kernels.name in encoder.description
    if vae.config.is_residual:  # Wan 2.2's channel-mean shortcut sees the true channels only
        assert relative(WanFastEncoder(vae, kernels=kernels).moments(x), reference) < 1e-5


def test_an_attention_width_or_a_row_kernel_without_channels_last_is_refused(vae):
    attention = next(m.dim for m in vae.encoder.modules() if type(m).__name__ == "WanAttentionBlock")
    with pytest.raises(ValueError, match="attention"):
        WanFastEncoder(vae, pad_channels={attention: attention + 8})
    with pytest.raises(ValueError, match="channels_last"):
        WanFastEncoder(vae, kernels=FOLDED, channels_last=False)


def test_compiled_row_kernels_equal_the_eager_ones_and_compile_once_per_width():
    """The kernels --encoder-impl fast runs on CUDA (torch.compile; here inductor's C++ backend): the same latents
    within rounding, padded and batched, and one graph per width however many frames and resolutions come."""
    import torch._dynamo

    torch.manual_seed(7)
    vae = AutoencoderKLWan(**CONFIGS["wan2.1"]).eval().requires_grad_(False)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = CompiledRowKernels()
    encoder = WanFastEncoder(vae, kernels=compiled.kernels(), pad_channels={8: 16})
    for shape in [(2, 3, 9, 32, 48), (1, 3, 17, 48, 32)]:
        x = torch.rand(*shape, generator=torch.Generator().manual_seed(shape[2])) * 2 - 1
        assert relative(encoder.moments(x), vae._encode(x)) < 1e-5
    assert counters["stats"]["unique_graphs"] == 3  # the norm with and without a folded bias, the sum: one width


def test_weights_follow_the_module_to_another_dtype(vae):
    x = torch.rand(1, 3, 5, 32, 32, generator=torch.Generator().manual_seed(3)) * 2 - 1
    module = copy.deepcopy(vae)
    encoder = WanFastEncoder(module)
    fp32 = encoder.moments(x)
    module.to(torch.bfloat16)
    bf16 = encoder.moments(x.to(torch.bfloat16))
    assert bf16.dtype == torch.bfloat16 and relative(bf16.float(), fp32) < 0.05
    module.to(torch.float32)  # bf16-rounded weights now: the encoder must use these, not the ones it saw first
    assert torch.equal(encoder.moments(x), WanFastEncoder(module).moments(x))


def test_chunks_start_with_frame_zero_and_stay_multiples_of_four():
    assert chunk_bounds(1, 4) == [(0, 1)]
    assert chunk_bounds(13, 4) == [(0, 5), (5, 9), (9, 13)]
    assert chunk_bounds(13, 8) == [(0, 9), (9, 13)]
    assert chunk_bounds(33, 32) == [(0, 33)]
    with pytest.raises(ValueError, match="multiple of 4"):
        WanFastEncoder(None, chunk_frames=6)


# ----------------------------------------------------------------------------- --encoder-impl


def test_the_runner_s_fast_encode_matches_the_reference_and_is_independent_of_the_batch(views):
    from vaecache.vae import load_vae

    reference = load_vae("builtin:tiny", "cpu", views_per_forward=1, encoder_impl="reference")
    fast = load_vae("builtin:tiny", "cpu", views_per_forward=1, encoder_impl="fast")
    assert fast.model.encoder_impl == "fast" and fast.model.fingerprint()["encoder_impl"] == "fast"
    assert "encoder_impl" not in reference.model.fingerprint()  # a reference cache keeps the fingerprint it always had
    expected, got = reference.encode_views(views), fast.encode_views(views)
    assert relative(got.mean, expected.mean) < 1e-5 and relative(got.logvar, expected.logvar) < 1e-5
    alone = torch.cat([fast.encode_views(views[i:i + 1]).mean for i in range(views.shape[0])])
    assert torch.equal(alone, got.mean)  # at a fixed K, the bits do not depend on how many views come together
    assert load_vae("builtin:tiny", "cpu", encoder_impl="auto").model.encoder_impl == "reference"


def test_a_tiled_retry_runs_diffusers_tiled_encode(views):
    from vaecache.vae import load_vae
    from vaecache.vae.runner import VaeRunner

    def tiled_retry(impl: str):
        model = load_vae("builtin:tiny", "cpu", encoder_impl=impl).model
        return VaeRunner(model, inject_oom=lambda units, tiled: not tiled).encode_views(views)

    retried, reference = tiled_retry("fast"), tiled_retry("reference")
    assert sorted(retried.tiled) == [0, 1] and not retried.failed
    assert torch.equal(retried.mean, reference.mean)  # the tiled forward is diffusers' own, bit for bit


def test_fast_records_what_decides_its_bits_and_auto_stays_reference_off_the_validated_device():
    from vaecache.models import vae_class
    from vaecache.models._wan_fast import production_description
    from vaecache.vae import load_vae

    model = load_vae("builtin:tiny", "cpu", encoder_impl="fast").model
    assert model.fingerprint()["encoder_variant"] == "ndhwc-chunk4-eager" == production_description(model.module, "cpu")
    assert load_vae("builtin:tiny", "cpu", encoder_impl="auto", dtype="bf16").model.encoder_impl == "reference"
    assert ("cuda", "bfloat16", (9, 0), 96) in vae_class("AutoencoderKLWan").fast_encoder.validated


def test_fast_is_refused_where_it_cannot_run(models):
    from vaecache.errors import UsageError
    from vaecache.vae import load_vae

    with pytest.raises(UsageError, match="AutoencoderKLHunyuanVideo.*--encoder-impl reference"):
        load_vae(f"diffusers:{models['hunyuan']}", "cpu", encoder_impl="fast")
    with pytest.raises(UsageError, match="--tiling"):
        load_vae("builtin:tiny", "cpu", tiling=True, encoder_impl="fast")
    with pytest.raises(UsageError, match="--compile"):
        load_vae("builtin:tiny", "cpu", compiled=True, encoder_impl="fast")
    with pytest.raises(UsageError, match="--encoder-impl must be one of"):
        load_vae("builtin:tiny", "cpu", encoder_impl="quick")
    from vaecache.parallel.encoders import encoder_for
    from vaecache.settings.clip import ClipSettings, SamplingConfig

    for flags in ({"tiling": True}, {"compiled": True}):  # refused from the flags, before anything is probed
        with pytest.raises(UsageError, match="--encoder-impl fast cannot be combined with --(tiling|compile)"):
            ClipSettings(sampling=SamplingConfig(num_frames=9), height=32, width=32, encoder_impl="fast", **flags)
    clip = ClipSettings(sampling=SamplingConfig(num_frames=9), height=32, width=32, encoder_impl="fast")
    with pytest.raises(UsageError, match="--sp-mode spatial cannot be combined with --encoder-impl fast"):
        encoder_for("spatial").check(clip, load_vae("builtin:tiny", "cpu", encoder_impl="fast").model, 2,
                                     "builtin:tiny")


def test_encoder_impl_is_recorded_reencoded_with_and_never_mixed_on_resume(demo_data, tmp_path, run_cli, cache_io):
    out = tmp_path / "cache"
    args = ["encode", demo_data, "--out", out, "--vae", "builtin:tiny", "--num-frames", "9", "--size", "64x64",
            "--workers", "0", "--no-progress", "--max-clips-per-scene", "1"]
    assert run_cli([*args, "--encoder-impl", "fast"]).exit_code == 0
    assert cache_io.manifest(out)["vae"]["encoder_impl"] == "fast"
    assert run_cli(["verify", out, "--reencode", "1"]).exit_code == 0  # re-encoded by the recorded implementation
    refused = run_cli([*args, "--encoder-impl", "reference"])
    assert refused.exit_code == 2 and "encoder_impl" in refused.output
    assert run_cli([*args, "--encoder-impl", "fast"]).exit_code == 0  # the same one resumes
    assert run_cli(args).exit_code == 0  # and auto takes the recorded one, wherever auto would choose otherwise


def test_fast_latents_do_not_depend_on_the_batch_size_or_the_oom_backoff(demo_data, tmp_path, run_cli):
    """At a fixed K the fast encoder's latents are the same bits whatever the batch size, and a forward of several
    views that runs out of memory and backs off to single views gives K = 1's bits; the reference's latents agree
    within fp32 rounding."""
    from tests.conftest import assert_same_tensors, load_tensors

    def encode(name: str, *extra: str, env: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
        out = tmp_path / name
        result = run_cli(["encode", demo_data, "--out", out, "--vae", "builtin:tiny", "--num-frames", "9", "--size",
                          "64x64", "--workers", "0", "--no-progress", "--max-clips-per-scene", "2", *extra], env=env)
        assert result.exit_code == 0, result.output
        if env:  # the injected errors did make the runner back off
            assert re.search(r"OOM backoffs\s*│\s*[1-9]", result.output), result.output
        return load_tensors(out)

    fast = ["--encoder-impl", "fast"]
    one = encode("b1", *fast, "--views-per-forward", "1", "--batch-size", "1")
    assert_same_tensors(one, encode("b3", *fast, "--views-per-forward", "1", "--batch-size", "3"))
    backed_off = encode("oom", *fast, "--views-per-forward", "all", "--batch-size", "2",
                        env={"VAECACHE_FAULT": "oom:*>1"})  # every forward of 2 views fails: 1 view at a time
    assert_same_tensors(one, backed_off)
    reference = encode("ref", "--encoder-impl", "reference", "--views-per-forward", "1")
    assert sorted(reference) == sorted(one)
    for name in one:
        assert relative(one[name].float(), reference[name].float()) < 1e-5, name
