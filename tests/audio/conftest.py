"""A cache of videos with sound, shared by the audio tests."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from tests.audio.sound import write_video_with_sound

FPS = 25


@pytest.fixture(scope="session")
def cache_with_sound(tmp_path_factory: pytest.TempPathFactory, run_cli: Callable) -> Path:
    """Two scenes of two cameras, 3 s each: cam_0 silent, cam_1 with AAC stereo at 48 kHz written 0.25 s late
    (the muxer starts it at 0.228 s: the encoder's priming);
    clips of 9 frames every 2nd frame, starting every 11 frames (clips at many offsets)."""
    root = tmp_path_factory.mktemp("sound-cache")
    for scene in ("scene_000", "scene_001"):
        (root / "data" / scene).mkdir(parents=True)
        write_video_with_sound(root / "data" / scene / "cam_0.mp4", sound=False, seconds=3.0, fps=FPS)
        write_video_with_sound(root / "data" / scene / "cam_1.mp4", rate=48000, audio_offset=12000, seconds=3.0,
                               fps=FPS, seed=len(scene) + int(scene[-1]))
    result = run_cli(["encode", root / "data", "--out", root / "out", "--vae", "builtin:tiny", "--num-frames", "9",
                      "--size", "32x32", "--frame-stride", "2", "--window-stride", "11", "--workers", "0",
                      "--no-progress"])
    assert result.exit_code == 0, result.output
    return root / "out"


@pytest.fixture(scope="session")
def audio_vae(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random AutoencoderKLLTX2Audio (diffusers' own class), saved with save_pretrained."""
    from diffusers import AutoencoderKLLTX2Audio

    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Audio(base_channels=16, ch_mult=(1, 2, 4), num_res_blocks=1, latent_channels=8,
                                 mel_bins=64, output_channels=2)
    vae.latents_mean.copy_(torch.randn(16) * 0.1)
    vae.latents_std.copy_(torch.rand(16) + 0.5)
    folder = tmp_path_factory.mktemp("audio-vae") / "audio_vae"
    vae.save_pretrained(folder)
    return folder
