"""`vaecache export --format ltx2`: LTX-2's trainer's .precomputed folder, each file loaded as its
PrecomputedDataset loads it (torch.load(..., weights_only=True)), its latents normalized as ltx-core's encoders
return them, a clip without sound without an audio file, and a dataset.jsonl naming each sample for its
process_captions.py. scripts/check_ltx2_export.py runs LTX-2's own dataset class over an export (docs/exports.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch

from tests.audio.sound import write_video_with_sound
from vaecache.export.ltx2 import ltx_normalized
from vaecache.models._ltx2_audio import normalize as normalize_audio_latents
from vaecache.training import LatentCache


@pytest.fixture(scope="module")
def ltx2_cache(tmp_path_factory: pytest.TempPathFactory, run_cli: Callable) -> Path:
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video

    root = tmp_path_factory.mktemp("ltx2")
    torch.manual_seed(0)
    video = AutoencoderKLLTX2Video(block_out_channels=(8, 8, 16, 16), decoder_block_out_channels=(8, 16, 16),
                                   layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
                                   latent_channels=8, patch_size=4)
    video.latents_mean.copy_(torch.randn(8) * 0.1)
    video.latents_std.copy_(torch.rand(8) + 0.5)
    video.save_pretrained(root / "video_vae")
    # LTX-2's statistics are over latent channels x mel bins / 4 = 8 x 16 = 128 features: its base_channels
    audio = AutoencoderKLLTX2Audio(base_channels=128, ch_mult=(1, 1, 1), num_res_blocks=1, latent_channels=8,
                                   mel_bins=64)
    audio.latents_mean.copy_(torch.randn(128) * 0.1)
    audio.latents_std.copy_(torch.rand(128) + 0.5)
    audio.save_pretrained(root / "audio_vae")
    (root / "data").mkdir()
    write_video_with_sound(root / "data" / "talk.mp4", rate=48000, audio_offset=12000, seconds=2.0, fps=25)
    (root / "data" / "talk.txt").write_text("a person talks")
    result = run_cli(["encode", root / "data", "--out", root / "out", "--vae", f"diffusers:{root / 'video_vae'}",
                      "--num-frames", "9", "--size", "64x64", "--window-stride", "12", "--workers", "0",
                      "--no-progress", "--audio-vae", f"diffusers:{root / 'audio_vae'}"])
    assert result.exit_code == 0, result.output
    return root / "out"


def test_each_sample_is_what_ltx2s_trainer_loads_normalized_as_its_encoders_return_latents(
        ltx2_cache: Path, run_cli: Callable, tmp_path: Path) -> None:
    result = run_cli(["export", ltx2_cache, "--format", "ltx2", "--out", tmp_path / "ltx2"])
    assert result.exit_code == 0, result.output
    cache = LatentCache(ltx2_cache)
    manifest = json.loads((ltx2_cache / "manifest.json").read_text())
    constants = manifest["audio"]["default"]["normalization"]
    lines = [json.loads(line) for line in (tmp_path / "ltx2" / "dataset.jsonl").read_text().splitlines()]
    assert len(lines) == len(cache) and all(line["caption"] == "a person talks" for line in lines)
    with_sound = 0
    for position, clip in enumerate(cache.ids()):
        assert lines[position]["media_path"] == f"{clip}.mp4"
        saved = torch.load(tmp_path / "ltx2" / ".precomputed" / "latents" / f"{clip}.pt", map_location="cpu",
                           weights_only=True)
        expected = ltx_normalized(cache[position].tensors["mean"], cache.normalization)[0]
        assert torch.equal(saved["latents"], expected)
        assert (saved["num_frames"], saved["height"], saved["width"], saved["fps"]) == (2, 2, 2, 25.0)
        sound_file = tmp_path / "ltx2" / ".precomputed" / "audio_latents" / f"{clip}.pt"
        item = cache[position].tensors
        if "audio/default" not in item:  # the sound starts 0.228 s in: the first clip has none, and no file
            assert not sound_file.exists()
            continue
        sound = torch.load(sound_file, map_location="cpu", weights_only=True)
        normalized = normalize_audio_latents(item["audio/default"].float()[None],
                                             torch.tensor(constants["latents_mean"]),
                                             torch.tensor(constants["latents_std"]))[0]
        assert torch.equal(sound["latents"], normalized)
        assert (sound["num_time_steps"], sound["frequency_bins"]) == tuple(normalized.shape[1:])
        assert sound["duration"] == pytest.approx(9 / 25, abs=1 / 48000)
        with_sound += 1
    assert with_sound == len(cache) - 1


def test_only_a_cache_of_ltx2s_video_vae_is_exported(good_cache: Path, run_cli: Callable, tmp_path: Path) -> None:
    result = run_cli(["export", good_cache, "--format", "ltx2", "--out", tmp_path / "ltx2"])
    assert result.exit_code == 2 and "LTX-2's trainer trains on the latents of its video VAE" in result.output
    assert not (tmp_path / "ltx2").exists()
    result = run_cli(["export", good_cache, "--format", "musubi", "--audio-set", "x", "--out", tmp_path / "m"])
    assert result.exit_code == 2 and "--audio-set applies to --format ltx2 only" in result.output


def test_without_an_audio_set_the_export_holds_latents_only(ltx2_cache: Path, run_cli: Callable,
                                                             tmp_path: Path) -> None:
    assert run_cli(["export", ltx2_cache, "--format", "ltx2", "--audio-set", "none",
                    "--out", tmp_path / "plain"]).exit_code == 0
    assert not (tmp_path / "plain" / ".precomputed" / "audio_latents").exists()
    latents = tmp_path / "plain" / ".precomputed" / "latents"
    written = sorted(str(path.relative_to(latents).with_suffix("")) for path in latents.rglob("*.pt"))
    assert written == sorted(LatentCache(ltx2_cache).ids())  # every clip's latents still (<scene>/<window>.pt)
    assert json.loads((tmp_path / "plain" / "export.json").read_text())["audio_set"] is None


def test_a_bf16_cache_exports_bf16_latents_in_ltx_cores_arithmetic(ltx2_cache: Path, run_cli: Callable,
                                                                   tmp_path: Path) -> None:
    """LTX-2's trainer encodes video in bf16 and ltx-core normalizes in bf16: a cache encoded in bf16 exports that."""
    root = ltx2_cache.parent
    result = run_cli(["encode", root / "data", "--out", tmp_path / "bf16", "--vae", f"diffusers:{root / 'video_vae'}",
                      "--num-frames", "9", "--size", "64x64", "--window-stride", "12", "--workers", "0",
                      "--dtype", "bf16", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert run_cli(["export", tmp_path / "bf16", "--format", "ltx2", "--out", tmp_path / "ltx2"]).exit_code == 0
    cache = LatentCache(tmp_path / "bf16")
    clip = cache.ids()[0]
    saved = torch.load(tmp_path / "ltx2" / ".precomputed" / "latents" / f"{clip}.pt", weights_only=True)
    stored = cache[0].tensors["mean"]
    mean = torch.tensor(cache.normalization["latents_mean"]).view(1, -1, 1, 1, 1).to(torch.bfloat16)
    std = torch.tensor(cache.normalization["latents_std"]).view(1, -1, 1, 1, 1).to(torch.bfloat16)
    assert stored.dtype == saved["latents"].dtype == torch.bfloat16
    assert torch.equal(saved["latents"], ((stored - mean) / std)[0])  # PerChannelStatistics.normalize, in bf16


def test_an_ltx2_text_set_exports_as_the_conditions_process_captions_saves(ltx2_cache: Path, run_cli: Callable,
                                                                           tmp_path: Path) -> None:
    """A Gemma text set (vaecache embed of an LTX2Pipeline folder) becomes .precomputed/conditions/<name>.pt, what
    LTX-2's process_captions.py saves for the sample's caption (ltx-core's own tokenizer and feature extractor,
    tests/text/ltx_core_reference.py), beside the same sample's latents and audio latents."""
    import shutil

    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration

    from tests.text import ltx_core_reference as ltx_core
    from tests.text.tiny_text import build_ltx2_text_folder

    text = build_ltx2_text_folder(tmp_path / "text", version=2)
    cache_dir = tmp_path / "cache"
    shutil.copytree(ltx2_cache, cache_dir)
    result = run_cli(["embed", cache_dir, "--text-encoder", f"diffusers:{text}", "--set", "gemma"])
    assert result.exit_code == 0, result.output
    assert run_cli(["verify", cache_dir]).exit_code == 0
    result = run_cli(["export", cache_dir, "--format", "ltx2", "--out", tmp_path / "ltx2"])
    assert result.exit_code == 0, result.output
    with torch.no_grad():
        saved_by_ltx = ltx_core.process_captions_item(
            Gemma3ForConditionalGeneration.from_pretrained(text / "text_encoder").eval().model,
            AutoTokenizer.from_pretrained(text / "tokenizer"),
            ltx_core.feature_extractor(LTX2TextConnectors.from_pretrained(text / "connectors").eval()),
            "a person talks")
    precomputed = tmp_path / "ltx2" / ".precomputed"
    cache = LatentCache(cache_dir)
    for clip in cache.ids():
        conditions = torch.load(precomputed / "conditions" / f"{clip}.pt", map_location="cpu", weights_only=True)
        assert conditions.keys() == saved_by_ltx.keys()
        for key, tensor in saved_by_ltx.items():
            assert conditions[key].dtype == tensor.dtype and torch.equal(conditions[key], tensor), key
        assert (precomputed / "latents" / f"{clip}.pt").is_file()
    assert json.loads((tmp_path / "ltx2" / "export.json").read_text())["text_set"] == "gemma"
    result = run_cli(["export", cache_dir, "--format", "ltx2", "--text-set", "none", "--out", tmp_path / "plain"])
    assert result.exit_code == 0 and not (tmp_path / "plain" / ".precomputed" / "conditions").exists()
    result = run_cli(["export", cache_dir, "--format", "ltx2", "--text-set", "other", "--out", tmp_path / "x"])
    assert result.exit_code == 2 and "has no text set 'other' (sets: gemma)" in result.output
