"""LatentCache.source_audio: a cached clip's sound, cut from its recorded source exactly to its frames."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Callable

import pytest
import torch

from tests.audio.sound import ffmpeg_samples, write_video_with_sound
from vaecache.errors import AudioMissingError
from vaecache.training import LatentCache

FPS = 25


@pytest.fixture(scope="module")
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


def test_each_clip_gets_the_samples_ffmpeg_decodes_for_its_frames(cache_with_sound: Path) -> None:
    cache = LatentCache(cache_with_sound)
    records = list(cache.records())
    assert len(records) >= 8 and len({record["frames"][0] for record in records}) >= 4  # many offsets
    references = {}
    for record in records:
        path = record["sources"][1]
        if path not in references:
            references[path] = ffmpeg_samples(Path(path))
        reference, rate, audio_start = references[path]
        start = Fraction(record["frames"][0], FPS)
        first = round((start - Fraction(audio_start).limit_denominator(rate)) * rate)
        count = int(len(record["frames"]) / (FPS / 2) * rate)
        if first < 0:  # the audio starts late: the scene's first clip has none
            with pytest.raises(AudioMissingError, match="its audio starts at"):
                cache.source_audio(record)
            continue
        sound = cache.source_audio(record)  # the first camera with a track: cam_1
        assert (sound.path, sound.rate, sound.layout, sound.first_sample) == (path, 48000, "stereo", first)
        assert torch.equal(sound.samples, torch.from_numpy(reference[:, first:first + count])), record["id"]


def test_a_camera_without_sound_and_a_window_before_the_sound_are_refused_by_name(cache_with_sound: Path) -> None:
    cache = LatentCache(cache_with_sound)
    first_clip = next(record for record in cache.records() if record["frames"][0] == 0)
    with pytest.raises(AudioMissingError, match="cam_0.mp4: no audio track"):
        cache.source_audio(first_clip, camera="cam_0")
    before = r"cam_1.mp4: its audio starts at 0\.228000 s, after the clip's window \[0\.000000, 0\.720000\) s"
    with pytest.raises(AudioMissingError, match=before):
        cache.source_audio(first_clip)
    with pytest.raises(KeyError, match="no camera 'cam_9'"):
        cache.source_audio(first_clip, camera="cam_9")
