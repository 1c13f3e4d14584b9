"""Audio latents: a tiny random AutoencoderKLLTX2Audio (diffusers' own class) over a clip's mel, and LTX-2's
normalization over the packed features, equal to diffusers' pipeline functions and ltx-core's patchify-normalize."""

from __future__ import annotations

import pytest
import torch

from vaecache.audio.latents import audio_posterior_mean
from vaecache.audio.mel import MelSpec, clip_mel
from vaecache.models._ltx2_audio import denormalize as denormalize_audio_latents
from vaecache.models._ltx2_audio import normalize as normalize_audio_latents


@pytest.fixture(scope="module")
def tiny_audio_vae() -> torch.nn.Module:
    from diffusers import AutoencoderKLLTX2Audio

    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Audio(base_channels=32, ch_mult=(1, 2, 4), num_res_blocks=1, latent_channels=8,
                                 mel_bins=64, output_channels=2).eval()
    # LTX-2's statistics are over latent channels x mel bins / 4 = 8 x 16 = 128 features (base_channels 128 in
    # the release); a tiny VAE of 32 base channels gets 128-entry statistics as the release's buffers hold them.
    vae.register_buffer("latents_mean", torch.randn(128) * 0.1, persistent=True)
    vae.register_buffer("latents_std", torch.rand(128) + 0.5, persistent=True)
    return vae


def test_the_stored_mean_is_diffusers_posterior_mode_of_the_clips_mel(tiny_audio_vae: torch.nn.Module) -> None:
    samples = torch.randn(2, 44100 // 2, generator=torch.Generator().manual_seed(1)) * 0.3
    mel = clip_mel(samples, 44100, MelSpec.ltx2(dict(tiny_audio_vae.config)))
    mean = audio_posterior_mean(tiny_audio_vae, mel)
    with torch.no_grad():
        expected = tiny_audio_vae.encode(mel).latent_dist.mode()
    assert torch.equal(mean, expected)
    assert mean.shape[:2] == (1, 8) and mean.shape[-1] == 64 // 4


def test_the_normalization_is_ltx2s_over_packed_features(tiny_audio_vae: torch.nn.Module) -> None:
    from diffusers import LTX2Pipeline

    mean = torch.randn(1, 8, 13, 16, generator=torch.Generator().manual_seed(2))
    vae_mean, vae_std = tiny_audio_vae.latents_mean, tiny_audio_vae.latents_std
    ours = normalize_audio_latents(mean, vae_mean, vae_std)
    packed = LTX2Pipeline._normalize_audio_latents(LTX2Pipeline._pack_audio_latents(mean), vae_mean, vae_std)
    assert torch.equal(ours, LTX2Pipeline._unpack_audio_latents(packed, 13, 16))
    # ltx-core's AudioPatchifier.patchify is einops "b c t f -> b t (c f)", then (x - mean-of-means) / std-of-means
    core = ((mean.permute(0, 2, 1, 3).reshape(1, 13, 128) - vae_mean) / vae_std).reshape(1, 13, 8, 16).permute(
        0, 2, 1, 3)
    assert torch.equal(ours, core)
    assert torch.allclose(denormalize_audio_latents(ours, vae_mean, vae_std), mean, atol=1e-6)
    with pytest.raises(ValueError, match="8 x 16 features; the VAE records 64 means"):
        normalize_audio_latents(mean, vae_mean[:64], vae_std[:64])
