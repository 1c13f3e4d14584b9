"""A clip's audio is the samples FFmpeg's own command line decodes from the same stream, cut by sample index at the
stream's rate: whatever the clip's first frame, its frame stride, the stream's start, codec, rate or channels."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.audio.sound import ffmpeg_samples, write_video_with_sound
from vaecache.audio.track import AudioWindow, cut_audio, has_audio
from vaecache.errors import AudioMissingError
from vaecache.video.reader import VideoReader

FPS = 25
STREAMS = {
    "aac-stereo-44k": {"rate": 44100, "layout": "stereo"},  # AAC priming skipped through the mp4 edit list
    "aac-mono-48k-starting-late": {"rate": 48000, "layout": "mono", "audio_offset": 24000},
    "aac-5.1-48k": {"rate": 48000, "layout": "5.1"},
    "pcm-s16-16k-starting-late": {"rate": 16000, "codec": "pcm_s16le", "audio_offset": 8000},  # FFmpeg's s16 -> f32
    "opus-stereo-48k": {"rate": 48000, "layout": "stereo", "codec": "libopus"},  # pre-skip through the edit list
}
WINDOWS = [(0, 9, 1), (13, 17, 1), (20, 5, 2), (37, 9, 1), (45, 9, 1)]
"""(first frame, frames, frame stride): clips at any offset, one with a stride, one running past the audio's end."""


@pytest.fixture(scope="module")
def streams(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, np.ndarray, int, float]]:
    folder = tmp_path_factory.mktemp("sound")
    found = {}
    for name, given in STREAMS.items():
        path = folder / f"{name}.{'mov' if given.get('codec') == 'pcm_s16le' else 'mp4'}"
        write_video_with_sound(path, fps=FPS, **given)
        found[name] = (path, *ffmpeg_samples(path))
    return found


@pytest.mark.parametrize("name", sorted(STREAMS))
@pytest.mark.parametrize(("first_frame", "frames", "stride"), WINDOWS)
def test_a_clip_window_is_what_ffmpeg_decodes_cut_by_sample_index(streams: dict, name: str, first_frame: int,
                                                                  frames: int, stride: int) -> None:
    path, reference, rate, audio_start = streams[name]
    with VideoReader(str(path)) as video:
        start = video.frame_time(first_frame)
    assert start == Fraction(first_frame, FPS)  # the video starts at 0 here: its frame times are exact
    window = AudioWindow.of_clip(start, frames, FPS / stride)
    first = round((start - Fraction(audio_start).limit_denominator(rate)) * rate)
    count = int(frames / (FPS / stride) * rate)
    if first < 0 or first + count > reference.shape[1]:
        with pytest.raises(AudioMissingError, match=f"{path.name}: its audio (starts|ends) at"):
            cut_audio(str(path), window)
        return
    cut = cut_audio(str(path), window)
    assert (cut.rate, cut.first_sample, cut.samples.shape) == (rate, first, (reference.shape[0], count))
    assert torch.equal(cut.samples, torch.from_numpy(reference[:, first:first + count]))


def test_the_same_samples_whatever_window_they_are_cut_in(streams: dict) -> None:
    """Two overlapping clips share the samples of their overlap, bit for bit."""
    path, _, rate, _ = streams["aac-stereo-44k"]
    one = cut_audio(str(path), AudioWindow.of_clip(Fraction(10, FPS), 17, FPS))
    other = cut_audio(str(path), AudioWindow.of_clip(Fraction(18, FPS), 17, FPS))
    shift = other.first_sample - one.first_sample
    assert shift == round(Fraction(8, FPS) * rate)
    assert torch.equal(one.samples[:, shift:], other.samples[:, :one.samples.shape[1] - shift])


def test_a_video_without_sound_is_refused_by_name(tmp_path: Path) -> None:
    silent = write_video_with_sound(tmp_path / "silent.mp4", sound=False)
    assert not has_audio(str(silent))
    with pytest.raises(AudioMissingError, match="silent.mp4: has no audio track"):
        cut_audio(str(silent), AudioWindow.of_clip(Fraction(0), 9, FPS))
    with pytest.raises(AudioMissingError, match="nothing.mp4: cannot be opened"):
        has_audio(str(tmp_path / "nothing.mp4"))
