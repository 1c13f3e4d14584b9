"""Qwen-Image (vaecache/models/qwenimage.py, one module): a tiny random AutoencoderKLQwenImage encodes to diffusers'
own latents, normalized as QwenImageImg2ImgPipeline encodes, re-encoded by verify, resumed after a kill, exported."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models import family_checks
from vaecache.models import FAMILIES, rule_of_config

SIZE, FRAMES = 16, 5
MEAN = [round(-0.7 + 0.09 * c, 4) for c in range(16)]
STD = [round(1.5 + 0.2 * c, 4) for c in range(16)]
QWEN_TINY = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True],
                 latents_mean=MEAN, latents_std=STD)
"""Qwen-Image's 16 channels and Wan 2.1's layout at width 8, two levels: 2x time, 4x space."""


@pytest.fixture(scope="module")
def qwen_vae(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("qwenimage") / "vae"
    AutoencoderKLQwenImage(**QWEN_TINY).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return family_checks.write_data(tmp_path_factory.mktemp("qwen-data") / "data", frames=FRAMES, size=SIZE)


@pytest.fixture(scope="module")
def cache_dir(qwen_vae: Path, data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen-cache") / "cache"
    family_checks.encode(data, out, qwen_vae, FRAMES, SIZE)
    return out


def test_qwenimage_frame_rule_is_wans() -> None:
    rule = rule_of_config({"_class_name": "AutoencoderKLQwenImage"})  # the release's layout
    assert (rule.temporal_factor, rule.spatial_factor, rule.causal, rule.step) == (4, 8, True, 4)
    assert rule.frames_ok(1) and rule.frames_ok(5) and not rule.frames_ok(4)
    assert rule_of_config({"_class_name": "AutoencoderKLQwenImage", **QWEN_TINY}).describe() == \
        "1 + 4k frames, height and width multiples of 4"


def test_qwenimage_latents_are_diffusers_own(qwen_vae: Path, cache_dir: Path) -> None:
    from diffusers import AutoencoderKLQwenImage

    cache = family_checks.LatentCache(cache_dir)
    vae = cache.manifest["vae"]
    assert (vae["family"], vae["model"]) == ("AutoencoderKLQwenImage", "qwen-image")
    assert vae["reference_encode"] == {"name": "untiled"}
    assert cache[0].mean.shape == (1, 16, 3, 4, 4)
    module = AutoencoderKLQwenImage.from_pretrained(qwen_vae)
    assert family_checks.assert_diffusers_latents(cache, module) == 2
    assert FAMILIES["qwen-image"].label == "Qwen-Image"


def test_qwenimage_normalization_is_its_img2img_pipelines(cache_dir: Path) -> None:
    """QwenImageImg2ImgPipeline._encode_vae_image: `(image_latents - latents_mean) * latents_std` with latents_std the
    reciprocal `1.0 / torch.tensor(config.latents_std)` (pipeline_qwenimage_img2img.py:242-251), bit for bit."""
    cache = family_checks.LatentCache(cache_dir)
    assert cache.normalization == {"latents_mean": MEAN, "latents_std": STD,
                                   "formula": "(z - latents_mean) / latents_std"}
    z = cache[0].mean
    latents_mean = torch.tensor(MEAN).view(1, 16, 1, 1, 1).to(z.device, z.dtype)
    latents_std = 1.0 / torch.tensor(STD).view(1, 16, 1, 1, 1).to(z.device, z.dtype)
    assert torch.equal(cache.normalize(z), (z - latents_mean) * latents_std)
    assert torch.allclose(cache.denormalize(cache.normalize(z)), z, atol=1e-6)


def test_qwenimage_verify_reencode_and_webdataset_export(cache_dir: Path, tmp_path: Path) -> None:
    family_checks.assert_reencode_passes(cache_dir, 2)
    family_checks.assert_webdataset_export(cache_dir, tmp_path / "wds")


@pytest.mark.slow
def test_qwenimage_killed_encode_resumes_to_the_same_bytes(qwen_vae: Path, data: Path, cache_dir: Path,
                                                           tmp_path: Path) -> None:
    family_checks.assert_resume_after_kill(data, tmp_path / "cache", qwen_vae, FRAMES, SIZE, cache_dir)


def test_qwenimage_musubi_export_names_why_musubi_cannot_take_it(cache_dir: Path, tmp_path: Path) -> None:
    """The family's musubi architecture (qi) is an image one: the export refuses, saying so, before writing."""
    result = family_checks.invoke(["export", cache_dir, "--format", "musubi", "--out", tmp_path / "musubi"])
    assert result.exit_code == 2 and "Qwen-Image is an image architecture" in result.output
    assert not (tmp_path / "musubi").exists()
