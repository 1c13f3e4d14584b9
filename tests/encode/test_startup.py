"""Start-up, shared by encode and plan: it takes the parts of the settings it reads and returns what it resolved
(the clip settings, the decoder's threads, the torch threads, the numerics, the notes), never writing back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vaecache.encode.numerics import cores_per_rank, decode_thread_budget, torch_threads_kept
from vaecache.encode.startup import Recorded, StartRequest, start_up
from vaecache.settings.clip import ClipSettings, SamplingConfig
from vaecache.settings.parts import DecodeConfig, ParallelConfig, SourceConfig, VaeConfig


def _request(data: Path, **given: object) -> StartRequest:
    return StartRequest(SourceConfig(data), VaeConfig("builtin:tiny"), ClipSettings(SamplingConfig(9), 32, 32),
                        DecodeConfig(workers=1), ParallelConfig(device="cpu"), torch.device("cpu"), **given)


def test_start_up_returns_what_it_resolved_and_leaves_the_settings_asked(demo_data: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    request = _request(demo_data)
    with torch_threads_kept():
        start = start_up(request)
    assert request.clip.views_per_forward == "auto" and start.clip.views_per_forward == 1  # auto: 1 on CPU
    assert start.threads == max(1, cores_per_rank(1) - 1)  # this machine's cores less the one decode worker
    assert start.backend.name.startswith("pyav") and start.backend.threads == decode_thread_budget(
        cores_per_rank(1), 1, start.threads)
    assert start.numerics["threads"] == start.threads and start.other_numerics == []
    assert start.job.clips and not start.job.skipped


def test_a_resume_computes_with_the_threads_and_the_encoder_its_cache_recorded(demo_data: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    recorded = Recorded(encoder_impl="reference", cpu_threads=3)
    with torch_threads_kept():
        start = start_up(_request(demo_data, out_ready=lambda: recorded))
        assert torch.get_num_threads() == 3
    assert start.threads == 3 and start.numerics["threads"] == 3
    assert start.clip.encoder_impl == "reference"


def test_a_text_encoder_typo_is_refused_before_any_video_is_probed(demo_data: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from vaecache.errors import VaecacheError
    from vaecache.settings.parts import TextConfig
    from vaecache.sources import probing

    probed = []
    monkeypatch.setattr(probing, "probe_file", lambda *args, **kwargs: probed.append(args))
    with pytest.raises(VaecacheError, match="--text-encoder"):
        start_up(_request(demo_data, text=TextConfig("diffusers:/nowhere/wan")))
    assert probed == []
