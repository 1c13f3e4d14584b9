"""FrameRule: valid frame counts, nearest valid values, and one message naming every wrong value."""

from __future__ import annotations

import pytest

from vaecache.errors import FrameRuleError
from vaecache.models.rules import FrameRule


@pytest.mark.parametrize(("rule", "frames", "nearest"), [
    (FrameRule(4, 8, causal=True), 16, [13, 17]),
    (FrameRule(4, 8, causal=True), 0, [1]),
    (FrameRule(4, 8, causal=True, frame_step=8), 12, [9, 17]),
    (FrameRule(4, 8), 2, [4]),
    (FrameRule(4, 8), 10, [8, 12]),
])
def test_nearest_valid_frame_counts(rule: FrameRule, frames: int, nearest: list[int]) -> None:
    assert not rule.frames_ok(frames) and rule.nearest_frames(frames) == nearest
    assert all(rule.frames_ok(n) for n in nearest)


def test_height_and_width_both_wrong_are_named_in_one_message() -> None:
    rule = FrameRule(4, 8, causal=True, label="AutoencoderKLWan")
    with pytest.raises(FrameRuleError) as raised:
        rule.check(9, 60, 70)
    assert str(raised.value) == ("--size 60x70: height 60 and width 70 are not multiples of 8 (the spatial factor "
                                 "of AutoencoderKLWan); nearest valid height: 56 and 64; nearest valid width: "
                                 "64 and 72")


def test_frames_and_size_both_wrong_are_named_in_one_message() -> None:
    rule = FrameRule(4, 8, causal=True, label="AutoencoderKLWan")
    with pytest.raises(FrameRuleError) as raised:
        rule.check(10, 64, 70)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("--size 64x70: width 70 is not a multiple of 8 ")
    assert "nearest valid width: 64 and 72; --num-frames 10 is not valid for AutoencoderKLWan" in message
    assert message.endswith("nearest valid: 9 and 13")
    assert rule.problems(9, 64, 64) == []


def test_rule_factors_are_validated() -> None:
    with pytest.raises(ValueError, match="factors must be >= 1"):
        FrameRule(0, 8)
