"""The encode loop's start-up order: what can be checked without the VAE fails before the VAE is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest


def _args(vae: str) -> list[str]:
    return ["--vae", vae, "--num-frames", "9", "--size", "64x64", "--workers", "0", "--no-progress"]


def test_a_missing_dataset_fails_before_the_vae_loads(run_cli, loud_vae, tmp_path: Path) -> None:
    result = run_cli(["encode", tmp_path / "no-such-data", "--out", tmp_path / "out", *_args(loud_vae)])
    assert result.exit_code == 2, result.output
    assert "no-such-data: dataset path does not exist" in result.output
    assert not (tmp_path / "vae-was-loaded").exists() and not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_fails_before_the_vae_loads(run_cli, loud_vae, demo_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.write_text("not a folder")
    result = run_cli(["encode", demo_data, "--out", out, *_args(loud_vae)])
    assert result.exit_code == 2, result.output
    assert "--out exists and is not a folder" in result.output
    assert not (tmp_path / "vae-was-loaded").exists()


def test_the_vae_loads_once_data_and_out_are_fine(run_cli, loud_vae, demo_data: Path, tmp_path: Path) -> None:
    # The same fixture, with nothing wrong before the VAE: it is loaded (so the tests above can fail).
    result = run_cli(["encode", demo_data, "--out", tmp_path / "out", *_args(loud_vae)])
    assert result.exit_code != 0
    assert (tmp_path / "vae-was-loaded").exists()


def test_decode_workers_share_the_cores_the_encode_leaves() -> None:
    from vaecache.encode.numerics import decode_thread_budget

    assert decode_thread_budget(cores=2, workers=1, main_threads=1) == 1  # the 2-core CPU case: one each
    assert decode_thread_budget(cores=16, workers=4, main_threads=1) == 3  # a CUDA rank: main thread + 4 workers
    assert decode_thread_budget(cores=8, workers=2, main_threads=8) == 1  # OMP_NUM_THREADS took every core
    assert decode_thread_budget(cores=6, workers=0, main_threads=6) == 6  # decoding between forwards
    assert decode_thread_budget(cores=0, workers=0, main_threads=1) == 1


# --- what the third adversarial round found (each a recorded failure, never a crash or silent wrong latents) ----

SMALL = ("--vae", "builtin:tiny", "--num-frames", "5", "--size", "32x32", "--workers", "0", "--no-progress")


def _index(run_cli, data: Path, index: Path) -> list[dict]:
    import json

    result = run_cli(["index", data, "-o", index])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in index.read_text().splitlines()]


def _write_index(index: Path, lines: list[dict]) -> None:
    import json

    index.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_frames_over_the_pixel_budget_are_a_recorded_failure_decided_from_the_probe(run_cli, cache_io,
                                                                                    tmp_path: Path) -> None:
    """A huge-frame video (a 424 KB 12000x12000 h264 file took 12.3 GB to decode) is refused from its probe,
    before a frame is decoded; a lying index that hides its size is caught when the file is opened, once."""
    from tests.conftest import H264
    from tests.videos import write_video

    data = tmp_path / "data"
    write_video(data / "small.mp4", H264, frames=9, height=32, width=32, fps=10)
    write_video(data / "big.mp4", H264, frames=9, height=64, width=64, fps=10)
    result = run_cli(["encode", data, "--out", tmp_path / "out", *SMALL, "--max-frame-pixels", "2000"])
    assert result.exit_code == 3, result.output
    (failure,) = cache_io.failures(tmp_path / "out")
    assert failure["path"].endswith("big.mp4") and failure.get("clip") is None
    assert failure["reason"].startswith("frames of 64x64 (4,096 pixels) exceed the decode budget of 2,000 pixels")
    assert [clip["scene"] for clip in cache_io.clips(tmp_path / "out")] == ["small"]
    assert cache_io.manifest(tmp_path / "out")["settings"]["max_frame_pixels"] == 2000
    assert cache_io.manifest(tmp_path / "out")["counts"]["planned_clips"] == 1  # big.mp4 never planned: not opened
    lines = _index(run_cli, data, tmp_path / "index.jsonl")
    for line in lines:
        line["probe"].update(width=32, height=32)  # the index hides big.mp4's size: planning cannot tell
    _write_index(tmp_path / "index.jsonl", lines)
    result = run_cli(["encode", tmp_path / "index.jsonl", "--out", tmp_path / "out2", *SMALL,
                      "--max-frame-pixels", "2000"])
    assert result.exit_code == 3, result.output
    (failure,) = cache_io.failures(tmp_path / "out2")
    assert failure["scene"] == "big" and failure.get("clip") is None and "exceed the decode budget" in failure["reason"]
    assert cache_io.manifest(tmp_path / "out2")["counts"]["planned_clips"] == 2  # planned, refused at open


def test_a_probe_claiming_far_more_frames_fails_its_scene_once(run_cli, cache_io, demo_data: Path,
                                                               tmp_path: Path) -> None:
    """An index claiming 20000 frames for a 17-frame video plans 4000 clips: the scene fails once (one failure
    record naming the file), its other clips are not decoded or encoded, and verify --dataset accounts for them."""
    import time

    lines = _index(run_cli, demo_data, tmp_path / "index.jsonl")
    for camera in lines[1]["probe"].values():
        camera["frames"] = 20000
        del camera["timeline"]  # whose rule of 17 frames refuses the line at planning (tests/video/test_hostile_index)
    _write_index(tmp_path / "index.jsonl", lines)
    started = time.perf_counter()
    result = run_cli(["encode", tmp_path / "index.jsonl", "--out", tmp_path / "out", *SMALL])
    assert result.exit_code == 3, result.output
    assert time.perf_counter() - started < 120  # was ~18 min for 200000 frames: one failure per made-up clip
    (failure,) = cache_io.failures(tmp_path / "out")
    assert failure["scene"] == "scene_001" and failure.get("clip") is None
    assert failure["reason"].startswith("the index says 20000 frames of 64x64, the video has 17 frames")
    assert {clip["scene"] for clip in cache_io.clips(tmp_path / "out")} == {"scene_000", "scene_002"}
    verified = run_cli(["verify", tmp_path / "out", "--dataset", tmp_path / "index.jsonl"])
    assert verified.exit_code == 0, verified.output


def test_a_video_rewritten_since_it_was_indexed_is_a_failure_naming_both(run_cli, cache_io, demo_data: Path,
                                                                          tmp_path: Path) -> None:
    """Same frame count and size, other content: the index's size and mtime no longer match the file."""
    import shutil

    from vaecache.demodata import DemoDataSpec, write_demo_dataset

    data = Path(shutil.copytree(demo_data, tmp_path / "data"))
    _index(run_cli, data, tmp_path / "index.jsonl")
    other = write_demo_dataset(tmp_path / "other", DemoDataSpec(scenes=1, cameras=2, frames=17, height=64, width=64,
                                                                fps=10, seed=7))
    shutil.copy(other[0], data / "scene_002" / "cam_0.mp4")  # same 17 frames of 64x64, other pictures
    result = run_cli(["encode", tmp_path / "index.jsonl", "--out", tmp_path / "out", *SMALL])
    assert result.exit_code == 3, result.output
    (failure,) = cache_io.failures(tmp_path / "out")
    assert failure["scene"] == "scene_002" and failure["path"].endswith("scene_002/cam_0.mp4")
    assert failure["reason"].startswith("changed since it was probed (") and "modified " in failure["reason"]
    assert {clip["scene"] for clip in cache_io.clips(tmp_path / "out")} == {"scene_000", "scene_001"}


def test_torn_utf8_tails_and_unreadable_run_records_never_block_a_rerun(run_cli, demo_data: Path,
                                                                      tmp_path: Path) -> None:
    """A crash while writing a non-ASCII path can tear a probe-cache line inside a UTF-8 character: the rerun cuts
    it; an invalid-UTF-8 run.json is named in the error."""
    import shutil

    data = Path(shutil.copytree(demo_data, tmp_path / "données"))
    out = tmp_path / "out"
    assert run_cli(["encode", data, "--out", out, *SMALL]).exit_code == 0
    probes = out / "probes" / "rank-00000.jsonl"
    probes.write_bytes(probes.read_bytes() + '{"path":"/x/donn\u00e9es'.encode()[:-1])
    result = run_cli(["encode", data, "--out", out, *SMALL])
    assert result.exit_code == 0 and "is already complete" in result.output, result.output
    (out / "run.json").write_bytes(b'{"attempt": 0, "fingerprint": "\xff\xfe"}')
    result = run_cli(["encode", data, "--out", out, *SMALL])
    assert result.exit_code == 1, result.output
    assert f"{out / 'run.json'}: the run record is not UTF-8 text" in result.output and "Traceback" not in result.output


def test_a_complete_cache_on_a_read_only_mount_is_confirmed_complete(run_cli, demo_data: Path, tmp_path: Path) -> None:
    """Rerunning encode on a finished cache mounted read-only (a shared dataset volume) says it is complete."""
    import subprocess

    out, mounted = tmp_path / "out", tmp_path / "ro"
    assert run_cli(["encode", demo_data, "--out", out, *SMALL]).exit_code == 0
    mounted.mkdir()
    bind = subprocess.run(["mount", "--bind", str(out), str(mounted)], capture_output=True, text=True)
    if bind.returncode != 0:
        pytest.skip(f"cannot bind-mount here (needs root): {bind.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mounted)], check=True, capture_output=True)
        result = run_cli(["encode", demo_data, "--out", mounted, *SMALL])
        assert result.exit_code == 0, result.output
        assert "is already complete: nothing to encode" in result.output
        result = run_cli(["encode", demo_data, "--out", mounted, *SMALL, "--overwrite"])
        assert result.exit_code == 1 and "on a read-only filesystem" in result.output
    finally:
        subprocess.run(["umount", str(mounted)], capture_output=True)


_GARBAGE_THEN_ENCODE = """
import gc, os, sys
import av
from vaecache.cli.app import main

def leave_a_threaded_decoder_as_cyclic_garbage(video):
    container = av.open(video)
    stream = container.streams.video[0]
    stream.thread_type, stream.thread_count = "AUTO", 4
    for index, _ in enumerate(container.decode(stream)):
        if index == 3:
            break
    cycle = {"container": container}
    cycle["itself"] = cycle

# Garbage survives in a long-lived generation until a full collection, which a child may run at any time. Made
# certain here: this process collects nothing until it forks, and a forked child collects at every allocation.
gc.disable()
os.register_at_fork(after_in_child=lambda: (gc.set_threshold(1, 1, 1), gc.enable()))
leave_a_threaded_decoder_as_cyclic_garbage(sys.argv[1])
sys.argv = ["vaecache", *sys.argv[2:]]
main()
"""


def test_decode_workers_fork_past_a_decoder_left_as_cyclic_garbage(demo_data: Path, tmp_path: Path) -> None:
    """A forked worker's collector that freed the parent's garbage decoder would wait forever on FFmpeg threads that
    do not exist in the child: the encode must finish."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import ENCODE_ARGS, read_clips, subprocess_env

    video = sorted(demo_data.rglob("*.mp4"))[0]
    out = tmp_path / "out"
    command = [sys.executable, "-c", _GARBAGE_THEN_ENCODE, str(video), "encode", str(demo_data), "--out", str(out),
               *map(str, ENCODE_ARGS), "--workers", "1"]
    # a session of its own: a hung worker outlives its killed parent, and is killed with the whole group
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=subprocess_env(), start_new_session=True)
    try:
        output, _ = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        pytest.fail("the encode hung: a forked decode worker's collector freed the parent's garbage decoder")
    assert child.returncode == 0, output
    assert len(read_clips(out)) > 0
