"""Pure planning: clip windows, clip ids, DP/SP assignment and the job plan (vaecache/planning/clips.py)."""

from __future__ import annotations

import dataclasses

import pytest

from vaecache.errors import UsageError
from vaecache.planning.clips import Clip, DoneMask, DoneMaskBuilder, clip_id_for, plan_clips, window, window_count
from vaecache.planning.jobs import JobPlan, assign, assign_contiguous, batch_views, batched, plan_job, sp_repeats_advice
from vaecache.settings.clip import SamplingConfig
from vaecache.sources.probing import judge_scene
from vaecache.sources.scene import CameraProbe, Scene, SceneProbe


def plan_windows(start: int, stop: int, sampling: SamplingConfig) -> list[tuple[int, ...]]:
    """Every window of [start, stop), listed."""
    return [window(start, index, sampling) for index in range(window_count(start, stop, sampling))]


def test_windows_do_not_overlap_by_default() -> None:
    assert plan_windows(0, 17, SamplingConfig(num_frames=9)) == [tuple(range(9))]
    assert plan_windows(0, 18, SamplingConfig(num_frames=9)) == [tuple(range(9)), tuple(range(9, 18))]
    assert plan_windows(0, 8, SamplingConfig(num_frames=9)) == []


def test_frame_stride_window_stride_and_limit() -> None:
    strided = SamplingConfig(num_frames=3, frame_stride=2)
    assert strided.span == 5
    assert plan_windows(0, 12, strided) == [(0, 2, 4), (6, 8, 10)]
    overlapping = SamplingConfig(num_frames=5, window_stride=2)
    assert plan_windows(0, 9, overlapping) == [(0, 1, 2, 3, 4), (2, 3, 4, 5, 6), (4, 5, 6, 7, 8)]
    limited = SamplingConfig(num_frames=5, window_stride=2, max_clips_per_scene=2)
    assert plan_windows(0, 9, limited) == [(0, 1, 2, 3, 4), (2, 3, 4, 5, 6)]
    assert plan_windows(10, 16, SamplingConfig(num_frames=3)) == [(10, 11, 12), (13, 14, 15)]


def _scene(scene_id: str, cameras: int = 2, frame_range: tuple[int, int] | None = None) -> Scene:
    names = tuple(f"cam_{i}" for i in range(cameras))
    return Scene(scene_id, names, tuple(f"/videos/{scene_id}/{n}.mp4" for n in names), frame_range)


def test_plan_clips_ids_cameras_and_skips() -> None:
    scenes = [_scene("long"), _scene("short"), _scene("broken"), _scene("ranged", frame_range=(4, 13))]
    probes = {
        "long": SceneProbe("long", num_frames=30, fps=24.0),
        "short": SceneProbe("short", num_frames=8, fps=24.0),
        "broken": SceneProbe("broken", error="not a readable video", error_path="/videos/broken/cam_1.mp4"),
        "ranged": SceneProbe("ranged", num_frames=100, fps=30.0),
    }
    clips, skipped = plan_clips(scenes, probes, SamplingConfig(num_frames=9))
    assert [c.clip_id for c in clips] == ["long/000000-000008", "long/000009-000017", "long/000018-000026",
                                          "ranged/000004-000012"]
    for clip in clips:
        scene = next(s for s in scenes if s.scene_id == clip.scene_id)
        assert (clip.cameras, clip.paths) == (scene.cameras, scene.paths)  # one frame tuple for every camera
        assert clip.num_views == 2 and len(clip.frames) == 9
    assert clips[-1].fps == 30.0
    assert {s.scene_id: s.reason for s in skipped} == {
        "short": "too short: 8 usable frames, one clip needs 9",
        "broken": "not a readable video",
    }
    assert [s.path for s in skipped] == [None, "/videos/broken/cam_1.mp4"]


def test_clip_ids_come_from_scene_and_window_only() -> None:
    assert clip_id_for("scene", (16, 18, 20)) == "scene/000016-000020"
    scenes = [_scene(f"s{i}") for i in range(5)]
    probes = {s.scene_id: SceneProbe(s.scene_id, num_frames=20, fps=10.0) for s in scenes}
    clips, _ = plan_clips(scenes, probes, SamplingConfig(num_frames=5))
    assert len({c.clip_id for c in clips}) == len(clips) == 20
    assert [c.clip_id for c in clips[4:8]] == [f"s1/{a:06d}-{a + 4:06d}" for a in (0, 5, 10, 15)]
    # Sharding never renames a clip: every world size sees the same (id, frames) pairs.
    for world in (1, 2, 3, 7):
        seen = sorted((clip.clip_id, clip.frames) for rank in range(world)
                      for batch in batched(assign(clips, rank, world), 3) for clip in batch)
        assert seen == sorted((c.clip_id, tuple(range(int(c.clip_id[-13:-7]), int(c.clip_id[-6:]) + 1)))
                              for c in clips)
    # Planning a subset of scenes gives the same ids for the scenes it keeps.
    subset, _ = plan_clips(scenes[2:], probes, SamplingConfig(num_frames=5))
    assert [c.clip_id for c in subset] == [c.clip_id for c in clips[8:]]


@pytest.mark.parametrize("count", [0, 1, 5, 12, 13])
def test_assign_partitions_disjointly_and_covers_everything(count: int) -> None:
    items = [f"clip-{i}" for i in range(count)]
    for world in range(1, 10):
        shares = [assign(items, rank, world) for rank in range(world)]
        flat = [item for share in shares for item in share]
        assert sorted(flat) == sorted(items)  # covers all, no item twice
        assert len(set(flat)) == len(flat)
        assert max(map(len, shares)) - min(map(len, shares)) <= 1  # balanced
        assert shares == [assign(items, rank, world) for rank in range(world)]  # deterministic


def test_assign_rejects_a_rank_outside_the_world() -> None:
    with pytest.raises(ValueError, match="rank 2 outside world of 2"):
        assign([1, 2, 3], 2, 2)
    with pytest.raises(ValueError):
        assign([1, 2, 3], -1, 2)


def test_batched_keeps_order_and_the_last_partial_batch() -> None:
    assert batched(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert batched([], 3) == []
    clips = [Clip(f"s/{i}", "s", ("a", "b"), ("pa", "pb"), (0,), 1.0) for i in range(2)]
    assert [(v.clip_index, v.camera_index) for v in batch_views(clips)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("count", [0, 1, 5, 17])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_assign_contiguous_partitions_in_order_and_balances(count, world):
    items = list(range(count))
    parts = [assign_contiguous(items, rank, world) for rank in range(world)]
    assert [x for part in parts for x in part] == items  # disjoint, complete, contiguous, in order
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def _ids_per_dp_group(job: JobPlan) -> list[list[str]]:
    return [[clip.clip_id for clip in job.dp_clips(dp)] for dp in range(job.dp_size)]


def _job(world_size: int, sp_size: int, batch_size: int, done: frozenset[str] = frozenset()) -> JobPlan:
    scenes = [_scene(f"s{i}", cameras=3) for i in range(4)]
    probes = {s.scene_id: SceneProbe(s.scene_id, num_frames=20, fps=10.0) for s in scenes}
    return plan_job(scenes, probes, SamplingConfig(num_frames=5), world_size, sp_size, batch_size, done)


@pytest.mark.parametrize(("world", "sp"), [(1, 1), (2, 1), (4, 2), (6, 3), (8, 4)])
def test_job_plan_gives_each_dp_group_a_contiguous_block_and_its_sp_ranks_the_same_batches(world, sp) -> None:
    job = _job(world, sp, batch_size=2)
    per_group = _ids_per_dp_group(job)
    assert [i for ids in per_group for i in ids] == [c.clip_id for c in job.clips]  # contiguous, in order, complete
    sizes = [len(ids) for ids in per_group]  # 16 clips over world // sp groups, balanced
    assert sum(sizes) == 16 and max(sizes) - min(sizes) <= 1
    if (world, sp) == (4, 2):
        assert per_group == [[f"s{s}/{a:06d}-{a + 4:06d}" for s in scenes for a in (0, 5, 10, 15)]
                             for scenes in ((0, 1), (2, 3))]
    for rank in range(world):
        work = job.rank_work(rank)
        group_writer = job.rank_work(rank - rank % sp)
        assert work.batches == group_writer.batches and work.sp_plans == group_writer.sp_plans
        assert [c.clip_id for c in work.clips] == per_group[rank // sp]
        assert all(len(batch) <= 2 for batch in work.batches)
    # Together the SP ranks of a group decode every view of each batch (3 cameras x 2 clips = 6 views).
    for dp in range(world // sp):
        works = [job.rank_work(r) for r in range(dp * sp, (dp + 1) * sp)]
        for b, batch in enumerate(works[0].batches):
            covered = {v for w in works for v in w.view_indices[b]}
            assert covered == set(range(len(batch_views(batch))))


def test_job_plan_leaves_committed_clips_out_of_every_share() -> None:
    full = _job(2, 1, 1)
    done = frozenset(c.clip_id for c in full.clips[:5])
    resumed = _job(2, 1, 1, done)
    assert resumed.clips == full.clips  # the plan is the same; only the work left shrinks
    assert [i for ids in _ids_per_dp_group(resumed) for i in ids] == [c.clip_id for c in full.clips[5:]]


def test_job_plan_rejects_a_cluster_shape_that_cannot_be() -> None:
    with pytest.raises(UsageError, match="--sp-size 2 must divide the world size 3"):
        _job(3, 2, 1)
    with pytest.raises(UsageError, match="--batch-size must be an integer >= 1"):
        _job(2, 1, 0)


def _uneven_job_inputs() -> tuple[list[Scene], dict[str, SceneProbe]]:
    """Scenes of 0..6 clips (some too short, one broken, one with a frame range): uneven per-scene counts."""
    frames = [5, 31, 4, 12, 30, 9, 18, 0, 26, 7, 15]
    scenes = [_scene(f"s{i:02d}", cameras=2, frame_range=(3, 20) if i == 6 else None) for i in range(len(frames))]
    probes = {s.scene_id: (SceneProbe(s.scene_id, num_frames=n, fps=10.0) if n else
                           SceneProbe(s.scene_id, error="not a readable video")) for s, n in zip(scenes, frames)}
    return scenes, probes


@pytest.mark.parametrize(("world", "sp"), [(1, 1), (2, 1), (3, 1), (4, 2), (6, 3), (8, 1), (16, 2), (64, 1)])
@pytest.mark.parametrize("sampling", [SamplingConfig(num_frames=5), SamplingConfig(num_frames=3, window_stride=2),
                                      SamplingConfig(num_frames=2, frame_stride=3, max_clips_per_scene=3)],
                         ids=["plain", "overlapping", "strided-capped"])
def test_block_planning_gives_each_rank_exactly_the_clips_of_the_materialized_plan(world, sp, sampling) -> None:
    scenes, probes = _uneven_job_inputs()
    every, _ = plan_clips(scenes, probes, sampling)  # the whole list, as planning did before blocks
    assert len(every) > 16  # unevenly spread over scenes; world 64 leaves some DP groups idle
    committed = frozenset(c.clip_id for c in every[1::3]) | {"s01/999990-999994", "gone/000000-000004"}
    for done in (frozenset(), committed):
        job = plan_job(scenes, probes, sampling, world, sp, 2, done)
        assert list(job.clips) == every
        todo = [c for c in every if c.clip_id not in done]
        for rank in range(world):
            expected = assign_contiguous(todo, rank // sp, world // sp)
            work = job.rank_work(rank)
            assert list(work.clips) == expected
            assert [list(b) for b in work.batches] == batched(expected, 2)
            if rank % sp == 0:  # the plan report's counts, made without building clips, agree with the work
                counts = job.dp_counts(rank // sp)
                assert (counts.clips, counts.batches) == (len(work.clips), len(work.batches))
                assert counts.views == sum(p.num_views for p in work.sp_plans)
                assert counts.views_per_rank == sum(len(v) for v in work.view_indices)


def test_planned_clips_index_and_slice_like_a_list() -> None:
    scenes, probes = _uneven_job_inputs()
    every, _ = plan_clips(scenes, probes, SamplingConfig(num_frames=5))
    planned = plan_job(scenes, probes, SamplingConfig(num_frames=5)).clips
    assert len(planned) == len(every) and planned == every
    assert planned[0] == every[0] and planned[-1] == every[-1] and planned[7] == every[7]
    for lo, hi in [(0, 0), (0, 3), (2, 9), (5, len(every)), (len(every) - 1, len(every) + 5), (-4, -1)]:
        assert planned[lo:hi] == every[lo:hi]
    assert planned[::2] == every[::2]
    with pytest.raises(IndexError):
        planned[len(every)]


def test_a_done_mask_plans_every_rank_like_the_committed_ids() -> None:
    """Resume hands every rank a bit per planned clip (DoneMask), not the ids: same shares either way."""
    scenes, probes = _uneven_job_inputs()
    sampling = SamplingConfig(num_frames=3, window_stride=2)
    every, _ = plan_clips(scenes, probes, sampling)
    committed = [c.clip_id for c in every[::4]]
    strangers = ["gone/000000-000002", "s01/000001-000003", "s01/000000-000099", "s01/0-2", "no-window"]
    job = plan_job(scenes, probes, sampling, 4, 1, 2)
    builder = DoneMaskBuilder(job.clips)
    builder.add(committed + strangers)
    mask = builder.mask()
    assert builder.committed == len(committed) + len(strangers)
    assert (mask.size, mask.count, len(mask.bits)) == (len(every), len(committed), (len(every) + 7) // 8)
    by_ids = plan_job(scenes, probes, sampling, 4, 1, 2, frozenset(committed))
    by_mask = dataclasses.replace(job, done=mask)
    assert list(by_mask.todo) == [c for c in every if c.clip_id not in set(committed)]
    for rank in range(4):
        assert by_mask.rank_work(rank) == by_ids.rank_work(rank)
    builder.discard(committed[:1] + strangers[:1])  # a damaged shard's clips are taken back
    assert builder.committed == len(committed) + len(strangers) - 2 and builder.mask().count == len(committed) - 1
    assert list(job.clips.with_done(builder.mask()))[0] == every[0]
    with pytest.raises(ValueError, match="DoneMask"):
        DoneMask(b"\0", 9, 0)
    with pytest.raises(ValueError, match="a DoneMask of 3 clips for a plan of"):
        job.clips.with_done(DoneMask(b"\x01", 3, 1))


@pytest.mark.parametrize("batch", [1, 3])
def test_dp_counts_batch_clips_of_different_camera_counts_like_rank_work(batch: int) -> None:
    """Scenes of 1, 2 and 3 cameras: the counts cannot take the one-run shortcut of a uniform dataset."""
    scenes = [_scene(f"s{i:02d}", cameras=1 + i % 3) for i in range(10)]
    probes = {s.scene_id: SceneProbe(s.scene_id, num_frames=5 + 7 * (i % 4), fps=10.0) for i, s in enumerate(scenes)}
    for world, sp in ((1, 1), (3, 1), (4, 2), (6, 3)):
        job = plan_job(scenes, probes, SamplingConfig(num_frames=5), world, sp, batch)
        assert job.clips.views() == sum(c.num_views for c in job.clips)
        for dp in range(world // sp):
            work, counts = job.rank_work(dp * sp), job.dp_counts(dp)
            assert (counts.clips, counts.batches) == (len(work.clips), len(work.batches))
            assert counts.views == sum(p.num_views for p in work.sp_plans)
            assert counts.views_per_rank == sum(len(v) for v in work.view_indices)


def test_a_scene_whose_index_gives_its_probe_plans_like_one_probed_by_opening_it() -> None:
    """The planner's shortcut for one camera and a whole video agrees with judge_scene's full check."""
    scenes = []
    for i, (frames, rotation, frame_range) in enumerate([(12, 0, None), (12, 90, None), (3, 0, None), (30, 0, (4, 20)),
                                                         (17, 270, None)]):
        probe = CameraProbe(frames, 10.0, 64 + i, 48, "h264", 1000, i, rotation)
        scenes.append(Scene(f"s{i}", ("video",), (f"/v/{i}.mp4",), frame_range, (probe,)))
    opened = {s.scene_id: judge_scene(s, s.probed) for s in scenes}
    for sizes in (None, [(32, 48), (48, 32)]):
        from_index = plan_job(scenes, {}, SamplingConfig(num_frames=5), sizes=sizes)
        by_opening = plan_job([dataclasses.replace(s, probed=None) for s in scenes], opened,
                              SamplingConfig(num_frames=5), sizes=sizes)
        # the same clips; those planned from an index also carry the (size, mtime) decoding checks the file against
        assert [dataclasses.replace(c, identity=()) for c in from_index.clips] == list(by_opening.clips)
        assert len(from_index.clips) == 10
        assert all(c.identity == ((1000, int(c.scene_id[1:])),) for c in from_index.clips)
        assert from_index.skipped == by_opening.skipped and [s.scene_id for s in from_index.skipped] == ["s2"]


@pytest.mark.parametrize(("batch", "views", "k", "sp", "advice"), [
    (1, 6, 6, 2, "pass --views-per-forward 3 or --batch-size 2"),
    (1, 6, 6, 4, "pass --views-per-forward 1 or --batch-size 4"),
    (1, 1, 1, 4, "pass --batch-size 4"),
    (1, 6, 1, 2, None), (2, 6, 6, 2, None), (1, 6, 6, 1, None), (1, None, 2, 2, None),
])
def test_sp_repeats_advice_names_what_gives_every_rank_units_of_its_own(batch, views, k, sp, advice) -> None:
    said = sp_repeats_advice(batch, views, k, sp)
    assert said == advice if advice is None else said.endswith(advice) and f"fewer than the {sp} ranks" in said
