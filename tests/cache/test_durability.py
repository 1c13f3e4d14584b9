"""Crash safety, resume, guards and bad inputs: kill it anywhere, rerun, get the same bytes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import Result

from tests.conftest import invoke
from vaecache.cache.reader import CacheReader
from vaecache.demodata import DemoDataSpec, write_demo_dataset

ENCODE_ARGS = ["--vae", "builtin:tiny", "--num-frames", "9", "--size", "64x64", "--workers", "0", "--no-progress"]


def run_vaecache(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {key: value for key, value in os.environ.items() if key != "VAECACHE_FAULT"}
    full_env["OMP_NUM_THREADS"] = "1"  # two spinning OpenMP threads on a shared 2-core runner slow everything
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "vaecache", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def encode(data: Path, out: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A child-process encode: for the runs that crash (os._exit) or must show what a user's terminal shows."""
    return run_vaecache("encode", str(data), "--out", str(out), *ENCODE_ARGS, *extra, env=env)


def encode_here(data: Path, out: Path, *extra: str) -> Result:
    """The same encode in this process (`vaecache` CLI through CliRunner; exit code and output as in a child,
    without a ~4 s interpreter and torch start): for the reruns and the runs that refuse. The children's
    OMP_NUM_THREADS=1 is this process's torch.set_num_threads(1) (tests/conftest.py), so the bytes are the same."""
    return invoke(["encode", data, "--out", out, *ENCODE_ARGS, *extra], env={"VAECACHE_FAULT": None})


def verify_here(out: Path) -> Result:
    """`vaecache verify OUT` in this process: the same CLI and exit code as a child process."""
    return invoke(["verify", out], env={"VAECACHE_FAULT": None})


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("durability-data")
    write_demo_dataset(root, DemoDataSpec(scenes=4, cameras=2, frames=18, height=64, width=64, seed=3))
    return root


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory, cache_io) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("durability-ref") / "out"
    result = encode(data, out)
    assert result.returncode == 0, result.stderr
    tensors = cache_io.tensors(out)
    assert len(tensors) == 2 * 8  # 4 scenes x 2 clips x (mean, logvar)
    return tensors


@pytest.fixture(scope="module")
def crashed_after_3(data, tmp_path_factory) -> Path:
    """A child encode of `data` (--shard-size 1) killed by os._exit right after its 3rd commit. Read-only: the tests
    that resume or damage it work on a copy (`crashed_copy`)."""
    out = tmp_path_factory.mktemp("durability-crashed") / "out"
    crashed = encode(data, out, "--shard-size", "1", env={"VAECACHE_FAULT": "crash-after-commit:3"})
    assert crashed.returncode == 137, crashed.stderr
    return out


@pytest.fixture
def crashed_copy(crashed_after_3, tmp_path) -> Path:
    """A private copy of `crashed_after_3` (shutil.copytree keeps the files' sizes and mtimes)."""
    return Path(shutil.copytree(crashed_after_3, tmp_path / "out"))


@pytest.mark.parametrize("point", ["crash-after-commit:2", "crash-mid-write:2", "crash-before-record:2"])
def test_crash_then_rerun_gives_identical_cache(cache_io, point, data, reference, tmp_path):
    out = tmp_path / "out"
    crashed = encode(data, out, "--shard-size", "1", env={"VAECACHE_FAULT": point})
    assert crashed.returncode == 137, crashed.stderr
    assert not (out / "manifest.json").exists()
    incomplete = verify_here(out)
    assert incomplete.exit_code == 1
    assert "incomplete" in incomplete.output
    rerun = encode_here(data, out, "--shard-size", "1")
    assert rerun.exit_code == 0, rerun.output
    verified = verify_here(out)
    assert verified.exit_code == 0, verified.output
    cache_io.same_tensors(cache_io.tensors(out), reference)
    # One clip per shard: only shards whose progress line was written survive the crash.
    committed = {"crash-after-commit:2": 2, "crash-mid-write:2": 1, "crash-before-record:2": 1}[point]
    assert f"attempt 1, {committed} clips already committed" in (out / "logs" / "rank-00000.log").read_text()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["clips"] == 8
    assert len(list((out / "shards").iterdir())) == len(manifest["shards"])  # debris discarded


def test_disk_full_leaves_nothing_that_passes_and_rerun_completes(cache_io, data, reference, tmp_path):
    out = tmp_path / "out"
    failed = encode(data, out, "--shard-size", "1", env={"VAECACHE_FAULT": "enospc:2"})
    assert failed.returncode == 1
    assert "No space left on device" in failed.stderr
    assert "Traceback" not in failed.stderr
    assert verify_here(out).exit_code == 1
    rerun = encode_here(data, out, "--shard-size", "1")
    assert rerun.exit_code == 0, rerun.output
    assert verify_here(out).exit_code == 0
    cache_io.same_tensors(cache_io.tensors(out), reference)


def test_sigterm_stops_cleanly_and_rerun_resumes(cache_io, data, reference, tmp_path):
    out = tmp_path / "out"
    env = {key: value for key, value in os.environ.items() if key != "VAECACHE_FAULT"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "vaecache", "encode", str(data), "--out", str(out), *ENCODE_ARGS,
                             "--shard-size", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    progress = out / "progress" / "rank-00000.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (progress.exists() and progress.read_text().count("\n") >= 1):
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the run finished before SIGTERM arrived")
    assert proc.returncode == 75, stderr
    assert "rerun the same command to resume" in stderr
    assert not (out / "manifest.json").exists()
    assert not (out / ".lock").exists()
    rerun = encode_here(data, out, "--shard-size", "1")
    assert rerun.exit_code == 0, rerun.output
    cache_io.same_tensors(cache_io.tensors(out), reference)


def test_second_job_on_same_out_is_refused(data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / ".lock").write_text(json.dumps({"host": os.uname().nodename, "pid": holder.pid, "job_id": "42"}))
        refused = encode_here(data, out)
        assert refused.exit_code == 1
        assert "locked by another vaecache job" in refused.output and str(holder.pid) in refused.output
    finally:
        holder.kill()
        holder.wait()
    stale = encode_here(data, out)  # the holder is dead now: its lock is stale and cleared
    assert stale.exit_code == 0, stale.output
    assert not (out / ".lock").exists()


def _bad_dataset(root: Path) -> dict[str, str]:
    """Good scenes plus one of every bad-input kind; returns scene -> expected reason fragment."""
    write_demo_dataset(root, DemoDataSpec(scenes=2, cameras=2, frames=9, height=64, width=64, seed=1))
    good = root / "scene_000" / "cam_0.mp4"
    expected = {}

    def scene(name: str) -> Path:
        folder = root / name
        folder.mkdir()
        shutil.copy(root / "scene_001" / "cam_1.mp4", folder / "cam_1.mp4")
        return folder

    (scene("bad_empty") / "cam_0.mp4").write_bytes(b"")
    expected["bad_empty"] = "empty file"
    data = good.read_bytes()
    (scene("bad_truncated") / "cam_0.mp4").write_bytes(data[: len(data) // 3])
    expected["bad_truncated"] = "cam_0.mp4"
    (scene("bad_notvideo") / "cam_0.mp4").write_text("this is not a video\n" * 50)
    expected["bad_notvideo"] = "not a readable video"
    scene("bad_missing_camera")
    expected["bad_missing_camera"] = "camera 'cam_0' is missing"
    short = root / "short_src"
    write_demo_dataset(short, DemoDataSpec(scenes=1, cameras=1, frames=5, height=64, width=64, seed=2))
    shutil.copy(short / "scene_000" / "cam_0.mp4", scene("bad_fewer_frames") / "cam_0.mp4")
    expected["bad_fewer_frames"] = "has 5 frames"
    shutil.rmtree(short)
    both_short = root / "bad_too_short"
    both_short.mkdir()
    tmp = root.parent / f"{root.name}-short2"
    write_demo_dataset(tmp, DemoDataSpec(scenes=1, cameras=2, frames=5, height=64, width=64, seed=4))
    for cam in ("cam_0", "cam_1"):
        shutil.copy(tmp / "scene_000" / f"{cam}.mp4", both_short / f"{cam}.mp4")
    shutil.rmtree(tmp)
    expected["bad_too_short"] = "too short"
    (scene("bad_unreadable") / "cam_0.mp4").mkdir()
    expected["bad_unreadable"] = "not a regular file"
    return expected


def test_bad_inputs_are_recorded_and_the_run_goes_on(tmp_path):
    data = tmp_path / "data"
    expected = _bad_dataset(data)
    out = tmp_path / "out"
    result = encode_here(data, out)
    assert result.exit_code == 3, result.output
    failures = CacheReader(out).failure_records()
    by_scene = {f["scene"]: f for f in failures}
    assert set(by_scene) == set(expected)
    for failure in failures:  # the documented record, no internal fields
        assert set(failure) == {"scene", "clip", "camera", "path", "reason"}, failure
        if failure["path"] is not None:
            assert failure["camera"] == Path(failure["path"]).stem, failure
    for scene, fragment in expected.items():
        assert fragment in (by_scene[scene]["reason"] + " " + str(by_scene[scene]["path"])), by_scene[scene]
    clips = list(CacheReader(out).clip_records())
    assert sorted({c["scene"] for c in clips}) == ["scene_000", "scene_001"]
    verified = verify_here(out)
    assert verified.exit_code == 0, verified.output
    assert f"{len(expected)} skipped input(s)" in verified.output


def test_on_error_fail_stops_at_first_bad_input(tmp_path):
    data = tmp_path / "data"
    _bad_dataset(data)
    out = tmp_path / "out"
    result = encode(data, out, "--on-error", "fail")
    assert result.returncode == 1
    assert "bad_" in result.stderr and "Traceback" not in result.stderr
    assert not (out / "manifest.json").exists()


def test_cameras_at_different_frame_rates_are_a_bad_input(tmp_path):
    data = tmp_path / "data"
    write_demo_dataset(data, DemoDataSpec(scenes=2, cameras=2, frames=9, height=64, width=64, fps=10, seed=1))
    other = tmp_path / "other"
    write_demo_dataset(other, DemoDataSpec(scenes=1, cameras=2, frames=9, height=64, width=64, fps=25, seed=1))
    shutil.copy(other / "scene_000" / "cam_1.mp4", data / "scene_001" / "cam_1.mp4")
    out = tmp_path / "out"
    result = encode_here(data, out)
    assert result.exit_code == 3, result.output
    failures = CacheReader(out).failure_records()
    assert [(f["scene"], f["path"].endswith("cam_1.mp4")) for f in failures] == [("scene_001", True)]
    assert "camera 'cam_1' runs at 25 fps, camera 'cam_0' at 10 fps" in failures[0]["reason"]


def test_resume_on_other_data_is_refused_naming_what_differs(tmp_path: Path, cache_io) -> None:
    """A crashed run on dataset A resumed on B with the same scene names used to finish as half A, half B."""
    spec = DemoDataSpec(scenes=3, cameras=2, frames=9, height=64, width=64, seed=3)
    first, second = tmp_path / "a", tmp_path / "b"
    write_demo_dataset(first, spec)
    write_demo_dataset(second, DemoDataSpec(scenes=3, cameras=2, frames=9, height=64, width=64, seed=4))
    out = tmp_path / "out"
    assert encode(first, out, "--shard-size", "1", env={"VAECACHE_FAULT": "crash-after-commit:1"}).returncode == 137
    elsewhere = encode_here(second, out, "--shard-size", "1")
    assert elsewhere.exit_code == 2 and "made with other settings (data:" in elsewhere.output
    # The same path with other videos in it (same names, same sizes possible): refused, naming a file.
    write_demo_dataset(first, DemoDataSpec(scenes=3, cameras=2, frames=9, height=64, width=64, seed=5))
    replaced = encode_here(first, out, "--shard-size", "1")
    assert replaced.exit_code == 2 and "was made from other data" in replaced.output
    assert "scene_000/cam_0.mp4: " in replaced.output
    assert not (out / "manifest.json").exists()


def test_hash_sources_tells_a_touched_file_from_changed_content(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_demo_dataset(data, DemoDataSpec(scenes=2, cameras=1, frames=9, height=64, width=64, seed=3))
    out = tmp_path / "out"
    crashed = encode(data, out, "--shard-size", "1", "--hash-sources", env={"VAECACHE_FAULT": "crash-after-commit:1"})
    assert crashed.returncode == 137
    os.utime(data / "scene_000" / "cam_0.mp4")  # touched, same bytes
    resumed = encode_here(data, out, "--shard-size", "1", "--hash-sources")
    assert resumed.exit_code == 0, resumed.output
    recorded = json.loads((out / "run.json").read_text())["sources"]
    assert all(len(entry["sha256"]) == 64 for entry in recorded.values()) and len(recorded) == 2


def _flip_a_byte(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x40  # inside the tensor data: the size stays, the sha256 does not
    shard.write_bytes(bytes(data))


def test_a_damaged_shard_is_repaired_by_the_resume(data, reference, crashed_copy: Path, cache_io) -> None:
    out = crashed_copy
    _flip_a_byte(sorted((out / "shards").glob("*.safetensors"))[0])
    resumed = encode_here(data, out, "--shard-size", "1")
    assert resumed.exit_code == 0, resumed.output
    assert "repaired: 1 damaged shard(s)" in resumed.output and "sha256 differs" in resumed.output
    cache_io.same_tensors(cache_io.tensors(out), reference)
    assert verify_here(out).exit_code == 0


def test_each_resume_hashes_only_the_shards_it_has_not_hashed(crashed_copy: Path, monkeypatch) -> None:
    """A requeued job resumes many times: shards hashed intact by one resume are not hashed by the next unless
    their size or mtime changed."""
    from vaecache.cache import repair

    out = crashed_copy
    hashed: list[str] = []
    real = repair.sha256_file
    monkeypatch.setattr(repair, "sha256_file", lambda path: hashed.append(Path(path).name) or real(path))
    shards = sorted((out / "shards").glob("*.safetensors"))
    assert repair.repair_progress(out)[2] == {} and sorted(hashed) == [p.name for p in shards] and len(shards) == 3
    hashed.clear()
    assert repair.repair_progress(out)[2] == {} and hashed == []
    _flip_a_byte(shards[1])
    stat = shards[1].stat()
    os.utime(shards[1], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # coarse clocks: make the change visible
    damaged = repair.repair_progress(out)[2]
    assert hashed == [shards[1].name] and list(damaged) == [f"shards/{shards[1].name}"]


@pytest.mark.parametrize("guess", ["right", "refuted"])
def test_the_decode_starts_while_out_is_prepared_only_where_nothing_is_done(
        guess: str, data, reference, crashed_copy: Path, tmp_path: Path, cache_io, monkeypatch) -> None:
    """Into an OUT that looked empty the decode workers start before OUT is prepared; on a resume after prepare.
    A guess that prepare refutes (another job committed in between) is dropped: the resume is the same."""
    from vaecache.cache.outdir import DiskOut
    from vaecache.encode import loop

    events: list[str] = []
    started, prepare = loop.DecodeFeed.__init__, DiskOut.prepare
    monkeypatch.setattr(loop.DecodeFeed, "__init__", lambda self, *a: (events.append("decode"), started(self, *a))[1])
    monkeypatch.setattr(DiskOut, "prepare", lambda self, *a, **k: (events.append("prepare"), prepare(self, *a, **k))[1])
    if guess == "refuted":
        monkeypatch.setattr(DiskOut, "looked_empty", lambda self: True)
    fresh = tmp_path / "fresh"
    assert encode_here(data, fresh, "--shard-size", "1", "--workers", "1").exit_code == 0
    assert events == ["decode", "prepare"]
    events.clear()
    resumed = encode_here(data, crashed_copy, "--shard-size", "1", "--workers", "1")
    assert resumed.exit_code == 0, resumed.output
    assert events == (["prepare", "decode"] if guess == "right" else ["decode", "prepare", "decode"])
    assert "attempt 1, 3 clips already committed" in (crashed_copy / "logs" / "rank-00000.log").read_text()
    cache_io.same_tensors(cache_io.tensors(crashed_copy), reference)
    cache_io.same_tensors(cache_io.tensors(fresh), reference)


def test_the_last_shard_is_handed_to_the_writer_before_the_decode_workers_end(
        data, reference, tmp_path: Path, cache_io, monkeypatch) -> None:
    """After the last batch the writer starts on the last shard at once: its write (a PUT over object storage) runs
    while the DataLoader shuts its workers down, not after. The shards are the same ones."""
    from vaecache.cache.writer import ShardWriter
    from vaecache.encode import loop

    events: list[str] = []
    take, flush = loop.DecodeFeed.take, ShardWriter.flush

    def taken(self):
        try:
            yield from take(self)
        finally:  # the loader's end, or (on CUDA, which is not asked for more) its last reference gone
            events.append("decoded all")

    monkeypatch.setattr(loop.DecodeFeed, "take", taken)
    monkeypatch.setattr(ShardWriter, "flush", lambda self: (events.append("flush"), flush(self))[1])
    out = tmp_path / "out"
    assert encode_here(data, out, "--workers", "1").exit_code == 0
    assert events[:2] == ["flush", "decoded all"]
    cache_io.same_tensors(cache_io.tensors(out), reference)


def test_encode_again_repairs_a_cache_that_verify_failed(data, reference, crashed_copy: Path, cache_io) -> None:
    out = crashed_copy
    resumed = encode_here(data, out, "--shard-size", "1")  # the resume recorded shards 0-2 as hashed
    assert resumed.exit_code == 0, resumed.output
    # the resume re-encodes none of the 3 committed clips and gives the uninterrupted run's bytes
    assert "3 clips already committed" in (out / "logs" / "rank-00000.log").read_text()
    cache_io.same_tensors(cache_io.tensors(out), reference)
    shard = sorted((out / "shards").glob("*.safetensors"))[2]
    stat = shard.stat()
    _flip_a_byte(shard)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # bit rot keeps the mtime: a rerun hashes every shard
    assert verify_here(out).exit_code == 1
    repaired = encode_here(data, out, "--shard-size", "1")
    assert repaired.exit_code == 0, repaired.output
    assert "repaired: 1 damaged shard(s)" in repaired.output
    cache_io.same_tensors(cache_io.tensors(out), reference)
    assert verify_here(out).exit_code == 0
    again = encode_here(data, out, "--shard-size", "1")  # now intact: left alone
    assert again.exit_code == 0 and "already complete" in again.output


@pytest.mark.parametrize("content, kept", [
    (b"", b""), (b'{"a":1}\n', b'{"a":1}\n'), (b'{"a":1}\n{"b"', b'{"a":1}\n'), (b'{"tor', b""),
    (b"x" * 70000 + b"\n" + b"y" * 70000, b"x" * 70000 + b"\n"),
])
def test_cut_torn_tail_keeps_whole_lines_only(tmp_path, content, kept):
    from vaecache.cache.io import cut_torn_tail

    path = tmp_path / "log.jsonl"
    path.write_bytes(content)
    cut_torn_tail(path)
    assert path.read_bytes() == kept
    cut_torn_tail(tmp_path / "missing.jsonl")  # nothing to cut
