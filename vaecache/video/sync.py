"""Timestamp synchronization (--sync timestamps), pure: which frame of each camera goes with each frame of the
reference camera, and why a clip cannot be made (a gap in the reference, a camera with no frame near enough).

A clip's times are its reference frames' times. Every other camera takes its frame nearest each of them, within
the tolerance: --sync-tolerance, or half of that camera's own median frame period, so a frame a camera dropped is
noticed (the next one is a whole period away) and a camera that runs faster than the reference is sampled at the
reference's rate. A camera slower than the reference sampling would have to show one frame twice: refused.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from vaecache.errors import VideoDecodeError

GAP_FACTOR = 1.5
"""A step between consecutive reference frames longer than this many median periods is a gap (a dropped frame)."""


def median_period(times: Sequence[int]) -> int:
    """The median step of a timeline (ns); 0 for a single frame."""
    if len(times) < 2:
        return 0
    return int(np.median(np.diff(np.asarray(times, dtype=np.int64))))


def check_reference(times: Sequence[int], frames: Sequence[int], camera: str, path: str, period: int) -> None:
    """VideoDecodeError naming the camera and the time where the reference camera skips time between the clip's
    first and last frame (every frame in between counts, strided or not)."""
    if period <= 0 or len(frames) < 2:
        return
    span = np.asarray(times[frames[0]:frames[-1] + 1], dtype=np.int64)
    steps = np.diff(span)
    worst = int(np.argmax(steps))
    if steps[worst] > GAP_FACTOR * period:
        raise VideoDecodeError(path, f"camera {camera}: a gap of {steps[worst] / 1e6:.0f} ms after frame "
                                     f"{frames[0] + worst} at {span[worst] / 1e9:.3f} s (its frames are "
                                     f"{period / 1e6:.1f} ms apart): dropped frames")


def nearest_frames(reference_times: Sequence[int], times: Sequence[int], tolerance: int, camera: str,
                   path: str) -> list[int]:
    """For each reference time, the index of the nearest of `times` (an earlier one on a tie); VideoDecodeError
    naming the camera and the time when none lies within `tolerance` ns, or when one frame would serve twice."""
    timeline = np.asarray(times, dtype=np.int64)
    wanted = np.asarray(reference_times, dtype=np.int64)
    after = np.searchsorted(timeline, wanted, side="left").clip(0, len(timeline) - 1)
    before = (after - 1).clip(0, len(timeline) - 1)
    pick = np.where(np.abs(timeline[before] - wanted) <= np.abs(timeline[after] - wanted), before, after)
    distance = np.abs(timeline[pick] - wanted)
    worst = int(np.argmax(distance))
    if distance[worst] > tolerance:
        raise VideoDecodeError(path, f"camera {camera}: no frame within {tolerance / 1e6:.1f} ms of "
                                     f"{wanted[worst] / 1e9:.3f} s (the nearest is {distance[worst] / 1e6:.1f} ms "
                                     "away: a dropped frame, or outside its recording)")
    repeated = np.flatnonzero(np.diff(pick) == 0)
    if len(repeated):
        at = int(repeated[0])
        raise VideoDecodeError(path, f"camera {camera}: its frame {int(pick[at])} is the nearest to both "
                                     f"{wanted[at] / 1e9:.3f} s and {wanted[at + 1] / 1e9:.3f} s (it runs slower than "
                                     "the reference sampling; use a slower --sync-reference or a larger "
                                     "--frame-stride)")
    return [int(index) for index in pick]


def synchronized_frames(reference: int, frames: Sequence[int], timelines: Sequence[Sequence[int]],
                        cameras: Sequence[str], paths: Sequence[str], tolerance_s: float | None) -> list[list[int]]:
    """Per camera, the frames that go with reference frames `frames` (the reference camera keeps them)."""
    ref_times = timelines[reference]
    check_reference(ref_times, frames, cameras[reference], paths[reference], median_period(ref_times))
    wanted = [ref_times[index] for index in frames]
    found = []
    for camera, times in enumerate(timelines):
        if camera == reference:
            found.append(list(frames))
            continue
        tolerance = (round(tolerance_s * 1e9) if tolerance_s is not None
                     else median_period(times) // 2 if len(times) > 1 else 0)
        found.append(nearest_frames(wanted, times, tolerance, cameras[camera], paths[camera]))
    return found


__all__ = ["GAP_FACTOR", "check_reference", "median_period", "nearest_frames", "synchronized_frames"]
