"""`vaecache plan`: clip counts, latent shapes, bytes, the split over ranks, the measured encode, and the
example configs under configs/."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from vaecache.demodata import DemoDataSpec, write_demo_dataset
from vaecache.encode.dry_run import build_plan
from vaecache.models import VAE_CLASSES
from vaecache.planning.clips import Clip
from vaecache.planning.jobs import JobPlan
from vaecache.planning.report import Measurement, dp_shares, fits_views_per_forward, pipeline_eta
from vaecache.settings.clip import ClipSettings, SamplingConfig
from vaecache.settings.commands import PlanConfig
from vaecache.settings.loader import clip_settings as pop_clip_options
from vaecache.settings.loader import load_toml
from vaecache.settings.parts import SourceConfig, VaeConfig

REPO = Path(__file__).resolve().parents[2]
SPEC = DemoDataSpec(scenes=3, cameras=2, frames=17, height=32, width=32, fps=10, seed=1)
# 17 frames cut into 5-frame clips without overlap: starts 0, 5, 10 -> 3 clips per scene, 9 in all.
PLAN_ARGS = ("--vae", "builtin:tiny", "--num-frames", "5", "--size", "32x32")
TINY_SHAPE = [16, 2, 4, 4]  # builtin:tiny (Wan, 8x spatial, 4x temporal): 5 frames -> 2, 32 px -> 4


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plan") / "data"
    write_demo_dataset(root, SPEC)
    return root


def test_plan_cli_reports_clips_shapes_bytes_ranks_and_eta(data: Path, tmp_path: Path, run_cli: Any) -> None:
    out = tmp_path / "plan.json"
    result = run_cli(["plan", data, *PLAN_ARGS, "--world-size", "4", "--sp-size", "2", "--batch-size", "2",
                      "--memory-budget", "4GiB", "--json", out])
    assert result.exit_code == 0, result.output
    assert "(16, 2, 4, 4) (c, t, h, w)" in result.output and "ETA" in result.output
    report = json.loads(out.read_text())
    assert report["format"] == "vaecache-plan/1"
    dataset = report["dataset"]
    assert (dataset["scenes"], dataset["clips"], dataset["cameras"], dataset["views"],
            dataset["frames"]) == (3, 9, 2, 18, 90)
    assert [s["clips"] for s in dataset["per_scene"]] == [3, 3, 3] and dataset["skipped"] == []
    latent = report["latent"]
    assert latent["shape_per_view"] == TINY_SHAPE and latent["shape_per_clip"] == [2, *TINY_SHAPE]
    assert latent["stored"] == ["mean", "logvar"] and latent["dtype"] == "float32"
    assert latent["total_bytes"] == 18 * math.prod(TINY_SHAPE) * 4 * 2
    groups = report["ranks"]["dp_groups"]
    # Contiguous blocks, as encode assigns them: 9 clips over 2 DP groups -> clips 0-3 and 4-8.
    assert [(g["ranks"], g["clips"], g["batches"], g["views"], g["views_per_rank"]) for g in groups] == \
        [([0, 1], 4, 2, 8, 4), ([2, 3], 5, 3, 10, 5)]
    per_scene_ids = [f"{scene}/{start:06d}-{start + 4:06d}" for scene in ("scene_000", "scene_001", "scene_002")
                     for start in (0, 5, 10)]
    assert [g["clip_ids"] for g in groups] == [per_scene_ids[:4], per_scene_ids[4:]]
    assert report["ranks"]["padding"]["waste_fraction"] == 0.0
    assert report["config"]["views_per_forward"] == 1 and report["vae"]["views_per_forward"] == 1  # auto on CPU
    measured = report["measurement"]
    assert measured["views"] == 2 and measured["seconds_per_view"] > 0 and measured["device"] == "cpu"
    eta = report["eta"]  # 2 decode workers (the default): decoding overlaps the encode, as in encode
    assert measured["decode_seconds"] > 0 and measured["torch_threads"] >= 1 and eta["workers"] == 2
    assert eta["views_busiest_rank"] == 5 and eta["encode_s_per_view"] == measured["seconds_per_view"]
    assert eta["decode_s_per_view"] == pytest.approx(measured["decode_seconds"] / 2)
    assert eta["seconds_per_view"] == pytest.approx(max(eta["encode_s_per_view"], eta["decode_s_per_view"] / 2))
    assert report["eta_s"] == pytest.approx(eta["startup_s"] + 5 * eta["seconds_per_view"])
    assert any(note.startswith("ETA = start-up") and "decode" in note for note in report["notes"])
    assert report["memory"]["budget_bytes"] == 4 * 2**30
    fits = report["memory"]["max_views_per_forward_that_fits"]
    assert fits is None or fits >= 1
    assert report["vae"]["family"] == "AutoencoderKLWan" and report["vae"]["untrained"] is True


def test_plan_with_every_camera_per_forward_splits_batches_by_clip(data: Path, run_cli: Any) -> None:
    """--views-per-forward all: SP moves whole clips, so group 1's last batch (one clip) is encoded whole by
    both of its ranks (2 padded views), and the report says what that means on CPU."""
    result = run_cli(["plan", data, *PLAN_ARGS, "--world-size", "4", "--sp-size", "2", "--batch-size", "2",
                      "--views-per-forward", "all", "--memory-budget", "4GiB", "--json", "-"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    groups = report["ranks"]["dp_groups"]
    assert [(g["clips"], g["batches"], g["views"], g["views_per_rank"], g["padded_views"]) for g in groups] == \
        [(4, 2, 8, 4, 0), (5, 3, 10, 6, 2)]
    assert report["ranks"]["padding"]["waste_fraction"] == pytest.approx(2 / 20)
    assert report["config"]["views_per_forward"] == 2 and report["vae"]["views_per_forward"] == 2
    assert report["measurement"]["units_per_forward"] == 2
    assert report["eta"]["views_busiest_rank"] == 6
    assert report["eta_s"] == pytest.approx(report["eta"]["startup_s"] + 6 * report["eta"]["seconds_per_view"])
    assert any("2 views per forward on CPU" in note and "OMP_NUM_THREADS" in note for note in report["notes"])
    one_clip_batches = run_cli(["plan", data, *PLAN_ARGS, "--world-size", "2", "--sp-size", "2", "--views-per-forward",
                                "all", "--no-measure", "--json", "-"])
    assert any(note.endswith("pass --views-per-forward 1 or --batch-size 2")
               for note in json.loads(one_clip_batches.stdout)["notes"])
    bad = run_cli(["plan", data, *PLAN_ARGS, "--views-per-forward", "3", "--no-measure"])
    assert bad.exit_code == 2 and "--views-per-forward 3 does not divide the 2 cameras of a clip" in bad.output


def test_plan_json_to_stdout_parses(data: Path, run_cli: Any) -> None:
    result = run_cli(["plan", data, *PLAN_ARGS, "--store", "mean", "--no-measure", "--json", "-"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["latent"]["stored"] == ["mean"] and report["measurement"] is None and report["eta_s"] is None


def test_padding_waste_when_views_do_not_fill_the_sp_group() -> None:
    clips = [Clip(f"s/{i}", "s", ("a", "b"), ("a.mp4", "b.mp4"), (0, 1, 2), 10.0) for i in range(9)]
    (share,) = dp_shares(JobPlan(tuple(clips), (), world_size=4, sp_size=4, batch_size=1))
    # 2 views over 4 ranks: each rank encodes one view, two of the four encodes are padding.
    assert (share.views, share.views_per_rank, share.padded_views) == (18, 9, 18)
    shares = dp_shares(JobPlan(tuple(clips), (), world_size=3, sp_size=1, batch_size=2))
    assert [s.clips for s in shares] == [3, 3, 3] and all(s.padded_views == 0 for s in shares)


def test_memory_fit_from_measured_peak_per_view() -> None:
    measured = Measurement("c", 2, 1.0, 0.5, "cuda:0", "cuda max_memory_allocated", baseline_bytes=2 * 2**30,
                           peak_bytes=5 * 2**30, peak_per_view_bytes=3 * 2**29, units_per_forward=2)
    assert fits_views_per_forward(measured, 8 * 2**30) == 4  # (8 - 2) GiB / 1.5 GiB
    assert fits_views_per_forward(measured, 2 * 2**30) == 0
    unknown = Measurement("c", 2, 1.0, 0.5, "cpu", "peak RSS", None, None, None, 1)
    assert fits_views_per_forward(unknown, 8 * 2**30) is None


def test_build_plan_without_measuring(data: Path) -> None:
    cfg = PlanConfig(SourceConfig(data), VaeConfig("builtin:tiny"),
                     ClipSettings(SamplingConfig(9, max_clips_per_scene=1), 32, 32), memory_budget=2**30, measure=False)
    report = build_plan(cfg)
    assert report.clips == 3 and report.latent_shape == [16, 3, 4, 4] and report.measurement is None
    assert any("--memory-budget needs a measurement" in note for note in report.notes)


@pytest.mark.parametrize(("args", "match"), [
    (("--num-frames", "6"), "--num-frames 6 is not valid for AutoencoderKLWan.*nearest valid: 5 and 9"),
    (("--world-size", "3", "--sp-size", "2"), "--sp-size 2 must divide the world size 3"),
    (("--memory-budget", "lots"), "--memory-budget must be a byte count"),
    (("--size", "30x32"), "height 30 is not a multiple of 8"),
])
def test_plan_usage_errors_exit_2_with_one_line(data: Path, run_cli: Any, args: tuple[str, ...], match: str) -> None:
    result = run_cli(["plan", data, *PLAN_ARGS, "--no-measure", *args])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and "error:" in result.output
    assert re.search(match, " ".join(result.output.split())), result.output


def test_plan_reads_encode_config_files(data: Path, tmp_path: Path, run_cli: Any) -> None:
    config = tmp_path / "c.toml"
    config.write_text('vae = "builtin:tiny"\nnum-frames = 9\nsize = "32x32"\nout = "ignored"\nworkers = 3\n')
    out = tmp_path / "plan.json"
    result = run_cli(["plan", data, "--config", config, "--num-frames", "5", "--no-measure", "--json", out])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["latent"]["shape_per_view"] == TINY_SHAPE  # the flag won


# --------------------------------------------------------------------------- configs/*.toml

# Each example's VAE as its released config.json describes it (only the keys that set the rule).
RELEASED = {
    "wan2.1.toml": ("AutoencoderKLWan", {}),
    "wan2.2-ti2v.toml": ("AutoencoderKLWan", {"patch_size": 2, "z_dim": 48}),
    "hunyuanvideo.toml": ("AutoencoderKLHunyuanVideo", {}),
    "cogvideox.toml": ("AutoencoderKLCogVideoX", {}),
    "ltx-video.toml": ("AutoencoderKLLTXVideo", {}),
    "image-vae-per-frame.toml": ("AutoencoderKL", {"block_out_channels": [128, 256, 512, 512]}),
    "layout-multicam-rig.toml": ("AutoencoderKLWan", {}),
    "layout-jsonl-index.toml": ("AutoencoderKLHunyuanVideo", {}),
    "layout-video-folder.toml": ("AutoencoderKLCogVideoX", {}),
    "buckets-wan-480p.toml": ("AutoencoderKLWan", {}),
}


def test_every_example_config_is_listed() -> None:
    assert sorted(p.name for p in (REPO / "configs").glob("*.toml")) == sorted(RELEASED)


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_example_config_parses_and_fits_its_vae(name: str) -> None:
    settings = load_toml(REPO / "configs" / name)
    family, config = RELEASED[name]
    assert settings["vae"].startswith("diffusers:")
    clip = pop_clip_options(dict(settings))
    VAE_CLASSES[family].rule(config).check_buckets(clip.sampling.lengths, clip.sizes)


def test_plan_with_a_missing_dataset_fails_before_the_vae_loads(run_cli, loud_vae, tmp_path: Path) -> None:
    result = run_cli(["plan", tmp_path / "no-such-data", "--vae", loud_vae, "--num-frames", "9", "--size", "64x64"])
    assert result.exit_code == 2, result.output
    assert "no-such-data: dataset path does not exist" in result.output
    assert not (tmp_path / "vae-was-loaded").exists()


def test_plan_shows_a_jsonl_scenes_frame_range_as_its_source_frames(data: Path, tmp_path: Path, run_cli: Any) -> None:
    index = tmp_path / "index.jsonl"
    index.write_text(json.dumps({"id": "ranged", "path": str(data / "scene_000/cam_0.mp4"), "frames": [2, 12]}) + "\n"
                     + json.dumps({"id": "whole", "path": str(data / "scene_001/cam_0.mp4")}) + "\n")
    out = tmp_path / "plan.json"
    result = run_cli(["plan", index, *PLAN_ARGS, "--json", out])
    assert result.exit_code == 0, result.output
    rows = {row["scene"]: row for row in json.loads(out.read_text())["dataset"]["per_scene"]}
    assert (rows["ranged"]["source_frames"], rows["ranged"]["clips"]) == (10, 2)
    assert (rows["whole"]["source_frames"], rows["whole"]["clips"]) == (17, 3)


def test_the_eta_overlaps_decoding_with_workers_and_adds_it_without() -> None:
    measured = Measurement("c", 2, 1.0, 0.5, "cpu", "peak RSS", None, None, None, 1, decode_seconds=3.0)
    alone = pipeline_eta(10.0, 100, measured, workers=0)
    assert alone.seconds_per_view == pytest.approx(0.5 + 1.5) and alone.total_s == pytest.approx(10 + 200)
    assert pipeline_eta(10.0, 100, measured, workers=2).seconds_per_view == pytest.approx(0.75)  # decode-bound
    assert pipeline_eta(10.0, 100, measured, workers=4).seconds_per_view == pytest.approx(0.5)  # encode-bound
