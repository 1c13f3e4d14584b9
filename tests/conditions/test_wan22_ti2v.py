"""Wan 2.2 TI2V's image-to-video condition (a Wan VAE with patch_size): the first frame encoded alone and normalized,
and the mask 0 on the first latent frame, bit for bit diffusers' WanImageToVideoPipeline.prepare_latents with
expand_timesteps on the frame the cache says encode saw; verified and re-encoded; first-last refused."""

from __future__ import annotations

import shutil
import types

import pytest
import torch

from vaecache.training import LatentCache

WAN22 = dict(base_dim=16, decoder_base_dim=24, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
             temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
             scale_factor_spatial=16, scale_factor_temporal=4, latents_mean=[0.1, -0.2, 0.3, 0.0],
             latents_std=[1.5, 2.0, 0.5, 1.0])
"""Wan 2.2 TI2V-5B's VAE at a tiny width (tests/vae/test_single_file.py's)."""


@pytest.fixture(scope="module")
def ti2v_cache(tmp_path_factory, demo_data, run_cli):
    from diffusers import AutoencoderKLWan

    root = tmp_path_factory.mktemp("ti2v")
    torch.manual_seed(11)
    AutoencoderKLWan(**WAN22).save_pretrained(root / "vae")
    result = run_cli(["encode", demo_data, "--out", root / "cache", "--vae", f"diffusers:{root / 'vae'}",
                      "--num-frames", "5", "--size", "32x32", "--workers", "0", "--no-progress"])
    assert result.exit_code == 0, result.output
    return root


def diffusers_ti2v(vae, frame: torch.Tensor, num_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' own prepare_latents (unbound, with the attributes it reads) with expand_timesteps on one camera's
    first frame (3, H, W): (latent_condition, first_frame_mask), each of batch 1."""
    from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline

    pipeline = types.SimpleNamespace(vae=vae, config=types.SimpleNamespace(expand_timesteps=True),
                                     vae_scale_factor_temporal=4, vae_scale_factor_spatial=16)
    _, height, width = frame.shape
    noise = torch.zeros(1, 4, (num_frames - 1) // 4 + 1, height // 16, width // 16)
    with torch.no_grad():
        _, condition, mask = WanImageToVideoPipeline.prepare_latents(
            pipeline, frame[None], 1, 4, height, width, num_frames, torch.float32, torch.device("cpu"), None, noise)
    return condition, mask


def test_the_ti2v_condition_and_mask_are_the_pipelines_per_camera(ti2v_cache, run_cli, tmp_path):
    from diffusers import AutoencoderKLWan

    cache = shutil.copytree(ti2v_cache / "cache", tmp_path / "cache")
    refused = run_cli(["embed", cache, "--condition", "first-last"])
    assert refused.exit_code == 2 and "has no first-last condition" in refused.output
    result = run_cli(["embed", cache, "--condition", "first-frame"])
    assert result.exit_code == 0, result.output
    vae = AutoencoderKLWan.from_pretrained(ti2v_cache / "vae").eval()
    latents = LatentCache(cache)
    for item in latents:
        frames = latents.source_frames(item.id)
        condition, mask = item["condition/first-frame"], item["condition_mask/first-frame"]
        assert condition.shape == (len(item.cameras), 4, 1, *item.mean.shape[3:])
        assert mask.shape == (len(item.cameras), 1, *item.mean.shape[2:])
        for view in range(len(item.cameras)):
            expected, expected_mask = diffusers_ti2v(vae, frames[view, :, 0], frames.shape[2])
            assert torch.equal(condition[view], expected[0]) and torch.equal(mask[view], expected_mask[0])
    assert run_cli(["verify", cache, "--reencode", "2"]).exit_code == 0
