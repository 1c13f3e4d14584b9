"""A video's frame index as its probe keeps it: packed and read back exactly, refused by name when it is not one,
and the bytes a clip's decode reads found from its keyframes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vaecache.errors import DatasetError
from vaecache.video.timeline import Keyframe, Timeline, gop_bytes, merged, pack, unpack


def test_packed_lists_read_back_exactly_and_a_regular_one_packs_small() -> None:
    rng = np.random.default_rng(0)
    irregular = np.cumsum(rng.integers(1, 5000, size=(500, 4)), axis=0)
    assert np.array_equal(unpack(pack(irregular), 4), irregular)
    regular = np.arange(0, 108_000 * 512, 512)  # one hour at 30 fps: deltas all alike
    assert np.array_equal(unpack(pack(regular)), regular)
    assert len(pack(regular)) < 2000
    with pytest.raises(ValueError, match="not packed"):
        unpack("not base64!")


def test_a_constant_frame_rate_is_an_affine_rule_and_any_other_the_list() -> None:
    keys = [Keyframe(0, -1024, 0, 48, 900), Keyframe(12, 11264, 12288, 900, 2000)]
    constant = Timeline.build([1024 * i for i in range(24)], keys, [(0, 4096), (4000, 4200), (9000, 9500)], 90)
    assert constant.pts_rule == (0, 1024, 24) and constant.pts_packed is None
    assert constant.head == ((0, 4200), (9000, 9500))  # overlapping ranges joined
    varying = Timeline.build([0, 33, 67, 100, 133, 167, 200, 233, 267, 300, 333, 367, 400, 433], keys[:1])
    assert varying.pts_rule is None and varying.pts() == [0, 33, 67, 100, 133, 167, 200, 233, 267, 300, 333, 367,
                                                         400, 433]
    for timeline in (constant, varying):
        again = Timeline.from_json(json.loads(json.dumps(timeline.to_json())), "index.jsonl:1")
        assert again.text.startswith("v1|0,1024,24|" if timeline is constant else "v1|*")
        assert again == timeline and again.pts() == timeline.pts() and again.keyframes() == timeline.keyframes()
    assert constant.keyframes()[1] == Keyframe(12, 11264, 12288, 900, 2000) and constant.has_bytes
    assert not Timeline.build([0, 1], [Keyframe(0, 0, 0)]).has_bytes  # a container without packet positions


@pytest.mark.parametrize("raw", [{"v": 1, "pts": [0, 1, 3], "keys": "x"}, "v2|0,1,3|x||0", "v1|0,1,3|x|0", 7])
def test_a_timeline_that_is_not_one_is_refused_naming_the_line(raw: object) -> None:
    message = '^index.jsonl:7: probe field "timeline" is not a frame index \\(version 1 is the text "v1|PTS|'
    with pytest.raises(DatasetError, match=message):
        Timeline.from_json(raw, "index.jsonl:7")


@pytest.mark.parametrize(("text", "problem"), [
    ("v1|0,0,3|x||0", "positive step"),
    ("v1|0,1|x||0", r"\[first, step, count\]"),
    ("v1|0,1,3|x|5,2|0", "head is pairs"),
    ("v1|0,1,3|x|0,4,9|0", "head is pairs"),
    ("v1|0,1,3|x||45", "rotation a multiple of 90"),
    ("v1|a,1,3|x||0", "integers"),
])
def test_a_damaged_timeline_is_found_where_it_is_used(text: str, problem: str) -> None:
    """The form is checked as an index is read (cheaply: a million lines); the parts where a reader uses them."""
    timeline = Timeline.from_json(text, "index.jsonl:7")
    with pytest.raises(ValueError, match=problem):
        timeline.pts()
    with pytest.raises(ValueError, match=problem):
        timeline.check()
    assert timeline.frame_count() is None and not timeline.has_bytes


def test_damaged_packed_lists_are_found_where_they_are_unpacked() -> None:
    good = Timeline.build(list(range(10)), [Keyframe(0, 0, 0, 10, 20), Keyframe(5, 5, 5, 20, 30)])
    unordered = Timeline((0, 1, 10), None, pack(np.array([[5, 5, 20, 30], [0, 0, 10, 20]])))
    with pytest.raises(ValueError, match="ascending order"):
        unordered.keyframes()
    with pytest.raises(ValueError, match="ascending order"):
        unordered.check()
    outside = Timeline((0, 1, 3), None, good.keys_packed)  # keyframe 5 of a 3-frame video
    with pytest.raises(ValueError, match="frame numbers of the video"):
        outside.keyframes()
    with pytest.raises(ValueError, match="not packed"):
        Timeline(None, "AAAA", good.keys_packed).pts()


def test_a_clips_bytes_run_from_its_first_frames_keyframe_to_the_end_of_its_last_gop() -> None:
    keys = [Keyframe(0, 0, 0, 100, 900), Keyframe(12, 12, 12, 850, 1700), Keyframe(24, 24, 24, 1650, 2600)]
    assert gop_bytes(keys, 3, 8) == (100, 900)
    assert gop_bytes(keys, 12, 12) == (850, 1700)
    assert gop_bytes(keys, 10, 25) == (100, 2600)
    assert gop_bytes([Keyframe(0, 0, 0)], 0, 3) is None
    assert gop_bytes([], 0, 3) is None  # a reader that fell back to counting frames has no keyframes
    assert merged([(5, 9), (0, 2), (2, 4), (8, 12), (20, 20)]) == [(0, 4), (5, 12)]


def test_a_clip_record_keeps_the_keyframes_its_frames_are_decoded_from() -> None:
    keys = [Keyframe(frame, frame - 1, frame, 100 * frame + 48, 100 * frame + 1248) for frame in range(0, 120, 12)]
    timeline = Timeline.build(list(range(120)), keys, [(0, 4096), (20_000, 21_000)], 180)
    cut = timeline.for_frames(50, 70)  # in GOPs 48 and 60: their keyframes and the two before 48, which a seek
    assert [key.frame for key in cut.keyframes()] == [24, 36, 48, 60]  # that lands late steps back to
    assert (cut.pts_rule, cut.head, cut.rotation) == (timeline.pts_rule, timeline.head, 180)
    assert gop_bytes(cut.keyframes(), 50, 70) == gop_bytes(keys, 50, 70)
    assert [key.frame for key in timeline.for_frames(0, 5).keyframes()] == [0]
