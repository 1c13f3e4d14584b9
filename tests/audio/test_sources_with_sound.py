"""A clip's sound from where its video is: a WebDataset tar member read in place, and an object in an S3 bucket
(moto's server) read by ranges: the same samples FFmpeg decodes from the file itself."""

from __future__ import annotations

import io
import tarfile
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

import torch

from tests.audio.sound import ffmpeg_samples, write_video_with_sound
from vaecache.training import LatentCache

FPS = 25
ARGS = ["--vae", "builtin:tiny", "--num-frames", "9", "--size", "32x32", "--window-stride", "13", "--workers", "0",
        "--no-progress"]


def _expected(video: Path, record: dict[str, Any]) -> torch.Tensor:
    reference, rate, start = ffmpeg_samples(video)
    first = round((Fraction(record["frames"][0], FPS) - Fraction(start).limit_denominator(rate)) * rate)
    count = int(len(record["frames"]) / FPS * rate)
    return torch.from_numpy(reference[:, first:first + count])


def test_the_sound_of_a_video_in_a_tar_is_cut_in_place(tmp_path: Path, run_cli: Callable) -> None:
    video = write_video_with_sound(tmp_path / "clip.mp4", rate=44100, seconds=2.0, fps=FPS)
    (tmp_path / "shards").mkdir()
    with tarfile.open(tmp_path / "shards" / "a.tar", "w") as tar:
        for name in ("s000.mp4", "s001.mp4"):
            data = video.read_bytes()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    result = run_cli(["encode", tmp_path / "shards", "--out", tmp_path / "out", *ARGS])
    assert result.exit_code == 0, result.output
    cache = LatentCache(tmp_path / "out")
    records = list(cache.records())
    assert len(records) == 8 and all("#" in record["sources"][0] for record in records)  # members, read in place
    for record in records:
        assert torch.equal(cache.source_audio(record).samples, _expected(video, record)), record["id"]


def test_the_sound_of_an_object_in_s3_is_cut_by_ranged_reads(s3: Any, tmp_path: Path, run_cli: Callable) -> None:
    from tests.s3 import make_bucket, upload

    (tmp_path / "data" / "scene_000").mkdir(parents=True)
    video = write_video_with_sound(tmp_path / "data" / "scene_000" / "cam_0.mp4", rate=48000, layout="mono",
                                   seconds=2.0, fps=FPS)
    make_bucket(s3, "sound")
    data = upload(s3, tmp_path / "data", "sound", "videos")
    result = run_cli(["encode", data, "--out", tmp_path / "out", *ARGS])
    assert result.exit_code == 0, result.output
    cache = LatentCache(tmp_path / "out")
    records = list(cache.records())
    assert records and all(record["sources"][0].startswith("s3://sound/videos/") for record in records)
    for record in records:
        assert torch.equal(cache.source_audio(record).samples, _expected(video, record)), record["id"]
