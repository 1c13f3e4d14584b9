"""CameraProbe's recorded form: what `vaecache index` writes reads back equal, frame times included, and a probe
with a field it does not know is refused, however few fields it has."""

from __future__ import annotations

import pytest

from vaecache.errors import DatasetError
from vaecache.sources.scene import CameraProbe

TIMED = CameraProbe(17, 10.0, 64, 48, "h264", 1234, 99, 90, 240_000_000, 1_840_000_000)


def test_a_probe_with_frame_times_reads_back_equal():
    assert CameraProbe.from_json(TIMED.to_json(), "x") == TIMED
    untimed = CameraProbe(17, 0.0, 64, 48, "png", 1234, 99)  # an image sequence of unknown rate
    assert CameraProbe.from_json(untimed.to_json(), "x") == untimed


def _without(*keys: str) -> dict:
    return {key: value for key, value in TIMED.to_json().items() if key not in keys}


@pytest.mark.parametrize("raw, message", [
    (_without("end_ns"), "both or neither"),
    ({**TIMED.to_json(), "end_ns": 1}, "start_ns <= end_ns"),
    ({**_without("rotation", "start_ns", "end_ns"), "bogus": 1}, "unknown probe field"),  # 8 keys, one unknown
])
def test_a_malformed_probe_is_refused(raw, message):
    with pytest.raises(DatasetError, match=message):
        CameraProbe.from_json(raw, "index.jsonl:3")
