"""LTX-2's checkpoint file as its authors release it (the transformer, `vae.*`, `audio_vae.*` and a `config`
metadata in one safetensors file): `--vae FILE` and `--audio-vae FILE` give the latents and audio latents of the
same weights as diffusers folders, bit for bit; each VAE is loaded strictly from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import save_file

from tests.audio.sound import write_video_with_sound
from tests.conftest import assert_same_tensors, load_tensors
from tests.vae.original_layouts import ltx2_audio_original, ltx2_original
from vaecache.errors import VaeSpecError
from vaecache.training import LatentCache

VIDEO = dict(latent_channels=8, block_out_channels=(8, 16, 32, 64), decoder_block_out_channels=(8, 16, 32),
             layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1))
"""LTX-2.0's video VAE at a tiny width: its levels, resamplers and causality (each decoder level's upsampler halves
the channels, as the release's, so no level needs a channel-changing conv_in the original layout has no name for)."""
AUDIO = dict(base_channels=128, ch_mult=(1, 1, 1), num_res_blocks=1, latent_channels=8, mel_bins=64)


def audio_metadata(n_fft: int) -> dict:
    """`config.audio_vae` as an LTX-2 checkpoint holds it (what ltx-core's AudioEncoderConfigurator reads), for the
    tiny audio VAE: every key ltx-core's defaults would get wrong spelled out, as a release's are."""
    return {"model": {"params": {"sampling_rate": 16000, "ddconfig": {
        "ch": 128, "out_ch": 2, "ch_mult": [1, 1, 1], "num_res_blocks": 1, "attn_resolutions": [],
        "resolution": 256, "z_channels": 8, "double_z": True, "dropout": 0.0, "in_channels": 2,
        "mid_block_add_attention": False, "norm_type": "pixel", "causality_axis": "height", "mel_bins": 64}}},
        "preprocessing": {"stft": {"filter_length": n_fft, "hop_length": 160, "causal": True},
                          "mel": {"n_mel_channels": 64}}}


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """root/{video_vae, audio_vae} diffusers folders and root/ltx-2-tiny.safetensors, the same weights in LTX-2's
    release layout with a stand-in transformer tensor, the statistics' extra tensors and the config metadata."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video

    root = tmp_path_factory.mktemp("ltx2-release")
    torch.manual_seed(0)
    video = AutoencoderKLLTX2Video(**VIDEO)
    video.latents_mean.copy_(torch.randn(8) * 0.1)
    video.latents_std.copy_(torch.rand(8) + 0.5)
    video.save_pretrained(root / "video_vae")
    audio = AutoencoderKLLTX2Audio(**AUDIO)
    audio.latents_mean.copy_(torch.randn(128) * 0.1)
    audio.latents_std.copy_(torch.rand(128) + 0.5)
    audio.save_pretrained(root / "audio_vae")
    tensors = {**ltx2_original(video.state_dict()), **ltx2_audio_original(audio.state_dict()),
               "vae.per_channel_statistics.channel": torch.arange(8.0),
               "vae.per_channel_statistics.mean-of-stds": torch.ones(8),
               "audio_vae.per_channel_statistics.mean-of-stds": torch.ones(128),
               "model.diffusion_model.scale_shift_table": torch.zeros(2, 16)}
    save_file({key: value.contiguous() for key, value in tensors.items()}, root / "ltx-2-tiny.safetensors",
              metadata={"config": json.dumps({"vae": {"_class_name": "CausalVideoAutoencoder"},
                                              "audio_vae": audio_metadata(1024)})})
    (root / "data").mkdir()
    write_video_with_sound(root / "data" / "talk.mp4", rate=48000, seconds=1.2, fps=25)
    return root


ARGS = ("--num-frames", "9", "--size", "64x64", "--workers", "0", "--no-progress")


def test_the_release_file_gives_the_latents_and_audio_latents_of_the_diffusers_folders(
        release: Path, run_cli: Callable, tmp_path: Path) -> None:
    single = release / "ltx-2-tiny.safetensors"
    runs = {"folders": ("--vae", f"diffusers:{release / 'video_vae'}", "--audio-vae",
                        f"diffusers:{release / 'audio_vae'}"),
            "file": ("--vae", single, "--vae-config", release / "video_vae" / "config.json", "--audio-vae", single)}
    for name, args in runs.items():
        result = run_cli(["encode", release / "data", "--out", tmp_path / name, *ARGS, *args])
        assert result.exit_code == 0, result.output
    assert_same_tensors(load_tensors(tmp_path / "folders"), load_tensors(tmp_path / "file"))
    folders, file = LatentCache(tmp_path / "folders"), LatentCache(tmp_path / "file")
    assert file.manifest["vae"]["family"] == "AutoencoderKLLTX2Video"
    assert file.normalization["latents_mean"] == folders.normalization["latents_mean"]
    for a, b in zip(folders, file):
        assert torch.equal(a["audio/default"], b["audio/default"])
    record = json.loads((tmp_path / "file" / "manifest.json").read_text())["audio"]["default"]
    assert record["audio_vae"] == str(single) and record["fingerprint"]["mel"]["n_fft"] == 1024
    assert run_cli(["verify", tmp_path / "file", "--reencode", "1"]).exit_code == 0


def test_the_files_stft_size_reaches_the_mel(release: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from vaecache.audio.release_file import load_audio_single_file

    changed = tmp_path / "ltx-2-512.safetensors"
    save_file(load_file(release / "ltx-2-tiny.safetensors"), changed,
              metadata={"config": json.dumps({"audio_vae": audio_metadata(512)})})
    loaded = load_audio_single_file(changed)
    assert loaded.n_fft == 512 and loaded.config_source.startswith("the file's metadata")


def _refused_audio(path: Path) -> str:
    from vaecache.audio.release_file import load_audio_single_file

    with pytest.raises(VaeSpecError) as caught:
        load_audio_single_file(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    return message


def test_each_vae_is_loaded_strictly_from_the_file(release: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from vaecache.vae.single_file import load_single_file

    state = load_file(release / "ltx-2-tiny.safetensors")
    metadata = {"config": json.dumps({"audio_vae": audio_metadata(1024)})}
    gone = tmp_path / "no-audio-weight.safetensors"
    save_file({k: v for k, v in state.items() if k != "audio_vae.encoder.conv_in.conv.weight"}, gone, metadata)
    assert "no tensor for encoder.conv_in.conv.weight" in _refused_audio(gone)
    extra = tmp_path / "extra.safetensors"
    save_file({**state, "audio_vae.encoder.extra.weight": torch.zeros(2)}, extra, metadata)
    assert "has no place for: encoder.extra.weight" in _refused_audio(extra)
    video_gone = tmp_path / "no-video-weight.safetensors"
    save_file({k: v for k, v in state.items() if k != "vae.encoder.conv_in.conv.weight"}, video_gone, metadata)
    with pytest.raises(VaeSpecError, match="no tensor for encoder.conv_in.conv.weight"):
        load_single_file(video_gone, release / "video_vae" / "config.json", False)
    only_audio = tmp_path / "audio-only.safetensors"
    save_file({k: v for k, v in state.items() if k.startswith("audio_vae.")}, only_audio, metadata)
    with pytest.raises(VaeSpecError, match="LTX-2's audio VAE alone .* pass it as --audio-vae"):
        load_single_file(only_audio, None, False)
    only_video = tmp_path / "video-only.safetensors"
    save_file({k: v for k, v in state.items() if k.startswith("vae.")}, only_video)
    assert "no audio_vae.* tensors" in _refused_audio(only_video)


def test_an_audio_vae_file_without_its_tensors_is_refused_before_any_video_is_read(release: Path, run_cli: Callable,
                                                                                   tmp_path: Path) -> None:
    from safetensors.torch import load_file

    only_video = tmp_path / "video-only.safetensors"
    save_file({k: v for k, v in load_file(release / "ltx-2-tiny.safetensors").items() if k.startswith("vae.")},
              only_video)
    result = run_cli(["encode", release / "data", "--out", tmp_path / "out", *ARGS, "--vae",
                      f"diffusers:{release / 'video_vae'}", "--audio-vae", only_video])
    assert result.exit_code == 2 and "no audio_vae.* tensors" in result.output
    assert not (tmp_path / "out").exists()
    result = run_cli(["embed", tmp_path / "nothing", "--audio-vae", release / "audio_vae" / "config.json"])
    assert result.exit_code == 2 and "--audio-vae must be diffusers:PATH[#SUBFOLDER]" in result.output


def test_a_timestep_conditioned_decoder_is_never_taken_for_ltx2s_with_or_without_the_vae_prefix() -> None:
    """LTX-Video 0.9.5's VAE has LTX-2.0's encoder; its decoder's 0-dim timestep_scale_multiplier tells it apart,
    whether the file's keys carry `vae.` or not."""
    import diffusers

    from tests.vae.original_layouts import ltx_original
    from vaecache.models._ltx2_file import video_config_name
    from vaecache.models.base import CONFIGS

    config = json.loads((CONFIGS / "ltx-video-0.9.5_vae.json").read_text())
    with torch.device("meta"):
        module = diffusers.AutoencoderKLLTXVideo.from_config(config)
    prefixed = {key: tuple(value.shape) for key, value in ltx_original(module.state_dict(), "0.9.5").items()}
    assert prefixed["vae.decoder.timestep_scale_multiplier"] == ()
    bare = {key.removeprefix("vae."): shape for key, shape in prefixed.items()}
    assert video_config_name(prefixed) is None and video_config_name(bare) is None
    without = {key: shape for key, shape in bare.items() if "timestep" not in key and "time_embedder" not in key
               and "scale_shift_table" not in key}
    assert video_config_name(without) == "ltx-2.0_vae.json"
