"""What an audio VAE is fed: a clip's samples folded to the VAE's channels, resampled to its rate and turned into a
log-mel spectrogram, every parameter of which a `MelSpec` holds (and records).

LTX-2's audio VAE (`AutoencoderKLLTX2Audio`) takes the log-mel of ltx-core's `AudioProcessor`
(`ltx_core/model/audio_vae/ops.py`, ltx-core 1.0.0): torchaudio's `MelSpectrogram` (power 1, slaney mel scale and
norm, centered, reflect padding, a periodic Hann window of `n_fft`) of the waveform resampled by torchaudio's
`functional.resample` (windowed sinc, Hann, 6 zero crossings, roll-off 0.99), then `log(clamp(mel, 1e-5))`, as
(batch, channels, frames, mel bins). LTX-2's trainer folds the channels first, at the source rate
(`packages/ltx-trainer/scripts/process_videos.py:_encode_audio`): mono duplicated, 5.1 and 7.1 folded with its
weights, any other layout averaged to mono and duplicated. torchaudio is not needed: its functions are computed here
with the same torch operations in the same order (`torchaudio/functional/functional.py` and
`torchaudio/transforms/_transforms.py`, torchaudio 2.11.1), which the tests hold against a copy of them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from vaecache.errors import UsageError

MEL_SCALES = ("slaney", "htk")


@dataclass(frozen=True)
class MelSpec:
    """Every parameter of a log-mel spectrogram and of the resampling before it (the audio kind's fingerprint holds
    them all, so a cache made with another mel never mixes with this one)."""

    sample_rate: int = 16000
    n_fft: int = 1024
    hop_length: int = 160
    mel_bins: int = 64
    channels: int = 2
    """The VAE's input channels the samples are folded to (LTX-2: stereo)."""
    f_min: float = 0.0
    f_max: float | None = None
    """None: half the sample rate."""
    power: float = 1.0
    mel_scale: str = "slaney"
    norm: str | None = "slaney"
    center: bool = True
    pad_mode: str = "reflect"
    log_floor: float = 1e-5
    lowpass_filter_width: int = 6
    rolloff: float = 0.99

    def __post_init__(self) -> None:
        for name in ("sample_rate", "n_fft", "hop_length", "mel_bins", "channels", "lowpass_filter_width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"mel {name} must be an integer >= 1, got {value!r}")
        if self.mel_scale not in MEL_SCALES:
            raise UsageError(f"mel scale must be one of {', '.join(MEL_SCALES)}, got {self.mel_scale!r}")
        if self.norm not in (None, "slaney"):
            raise UsageError(f"mel norm must be None or 'slaney', got {self.norm!r}")
        if self.channels > 2:
            raise UsageError(f"audio folded to {self.channels} channels: only mono and stereo VAEs are known")

    @property
    def top_frequency(self) -> float:
        return self.f_max if self.f_max is not None else self.sample_rate / 2.0

    def to_record(self) -> dict[str, Any]:
        return {**asdict(self), "f_max": self.top_frequency}

    @classmethod
    def ltx2(cls, vae_config: dict[str, Any], n_fft: int = 1024) -> MelSpec:
        """LTX-2's audio VAE's mel as its family declares it (models/ltx2.py `AUDIO_VAE.mel`), for the callers that
        name that VAE."""
        from vaecache.models.ltx2 import AUDIO_VAE

        return cls(**AUDIO_VAE.mel(vae_config, n_fft))


def fold_channels(samples: torch.Tensor, channels: int = 2) -> torch.Tensor:
    """(source channels, n) -> (channels, n), as LTX-2's trainer folds them for its stereo VAE: mono duplicated; 5.1
    (L, R, C, LFE, Ls, Rs) and 7.1 (... Lb, Rb) folded with weights that sum to 1, the LFE left out; any other layout
    averaged to mono, then duplicated. A mono VAE (`channels` 1) takes the mean of the channels."""
    count = samples.shape[0]
    if channels == 1:
        return samples if count == 1 else samples.mean(dim=0, keepdim=True)
    if count == 2:
        return samples
    if count == 1:
        return samples.repeat(2, 1)
    if count == 6:
        main, other = 1.0 / 2.414, 0.707 / 2.414
        left = main * samples[0] + other * samples[2] + other * samples[4]
        right = main * samples[1] + other * samples[2] + other * samples[5]
        return torch.stack([left, right])
    if count == 8:
        main, other = 1.0 / 3.121, 0.707 / 3.121
        center = samples[2]
        left = main * samples[0] + other * (center + samples[4] + samples[6])
        right = main * samples[1] + other * (center + samples[5] + samples[7])
        return torch.stack([left, right])
    return samples.mean(dim=0, keepdim=True).repeat(2, 1)


def resample(waveform: torch.Tensor, orig_freq: int, new_freq: int, lowpass_filter_width: int = 6,
             rolloff: float = 0.99) -> torch.Tensor:
    """torchaudio.functional.resample with its default windowed sinc (Hann): (..., n) at `orig_freq` -> (..., m)
    at `new_freq`, the same operations in the same order."""
    if orig_freq <= 0 or new_freq <= 0:
        raise ValueError("Original frequency and desired frequecy should be positive")
    if orig_freq == new_freq:
        return waveform
    gcd = math.gcd(int(orig_freq), int(new_freq))
    kernel, width = _sinc_resample_kernel(orig_freq, new_freq, gcd, lowpass_filter_width, rolloff, waveform.device,
                                          waveform.dtype)
    orig, new = int(orig_freq) // gcd, int(new_freq) // gcd
    shape = waveform.size()
    waveform = waveform.view(-1, shape[-1])
    num_wavs, length = waveform.shape
    waveform = torch.nn.functional.pad(waveform, (width, width + orig))
    resampled = torch.nn.functional.conv1d(waveform[:, None], kernel, stride=orig)
    resampled = resampled.transpose(1, 2).reshape(num_wavs, -1)
    target_length = torch.ceil(torch.as_tensor(new * length / orig)).long()
    resampled = resampled[..., :target_length]
    return resampled.view(shape[:-1] + resampled.shape[-1:])


def _sinc_resample_kernel(orig_freq: int, new_freq: int, gcd: int, lowpass_filter_width: int, rolloff: float,
                          device: torch.device, dtype: torch.dtype | None) -> tuple[torch.Tensor, int]:
    orig_freq = int(orig_freq) // gcd
    new_freq = int(new_freq) // gcd
    base_freq = min(orig_freq, new_freq) * rolloff
    width = math.ceil(lowpass_filter_width * orig_freq / base_freq)
    idx_dtype = dtype if dtype is not None else torch.float64
    idx = torch.arange(-width, width + orig_freq, dtype=idx_dtype, device=device)[None, None] / orig_freq
    t = torch.arange(0, -new_freq, -1, dtype=dtype, device=device)[:, None, None] / new_freq + idx
    t *= base_freq
    t = t.clamp_(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t *= math.pi
    scale = base_freq / orig_freq
    kernels = torch.where(t == 0, torch.tensor(1.0).to(t), t.sin() / t)
    kernels *= window * scale
    if dtype is None:
        kernels = kernels.to(dtype=torch.float32)
    return kernels, width


def mel_filterbank(spec: MelSpec) -> torch.Tensor:
    """torchaudio.functional.melscale_fbanks: (n_fft // 2 + 1, mel bins) triangular filters."""
    n_freqs = spec.n_fft // 2 + 1
    all_freqs = torch.linspace(0, spec.sample_rate // 2, n_freqs)
    m_min = _hz_to_mel(spec.f_min, spec.mel_scale)
    m_max = _hz_to_mel(spec.top_frequency, spec.mel_scale)
    m_pts = torch.linspace(m_min, m_max, spec.mel_bins + 2)
    f_pts = _mel_to_hz(m_pts, spec.mel_scale)
    f_diff = f_pts[1:] - f_pts[:-1]
    slopes = f_pts.unsqueeze(0) - all_freqs.unsqueeze(1)
    zero = torch.zeros(1)
    down_slopes = (-1.0 * slopes[:, :-2]) / f_diff[:-1]
    up_slopes = slopes[:, 2:] / f_diff[1:]
    fb = torch.max(zero, torch.min(down_slopes, up_slopes))
    if spec.norm == "slaney":
        enorm = 2.0 / (f_pts[2:spec.mel_bins + 2] - f_pts[:spec.mel_bins])
        fb *= enorm.unsqueeze(0)
    return fb


def _hz_to_mel(freq: float, mel_scale: str) -> float:
    if mel_scale == "htk":
        return 2595.0 * math.log10(1.0 + (freq / 700.0))
    f_min, f_sp = 0.0, 200.0 / 3
    mels = (freq - f_min) / f_sp
    min_log_hz = 1000.0
    min_log_mel = (min_log_hz - f_min) / f_sp
    logstep = math.log(6.4) / 27.0
    if freq >= min_log_hz:
        mels = min_log_mel + math.log(freq / min_log_hz) / logstep
    return mels


def _mel_to_hz(mels: torch.Tensor, mel_scale: str) -> torch.Tensor:
    if mel_scale == "htk":
        return 700.0 * (10.0 ** (mels / 2595.0) - 1.0)
    f_min, f_sp = 0.0, 200.0 / 3
    freqs = f_min + f_sp * mels
    min_log_hz = 1000.0
    min_log_mel = (min_log_hz - f_min) / f_sp
    logstep = math.log(6.4) / 27.0
    log_t = mels >= min_log_mel
    freqs[log_t] = min_log_hz * torch.exp(logstep * (mels[log_t] - min_log_mel))
    return freqs


def log_mel(waveform: torch.Tensor, spec: MelSpec) -> torch.Tensor:
    """ltx-core's AudioProcessor.waveform_to_mel for a waveform already at `spec.sample_rate`: (batch, channels, n)
    -> (batch, channels, frames, mel bins), log(clamp(mel, log_floor)), in the waveform's dtype."""
    window = torch.hann_window(spec.n_fft).to(waveform.device)
    shape = waveform.size()
    flat = waveform.reshape(-1, shape[-1])
    spectrum = torch.stft(input=flat, n_fft=spec.n_fft, hop_length=spec.hop_length, win_length=spec.n_fft,
                          window=window, center=spec.center, pad_mode=spec.pad_mode, normalized=False, onesided=True,
                          return_complex=True)
    spectrum = spectrum.reshape(shape[:-1] + spectrum.shape[-2:])
    magnitude = spectrum.abs() if spec.power == 1.0 else spectrum.abs().pow(spec.power)
    fb = mel_filterbank(spec).to(magnitude.device)
    mel = torch.matmul(magnitude.transpose(-1, -2), fb).transpose(-1, -2)
    mel = torch.log(torch.clamp(mel, min=spec.log_floor))
    mel = mel.to(device=waveform.device, dtype=waveform.dtype)
    return mel.permute(0, 1, 3, 2).contiguous()


def clip_mel(samples: torch.Tensor, rate: int, spec: MelSpec) -> torch.Tensor:
    """A clip's samples (source channels, n) at `rate` -> the VAE's input (1, channels, frames, mel bins): folded to
    the VAE's channels at the source rate, resampled to its rate, then the log-mel, as LTX-2's trainer does."""
    folded = fold_channels(samples.float(), spec.channels)[None]
    at_rate = resample(folded, rate, spec.sample_rate, spec.lowpass_filter_width, spec.rolloff)
    at_rate = at_rate.to(dtype=folded.dtype)
    return log_mel(at_rate, spec)
