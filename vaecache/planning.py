"""The job plan: which clips a dataset yields, and which of them each rank encodes, in what batches.

Everything here is pure (no I/O, no processes): the same inputs give the same plan on every rank,
in `vaecache encode`, `vaecache plan` and `vaecache verify --dataset`. :class:`JobPlan` is the only
caller of the assignment functions, so a dry run cannot drift from what an encode does.
"""

from __future__ import annotations

import bisect
import functools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, overload

from vaecache.config import SamplingConfig
from vaecache.dist.mesh import make_mesh
from vaecache.errors import UsageError
from vaecache.parallel import SPPlan, plan_sp
from vaecache.sources import Skipped, judge_scene

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
    expect: tuple[tuple[int, int, int], ...] = ()
    """Per camera, (frames, width, height) the probe found: decoding refuses a video that differs (it
    changed since it was probed). Empty: nothing to check."""
    metadata: str | None = None
    """The scene's index metadata as JSON text (Scene.metadata); the writer stores it as the record's `metadata`."""

    @property
    def num_views(self) -> int:
        return len(self.cameras)


def clip_id_for(scene_id: str, frames: Sequence[int]) -> str:
    """Identity of a clip, from its source only: scene id and first/last source frame."""
    return f"{scene_id}/{frames[0]:06d}-{frames[-1]:06d}"


def plan_clips(scenes: Sequence[Scene], probes: dict[str, SceneProbe], sampling: SamplingConfig) -> tuple[list[Clip], list[Skipped]]:
    """Cut every usable scene into windows of `sampling.num_frames` frames. Pure: no I/O."""
    clips, skipped = plan_scene_clips(scenes, probes, sampling)
    return list(clips), skipped


def window_count(start: int, stop: int, sampling: SamplingConfig) -> int:
    """How many windows plan_windows(start, stop, sampling) gives, without listing them."""
    if stop - start < sampling.span:
        return 0
    count = (stop - start - sampling.span) // sampling.step + 1
    return count if sampling.max_clips_per_scene is None else min(count, sampling.max_clips_per_scene)


def window(start: int, index: int, sampling: SamplingConfig) -> tuple[int, ...]:
    """The frame indices of window `index` of a scene whose usable frames start at `start`."""
    first = start + index * sampling.step
    return tuple(range(first, first + sampling.span, sampling.frame_stride))


def plan_scene_clips(scenes: Sequence[Scene], probes: dict[str, SceneProbe], sampling: SamplingConfig,
                     ) -> tuple[PlannedClips, list[Skipped]]:
    """The clips of every usable scene as a PlannedClips (a clip count per scene: no Clip is built until
    a block of them is asked for), and the scenes that give none. Pure: no I/O. A scene whose index gives
    its probe (Scene.probed) needs no entry in `probes`."""
    usable: list[tuple[Scene, int, float, tuple[tuple[int, int, int], ...]]] = []
    counts = array("q")
    skipped: list[Skipped] = []
    shared: dict[Any, Any] = {}  # equal `expect` tuples stored once
    for scene in scenes:
        probe = probes.get(scene.scene_id)
        if probe is None and scene.probed is not None:
            probe = judge_scene(scene, scene.probed)  # pure: the index gave the probe (none kept per scene)
        elif probe is None:
            raise KeyError(f"scene {scene.scene_id} was not probed")
        if probe.error is not None:
            skipped.append(Skipped(scene.scene_id, probe.error_path, probe.error, probe.error_camera))
            continue
        start, stop = scene.frame_range if scene.frame_range is not None else (0, probe.num_frames)
        count = window_count(start, stop, sampling)
        if not count:
            skipped.append(Skipped(scene.scene_id, None,
                                   f"too short: {stop - start} usable frames, one clip needs {sampling.span}"))
            continue
        expect = tuple((c.frames, c.width, c.height) for c in probe.cameras)
        usable.append((scene, start, probe.fps, shared.setdefault(expect, expect)))
        counts.append(count)
    return PlannedClips(tuple(usable), counts, sampling), skipped


class PlannedClips(Sequence[Clip]):
    """The clips of a plan, in plan order, held as one clip count per scene.

    Indexing and slicing build only the clips asked for, found through prefix sums of the counts: a DP
    group's contiguous block of ten million clips costs the memory of its own clips (and a few bytes per
    scene), never the whole list. `without(done)` is the same sequence less the clips already committed."""

    def __init__(self, scenes: tuple[tuple[Scene, int, float, tuple[tuple[int, int, int], ...]], ...], counts: array,
                 sampling: SamplingConfig, done: frozenset[str] = frozenset(), skips: dict[int, frozenset[int]] | None = None,
                 ) -> None:
        self._scenes, self._sampling, self._done = scenes, sampling, done
        self._skips = skips or {}
        """Scene position -> window indices left out (committed clips)."""
        self._window_counts = counts
        ends = array("q")
        total = 0
        for position, count in enumerate(counts):
            total += count - len(self._skips.get(position, ()))
            ends.append(total)
        self._ends = ends
        """Running total of clips up to and including each scene."""

    def without(self, done: frozenset[str]) -> PlannedClips:
        """These clips less those whose id is in `done` (ids of clips not in the plan are ignored)."""
        if not done:
            return self
        positions = {scene.scene_id: position for position, (scene, *_) in enumerate(self._scenes)}
        skips: dict[int, set[int]] = {}
        for clip_id in done:
            scene_id, _, frames = clip_id.rpartition("/")
            position = positions.get(scene_id)
            first, _, last = frames.partition("-")
            if position is None or not (first.isdigit() and last.isdigit()):
                continue
            start = self._scenes[position][1]
            index, offset = divmod(int(first) - start, self._sampling.step)
            if offset or not 0 <= index < self._window_counts[position]:
                continue
            if clip_id_for(scene_id, window(start, index, self._sampling)) == clip_id:
                skips.setdefault(position, set()).add(index)
        return PlannedClips(self._scenes, self._window_counts, self._sampling, done,
                            {position: frozenset(indices) for position, indices in skips.items()})

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def scene_counts(self) -> dict[str, int]:
        """Scene id -> clips it gives here (committed clips left out)."""
        return {scene.scene_id: self._ends[p] - (self._ends[p - 1] if p else 0)
                for p, (scene, *_) in enumerate(self._scenes)}

    def _scene_clips(self, position: int) -> list[Clip]:
        scene, start, fps, expect = self._scenes[position]
        skip = self._skips.get(position, ())
        clips = []
        for index in range(self._window_counts[position]):
            if index in skip:
                continue
            frames = window(start, index, self._sampling)
            clips.append(Clip(clip_id_for(scene.scene_id, frames), scene.scene_id, scene.cameras,
                              scene.paths, frames, fps, expect, scene.metadata))  # type: ignore[arg-type]  # usable: no None path
        return clips

    def block(self, lo: int, hi: int) -> list[Clip]:
        """Clips lo..hi-1 (plan order), building only the scenes they come from."""
        lo, hi = max(0, lo), min(len(self), hi)
        if lo >= hi:
            return []
        position = bisect.bisect_right(self._ends, lo)
        before = self._ends[position - 1] if position else 0
        out: list[Clip] = []
        while len(out) < hi - lo + (lo - before):
            out.extend(self._scene_clips(position))
            position += 1
        return out[lo - before:hi - before]

    @overload
    def __getitem__(self, index: int) -> Clip: ...

    @overload
    def __getitem__(self, index: slice) -> list[Clip]: ...

    def __getitem__(self, index: int | slice) -> Clip | list[Clip]:
        if isinstance(index, slice):
            start, stop, stride = index.indices(len(self))
            if stride != 1:
                return self.block(0, len(self))[index]
            return self.block(start, stop)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"clip {index} of {len(self)}")
        return self.block(index, index + 1)[0]

    def __iter__(self) -> Iterator[Clip]:
        for position in range(len(self._scenes)):
            yield from self._scene_clips(position)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)) or len(other) != len(self):
            return NotImplemented if not isinstance(other, Sequence) else False
        return all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PlannedClips({len(self)} clips of {len(self._scenes)} scenes)"


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

    clips: Sequence[Clip]
    """A tuple, or a PlannedClips (plan_job) that builds only the block a DP group asks for."""
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

    @functools.cached_property
    def todo(self) -> Sequence[Clip]:
        """The clips still to encode, in plan order (built block by block where the plan is a PlannedClips)."""
        if isinstance(self.clips, PlannedClips):
            return self.clips.without(self.done_clip_ids)
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
        splits: dict[int, tuple[SPPlan, tuple[int, ...]]] = {}  # views per batch -> its split (few distinct)
        for batch in batches:
            views = sum(clip.num_views for clip in batch)  # len(batch_views(batch)), without listing them
            if views not in splits:
                split = plan_sp(views, self.sp_size)
                splits[views] = (split, tuple(split.view_indices(mesh.sp_rank)))
        chosen = [splits[sum(clip.num_views for clip in batch)] for batch in batches]
        return RankWork(tuple(clips), tuple(tuple(batch) for batch in batches), tuple(c[0] for c in chosen),
                        tuple(c[1] for c in chosen))

    def clip_ids_per_dp_group(self) -> list[list[str]]:
        """For each DP group, in order: the ids of the clips its writer commits."""
        return [[clip.clip_id for clip in self.dp_clips(dp)] for dp in range(self.dp_size)]


def plan_job(scenes: Sequence[Scene], probes: dict[str, SceneProbe], sampling: SamplingConfig, world_size: int = 1,
             sp_size: int = 1, batch_size: int = 1, done_clip_ids: Sequence[str] | frozenset[str] = frozenset(),
             ) -> JobPlan:
    """Pure: the job plan for these scenes (probed), sampling and cluster shape. Its clips are a PlannedClips:
    each rank builds only its own DP group's block."""
    clips, skipped = plan_scene_clips(scenes, probes, sampling)
    return JobPlan(clips, tuple(skipped), world_size, sp_size, batch_size, frozenset(done_clip_ids))


__all__ = ["Clip", "JobPlan", "PlannedClips", "RankWork", "Skipped", "ViewRef", "assign", "assign_contiguous",
           "batch_views", "batched", "clip_id_for", "plan_clips", "plan_job", "plan_scene_clips", "plan_windows",
           "window", "window_count"]
