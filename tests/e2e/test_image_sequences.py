"""Image-sequence cameras and timestamp sync end to end: the latents of a PNG-folder rig equal those of lossless
videos of the same frames bit for bit; two cameras of one footage, one starting later, encoded with --sync
timestamps give equal views; and --sync frames keeps refusing cameras of different lengths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tests.conftest import assert_same_tensors, encode_ok, invoke, load_tensors, read_clips
from tests.video.test_frames import write_frames, write_lossless
from tests.videos import frame_pixels

RIG = ("--num-frames", "5", "--size", "32x48")


def _rig(root: Path, scenes: int = 2, frames: int = 10) -> tuple[Path, Path]:
    """The same frames twice: DATA/<scene>/<camera>/NNNN.png and DATA/<scene>/<camera>.mkv (lossless RGB)."""
    images, videos = root / "images", root / "videos"
    for scene in range(scenes):
        for camera in range(2):
            files = write_frames(images / f"s{scene}" / f"cam_{camera}", frames, first=10 * scene + 3 * camera)
            arrays = [np.asarray(Image.open(f).convert("RGB")) for f in files]
            (videos / f"s{scene}").mkdir(parents=True, exist_ok=True)
            write_lossless(videos / f"s{scene}" / f"cam_{camera}.mkv", arrays)
    return images, videos


def test_png_cameras_give_the_latents_of_lossless_videos_of_the_same_frames(tmp_path):
    images, videos = _rig(tmp_path)
    encode_ok(images, tmp_path / "from-images", *RIG, "--fps", "10")
    encode_ok(videos, tmp_path / "from-videos", *RIG)
    assert_same_tensors(load_tensors(tmp_path / "from-images"), load_tensors(tmp_path / "from-videos"))
    (record, *_) = read_clips(tmp_path / "from-images")
    assert record["fps"] == 10.0 and record["times"] == [0.0, 0.1, 0.2, 0.3, 0.4]
    assert [Path(f).name for f in record["frame_files"]["cam_0"]] == [f"{i:04d}.png" for i in range(5)]
    assert record["source_identity"][0]["size"] == sum(Path(f).stat().st_size for f in record["frame_files"]["cam_0"])
    assert invoke(["verify", tmp_path / "from-images", "--dataset", images]).exit_code == 0


def test_without_a_rate_frames_sync_still_works_and_the_record_says_so(tmp_path):
    images, _ = _rig(tmp_path, scenes=1)
    encode_ok(images, tmp_path / "out", *RIG)
    (record, *_) = read_clips(tmp_path / "out")
    assert record["fps"] is None and "times" not in record
    result = invoke(["encode", images, "--out", tmp_path / "synced", "--vae", "builtin:tiny", *RIG, "--workers", "0",
                     "--no-progress", "--sync", "timestamps"])
    assert result.exit_code == 1, result.output  # nothing to pair by: no clip at all
    assert "camera 'cam_0' has no frame times" in result.output


def _offset_rig(root: Path, late_ms: int = 240, frames: int = 30, fps: int = 25) -> Path:
    """One footage seen by two cameras: cam_b starts `late_ms` later (its timestamps say so), so its frame i shows
    cam_a's frame i + late_ms / frame period."""
    skip = late_ms * fps // 1000
    arrays = [frame_pixels(i, 32, 48) for i in range(frames)]
    (root / "s0").mkdir(parents=True)
    write_lossless(root / "s0" / "cam_a.mkv", arrays, fps=fps)
    write_lossless(root / "s0" / "cam_b.mkv", arrays[skip:], fps=fps, start_ms=late_ms)
    return root


def test_cameras_starting_at_different_times_are_paired_by_timestamp(tmp_path):
    data = _offset_rig(tmp_path / "data")
    refused = invoke(["encode", data, "--out", tmp_path / "by-index", "--vae", "builtin:tiny", *RIG, "--workers", "0",
                      "--no-progress"])
    assert refused.exit_code == 1, refused.output  # --sync frames: refused as before, the only scene skipped
    assert "camera 'cam_b' has 24 frames, others have up to 30" in refused.output

    encode_ok(data, tmp_path / "out", *RIG, "--sync", "timestamps")
    records = read_clips(tmp_path / "out")
    assert [r["frames"] for r in records] == [[6, 7, 8, 9, 10], [11, 12, 13, 14, 15], [16, 17, 18, 19, 20],
                                              [21, 22, 23, 24, 25]]  # cam_a from where cam_b begins
    for record in records:
        assert record["camera_frames"]["cam_b"] == [f - 6 for f in record["frames"]]
        assert record["camera_times"]["cam_a"] == record["camera_times"]["cam_b"]
    tensors = load_tensors(tmp_path / "out")
    for name, latent in tensors.items():
        assert torch.equal(latent[0], latent[1]), f"{name}: the two cameras see the same moment"
    assert invoke(["verify", tmp_path / "out", "--dataset", data]).exit_code == 0
