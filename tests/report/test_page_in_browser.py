"""The report as a person sees it: the page of a demo cache, rendered by Debian's headless Chromium (tests/browser.py),
with every kind of set it shows (a text set, a first-frame condition, an audio set), a skipped input, and a caption
that is an attack. Every section is there, every image and sound loads, nothing fails in the console, nothing is
asked of the network, and the caption shows as its text: no script runs.

Chromium is installed with apt when missing and the tests run as root (as the SLURM tests install SLURM); elsewhere
the test is skipped with the reason, and under CI=true (or VAECACHE_REQUIRE_CHROMIUM=1) it fails instead.
VAECACHE_REPORT_SCREENSHOT=PATH also writes the README's screenshot (the glance and a clip, small) to PATH.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.audio.sound import write_video_with_sound
from tests.browser import Browser, chromium_binary, required

HOSTILE = '</span><script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
SECTIONS = ("contents", "failures", "scale", "clips", "text")


@pytest.fixture(scope="module")
def chromium() -> Path:
    binary, why = chromium_binary()
    if binary is None:
        if required():
            pytest.fail(f"headless Chromium is required here (CI=true or VAECACHE_REQUIRE_CHROMIUM=1) but: {why}",
                        pytrace=False)
        pytest.skip(why)
    return binary


@pytest.fixture(scope="module")
def demo_report(demo_data: Path, tmp_path_factory: pytest.TempPathFactory, run_cli: Callable) -> Path:
    """The demo data and a scene with sound, read from an index whose captions include HOSTILE, plus a scene whose
    video is not a video; encoded by builtin:small; a text set, a first-frame condition and an audio set added;
    reported with every clip shown."""
    import torch
    from diffusers import AutoencoderKLLTX2Audio

    from tests.text.tiny_text import build_wan_text_folder

    root = tmp_path_factory.mktemp("browser")
    (root / "sound").mkdir()
    for camera in ("cam_0", "cam_1"):
        write_video_with_sound(root / "sound" / f"{camera}.mp4", seconds=1.0, fps=10, seed=len(camera))
    (root / "broken").mkdir()
    (root / "broken" / "cam_0.mp4").write_bytes(b"not a video at all" * 64)
    (root / "broken" / "cam_1.mp4").write_bytes(b"not a video either" * 64)
    captions = {"scene_000": HOSTILE, "scene_001": "a red car turns left", "scene_002": "a red car turns left",
                "sound": "", "broken": "never encoded"}
    scenes = {**{scene.name: scene for scene in sorted(demo_data.iterdir())}, "sound": root / "sound",
              "broken": root / "broken"}
    lines = [{"id": name, "cameras": {video.stem: str(video) for video in sorted(folder.glob("*.mp4"))},
              "caption": captions[name]} for name, folder in sorted(scenes.items())]
    (root / "index.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = root / "cache"
    encoded = run_cli(["encode", root / "index.jsonl", "--out", out, "--vae", "builtin:small", "--num-frames", "9",
                       "--size", "64x64", "--workers", "0", "--no-progress"])
    assert encoded.exit_code == 3, encoded.output  # done, one scene skipped
    text = build_wan_text_folder(root / "text")
    assert run_cli(["embed", out, "--text-encoder", f"diffusers:{text}"]).exit_code == 0
    assert run_cli(["embed", out, "--condition", "first-frame"]).exit_code == 0
    torch.manual_seed(0)
    audio = AutoencoderKLLTX2Audio(base_channels=16, ch_mult=(1, 2, 4), num_res_blocks=1, latent_channels=8,
                                   mel_bins=64, output_channels=2)
    audio.save_pretrained(root / "audio_vae")
    added = run_cli(["embed", out, "--audio-vae", f"diffusers:{root / 'audio_vae'}"])
    assert added.exit_code == 0, added.output
    reported = run_cli(["report", out, "--out", root / "report", "--clips", "12", "--device", "cpu"])
    assert reported.exit_code == 0, reported.output
    return root / "report"


def test_the_report_renders_in_chromium_with_every_image_and_sound_and_the_caption_as_text(
        chromium: Path, demo_report: Path, tmp_path: Path) -> None:
    summary = json.loads((demo_report / "report.json").read_text())
    assert summary["sample"] == {"clips": 4, "decoded": 4, "mean_psnr_db": summary["sample"]["mean_psnr_db"]}
    with Browser(chromium) as browser:
        page = browser.open((demo_report / "index.html").as_uri())
        page.evaluate("Promise.all(Array.from(document.querySelectorAll('audio')).map(a => a.readyState >= 1 ? 1 : "
                      "new Promise(done => { a.onloadedmetadata = done; a.onerror = done; })))", await_promise=True)
        shot = page.screenshot(tmp_path / "report.png")
        images = page.evaluate("Array.from(document.images).map(i => [i.getAttribute('src'), i.complete, "
                               "i.naturalWidth])")
        sounds = page.evaluate("Array.from(document.querySelectorAll('audio')).map(a => [a.getAttribute('src'), "
                               "a.readyState, a.error && a.error.code, a.duration])")
        sections = page.evaluate("Array.from(document.querySelectorAll('main > section')).map(s => [s.id, "
                                 "s.querySelector('h2').textContent, s.getBoundingClientRect().height])")
        captions = page.evaluate("Array.from(document.querySelectorAll('[data-role=caption]')).map(e => e.textContent)")
        ran = page.evaluate("[typeof window.__pwned, document.scripts.length]")
        problems, requests = page.problems(), page.requests()
        if os.environ.get("VAECACHE_REPORT_SCREENSHOT"):
            _readme_screenshot(page, Path(os.environ["VAECACHE_REPORT_SCREENSHOT"]), tmp_path)
    assert shot.stat().st_size > 50_000  # a page, not a blank
    assert problems == []
    # no network: the page's own files, and the data: icons of Chromium's own <audio> controls
    assert requests and [url for url in requests if not url.startswith(("file://", "data:"))] == []
    assert [name for name, _, _ in sections] == list(SECTIONS)
    assert all(height > 40 for _, _, height in sections)
    # every picture: 2 cameras x 4 clips, a condition per clip, a spectrogram per clip with sound, and the charts
    strips = [src for src, _, _ in images if "-camera-" in src]
    assert len(strips) == 8 and len([src for src, _, _ in images if "-condition-" in src]) == 4
    assert [src for src, _, _ in images if "-sound-" in src] == ["images/clip-004-sound-0.png"]
    assert {"images/buckets.png", "images/scale.png", "images/failures.png"} <= {src for src, _, _ in images}
    assert all(complete and width > 0 for _, complete, width in images), images
    assert len(sounds) == 1 and sounds[0][0] == "sounds/clip-004-sound-0.wav" and sounds[0][1] >= 1
    assert sounds[0][2] is None and sounds[0][3] == pytest.approx(0.9, abs=0.05)  # the 9 frames at 10 fps
    assert HOSTILE in captions and ran == ["undefined", 0]  # shown as text; no script ran, none is on the page
    assert summary["failures"]["count"] == 1 and summary["failures"]["groups"][0]["shown"][0]["scene"] == "broken"


def _readme_screenshot(page: Any, target: Path, tmp_path: Path) -> None:
    """The README's picture: the glance and the second clip's card, at 3/4 scale, in 128 colours (under 200 KB)."""
    from PIL import Image

    top, height, right = page.evaluate("(() => { const card = document.getElementById('clip-2')"
                                       ".getBoundingClientRect(); return [card.top + window.scrollY, card.height, "
                                       "card.right]; })()")
    width = round(right + 20)
    header = page.evaluate("document.querySelector('header').getBoundingClientRect().height")
    glance = page.screenshot(tmp_path / "top.png", clip={"x": 0, "y": 0, "width": width, "height": header})
    card = page.screenshot(tmp_path / "card.png", clip={"x": 0, "y": top - 8, "width": width, "height": height + 16})
    parts = [Image.open(glance).convert("RGB"), Image.open(card).convert("RGB")]
    joined = Image.new("RGB", (width, sum(p.height for p in parts)), "white")
    joined.paste(parts[0], (0, 0))
    joined.paste(parts[1], (0, parts[0].height))
    small = joined.resize((round(width * 0.75), round(joined.height * 0.75)), Image.Resampling.LANCZOS)
    small.quantize(colors=128, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(target, optimize=True)
    shutil.copy(target, tmp_path / "readme.png")
    assert target.stat().st_size < 200_000
