"""The audio VAE's input: a clip's samples folded, resampled and turned into a log-mel exactly as LTX-2's trainer and
ltx-core do it, bit for bit against their code over torchaudio's own functions (tests/audio/torchaudio_reference.py)."""

from __future__ import annotations

import pytest
import torch

from tests.audio import torchaudio_reference as reference
from vaecache.audio.mel import MelSpec, clip_mel, fold_channels, log_mel, mel_filterbank, resample
from vaecache.errors import UsageError

LTX2 = MelSpec.ltx2({"sample_rate": 16000, "mel_hop_length": 160, "mel_bins": 64, "in_channels": 2})


def _noise(channels: int, count: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(channels, count, generator=torch.Generator().manual_seed(seed)) * 0.3


@pytest.mark.parametrize(("orig", "new"), [(44100, 16000), (48000, 16000), (22050, 16000), (8000, 16000),
                                           (16000, 16000)])
def test_resampling_is_torchaudios(orig: int, new: int) -> None:
    waveform = _noise(2, orig // 3)[None]
    assert torch.equal(resample(waveform, orig, new), reference.resample(waveform, orig, new))


@pytest.mark.parametrize(("scale", "norm"), [("slaney", "slaney"), ("htk", None), ("slaney", None)])
def test_the_filter_bank_is_torchaudios(scale: str, norm: str | None) -> None:
    spec = MelSpec(mel_scale=scale, norm=norm, mel_bins=80, n_fft=512)
    expected = reference.melscale_fbanks(257, 0.0, 8000.0, 80, 16000, norm, scale)
    assert torch.equal(mel_filterbank(spec), expected)


@pytest.mark.parametrize("channels", [1, 2, 3, 6, 8])
def test_the_channels_fold_as_ltx2s_trainer_folds_them(channels: int) -> None:
    samples = _noise(channels, 4000, seed=channels)
    assert torch.equal(fold_channels(samples)[None], reference.ltx_trainer_fold(samples[None]))


@pytest.mark.parametrize(("channels", "rate", "count"), [(2, 44100, 30000), (1, 48000, 24000), (6, 48000, 17000),
                                                         (2, 16000, 11360)])
def test_a_clips_mel_is_ltx_cores(channels: int, rate: int, count: int) -> None:
    samples = _noise(channels, count, seed=count)
    expected = reference.ltx_waveform_to_mel(reference.ltx_trainer_fold(samples[None]), rate, 16000, 64, 160, 1024)
    got = clip_mel(samples, rate, LTX2)
    assert got.shape == expected.shape and got.shape[:2] == (1, 2) and got.shape[-1] == 64
    assert torch.equal(got, expected)


def test_the_mel_of_a_waveform_at_the_vaes_rate_is_ltx_cores() -> None:
    waveform = _noise(2, 16000)[None]
    assert torch.equal(log_mel(waveform, LTX2), reference.ltx_waveform_to_mel(waveform, 16000, 16000, 64, 160, 1024))


def test_every_mel_parameter_is_recorded_and_checked() -> None:
    record = LTX2.to_record()
    assert record["f_max"] == 8000.0 and record["n_fft"] == 1024 and record["hop_length"] == 160
    assert {"sample_rate", "mel_bins", "channels", "power", "mel_scale", "norm", "center", "pad_mode", "log_floor",
            "lowpass_filter_width", "rolloff"} <= set(record)
    assert MelSpec(n_fft=512).to_record() != record
    with pytest.raises(UsageError, match="mel hop_length must be an integer >= 1"):
        MelSpec(hop_length=0)
    with pytest.raises(UsageError, match="mel scale must be one of slaney, htk"):
        MelSpec(mel_scale="bark")
