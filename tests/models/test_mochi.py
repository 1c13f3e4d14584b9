"""Mochi 1 (vaecache/models/mochi.py, one module): a tiny random AutoencoderKLMochi encodes to diffusers' own
latents, normalized as the inverse of MochiPipeline's decode, re-encoded by verify, resumed after a kill, exported."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models import family_checks
from vaecache.models import FAMILIES, rule_of_config

SIZE, FRAMES = 16, 7
MEAN = [round(-0.3 + 0.05 * c, 4) for c in range(12)]
STD = [round(0.5 + 0.1 * c, 4) for c in range(12)]
MOCHI_TINY = dict(encoder_block_out_channels=(32, 32, 32, 32), decoder_block_out_channels=(32, 32, 32, 32),
                  latent_channels=12, layers_per_block=(1, 1, 1, 1, 1), temporal_expansions=(1, 2, 3),
                  spatial_expansions=(2, 2, 2), latents_mean=MEAN, latents_std=STD, scaling_factor=1.15258426)
"""Mochi 1's layout (12 channels, 6x time, 8x space, attention in the deeper blocks) at width 32."""


@pytest.fixture(scope="module")
def mochi_vae(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusers import AutoencoderKLMochi

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("mochi") / "vae"
    AutoencoderKLMochi(**MOCHI_TINY).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return family_checks.write_data(tmp_path_factory.mktemp("mochi-data") / "data", frames=FRAMES, size=SIZE)


@pytest.fixture(scope="module")
def cache_dir(mochi_vae: Path, data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mochi-cache") / "cache"
    family_checks.encode(data, out, mochi_vae, FRAMES, SIZE)
    return out


def test_mochi_frame_rule_is_its_encoders() -> None:
    rule = rule_of_config({"_class_name": "AutoencoderKLMochi"})  # the release's expansions
    assert (rule.temporal_factor, rule.spatial_factor, rule.causal) == (6, 8, True)
    assert rule.frames_ok(163) and rule.frames_ok(7) and not rule.frames_ok(8)
    assert rule_of_config({"_class_name": "AutoencoderKLMochi", "temporal_expansions": (1, 2),
                           "spatial_expansions": (2, 2)}).describe() == \
        "1 + 2k frames, height and width multiples of 4"


def test_mochi_latents_are_diffusers_own(mochi_vae: Path, cache_dir: Path) -> None:
    from diffusers import AutoencoderKLMochi

    cache = family_checks.LatentCache(cache_dir)
    vae = cache.manifest["vae"]
    assert (vae["family"], vae["model"]) == ("AutoencoderKLMochi", "mochi")
    assert vae["reference_encode"] == {"name": "untiled"}
    assert cache[0].mean.shape == (1, 12, 2, 2, 2)
    module = AutoencoderKLMochi.from_pretrained(mochi_vae).eval()
    assert family_checks.assert_diffusers_latents(cache, module) == 2
    assert FAMILIES["mochi"].label == "Mochi 1"


def test_mochi_normalization_is_the_inverse_of_its_pipelines_decode(cache_dir: Path) -> None:
    """MochiPipeline decodes `latents * latents_std / scaling_factor + latents_mean` (pipeline_mochi.py:709):
    denormalize is that, bit for bit, and normalize is its inverse."""
    cache = family_checks.LatentCache(cache_dir)
    assert cache.normalization == {"latents_mean": MEAN, "latents_std": STD, "scaling_factor": 1.15258426,
                                   "formula": "(z - latents_mean) * scaling_factor / latents_std"}
    z = cache[0].mean
    latents_mean = torch.tensor(MEAN).view(1, 12, 1, 1, 1).to(z.device, z.dtype)
    latents_std = torch.tensor(STD).view(1, 12, 1, 1, 1).to(z.device, z.dtype)
    assert torch.equal(cache.denormalize(z), z * latents_std / 1.15258426 + latents_mean)
    assert torch.allclose(cache.denormalize(cache.normalize(z)), z, atol=1e-6)
    assert torch.allclose(cache.normalize(z), (z - latents_mean) * 1.15258426 / latents_std, atol=1e-6)


def test_mochi_verify_reencode_and_webdataset_export(cache_dir: Path, tmp_path: Path) -> None:
    family_checks.assert_reencode_passes(cache_dir, 2)
    family_checks.assert_webdataset_export(cache_dir, tmp_path / "wds")


@pytest.mark.slow
def test_mochi_killed_encode_resumes_to_the_same_bytes(mochi_vae: Path, data: Path, cache_dir: Path,
                                                       tmp_path: Path) -> None:
    family_checks.assert_resume_after_kill(data, tmp_path / "cache", mochi_vae, FRAMES, SIZE, cache_dir)
