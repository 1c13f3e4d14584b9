"""PixelDecoder: the same frames and gradients as a plain autograd decode, with the causal cache's gradient path kept
and every stage recomputed under checkpointing; the recorded VAE of a cache; the targets a pixel loss compares with;
the example with a pixel loss."""

from __future__ import annotations

import os
import runpy
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import ENCODE_ARGS, invoke
from tests.vae.tiny_vaes import FAMILY_CONFIGS
from vaecache import LatentCache, PixelDecoder
from vaecache.errors import SourceChangedError, UsageError
from vaecache.vae import load_vae
from vaecache.vae.latent_decode import iter_decoded

ROOT = Path(__file__).resolve().parents[2]


WAN22 = dict(base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
             temperal_downsample=[False, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
             scale_factor_spatial=8, scale_factor_temporal=2, latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
"""A tiny Wan 2.2 layout (residual blocks, patchified 12 channels); the other families are tests/vae's own."""


def tiny(family: str) -> torch.nn.Module:
    import diffusers

    torch.manual_seed(7)
    name, config = ("AutoencoderKLWan", WAN22) if family == "wan2.2" else FAMILY_CONFIGS[family]
    return getattr(diffusers, name)(**config).eval().requires_grad_(False)


def plain_decode(module: torch.nn.Module, z: torch.Tensor) -> torch.Tensor:
    """What a trainer writes without vaecache: module.decode under autograd (a 2D VAE frame by frame)."""
    if type(module).__name__ == "AutoencoderKL":
        return torch.stack([module.decode(z[:, :, t]).sample for t in range(z.shape[2])], dim=2)
    return module.decode(z).sample


@pytest.mark.parametrize("family, shape", [("wan", (2, 4, 3, 8, 8)), ("wan2.2", (1, 4, 3, 4, 4)),
                                           ("kl", (1, 4, 3, 8, 8)), ("hunyuan", (1, 4, 3, 4, 4))])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_frames_and_gradients_equal_a_plain_autograd_decode(family: str, shape: tuple[int, ...],
                                                            checkpoint: bool) -> None:
    module = tiny(family)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    reference_z = z.clone().requires_grad_(True)
    reference = plain_decode(module, reference_z)
    weights = torch.randn(reference.shape, generator=torch.Generator().manual_seed(2))
    (reference * weights).sum().backward()

    mine_z = z.clone().requires_grad_(True)
    frames = PixelDecoder(module, checkpoint=checkpoint, chunk_frames=1)(mine_z)
    (frames * weights).sum().backward()
    assert torch.equal(frames, reference)
    scale = float(reference_z.grad.abs().max())
    assert scale > 0 and float((mine_z.grad - reference_z.grad).abs().max()) <= 1e-5 * scale
    assert not any(p.requires_grad or p.grad is not None for p in module.parameters())  # the VAE stays frozen


@pytest.mark.parametrize("family", ["wan", "wan2.2", "kl"])
def test_checkpointing_recomputes_each_stage_in_the_backward(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = tiny(family)
    mid = module.decoder.mid_block
    calls: list[int] = []
    forward = mid.forward

    def counted(*args: Any, **kwargs: Any) -> Any:  # (module hooks do not fire in a checkpoint's recompute)
        calls.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(mid, "forward", counted)
    for checkpoint in (False, True):
        calls.clear()
        z = torch.randn(1, 4, 3, 4, 4, requires_grad=True)
        PixelDecoder(module, checkpoint=checkpoint)(z).sum().backward()
        assert len(calls) == (6 if checkpoint else 3)  # 3 latent frames; checkpointed: once more in the backward
        calls.clear()
        with torch.no_grad():  # no gradients: nothing to recompute
            PixelDecoder(module, checkpoint=checkpoint)(z)
        assert len(calls) == 3


def test_the_causal_cache_carries_the_gradient_to_earlier_frames() -> None:
    module = tiny("wan")
    z = torch.randn(1, 4, 3, 8, 8, requires_grad=True)
    frames = PixelDecoder(module, checkpoint=True)(z)
    frames[:, :, -1].abs().sum().backward()  # a loss on the last frame alone
    reached = [float(z.grad[:, :, t].abs().sum()) for t in range(3)]
    assert all(value > 0 for value in reached), reached  # frame 0 reaches it through the carried cache


def test_from_cache_decodes_what_vaecache_decode_decodes_and_refuses_another_vae(good_cache: Path) -> None:
    cache = LatentCache(good_cache)
    mean = cache[0].mean
    decoder = PixelDecoder.from_cache(good_cache)
    runner = load_vae("builtin:tiny")
    expected = torch.cat(list(iter_decoded(runner.model, mean, chunk_frames=1)), dim=2)
    assert torch.equal(decoder(mean), expected)
    with pytest.raises(UsageError, match="does not match the VAE recorded"):
        PixelDecoder.from_cache(good_cache, vae="builtin:small")


def test_source_frames_are_what_encode_fed_the_vae_and_refuse_a_changed_source(demo_data: Path,
                                                                               tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    out = tmp_path / "out"
    assert invoke(["encode", data, "--out", out, *ENCODE_ARGS]).exit_code == 0
    cache = LatentCache(out)
    record = cache.record(0)
    targets = cache.source_frames(record["id"])
    assert targets.shape == (2, 3, 9, 64, 64) and targets.dtype == torch.float32
    assert float(targets.min()) >= -1 and float(targets.max()) <= 1
    again = load_vae("builtin:tiny").encode_views(targets)  # the same input gives the stored latents
    assert torch.equal(again.mean, cache[0].mean)
    source = Path(record["sources"][0])
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(SourceChangedError, match=f"{source}.*modified"):
        cache.source_frames(record["id"])


def test_pixel_loss_example_trains_and_needs_a_cache(good_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    example = ROOT / "examples" / "train_pixel_loss.py"
    monkeypatch.setattr(sys, "argv", [str(example), str(good_cache)])
    runpy.run_path(str(example), run_name="__main__")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == len(LatentCache(good_cache))
    assert all("pixel" in line and "nan" not in line for line in lines)
    monkeypatch.setattr(sys, "argv", [str(example)])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(example), run_name="__main__")
    assert exited.value.code == 2


@pytest.mark.parametrize("chunk_frames", [2, 3])
def test_checkpoint_regions_of_several_frames_carry_the_cache_across_their_boundaries(chunk_frames: int) -> None:
    module = tiny("wan")
    z = torch.randn(1, 4, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    reference_z = z.clone().requires_grad_(True)
    reference = plain_decode(module, reference_z)
    reference[:, :, -1].square().sum().backward()
    mine_z = z.clone().requires_grad_(True)
    frames = PixelDecoder(module, checkpoint=True, chunk_frames=chunk_frames)(mine_z)
    frames[:, :, -1].square().sum().backward()
    assert torch.equal(frames, reference)
    assert float((mine_z.grad - reference_z.grad).abs().max()) <= 1e-5 * float(reference_z.grad.abs().max())
