"""Clip planning (pure). Discovery and probing live in vaecache.sources, decoding in vaecache.decode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from vaecache.config import SamplingConfig
from vaecache.sources import Scene, SceneProbe, Skipped


@dataclass(frozen=True)
class Clip:
    """One training sample: the same frame indices of every camera of a scene."""

    clip_id: str
    scene_id: str
    cameras: tuple[str, ...]
    paths: tuple[str, ...]
    frames: tuple[int, ...]
    fps: float

    @property
    def num_views(self) -> int:
        return len(self.cameras)


def clip_id_for(scene_id: str, frames: Sequence[int]) -> str:
    """Identity of a clip, from its source only: scene id and first/last source frame."""
    return f"{scene_id}/{frames[0]:06d}-{frames[-1]:06d}"


# --------------------------------------------------------------------------- planning (pure)


def plan_clips(scenes: Sequence[Scene], probes: dict[str, SceneProbe], sampling: SamplingConfig) -> tuple[list[Clip], list[Skipped]]:
    """Cut every usable scene into windows of `sampling.num_frames` frames. Pure: no I/O."""
    clips: list[Clip] = []
    skipped: list[Skipped] = []
    for scene in scenes:
        probe = probes[scene.scene_id]
        if probe.error is not None:
            skipped.append(Skipped(scene.scene_id, probe.error_path, probe.error, probe.error_camera))
            continue
        start, stop = scene.frame_range if scene.frame_range is not None else (0, probe.num_frames)
        windows = plan_windows(start, stop, sampling)
        if not windows:
            skipped.append(Skipped(scene.scene_id, None,
                                   f"too short: {stop - start} usable frames, one clip needs {sampling.span}"))
            continue
        for frames in windows:
            clips.append(Clip(clip_id_for(scene.scene_id, frames), scene.scene_id, scene.cameras, scene.paths,
                              frames, probe.fps))
    return clips, skipped


def plan_windows(start: int, stop: int, sampling: SamplingConfig) -> list[tuple[int, ...]]:
    """Frame indices of each clip in [start, stop)."""
    windows = []
    first = start
    while first + sampling.span <= stop:
        windows.append(tuple(range(first, first + sampling.span, sampling.frame_stride)))
        if sampling.max_clips_per_scene is not None and len(windows) >= sampling.max_clips_per_scene:
            break
        first += sampling.step
    return windows


def assign(items: Sequence[Any], rank: int, world: int) -> list[Any]:
    """The deterministic share of `items` that worker `rank` of `world` takes (round-robin)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of {world}")
    return list(items[rank::world])


def assign_contiguous(items: Sequence[Any], rank: int, world: int) -> list[Any]:
    """Worker `rank`'s contiguous, balanced block of `items` (sizes differ by at most one).

    A scene's consecutive clips stay together, so an open video reader carries on instead of
    seeking back to a keyframe on another rank."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of {world}")
    count = len(items)
    return list(items[rank * count // world:(rank + 1) * count // world])


def batched(items: Sequence[Any], size: int) -> list[list[Any]]:
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


@dataclass(frozen=True)
class ViewRef:
    """One camera of one clip, addressed by its position in a batch."""

    clip_index: int
    camera_index: int


def batch_views(batch: Sequence[Clip]) -> list[ViewRef]:
    """The batch folded into views: clip-major, camera-minor (B*NC entries)."""
    return [ViewRef(i, c) for i, clip in enumerate(batch) for c in range(clip.num_views)]
