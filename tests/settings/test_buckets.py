"""Buckets without video: the nearest-aspect assignment (ties, rotation, multi-camera), frame-bucket policies,
fit geometry and its per-clip records, option parsing and the one-message frame-rule check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vaecache.cache.writer import geometry_record
from vaecache.errors import FrameRuleError, UsageError
from vaecache.models.rules import FrameRule
from vaecache.planning.clips import plan_clips
from vaecache.planning.jobs import JobPlan, batched
from vaecache.planning.report import bucket_histogram
from vaecache.settings.buckets import Bucket, fit_geometry, nearest_size, parse_lengths, parse_sizes
from vaecache.settings.clip import ClipSettings, SamplingConfig
from vaecache.settings.loader import clip_settings as pop_clip_options
from vaecache.settings.loader import load_toml
from vaecache.sources.scene import CameraProbe, Scene
from vaecache.video.resize import resize_fit, to_model_range

SIZES = ((32, 56), (56, 32), (40, 40))


def _scene(scene_id: str, *cameras: tuple[int, int, int, int]) -> Scene:
    """A scene whose index gives each camera's probe: (width, height, frames, rotation)."""
    names = tuple(f"cam{i}" for i in range(len(cameras)))
    probes = tuple(CameraProbe(frames, 10.0, w, h, "h264", 1000, 1, rotation) for w, h, frames, rotation in cameras)
    return Scene(scene_id, names, tuple(f"/d/{scene_id}/{n}.mp4" for n in names), probed=probes)


def _plan(scenes: list[Scene], lengths: tuple[int, ...] = (9,), policy: str = "longest",
          sizes: tuple[tuple[int, int], ...] = SIZES):
    sampling = SamplingConfig(lengths[0], frame_buckets=lengths if len(lengths) > 1 else (), frames_policy=policy)
    return plan_clips(scenes, {}, sampling, sizes)


def test_nearest_aspect_and_its_tie_break() -> None:
    assert nearest_size([(64, 36)], SIZES) == 0  # 16:9 -> 32x56
    assert nearest_size([(28, 64)], SIZES) == 1  # 0.43 -> 56x32
    assert nearest_size([(60, 56)], SIZES) == 2  # near square -> 40x40
    # a square source is as far from 2:1 as from 1:2: the larger area wins, then the size listed first
    assert nearest_size([(50, 50)], ((32, 64), (128, 64))) == 1
    assert nearest_size([(50, 50)], ((64, 32), (32, 64))) == 0
    assert nearest_size([(50, 50)], ((32, 64), (64, 32))) == 0


def test_rotation_is_applied_before_choosing_the_bucket() -> None:
    clips, _ = _plan([_scene("upright", (64, 36, 9, 0)), _scene("rotated", (64, 36, 9, 90)),
                      _scene("upside", (64, 36, 9, 180))])
    assert {c.scene_id: c.bucket.name for c in clips} == {"upright": "32x56x9", "rotated": "56x32x9",
                                                          "upside": "32x56x9"}
    assert clips[1].displayed == ((36, 64),)


def test_a_multi_camera_scene_shares_one_bucket_and_frames() -> None:
    # cameras at 2.0 and 1.2: the mean log aspect (1.55) is nearest 56/32 = 1.75
    clips, _ = _plan([_scene("rig", (64, 32, 9, 0), (48, 40, 9, 0))])
    (clip,) = clips
    assert clip.bucket == Bucket(32, 56, 9) and clip.displayed == ((64, 32), (48, 40))
    record = geometry_record(clip, "cover")
    assert [entry["source"] for entry in record["crop"]] == [[64, 32], [48, 40]]
    assert record["bucket"] == {"name": "32x56x9", "height": 32, "width": 56, "num_frames": 9}


def test_frames_policy_longest_and_all() -> None:
    scenes = [_scene("long", (64, 36, 20, 0)), _scene("mid", (64, 36, 7, 0)), _scene("short", (64, 36, 4, 0))]
    longest, skipped = _plan(scenes, (9, 5))
    assert [c.clip_id for c in longest] == ["long/000000-000008", "long/000009-000017", "mid/000000-000004"]
    assert [c.bucket.num_frames for c in longest] == [9, 9, 5]
    assert [s.reason for s in skipped] == ["too short: 4 usable frames, one clip needs 5"]
    every, _ = _plan(scenes, (9, 5), "all")
    assert [c.clip_id for c in every] == [
        "long/000000-000008", "long/000009-000017",
        "long/000000-000004", "long/000005-000009", "long/000010-000014", "long/000015-000019",
        "mid/000000-000004"]
    assert len({c.clip_id for c in every}) == len(every)  # one window at two lengths: distinct ids
    assert [len(c.frames) for c in every] == [9, 9, 5, 5, 5, 5, 5]
    assert every[3:5] == every.block(3, 5) and every[4].bucket == Bucket(32, 56, 5)


def test_resume_leaves_out_committed_clips_of_every_length() -> None:
    every, _ = _plan([_scene("long", (64, 36, 20, 0))], (9, 5), "all")
    rest = every.without(frozenset({"long/000000-000008", "long/000005-000009", "long/000000-000009"}))
    assert [c.clip_id for c in rest] == ["long/000009-000017", "long/000000-000004", "long/000010-000014",
                                         "long/000015-000019"]
    assert len(rest) == 4


def test_batches_never_mix_buckets() -> None:
    scenes = [_scene("a", (64, 36, 9, 0)), _scene("b", (64, 36, 9, 0)), _scene("c", (36, 64, 9, 0)),
              _scene("d", (64, 36, 18, 0))]
    clips, _ = _plan(scenes)
    assert [[c.scene_id for c in batch] for batch in batched(list(clips), 2)] == [["a", "b"], ["c"], ["d", "d"]]
    work = JobPlan(clips, (), world_size=2, sp_size=2, batch_size=3).rank_work(1)
    assert [len({c.bucket for c in batch}) for batch in work.batches] == [1, 1, 1]
    assert [p.num_views for p in work.sp_plans] == [2, 1, 2]  # the SP split happens inside each batch


def test_fit_geometry_and_crop_records() -> None:
    cover = fit_geometry(94, 40, 40, 40, "cover")  # 94x40 -> 94x40 (scale 1): the centre 40 columns
    assert cover.resize == (40, 94) and cover.crop == (0, 27, 40, 40) and cover.box == (27.0, 0.0, 67.0, 40.0)
    contain = fit_geometry(94, 40, 40, 40, "contain")  # scale 40/94: 40x17, padded 11 above and 12 below
    assert contain.resize == (17, 40) and contain.pad == (0, 11, 0, 12)
    assert contain.to_record((94, 40)) == {"source": [94, 40], "box": [0.0, 0.0, 94.0, 40.0], "pad": [0, 11, 0, 12]}
    stretch = fit_geometry(94, 40, 40, 40, "stretch")
    assert stretch.to_record((94, 40)) == {"source": [94, 40], "box": [0.0, 0.0, 94.0, 40.0], "pad": [0, 0, 0, 0]}
    same = fit_geometry(56, 32, 32, 56, "cover")
    assert same.box == (0.0, 0.0, 56.0, 32.0) and same.resize == (32, 56)


def test_contain_pads_with_zero_in_model_range_and_stretch_fills() -> None:
    frames = torch.full((2, 3, 40, 94), 255, dtype=torch.uint8)
    padded = to_model_range(resize_fit(frames, 40, 40, "contain"))
    assert padded.shape == (2, 3, 40, 40)
    assert torch.equal(padded[:, :, :11], torch.zeros(2, 3, 11, 40))  # mid grey: 0.0 exactly
    assert torch.equal(padded[:, :, 28:], torch.zeros(2, 3, 12, 40))
    assert torch.allclose(padded[:, :, 11:28], torch.ones(2, 3, 17, 40), atol=1e-5)  # the white frame, resized
    stretched = to_model_range(resize_fit(frames, 40, 40, "stretch"))
    assert torch.allclose(stretched, torch.ones(2, 3, 40, 40), atol=1e-5)


def test_histogram_reports_crop_padding_distortion_and_empty_buckets() -> None:
    scenes = [_scene("wide", (94, 40, 9, 0)), _scene("square", (40, 40, 9, 0))]
    clips, _ = _plan(scenes, sizes=((40, 40), (40, 80)))
    cover = {row["name"]: row for row in bucket_histogram(clips, "cover", lambda b: [1, 10, 10], 1)}
    assert cover["40x40x9"]["clips"] == 1 and cover["40x40x9"]["mean_kept"] == 1.0
    assert cover["40x80x9"]["mean_kept"] == round(80 / 94, 4)  # scale 1: the centre 80 of 94 columns
    assert cover["40x80x9"]["bytes"] == 100
    contain = {row["name"]: row for row in bucket_histogram(clips, "contain", lambda b: [1, 10, 10], 1)}
    assert contain["40x80x9"]["mean_padded"] == round(1 - 34 * 80 / (40 * 80), 4)  # 94x40 -> 80x34
    stretch = {row["name"]: row for row in bucket_histogram(clips, "stretch", lambda b: [1, 10, 10], 1)}
    assert stretch["40x80x9"]["max_distortion"] == round(94 / 40 / 2, 4)
    empty, _ = _plan([_scene("square", (40, 40, 9, 0))], sizes=((40, 40), (40, 80)))
    assert [(r["name"], r["clips"], r["mean_kept"]) for r in bucket_histogram(empty, "cover", lambda b: [1], 1)] == [
        ("40x40x9", 1, 1.0), ("40x80x9", 0, None)]


def test_size_and_frame_lists_presets_and_mistakes() -> None:
    assert parse_sizes("wan-480p") == ((480, 832), (832, 480), (624, 624))
    assert parse_sizes("480x832, 624x624") == ((480, 832), (624, 624))
    assert parse_sizes(["wan-480p", "256x256"])[-1] == (256, 256)
    assert parse_lengths("17,33,49") == (17, 33, 49) and parse_lengths(17) == (17,)
    with pytest.raises(UsageError, match="unknown preset 'wan-9000p'"):
        parse_sizes("wan-9000p")
    with pytest.raises(UsageError, match="lists 480x832 more than once"):
        parse_sizes("480x832,wan-480p")
    with pytest.raises(UsageError, match="lists 17 more than once"):
        parse_lengths("17,33,17")
    with pytest.raises(UsageError, match="--frames-policy must be one of longest, all"):
        pop_clip_options({"size": "64x64", "num_frames": "9,5", "frames_policy": "most"})
    with pytest.raises(UsageError, match="--fit must be one of cover, contain, stretch"):
        pop_clip_options({"size": "64x64", "num_frames": 9, "fit": "crop"})


def test_one_size_settings_record_as_before_and_buckets_round_trip(tmp_path: Path) -> None:
    one = pop_clip_options({"size": "64x64", "num_frames": "9"})
    assert one.size_buckets == () and not one.bucketed
    assert "sizes" not in one.to_record() and "fit" not in one.to_record()
    path = tmp_path / "c.toml"
    path.write_text('size = ["32x56", "56x32"]\nnum-frames = [9, 5]\nframes-policy = "all"\nfit = "contain"\n')
    bucketed = pop_clip_options(load_toml(path))
    assert bucketed.sizes == ((32, 56), (56, 32)) and bucketed.sampling.lengths == (9, 5)
    assert [b.name for b in bucketed.buckets()] == ["32x56x9", "32x56x5", "56x32x9", "56x32x5"]
    record = bucketed.to_record()
    assert record["sizes"] == [[32, 56], [56, 32]] and record["frames_policy"] == "all" and record["fit"] == "contain"
    assert ClipSettings.from_record(record) == bucketed
    path.write_text('size = ["32x56", 56]\n')
    with pytest.raises(UsageError, match="must be str or a list of str"):
        load_toml(path)


def test_every_bad_bucket_is_named_in_one_message() -> None:
    rule = FrameRule(4, 8, causal=True, label="Wan")
    rule.check_buckets((9, 5), ((32, 56), (40, 40)))
    with pytest.raises(FrameRuleError) as caught:
        rule.check_buckets((9, 6, 8), ((32, 56), (30, 40), (44, 36)))
    message = str(caught.value)
    assert "\n" not in message
    for part in ("--size 30x40", "--size 44x36", "--num-frames 6", "--num-frames 8"):
        assert part in message
    assert "--size 32x56" not in message and "--num-frames 9" not in message


def test_counted_shares_agree_with_the_work_of_a_bucketed_resumed_plan() -> None:
    """dp_counts (what `vaecache plan` reports, no clip built) equals each group's rank_work, buckets and
    committed clips included."""
    scenes = [_scene("a", (64, 36, 20, 0)), _scene("b", (36, 64, 9, 0)), _scene("c", (64, 36, 18, 0)),
              _scene("d", (64, 36, 9, 0)), _scene("e", (36, 64, 20, 0))]
    clips, _ = _plan(scenes, (9, 5), "all")
    done = frozenset(c.clip_id for c in list(clips)[1::3])
    for world, sp, batch in ((1, 1, 3), (2, 1, 2), (4, 2, 2), (3, 3, 1)):
        job = JobPlan(clips, (), world_size=world, sp_size=sp, batch_size=batch, done=done)
        for dp in range(world // sp):
            work, counts = job.rank_work(dp * sp), job.dp_counts(dp)
            assert (counts.clips, counts.batches) == (len(work.clips), len(work.batches))
            assert counts.views == sum(p.num_views for p in work.sp_plans)
            assert counts.views_per_rank == sum(len(v) for v in work.view_indices)
