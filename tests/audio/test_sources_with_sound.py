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


def test_the_sound_of_a_lerobot_episode_is_cut_from_its_file_at_the_episodes_frame_times(tmp_path: Path,
                                                                                         run_cli: Callable,
                                                                                         audio_vae: Path) -> None:
    """A LeRobot v3.0 camera file holds episodes one after another: each clip's sound starts at the time of the file
    frame its first frame is (the episode's from_timestamp plus its own time, the frame LeRobotDataset picks), on the
    file's track, cut by sample index from what FFmpeg decodes of the whole file."""
    import subprocess

    import av
    import imageio_ffmpeg

    from tests.sources.lerobot_fixture import CAMERAS, write_lerobot

    root = write_lerobot(tmp_path / "robot", [["pick"] * 24, ["place"] * 27], fps=10)
    top = root / "videos" / CAMERAS[0] / "chunk-000" / "file-000.mp4"
    with av.open(str(top)) as container:
        seconds = float(container.duration) / 1e6 + 0.5
    silent = top.with_name("silent.mp4")
    top.rename(silent)
    subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", str(silent), "-f", "lavfi", "-i",
                    f"anoisesrc=sample_rate=48000:amplitude=0.3:duration={seconds}", "-map", "0:v", "-map", "1:a",
                    "-c:v", "copy", "-c:a", "aac", str(top)], check=True)
    silent.unlink()
    result = run_cli(["encode", root, "--out", tmp_path / "out", "--vae", "builtin:tiny", "--num-frames", "9",
                      "--size", "32x32", "--window-stride", "7", "--workers", "0", "--no-progress"])
    assert result.exit_code == 0, result.output
    cache = LatentCache(tmp_path / "out")
    reference, rate, start = ffmpeg_samples(top)
    with av.open(str(top)) as container:
        stream = container.streams.video[0]
        times = sorted(Fraction(packet.pts) * stream.time_base for packet in container.demux(stream)
                       if packet.pts is not None)
    import pyarrow.parquet as pq

    table = pq.read_table(root / "meta" / "episodes" / "chunk-000" / "file-000.parquet").to_pylist()
    episodes = {row["episode_index"]: row[f"videos/{CAMERAS[0]}/from_timestamp"] for row in table}
    seen = []
    for record in cache.records():
        episode = int(record["scene"].rsplit("_", 1)[-1])
        wanted = Fraction(episodes[episode]).limit_denominator(10**6) + Fraction(record["frames"][0], 10)
        first_time = min(times, key=lambda t: abs(t - wanted))  # the frame LeRobotDataset picks
        first = round((first_time - Fraction(start).limit_denominator(rate)) * rate)
        count = int(len(record["frames"]) / 10 * rate)
        assert torch.equal(cache.source_audio(record).samples,
                           torch.from_numpy(reference[:, first:first + count])), record["id"]
        seen.append(episode)
    assert sorted(set(seen)) == [0, 1] and len(seen) >= 4 and episodes[1] > 0  # the second starts inside the file
    # and the audio set of those episodes: each clip's sound encoded, the camera its row names the file's
    from diffusers import AutoencoderKLLTX2Audio

    from vaecache.audio.latents import audio_posterior_mean
    from vaecache.audio.mel import MelSpec, clip_mel

    embedded = run_cli(["embed", tmp_path / "out", "--audio-vae", f"diffusers:{audio_vae}"])
    assert embedded.exit_code == 0, embedded.output
    vae = AutoencoderKLLTX2Audio.from_pretrained(audio_vae).eval()
    spec = MelSpec.ltx2(dict(vae.config))
    cache = LatentCache(tmp_path / "out")
    for record in cache.records():
        sound = cache.source_audio(record)
        expected = audio_posterior_mean(vae, clip_mel(sound.samples, sound.rate, spec))[0]
        assert torch.equal(cache[record["id"]].tensors["audio/default"], expected), record["id"]
    rows = pq.read_table(tmp_path / "out" / cache.manifest["audio"]["default"]["tables"]["clips"]["file"]).to_pylist()
    assert {row["camera"] for row in rows} == {CAMERAS[0]} and not any(row["audio"] for row in rows)
