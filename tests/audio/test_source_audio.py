"""LatentCache.source_audio: a cached clip's sound, cut from its recorded source exactly to its frames."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
import torch

from tests.audio.sound import ffmpeg_samples
from vaecache.errors import AudioMissingError
from vaecache.training import LatentCache

FPS = 25


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


def test_an_embeds_clips_of_one_video_open_it_for_its_track_and_index_it_once(cache_with_sound: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from vaecache.audio import track
    from vaecache.audio.track import AudioSources, record_audio
    from vaecache.video import reader

    opened, indexed = [], []
    real_has_audio, real_reader = track.has_audio, reader.VideoReader
    monkeypatch.setattr(track, "has_audio", lambda path: opened.append(path) or real_has_audio(path))
    monkeypatch.setattr(reader, "VideoReader", lambda path, *a, **k: indexed.append(path) or real_reader(path, *a, **k))
    cache = LatentCache(cache_with_sound)
    sources = AudioSources()
    records = [record for record in cache.records() if record["frames"][0] > 0]  # clips with sound
    cuts = [record_audio(record, 2, None, sources) for record in records]
    scenes = {record["scene"] for record in records}
    assert len(records) > len(scenes) and all(cut.samples.numel() for cut in cuts)
    assert sorted(indexed) == sorted({record["sources"][1] for record in records})  # once per video with sound
    assert len(opened) == len(set(opened)) == 2 * len(scenes)  # each camera's video asked for its track once
    assert torch.equal(cuts[0].samples, cache.source_audio(records[0]).samples)  # as without the memo
