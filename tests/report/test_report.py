"""`vaecache report` on real caches (the demo data encoded by builtin:tiny, and by a trained VAE whose constants fit):
what the page and report.json say of the contents, the scale (right, edited and rehashed, older caches without
per-channel statistics), the sampled clips decoded beside their sources, and when a clip is not decoded, why."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.report.conftest import fitted_moments, rehash_fingerprint, rewrite_clips
from vaecache.report.build import ReportSettings, write_report


def _summary(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "report.json").read_text())


def test_the_report_of_a_cache_shows_its_contents_clips_and_scale(good_cache: Path, run_cli: Callable,
                                                                    tmp_path: Path, cache_io: Any) -> None:
    result = run_cli(["report", good_cache, "--out", tmp_path / "report", "--clips", "2", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    page = tmp_path / "report" / "index.html"
    assert str(page) in result.stdout.splitlines()  # stdout: the page's path
    assert "wrote" in result.output and "16 of 16 latent channels off scale" in result.output  # untrained weights
    summary = _summary(tmp_path / "report")
    assert summary["contents"]["counts"] == {"clips": 3, "scenes": 3, "views": 6, "frames": 54, "failures": 0}
    assert summary["contents"]["cameras"] == {"cam_0": 3, "cam_1": 3}
    assert summary["contents"]["lengths"] == [{"frames": 9, "fps": 10.0, "seconds": 0.9, "clips": 3}]
    records = {r["id"]: r for r in cache_io.clips(good_cache)}
    clips = summary["clips"]
    assert len(clips) == 2 and {c["id"] for c in clips} <= set(records)
    for clip in clips:
        assert [c["camera"] for c in clip["cameras"]] == ["cam_0", "cam_1"] and clip["shown_frames"] == \
            [0, 1, 2, 3, 5, 6, 7, 8]
        for camera in clip["cameras"]:
            assert camera["reconstructed"] and 0 < camera["psnr_db"] < 100 and -1 <= camera["ssim"] <= 1
            assert (tmp_path / "report" / camera["strip"]).is_file()
    scale = summary["scale"]
    assert scale["exact"] and scale["source"].startswith("every clip's recorded per-channel statistics (3 clips")
    html = page.read_text()
    for section in ("contents", "failures", "scale", "clips", "text"):
        assert f'<section id="{section}">' in html
    assert "http://" not in html.replace("http://www.w3.org", "") and "<script" not in html


def test_the_same_seed_shows_the_same_clips_and_another_seed_others(good_cache: Path, tmp_path: Path) -> None:
    def shown(seed: int, folder: str) -> list[str]:
        written = write_report(good_cache, tmp_path / folder, ReportSettings(clips=1, seed=seed, device="cpu"))
        return [clip["id"] for clip in written.summary["clips"]]

    first = shown(0, "a")
    assert shown(0, "b") == first
    assert any(shown(seed, f"s{seed}") != first for seed in range(1, 6))


def test_a_normalization_that_fits_flags_nothing_and_edited_constants_flag_their_channels(
        fitted_cache: Path, run_cli: Callable, tmp_path: Path) -> None:
    right = write_report(fitted_cache, tmp_path / "right", ReportSettings(clips=1, device="cpu")).summary
    assert right["scale"]["flagged"] == [] and right["scale"]["exact"]
    channels = right["scale"]["channels"]
    assert all(abs(c["mean"]) < 1e-4 and abs(c["std"] - 1) < 1e-4 for c in channels)  # fitted on these very clips
    assert right["sample"]["decoded"] == 1 and right["sample"]["mean_psnr_db"] > 15

    held_out = Path(shutil.copytree(fitted_cache, tmp_path / "edited"))
    mean, std = fitted_moments(fitted_cache)

    def edit(vae: dict[str, Any]) -> None:
        normalization = vae["normalization"]
        normalization["latents_std"][3] = round(std[3] * 4, 6)  # channel 3 squeezed to a quarter of its scale
        normalization["latents_mean"][7] = round(mean[7] - 2 * std[7], 6)  # channel 7 moved by two stds
        normalization["latents_std"][11] = round(std[11] / 1.8, 6)  # channel 11 blown up 1.8 times

    rehash_fingerprint(held_out, edit)
    assert run_cli(["verify", held_out]).exit_code == 0  # every hash verify checks agrees
    result = run_cli(["report", held_out, "--out", tmp_path / "edited-report", "--clips", "1", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    summary = _summary(tmp_path / "edited-report")
    scale = summary["scale"]
    assert scale["flagged"] == [3, 7, 11]
    problems = {c["channel"]: c["problems"] for c in scale["channels"] if c["problems"]}
    assert problems == {3: ["std 0.25, below 0.50"], 7: ["mean +2.00, outside -0.50 to +0.50"],
                        11: ["std 1.80, above 1.50"]}
    assert scale["summary"][0].startswith("3 of 16 channels outside the band: 3, 7, 11.")
    html = (tmp_path / "edited-report" / "index.html").read_text()
    assert "3 of 16 channels outside the band: 3, 7, 11." in html and "std 0.25, below 0.50" in html
    # the VAE loaded from the recorded spec is not the one the edited manifest describes: sources, and why
    assert summary["sample"]["decoded"] == 0 and "does not match the VAE recorded" in summary["decoder"]["reason"]
    assert all(not camera["reconstructed"] and camera["strip"] for clip in summary["clips"]
               for camera in clip["cameras"])


def test_a_cache_written_before_channel_statistics_is_scaled_from_a_sample_and_says_so(
        fitted_cache: Path, tmp_path: Path) -> None:
    exact = write_report(fitted_cache, tmp_path / "exact", ReportSettings(clips=0)).summary["scale"]
    old = Path(shutil.copytree(fitted_cache, tmp_path / "old"))

    def forget(record: dict[str, Any]) -> None:
        for entry in record["tensors"].values():
            entry.pop("channel_stats", None)

    rewrite_clips(old, forget, drop_channel_column=True)
    scale = write_report(old, tmp_path / "sampled", ReportSettings(clips=0)).summary["scale"]
    assert not scale["exact"] and scale["source"].startswith("a sample of 3 of the 3 clips' stored tensors: 0 clip")
    for mine, theirs in zip(scale["channels"], exact["channels"]):
        assert mine["mean"] == pytest.approx(theirs["mean"], abs=1e-9)
        assert mine["std"] == pytest.approx(theirs["std"], rel=1e-9)
    assert "an estimate from that sample" in (tmp_path / "sampled" / "index.html").read_text()


def test_a_clip_not_decoded_shows_its_source_and_says_why(good_cache: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    budget = write_report(good_cache, tmp_path / "budget", ReportSettings(clips=1, decode_budget_s=0)).summary
    assert budget["decoder"]["reason"] == "not decoded: --decode-budget 0"
    small = write_report(good_cache, tmp_path / "small", ReportSettings(clips=3, decode_budget_s=1e-9,
                                                                         device="cpu")).summary
    for clip in small["clips"]:  # the decoder loads, but no clip's estimate fits the budget
        assert any(note.startswith("not decoded: its 0.07 million pixels would take about") for note in clip["notes"])
        assert all(not c["reconstructed"] and c["strip"] and c["psnr_db"] is None for c in clip["cameras"])
    from dataclasses import replace

    from vaecache.models import VAE_CLASSES

    monkeypatch.setitem(VAE_CLASSES, "AutoencoderKLWan", replace(
        VAE_CLASSES["AutoencoderKLWan"], not_decoded_here="a diffusion decoder: 50 denoising steps a frame"))
    refused = write_report(good_cache, tmp_path / "refused", ReportSettings(clips=1)).summary
    assert refused["decoder"]["reason"] == ("AutoencoderKLWan's decoder is not run by the report: a diffusion "
                                            "decoder: 50 denoising steps a frame")
    html = (tmp_path / "refused" / "index.html").read_text()
    assert "a diffusion decoder: 50 denoising steps a frame" in html and "source frames" in html


def test_a_clip_whose_source_changed_shows_its_reconstruction_alone(good_cache: Path, tmp_path: Path) -> None:
    cache = Path(shutil.copytree(good_cache, tmp_path / "cache"))

    def touched(record: dict[str, Any]) -> None:
        if record["id"].startswith("scene_001/"):
            record["source_identity"][1]["mtime_ns"] += 1

    rewrite_clips(cache, touched)
    clips = write_report(cache, tmp_path / "report", ReportSettings(clips=3, device="cpu")).summary["clips"]
    changed = next(clip for clip in clips if clip["id"].startswith("scene_001/"))
    assert changed["notes"][0].startswith("cam_1's source ") and " modified (mtime " in changed["notes"][0]
    assert "since the clip was encoded: no source frames are shown" in changed["notes"][0]
    assert all(camera["reconstructed"] and camera["psnr_db"] is None for camera in changed["cameras"])
    from PIL import Image

    for camera in changed["cameras"]:  # one row: the 8 frames shown, reconstructed
        assert Image.open(tmp_path / "report" / camera["strip"]).size == (8 * 64 + 7 * 2, 64)
    assert all(camera["reconstructed"] for clip in clips if clip is not changed for camera in clip["cameras"])


def test_a_report_replaces_a_report_and_nothing_else(good_cache: Path, run_cli: Callable, tmp_path: Path) -> None:
    folder = tmp_path / "report"
    assert run_cli(["report", good_cache, "-o", folder, "--clips", "0"]).exit_code == 0
    (folder / "stale.txt").write_text("left by the report before")
    assert run_cli(["report", good_cache, "-o", folder, "--clips", "0"]).exit_code == 0
    assert not (folder / "stale.txt").exists() and (folder / "index.html").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".report")]  # no staging or old copy left
    other = tmp_path / "notes"
    other.mkdir()
    (other / "mine.txt").write_text("keep me")
    refused = run_cli(["report", good_cache, "-o", other])
    assert refused.exit_code == 2 and "holds something other than a vaecache report" in refused.output
    assert (other / "mine.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    assert run_cli(["report", good_cache, "-o", tmp_path / "file"]).exit_code == 2
    assert "does not exist" in run_cli(["report", good_cache, "-o", tmp_path / "no" / "such"]).output
    missing = run_cli(["report", tmp_path / "nothing-here"])
    assert missing.exit_code == 2 and "no such folder" in missing.output
    for flags in (["--device", "tpu"], ["--clips", "-1"], ["--decode-budget", "-5"]):
        refused = run_cli(["report", good_cache, "-o", tmp_path / "flags", *flags])
        assert refused.exit_code == 2 and refused.output.startswith("error: "), refused.output
        assert not (tmp_path / "flags").exists()


def test_without_the_report_extra_one_line_names_it(good_cache: Path, run_cli: Callable, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: importing it raises ImportError
    result = run_cli(["report", good_cache, "-o", tmp_path / "r"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == ["error: vaecache report draws its charts with matplotlib, which is "
                                                  "not installed: pip install 'vaecache[report]'"]
    assert not (tmp_path / "r").exists()


def test_captions_and_file_names_are_escaped_in_the_page(good_cache: Path, tmp_path: Path) -> None:
    cache = Path(shutil.copytree(good_cache, tmp_path / "cache"))
    hostile = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'

    def caption(record: dict[str, Any]) -> None:
        record["metadata"] = {"caption": hostile}

    rewrite_clips(cache, caption)
    written = write_report(cache, tmp_path / "report", ReportSettings(clips=1, device="cpu"))
    html = written.page.read_text()
    assert hostile not in html and "<script" not in html and "onerror=" not in html.replace("onerror=&#34;", "")
    assert "&lt;script&gt;window.__pwned = 1&lt;/script&gt;&lt;img src=x onerror=&#34;window.__pwned = 2&#34;&gt;" \
        in html
    assert written.summary["text"][0]["repeated"] == [{"text": hostile, "clips": 3, "tokens": None}]


def test_a_cache_in_object_storage_reports_as_its_local_copy(s3: Any, good_cache: Path, tmp_path: Path) -> None:
    from tests.s3 import upload

    url = upload(s3, good_cache, "reported")
    remote = write_report(url, tmp_path / "remote", ReportSettings(clips=2, device="cpu")).summary
    local = write_report(good_cache, tmp_path / "local", ReportSettings(clips=2, device="cpu")).summary
    assert remote["cache"] == url and remote["sample"]["decoded"] == 2
    assert remote["contents"] == local["contents"] and remote["failures"] == local["failures"]
    assert remote["scale"] == local["scale"] and remote["text"] == local["text"]
    assert [c["cameras"] for c in remote["clips"]] == [c["cameras"] for c in local["clips"]]  # same PSNR, SSIM


def test_a_version_1_cache_reports_what_its_version_2_copy_does(good_cache: Path, tmp_path: Path) -> None:
    from tests.cache.test_table import downgrade_to_v1

    old = Path(shutil.copytree(good_cache, tmp_path / "v1"))
    downgrade_to_v1(old)
    v1 = write_report(old, tmp_path / "r1", ReportSettings(clips=1, device="cpu")).summary
    v2 = write_report(good_cache, tmp_path / "r2", ReportSettings(clips=1, device="cpu")).summary
    assert v1["contents"]["counts"] == v2["contents"]["counts"] and v1["scale"] == v2["scale"]
    assert [c["id"] for c in v1["clips"]] == [c["id"] for c in v2["clips"]] and v1["sample"]["decoded"] == 1
