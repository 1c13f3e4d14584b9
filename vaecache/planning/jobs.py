"""The job plan: which clips each rank encodes, in what batches, split how over its SP group; the same on
every rank, in encode, plan and verify --dataset."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vaecache.distributed.mesh import make_mesh
from vaecache.errors import UsageError
from vaecache.parallel import SPPlan, plan_sp
from vaecache.planning.clips import Clip, DoneMask, PlannedClips, plan_clips
from vaecache.settings.clip import SamplingConfig
from vaecache.settings.parts import ParallelConfig
from vaecache.sources.scene import Skipped

if TYPE_CHECKING:
    from vaecache.sources.scene import Scene, SceneProbe


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
    """Batches of `size` items in order; a batch never mixes buckets (one is cut short where the bucket changes)."""
    batches: list[list[Any]] = []
    for item in items:
        if (batches and len(batches[-1]) < size
                and getattr(batches[-1][0], "bucket", None) == getattr(item, "bucket", None)):
            batches[-1].append(item)
        else:
            batches.append([item])
    return batches


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


@dataclass
class ShareCounts:
    """A DP group's share, counted (JobPlan.dp_counts)."""

    clips: int
    batches: int = 0
    views: int = 0
    views_per_rank: int = 0
    """Views its first SP rank encodes, padding included (every rank of the group encodes as many)."""


_NO_BUCKET = object()


@dataclass(frozen=True)
class JobPlan:
    """Clips planned from a dataset, spread over DP groups (contiguous blocks) and SP ranks (views)."""

    clips: Sequence[Clip]
    """A tuple, or a PlannedClips (plan_job) that builds only the block a DP group asks for."""
    skipped: tuple[Skipped, ...]
    world_size: int = 1
    sp_size: int = 1
    batch_size: int = 1
    done: DoneMask | frozenset[str] = frozenset()
    """Clips already committed by an earlier attempt (a mask over the plan, or clip ids): left out of every
    rank's share."""
    views_per_forward: int = 1
    """K: the views of one clip that one VAE forward encodes together (a unit). SP splits a batch in whole
    units, so a clip's latents depend on K only, never on world, SP or batch size. K divides every clip's views."""

    def __post_init__(self) -> None:
        make_mesh(0, self.world_size, self.sp_size)  # sp_size must divide world_size
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise UsageError(f"--batch-size must be an integer >= 1, got {self.batch_size!r}")
        _check_views_per_forward(self.views_per_forward)

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @functools.cached_property
    def todo(self) -> Sequence[Clip]:
        """The clips still to encode, in plan order (built block by block where the plan is a PlannedClips)."""
        if isinstance(self.done, DoneMask):
            if isinstance(self.clips, PlannedClips):
                return self.clips.with_done(self.done)
            flags = self.done.flags()
            return [clip for position, clip in enumerate(self.clips) if not flags[position]]
        if isinstance(self.clips, PlannedClips):
            return self.clips.without(self.done) if self.done else self.clips
        return [clip for clip in self.clips if clip.clip_id not in self.done]

    def dp_clips(self, dp_rank: int) -> list[Clip]:
        """DP group `dp_rank`'s contiguous block of the clips still to encode."""
        return assign_contiguous(self.todo, dp_rank, self.dp_size)

    def rank_work(self, rank: int) -> RankWork:
        """The share of global rank `rank` (SP groups are contiguous blocks of sp_size ranks)."""
        mesh = make_mesh(rank, self.world_size, self.sp_size)
        clips = self.dp_clips(mesh.dp_rank)
        batches = batched(clips, self.batch_size)
        splits: dict[int, tuple[SPPlan, tuple[int, ...]]] = {}  # views per batch -> its split (few distinct)
        for clip in clips:
            self._check_units(clip.num_views, clip.clip_id)
        for batch in batches:
            views = sum(clip.num_views for clip in batch)  # len(batch_views(batch)), without listing them
            if views not in splits:
                split = plan_sp(views, self.sp_size, self.views_per_forward)
                splits[views] = (split, tuple(split.view_indices(mesh.sp_rank)))
        chosen = [splits[sum(clip.num_views for clip in batch)] for batch in batches]
        return RankWork(tuple(clips), tuple(tuple(batch) for batch in batches), tuple(c[0] for c in chosen),
                        tuple(c[1] for c in chosen))

    def dp_counts(self, dp_rank: int) -> ShareCounts:
        """What rank_work gives DP group `dp_rank`, counted: clips, batches, views, and the views its first SP
        rank encodes (padding included). A PlannedClips is counted from its runs, no clip built."""
        clips = self.todo
        lo, hi = dp_rank * len(clips) // self.dp_size, (dp_rank + 1) * len(clips) // self.dp_size
        if isinstance(clips, PlannedClips):
            runs = clips.block_runs(lo, hi)
        else:
            runs = [(getattr(clip, "bucket", None), clip.num_views, 1) for clip in clips[lo:hi]]
        counts = ShareCounts(hi - lo)
        splits: dict[int, int] = {}
        fill = batch_views = 0
        bucket: Any = _NO_BUCKET

        def close(batches: int = 1) -> None:
            if batch_views not in splits:
                splits[batch_views] = len(plan_sp(batch_views, self.sp_size, self.views_per_forward).view_indices(0))
            counts.batches += batches
            counts.views += batches * batch_views
            counts.views_per_rank += batches * splits[batch_views]

        for run_bucket, views, count in runs:
            self._check_units(views, f"DP group {dp_rank}")
            if run_bucket != bucket and fill:
                close()
                fill = batch_views = 0
            bucket = run_bucket
            while count:
                take = min(count, self.batch_size - fill)
                fill, batch_views, count = fill + take, batch_views + take * views, count - take
                if fill == self.batch_size:
                    close()
                    full = count // self.batch_size  # the run's next whole batches are all alike
                    if full:
                        batch_views = self.batch_size * views
                        close(full)
                        count -= full * self.batch_size
                    fill = batch_views = 0
        if fill:
            close()
        return counts

    def _check_units(self, views: int, what: str) -> None:
        if views % self.views_per_forward:
            raise UsageError(f"{what}: a clip of {views} views is not whole forward units of "
                             f"--views-per-forward {self.views_per_forward}")


def _check_views_per_forward(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"--views-per-forward must be an integer >= 1, 'all' or 'auto', got {value!r}")


def resolve_views_per_forward(requested: int | str, views_per_clip: int | None, device_type: str = "cpu") -> int:
    """Pure: K for a plan whose clips all have `views_per_clip` views (None: they differ) on `device_type`.

    "all": every view of a clip (what a per-clip loop does); "auto": "all" on CUDA and 1 elsewhere (oneDNN,
    PyTorch's CPU convolutions, gives a batched forward other bits for another intra-op thread count, and
    the thread count follows the ranks per node); a number must divide every clip's views."""
    if requested == "auto":
        requested = "all" if device_type == "cuda" and views_per_clip is not None else 1
    if requested == "all":
        if views_per_clip is None:
            raise UsageError("clips have different camera counts, so --views-per-forward all has no single value; "
                             "pass a K that divides every clip's camera count (1 always does)")
        return views_per_clip
    _check_views_per_forward(requested)
    if views_per_clip is not None and views_per_clip % requested:  # type: ignore[operator]
        raise UsageError(f"--views-per-forward {requested} does not divide the {views_per_clip} cameras of a clip "
                         f"(a forward encodes whole units of K views of one clip)")
    return requested  # type: ignore[return-value]


def sp_repeats_advice(batch_size: int, views_per_clip: int | None, views_per_forward: int, sp_size: int) -> str | None:
    """Pure: when a batch holds fewer forward units than an SP group has ranks (so ranks encode repeats of the
    same units), what to pass instead; None when every rank gets units of its own."""
    if sp_size <= 1 or views_per_clip is None:
        return None
    per_clip = views_per_clip // views_per_forward
    if batch_size * per_clip >= sp_size:
        return None
    smaller = [k for k in range(1, views_per_forward) if views_per_clip % k == 0 and
               batch_size * (views_per_clip // k) >= sp_size]
    instead = [f"--batch-size {-(-sp_size // per_clip)}"]
    if smaller:
        instead.insert(0, f"--views-per-forward {max(smaller)}")
    return (f"a batch of {batch_size} clip(s) holds {batch_size * per_clip} forward unit(s) of {views_per_forward} "
            f"views, fewer than the {sp_size} ranks of an SP group, so its ranks encode repeats of the same units; "
            f"pass {' or '.join(instead)}")


def plan_job(scenes: Sequence[Scene], probes: dict[str, SceneProbe], sampling: SamplingConfig, world_size: int = 1,
             sp_size: int = 1, batch_size: int = 1, done: DoneMask | Sequence[str] | frozenset[str] = frozenset(),
             sizes: Sequence[tuple[int, int]] | None = None, views_per_forward: int | str = 1,
             device_type: str = "cpu") -> JobPlan:
    """Pure: the job plan for these scenes (probed), sampling, size buckets, forward unit (resolved by
    resolve_views_per_forward for `device_type`) and cluster shape. Its clips are a PlannedClips: each rank
    builds only its own DP group's block."""
    clips, skipped = plan_clips(scenes, probes, sampling, sizes)
    views_per_clip = clips.views_per_clip() if clips.scene_total else (len(scenes[0].cameras) if scenes else 1)
    return JobPlan(clips, tuple(skipped), world_size, sp_size, batch_size,
                   done if isinstance(done, DoneMask) else frozenset(done),
                   resolve_views_per_forward(views_per_forward, views_per_clip, device_type))


def plan_notes(job: JobPlan, parallel: ParallelConfig, device_type: str, threads: int | None = None) -> list[str]:
    """What a user should know about this plan before it runs: an SP group that would encode repeats, and views
    batched on CPU (whose bits depend on the thread count). Encode logs them, plan lists them."""
    notes = []
    advice = sp_repeats_advice(parallel.batch_size, job.clips.views_per_clip(), job.views_per_forward,
                               parallel.sp_size) if parallel.sp_mode == "views" else None
    if advice:
        notes.append(advice)
    if job.views_per_forward > 1 and device_type == "cpu":
        per_rank = f" ({threads} per rank here)" if threads is not None else ""
        notes.append(f"{job.views_per_forward} views per forward on CPU: oneDNN gives a batched forward other bits "
                     f"for another intra-op thread count{per_rank}, so every run of one cache needs the same threads "
                     "per rank (OMP_NUM_THREADS) to match bit for bit")
    return notes
