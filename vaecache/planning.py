"""The job plan: which clips a dataset yields, and which of them each rank encodes, in what batches.

Everything here is pure (no I/O, no processes): the same inputs give the same plan on every rank,
in `vaecache encode`, `vaecache plan` and `vaecache verify --dataset`. :class:`JobPlan` is the only
caller of the assignment functions, so a dry run cannot drift from what an encode does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from vaecache.config import SamplingConfig
from vaecache.dist.mesh import make_mesh
from vaecache.errors import UsageError
from vaecache.parallel import SPPlan, plan_sp
from vaecache.sources import Skipped

if TYPE_CHECKING:
    from vaecache.sources import Scene, SceneProbe


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




@dataclass(frozen=True)
class RankWork:
    """What one rank encodes: its DP group's batches and, per batch, the SP split and the views it decodes."""

    clips: tuple[Clip, ...]
    """Its DP group's clips, in encode order."""
    batches: tuple[tuple[Clip, ...], ...]
    sp_plans: tuple[SPPlan, ...]
    view_indices: tuple[tuple[int, ...], ...]
    """Per batch: the batch views (see batch_views) this rank decodes and encodes."""


@dataclass(frozen=True)
class JobPlan:
    """Clips planned from a dataset, spread over DP groups (contiguous blocks) and SP ranks (views)."""

    clips: tuple[Clip, ...]
    skipped: tuple[Skipped, ...]
    world_size: int = 1
    sp_size: int = 1
    batch_size: int = 1
    done_clip_ids: frozenset[str] = frozenset()
    """Clips already committed by an earlier attempt: left out of every rank's share."""

    def __post_init__(self) -> None:
        make_mesh(0, self.world_size, self.sp_size)  # sp_size must divide world_size
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise UsageError(f"--batch-size must be an integer >= 1, got {self.batch_size!r}")

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def todo(self) -> list[Clip]:
        """The clips still to encode, in plan order."""
        return [clip for clip in self.clips if clip.clip_id not in self.done_clip_ids]

    def dp_clips(self, dp_rank: int) -> list[Clip]:
        """DP group `dp_rank`'s contiguous block of the clips still to encode."""
        return assign_contiguous(self.todo, dp_rank, self.dp_size)

    def dp_batches(self, dp_rank: int) -> list[list[Clip]]:
        return batched(self.dp_clips(dp_rank), self.batch_size)

    def rank_work(self, rank: int) -> RankWork:
        """The share of global rank `rank` (SP groups are contiguous blocks of sp_size ranks)."""
        mesh = make_mesh(rank, self.world_size, self.sp_size)
        clips = self.dp_clips(mesh.dp_rank)
        batches = batched(clips, self.batch_size)
        sp_plans = [plan_sp(len(batch_views(batch)), self.sp_size) for batch in batches]
        return RankWork(tuple(clips), tuple(tuple(batch) for batch in batches), tuple(sp_plans),
                        tuple(tuple(p.view_indices(mesh.sp_rank)) for p in sp_plans))

    def clip_ids_per_dp_group(self) -> list[list[str]]:
        """For each DP group, in order: the ids of the clips its writer commits."""
        return [[clip.clip_id for clip in self.dp_clips(dp)] for dp in range(self.dp_size)]


def plan_job(scenes: Sequence[Scene], probes: dict[str, SceneProbe], sampling: SamplingConfig, world_size: int = 1,
             sp_size: int = 1, batch_size: int = 1, done_clip_ids: Sequence[str] | frozenset[str] = frozenset(),
             ) -> JobPlan:
    """Pure: the job plan for these scenes (probed), sampling and cluster shape."""
    clips, skipped = plan_clips(scenes, probes, sampling)
    return JobPlan(tuple(clips), tuple(skipped), world_size, sp_size, batch_size, frozenset(done_clip_ids))


__all__ = ["Clip", "JobPlan", "RankWork", "Skipped", "ViewRef", "assign", "assign_contiguous", "batch_views",
           "batched", "clip_id_for", "plan_clips", "plan_job", "plan_windows"]
