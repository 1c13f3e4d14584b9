"""Kandinsky 5 I2V's image latent on a HunyuanVideo VAE cache (--condition-pipeline kandinsky5): the first frame
encoded alone, its posterior mean times scaling_factor, what diffusers' Kandinsky5I2VPipeline.prepare_latents writes
over the first latent frame when its VAE's sample is the mean; the pipeline asked by name, never guessed."""

from __future__ import annotations

import shutil
import types

import torch

from vaecache.training import LatentCache


def diffusers_k5_image_latent(vae, frame: torch.Tensor, num_frames: int) -> torch.Tensor:
    """diffusers' own prepare_latents (unbound) with the VAE's posterior answering its mode where the pipeline draws
    a sample, and the frame as its video_processor's output: the first latent frame it builds, (C, 1, h, w)."""
    from diffusers.pipelines.kandinsky5.pipeline_kandinsky_i2v import Kandinsky5I2VPipeline

    def encode(video):
        posterior = vae.encode(video).latent_dist
        return types.SimpleNamespace(latent_dist=types.SimpleNamespace(sample=lambda generator=None: posterior.mode()))

    stand_in = types.SimpleNamespace(encode=encode, config=vae.config)
    pipeline = types.SimpleNamespace(vae=stand_in, vae_scale_factor_temporal=4, vae_scale_factor_spatial=4,
                                     video_processor=types.SimpleNamespace(
                                         preprocess=lambda image, height, width: frame[None]),
                                     transformer=types.SimpleNamespace(visual_cond=False))
    _, height, width = frame.shape
    with torch.no_grad():
        latents = Kandinsky5I2VPipeline.prepare_latents(pipeline, None, 1, vae.config.latent_channels, height, width,
                                                        num_frames, torch.float32, torch.device("cpu"),
                                                        torch.Generator().manual_seed(0))
    return latents[0, 0:1].permute(3, 0, 1, 2)  # channels last -> (C, 1, h, w)


def test_the_kandinsky5_image_latent_is_the_pipelines_first_latent_frame(demo_data, run_cli, tmp_path):
    from diffusers import AutoencoderKLHunyuanVideo

    from tests.export.test_export import HUNYUAN_TINY

    torch.manual_seed(0)
    AutoencoderKLHunyuanVideo(**HUNYUAN_TINY).save_pretrained(tmp_path / "vae")
    result = run_cli(["encode", demo_data, "--out", tmp_path / "cache", "--vae", f"diffusers:{tmp_path / 'vae'}",
                      "--num-frames", "5", "--size", "32x32", "--workers", "0", "--no-progress"])
    assert result.exit_code == 0, result.output
    guessed = run_cli(["embed", tmp_path / "cache", "--condition", "first-frame"])
    assert guessed.exit_code == 2 and "--condition-pipeline (kandinsky5" in guessed.output
    result = run_cli(["embed", tmp_path / "cache", "--condition", "first-frame", "--condition-pipeline", "kandinsky5"])
    assert result.exit_code == 0, result.output
    vae = AutoencoderKLHunyuanVideo.from_pretrained(tmp_path / "vae").eval()
    latents = LatentCache(tmp_path / "cache")
    for item in latents:
        frames = latents.source_frames(item.id)
        condition = item["condition/first-frame"]
        assert condition.shape == (len(item.cameras), item.mean.shape[1], 1, *item.mean.shape[3:])
        for view in range(len(item.cameras)):
            assert torch.equal(condition[view], diffusers_k5_image_latent(vae, frames[view, :, 0], frames.shape[2]))
    verified = run_cli(["verify", tmp_path / "cache", "--reencode", "2"])
    assert verified.exit_code == 0, verified.output
    shutil.rmtree(tmp_path / "cache")


def test_a_kandinsky5_cache_conditions_for_kandinsky5_and_its_musubi_export_leaves_the_set_out(demo_data, run_cli,
                                                                                              tmp_path):
    """A cache encoded for Kandinsky 5 (--model kandinsky5) needs no --condition-pipeline; musubi's k5 caching cuts its
    latents_image from the video latents, so `export --arch k5` with the default --condition auto leaves a first-frame
    set out instead of refusing (asked for by name, it is still refused)."""
    from diffusers import AutoencoderKLHunyuanVideo
    from safetensors.torch import load_file

    from tests.export.test_export import HUNYUAN_TINY

    torch.manual_seed(0)
    AutoencoderKLHunyuanVideo(**HUNYUAN_TINY).save_pretrained(tmp_path / "vae")
    result = run_cli(["encode", demo_data, "--out", tmp_path / "cache", "--vae", f"diffusers:{tmp_path / 'vae'}",
                      "--model", "kandinsky5", "--num-frames", "5", "--size", "32x32", "--workers", "0",
                      "--no-progress"])
    assert result.exit_code == 0, result.output
    result = run_cli(["embed", tmp_path / "cache", "--condition", "first-frame"])
    assert result.exit_code == 0, result.output
    latents = LatentCache(tmp_path / "cache")
    assert latents.sets()["conditions"]["first-frame"].entry["fingerprint"]["pipeline"] == "kandinsky5"
    exported = run_cli(["export", tmp_path / "cache", "--format", "musubi", "-o", tmp_path / "k5"])
    assert exported.exit_code == 0, exported.output
    first = next((tmp_path / "k5" / "cache").glob("*_k5.safetensors"))
    assert sorted(load_file(first)) == ["latents_2x8x8_float32", "latents_image_2x8x8_float32"]
    asked = run_cli(["export", tmp_path / "cache", "--format", "musubi", "-o", tmp_path / "no", "--condition",
                     "first-frame"])
    assert asked.exit_code == 2 and "stores no first-frame latents_image" in asked.output
