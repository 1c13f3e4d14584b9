"""Timestamp synchronization, pure: the nearest frame within tolerance, gaps and slower cameras refused naming the
camera and the time."""

from __future__ import annotations

import pytest

from vaecache.errors import VideoDecodeError
from vaecache.video.sync import nearest_frames, synchronized_frames

MS = 1_000_000


def test_a_camera_that_starts_later_is_paired_by_time():
    reference = [i * 100 * MS for i in range(20)]
    late = [240 * MS + i * 100 * MS + 3 * MS for i in range(15)]  # starts 0.24 s later, 3 ms of skew
    frames = synchronized_frames(0, [3, 5, 7], [reference, late], ("a", "b"), ("a.mkv", "b.mkv"), None)
    assert frames == [[3, 5, 7], [1, 3, 5]]  # 0.3 s is b's frame 1 (0.343 s is 43 ms off, within 50)


def test_a_faster_camera_is_sampled_at_the_reference_rate():
    reference = [i * 100 * MS for i in range(10)]
    fast = [i * 33_333_333 for i in range(30)]
    assert nearest_frames([reference[i] for i in (0, 1, 2)], fast, 33_333_333 // 2, "fast", "f") == [0, 3, 6]


def test_a_dropped_frame_is_noticed_within_half_the_cameras_own_period():
    fast = [i * 33 * MS for i in range(30) if i != 3]  # frame at 99 ms dropped
    with pytest.raises(VideoDecodeError, match=r"camera fast: no frame within 16.5 ms of 0.100 s"):
        nearest_frames([0, 100 * MS], fast, 33 * MS // 2, "fast", "f")


def test_a_gap_in_the_reference_is_a_failure_naming_it():
    reference = [0, 100 * MS, 200 * MS, 500 * MS, 600 * MS]
    with pytest.raises(VideoDecodeError, match="camera a: a gap of 300 ms after frame 2 at 0.200 s"):
        synchronized_frames(0, [1, 2, 3], [reference, reference], ("a", "b"), ("a", "b"), None)


def test_a_slower_camera_would_show_one_frame_twice_and_is_refused():
    reference = [i * 33 * MS for i in range(10)]
    slow = [i * 100 * MS for i in range(4)]
    with pytest.raises(VideoDecodeError, match="runs slower than the reference sampling"):
        nearest_frames(reference[:4], slow, 50 * MS, "slow", "s")


def test_tolerance_given_in_seconds_wins():
    reference = [i * 100 * MS for i in range(5)]
    skewed = [t + 30 * MS for t in reference]
    frames = synchronized_frames(0, [0, 1], [reference, skewed], ("a", "b"), ("a", "b"), 0.031)
    assert frames[1] == [0, 1]
    with pytest.raises(VideoDecodeError, match="no frame within 20.0 ms"):
        synchronized_frames(0, [0, 1], [reference, skewed], ("a", "b"), ("a", "b"), 0.02)
