"""The report's scale arithmetic, pure: per-channel moments merged from per-clip statistics equal the moments of the
values themselves, each recorded normalization formula read as per-channel constants with its reference, and the
band's verdicts and sentences."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vaecache.cache.normalization import normalization_constants
from vaecache.errors import NormalizationError
from vaecache.report.scale import BAND, MomentSum, judge_scale, tensor_moments

WAN = {"latents_mean": [0.5, -1.0, 2.0], "latents_std": [2.0, 0.5, 4.0], "formula": "(z - latents_mean) / latents_std"}


def test_moments_merged_from_clips_equal_the_moments_of_every_value() -> None:
    rng = np.random.default_rng(0)
    clips = [rng.normal(loc=[1.0, -3.0, 0.0], scale=[0.5, 2.0, 10.0], size=(int(n), 3))
             for n in rng.integers(1, 400, size=37)]
    moments = MomentSum(3)
    for start in range(0, len(clips), 5):  # batches of clips, as the table streams them
        batch = clips[start:start + 5]
        moments.add_clips(np.asarray([len(c) for c in batch], dtype=np.float64),
                          np.asarray([c.mean(0) for c in batch]), np.asarray([c.std(0) for c in batch]))
    every = np.concatenate(clips)
    mean, std = moments.moments()
    assert mean == pytest.approx(every.mean(0).tolist(), rel=1e-12, abs=1e-12)
    assert std == pytest.approx(every.std(0).tolist(), rel=1e-12)
    assert all(math.isnan(v) for v in MomentSum(2).moments()[0])


def test_tensor_moments_read_each_tensors_channels() -> None:
    import torch

    torch.manual_seed(0)
    tensors = [torch.randn(2, 3, t, 4, 4) * torch.tensor([1.0, 2.0, 3.0]).view(1, 3, 1, 1, 1) for t in (1, 3, 2)]
    mean, std = tensor_moments(iter(tensors))
    every = torch.cat([t.transpose(0, 1).reshape(3, -1) for t in tensors], 1).double()
    assert mean == pytest.approx(every.mean(1).tolist(), abs=1e-12)
    assert std == pytest.approx(every.std(1, correction=0).tolist(), rel=1e-9)


@pytest.mark.parametrize(("norm", "mean", "std", "reference"), [
    (WAN, [0.5, -1.0, 2.0], [2.0, 0.5, 4.0], ([0.0] * 3, [1.0] * 3)),
    ({**WAN, "scaling_factor": 1.5, "formula": "(z - latents_mean) * scaling_factor / latents_std"},
     [0.5, -1.0, 2.0], [2.0, 0.5, 4.0], ([0.0] * 3, [1.5] * 3)),
    ({"shift_factor": 0.25, "scaling_factor": 2.0, "formula": "(z - shift_factor) * scaling_factor"},
     [0.25] * 3, [0.5] * 3, ([0.0] * 3, [1.0] * 3)),
    ({"scaling_factor": 0.25, "formula": "z * scaling_factor"}, [0.0] * 3, [4.0] * 3, (None, [1.0] * 3)),
], ids=["wan", "ltx", "shift", "scale"])
def test_each_formula_makes_its_published_statistics_its_reference(norm, mean, std, reference) -> None:
    constants = normalization_constants(norm, 3, "m.json")
    normalized_mean, normalized_std = constants.normalized_moments(mean, std)
    ref_mean, ref_std = constants.reference()
    assert ref_std == pytest.approx(reference[1]) and normalized_std == pytest.approx(reference[1])
    assert ref_mean is None if reference[0] is None else ref_mean == pytest.approx(reference[0])
    if reference[0] is not None:
        assert normalized_mean == pytest.approx(reference[0])


def test_a_normalization_that_cannot_be_read_is_named() -> None:
    with pytest.raises(NormalizationError, match="m.json: records no latent normalization"):
        normalization_constants({}, 3, "m.json")
    with pytest.raises(NormalizationError, match="needs latents_std, which is not recorded"):
        normalization_constants({"latents_mean": [0, 0, 0], "formula": WAN["formula"]}, 3, "m.json")
    with pytest.raises(NormalizationError, match="unknown normalization formula 'z \\*\\* 2'"):
        normalization_constants({"formula": "z ** 2"}, 3, "m.json")
    with pytest.raises(ValueError, match="latents_mean has 3 channels; the latents have 4"):
        normalization_constants(WAN, 4, "m.json")


def test_channels_inside_the_band_pass_and_those_outside_are_named_with_their_numbers() -> None:
    constants = normalization_constants(WAN, 3, "m.json")
    # raw moments normalized: channel 0 mean 0.1 std 0.8 (in), channel 1 mean -1.0 (out), channel 2 std 0.25 (out)
    report = judge_scale([0.5 + 0.1 * 2.0, -1.0 - 1.0 * 0.5, 2.0], [0.8 * 2.0, 0.9 * 0.5, 0.25 * 4.0], constants,
                         source="test", exact=True, latent_key="mean")
    assert [c.channel for c in report.flagged] == [1, 2]
    assert report.channels[0].problems == ()
    assert report.channels[1].problems == ("mean -1.00, outside -0.50 to +0.50",)
    assert report.channels[2].problems == ("std 0.25, below 0.50",)
    assert report.summary[0].startswith("2 of 3 channels outside the band: 1, 2.")
    assert any("1 channel(s) with their std outside the band" in line for line in report.summary)
    assert any("1 channel(s) with their mean shifted" in line for line in report.summary)
    assert report.to_json()["flagged"] == [1, 2] and report.band == BAND.words()


def test_every_channel_off_by_one_factor_is_told_as_one_mistake() -> None:
    constants = normalization_constants(WAN, 3, "m.json")
    report = judge_scale(list(WAN["latents_mean"]), [s * 0.25 for s in WAN["latents_std"]], constants, source="t",
                         exact=True, latent_key="mean")
    assert len(report.flagged) == 3
    assert "every channel's std is about 0.25x the reference" in report.summary[1]
    unflagged = judge_scale(list(WAN["latents_mean"]), [s * 0.7 for s in WAN["latents_std"]], constants,
                            source="t", exact=True, latent_key="mean")
    assert not unflagged.flagged and unflagged.summary[0].startswith("every channel of the 3 is inside the band")


def test_a_scaling_factor_alone_judges_no_mean() -> None:
    constants = normalization_constants({"scaling_factor": 0.5, "formula": "z * scaling_factor"}, 2, "m.json")
    report = judge_scale([40.0, -40.0], [2.0, 8.0], constants, source="t", exact=True, latent_key="mean")
    assert [c.reference_mean for c in report.channels] == [None, None]
    assert report.channels[0].problems == () and report.channels[1].problems == ("std 4.00, above 1.50",)
