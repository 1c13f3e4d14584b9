"""`vaecache embed OUT --audio-vae SPEC`: each clip's sound, cut to its frames, encoded by a tiny random
AutoencoderKLLTX2Audio (diffusers' own class, saved with save_pretrained) into an audio set on the set machinery:
read by LatentCache beside the video latents, verified, a clip without sound skipped or silenced with its reason."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

from tests.conftest import run_vaecache
from vaecache.audio.latents import audio_posterior_mean
from vaecache.audio.mel import MelSpec, clip_mel
from vaecache.training import LatentCache


@pytest.fixture
def sound_cache(cache_with_sound: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(cache_with_sound, tmp_path / "cache"))


def test_each_clip_holds_the_audio_vaes_mean_of_its_sound_and_one_without_sound_is_skipped_by_name(
        sound_cache: Path, audio_vae: Path, run_cli: Callable) -> None:
    from diffusers import AutoencoderKLLTX2Audio

    result = run_cli(["embed", sound_cache, "--audio-vae", f"diffusers:{audio_vae}"])
    assert result.exit_code == 0, result.output
    assert "added audio set 'default'" in result.output and "clips without sound: 2 skipped" in result.output
    first_clips = [clip for clip in LatentCache(sound_cache).ids() if clip.split("/")[1].startswith("000000-")]
    for clip in first_clips:  # each named, with why
        assert f"{clip}: skipped: " in result.output and "its audio starts at 0.228000 s" in result.output
    shown = run_cli(["inspect", sound_cache])
    assert shown.exit_code == 0, shown.output
    assert sum(f"  {clip}: skipped: " in shown.output for clip in first_clips) == 2
    manifest = json.loads((sound_cache / "manifest.json").read_text())
    record = manifest["audio"]["default"]
    assert (record["clips"], record["skipped"], record["silenced"]) == (len(list(LatentCache(sound_cache).ids())), 2, 0)
    assert record["fingerprint"]["mel"]["n_fft"] == 1024 and len(record["normalization"]["latents_std"]) == 16
    cache = LatentCache(sound_cache)
    vae = AutoencoderKLLTX2Audio.from_pretrained(audio_vae).eval()
    spec = MelSpec.ltx2(dict(vae.config))
    held = skipped = 0
    for index, clip in enumerate(cache.ids()):
        item = cache[index].tensors
        if cache.record(clip)["frames"][0] == 0:  # the sound starts 0.228 s in: the first clip of a scene has none
            assert "audio/default" not in item
            skipped += 1
            continue
        sound = cache.source_audio(clip)
        expected = audio_posterior_mean(vae, clip_mel(sound.samples, sound.rate, spec))[0]
        assert torch.equal(item["audio/default"], expected), clip
        assert item["audio/default"].shape[0] == 8 and item["mean"].shape[0] == 2  # beside the video latents
        held += 1
    assert skipped == 2 and held >= 6
    table = __import__("pyarrow.parquet", fromlist=["x"]).read_table(
        sound_cache / record["tables"]["clips"]["file"]).to_pylist()
    reasons = [row["audio"] for row in table if row["audio"]]
    assert len(reasons) == 2 and all("skipped: " in r and "its audio starts at 0.228000 s" in r for r in reasons)
    assert {row["camera"] for row in table if not row["audio"]} == {"cam_1"}
    assert run_cli(["verify", sound_cache]).exit_code == 0
    again = run_cli(["embed", sound_cache, "--audio-vae", f"diffusers:{audio_vae}"])
    assert again.exit_code == 0 and "is up to date" in again.output


def test_silence_stands_in_for_missing_sound_with_its_reason(sound_cache: Path, audio_vae: Path,
                                                             run_cli: Callable) -> None:
    result = run_cli(["embed", sound_cache, "--audio-vae", f"diffusers:{audio_vae}", "--audio-missing", "silence",
                      "--set", "quiet"])
    assert result.exit_code == 0, result.output
    record = json.loads((sound_cache / "manifest.json").read_text())["audio"]["quiet"]
    assert (record["skipped"], record["silenced"]) == (0, 2)
    cache = LatentCache(sound_cache)
    first = next(index for index, clip in enumerate(cache.ids()) if cache.record(clip)["frames"][0] == 0)
    silence, sound = cache[first].tensors["audio/quiet"], cache[first + 1].tensors["audio/quiet"]
    assert silence.shape == sound.shape  # silence of the window's length
    assert run_cli(["verify", sound_cache]).exit_code == 0


def test_verify_names_a_removed_audio_tensor_with_every_hash_recomputed(sound_cache: Path, audio_vae: Path,
                                                                       run_cli: Callable) -> None:
    from safetensors.torch import load, save

    assert run_cli(["embed", sound_cache, "--audio-vae", f"diffusers:{audio_vae}", "--shard-size", "1"]).exit_code == 0
    manifest = json.loads((sound_cache / "manifest.json").read_text())
    entry = next(shard for shard in manifest["audio"]["default"]["shards"]
                 if load((sound_cache / shard["file"]).read_bytes()))
    shard = sound_cache / entry["file"]
    (clip,) = load(shard.read_bytes())
    forged = save({}, metadata={"vaecache_audio": "default"})
    shard.write_bytes(forged)
    entry.update(bytes=len(forged), sha256=hashlib.sha256(forged).hexdigest())
    (sound_cache / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    report = run_cli(["verify", sound_cache])
    assert report.exit_code == 1 and f"holds no tensor for clip {clip}" in report.output


def test_a_killed_audio_embed_resumes_to_the_bytes_of_an_uninterrupted_one(cache_with_sound: Path, audio_vae: Path,
                                                                          run_cli: Callable, tmp_path: Path) -> None:
    whole, killed = (Path(shutil.copytree(cache_with_sound, tmp_path / name)) for name in ("whole", "killed"))
    args = ["--audio-vae", f"diffusers:{audio_vae}", "--shard-size", "1"]
    assert run_cli(["embed", whole, *args]).exit_code == 0
    crashed = run_vaecache("embed", killed, *args, env={"VAECACHE_FAULT": "crash-after-set-shard:audio:2"})
    assert crashed.returncode == 137, crashed.stderr[-2000:]
    assert run_cli(["verify", killed]).exit_code == 1  # what the dead process left is named
    resumed = run_cli(["embed", killed, *args])
    assert resumed.exit_code == 0 and "2 shard(s) an interrupted run committed kept" in resumed.output
    files = sorted(str(p.relative_to(whole / "audio")) for p in (whole / "audio").rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(killed / "audio")) for p in (killed / "audio").rglob("*") if p.is_file())
    assert all((whole / "audio" / f).read_bytes() == (killed / "audio" / f).read_bytes() for f in files)
    assert (killed / "manifest.json").read_bytes() == (whole / "manifest.json").read_bytes()


def test_an_audio_vae_of_another_class_or_no_folder_is_refused_by_name(sound_cache: Path, tmp_path: Path,
                                                                      run_cli: Callable) -> None:
    (tmp_path / "wan").mkdir()
    (tmp_path / "wan" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan"}))
    result = run_cli(["embed", sound_cache, "--audio-vae", f"diffusers:{tmp_path / 'wan'}"])
    assert result.exit_code == 2 and "is a AutoencoderKLWan; the audio VAEs are AutoencoderKLLTX2Audio" in result.output
    result = run_cli(["embed", sound_cache, "--audio-vae", f"diffusers:{tmp_path / 'none'}"])
    assert result.exit_code == 2 and "has no config.json" in result.output
    result = run_cli(["embed", sound_cache, "--audio-missing", "silence", "--text-encoder", "diffusers:/x"])
    assert result.exit_code == 2 and "--audio-missing applies to --audio-vae" in result.output


def test_encode_with_an_audio_vae_adds_the_audio_set_embed_would_add(cache_with_sound: Path, audio_vae: Path,
                                                                    run_cli: Callable, tmp_path: Path) -> None:
    data = cache_with_sound.parent / "data"
    args = ["--vae", "builtin:tiny", "--num-frames", "9", "--size", "32x32", "--frame-stride", "2",
            "--window-stride", "11", "--workers", "0", "--no-progress"]
    result = run_cli(["encode", data, "--out", tmp_path / "out", *args, "--audio-vae", f"diffusers:{audio_vae}"])
    assert result.exit_code == 0, result.output
    assert "audio set 'default' added" in result.output and "2 skipped" in result.output
    embedded = Path(shutil.copytree(cache_with_sound, tmp_path / "embedded"))
    assert run_cli(["embed", embedded, "--audio-vae", f"diffusers:{audio_vae}"]).exit_code == 0
    ours, theirs = (json.loads((folder / "manifest.json").read_text())["audio"]["default"]
                    for folder in (tmp_path / "out", embedded))
    assert [s["sha256"] for s in ours["shards"]] == [s["sha256"] for s in theirs["shards"]]
    refused = run_cli(["encode", data, "--out", tmp_path / "never", *args, "--audio-vae", f"diffusers:{tmp_path}"])
    assert refused.exit_code == 2 and "has no config.json" in refused.output
    assert not (tmp_path / "never" / "manifest.json").exists()


def test_verify_reencode_cuts_and_encodes_audio_again_and_names_an_altered_item(sound_cache: Path, audio_vae: Path,
                                                                               run_cli: Callable) -> None:
    from safetensors.torch import load, save

    assert run_cli(["embed", sound_cache, "--audio-vae", f"diffusers:{audio_vae}", "--shard-size", "1"]).exit_code == 0
    report = run_cli(["verify", sound_cache, "--reencode", "3"])
    assert report.exit_code == 0, report.output
    assert "re-encode 3 clip(s) of audio set default" in report.output
    # one value of one stored item moved, every hash and statistic recomputed: only the re-encode can tell
    manifest = json.loads((sound_cache / "manifest.json").read_text())
    entry = next(shard for shard in manifest["audio"]["default"]["shards"]
                 if load((sound_cache / shard["file"]).read_bytes()))
    shard = sound_cache / entry["file"]
    (clip, tensor), = load(shard.read_bytes()).items()
    tensor = tensor.clone()
    tensor.view(-1)[0] += 1e-3 * float(tensor.abs().max())
    forged = save({clip: tensor}, metadata={"vaecache_audio": "default"})
    shard.write_bytes(forged)
    entry.update(bytes=len(forged), sha256=hashlib.sha256(forged).hexdigest())
    (sound_cache / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    count = len(list(LatentCache(sound_cache).ids()))
    report = run_cli(["verify", sound_cache, "--reencode", str(count), "--quick"])
    assert report.exit_code == 1 and f"audio set default: clip {clip} re-encodes" in report.output, report.output


def test_an_audio_camera_the_cache_lacks_is_refused_by_name_before_anything_is_computed(sound_cache: Path,
                                                                                      audio_vae: Path,
                                                                                      run_cli: Callable) -> None:
    before = (sound_cache / "manifest.json").read_bytes()
    result = run_cli(["embed", sound_cache, "--audio-vae", f"diffusers:{audio_vae}", "--audio-camera", "cam_9"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines == [f"error: --audio-camera cam_9: no clip of {sound_cache} has that camera (cameras: cam_0, cam_1)"]
    assert (sound_cache / "manifest.json").read_bytes() == before and not (sound_cache / "audio").exists()


def test_encode_refuses_an_audio_camera_no_scene_has_before_probing(cache_with_sound: Path, audio_vae: Path,
                                                                    run_cli: Callable, tmp_path: Path) -> None:
    result = run_cli(["encode", cache_with_sound.parent / "data", "--out", tmp_path / "out", "--vae", "builtin:tiny",
                      "--num-frames", "9", "--size", "32x32", "--workers", "0", "--no-progress", "--audio-vae",
                      f"diffusers:{audio_vae}", "--audio-camera", "cam_9"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1].startswith("error: --audio-camera cam_9: no scene of ")
    assert "(cameras: cam_0, cam_1)" in result.output and not (tmp_path / "out" / "shards").exists()
