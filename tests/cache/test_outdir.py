"""OUT ownership: the lock's staleness rules, the settings guard's message, a complete cache left alone
on rerun, and an empty result refused."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from vaecache.cache.lock import acquire_lock, lock_is_stale, release_lock
from vaecache.cache.outdir import numerics_history
from vaecache.differences import describe_differences
from vaecache.errors import OutputError
from vaecache.verify.integrity import verify_cache

HOST = socket.gethostname()


def test_lock_of_dead_process_on_this_host_is_stale():
    assert lock_is_stale({"host": HOST, "pid": 2**22 + 12345, "job_id": None},
                         {"host": HOST, "job_id": None, "restart": 0})


def test_lock_of_live_process_is_not_stale():
    assert not lock_is_stale({"host": HOST, "pid": os.getpid(), "job_id": None},
                             {"host": HOST, "job_id": None, "restart": 0})


def test_lock_from_other_host_is_kept_unless_it_is_an_earlier_attempt_of_this_job():
    holder = {"host": "node-a", "pid": 1, "job_id": "77", "restart": 0}
    assert not lock_is_stale(holder, {"host": "node-b", "job_id": "78", "restart": 1})
    assert not lock_is_stale(holder, {"host": "node-b", "job_id": "77", "restart": 0})
    assert lock_is_stale(holder, {"host": "node-b", "job_id": "77", "restart": 1})


def test_acquire_refuses_a_held_lock_and_names_the_holder(tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"host": "elsewhere", "pid": 4242, "job_id": "9"}))
    with pytest.raises(OutputError, match="host elsewhere, pid 4242, job 9"):
        acquire_lock(tmp_path, job_id=None)


def test_acquire_and_release(tmp_path):
    acquire_lock(tmp_path, job_id="5")
    holder = json.loads((tmp_path / ".lock").read_text())
    assert (holder["pid"], holder["job_id"]) == (os.getpid(), "5")
    release_lock(tmp_path)
    assert not (tmp_path / ".lock").exists()


def test_describe_differences_names_each_changed_setting():
    diffs = describe_differences({"latents": {"num_frames": 9, "dtype": "fp32"}, "vae": {"w": "a"}},
                                 {"latents": {"num_frames": 13, "dtype": "fp32"}, "vae": {"w": "b"}})
    assert diffs == ["latents.num_frames: 9 -> 13", 'vae.w: "a" -> "b"']


def _file_digests(out: Path) -> dict[str, str]:
    """sha256 of every file in OUT except logs/ (each run appends its own lines to the rank logs)."""
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and p.relative_to(out).parts[0] != "logs"}


def test_numerics_history_lists_each_numerics_once_oldest_first():
    a100 = {"device": "cuda", "gpu": "NVIDIA A100-SXM4-80GB", "torch": "2.13.0"}
    h100 = {**a100, "gpu": "NVIDIA H100 80GB HBM3"}
    cpu = {"device": "cpu", "threads": 2, "torch": "2.13.0"}
    assert numerics_history({"fingerprint": {"numerics": a100}}, {"numerics": a100}) == [a100]  # one: not recorded
    first = numerics_history({"fingerprint": {"numerics": a100}}, {"numerics": h100}, [a100, cpu])
    assert first == [a100, h100, cpu]
    assert numerics_history({"fingerprint": {"numerics": h100}, "numerics_history": first}, {"numerics": a100}) == first
    assert numerics_history({"fingerprint": {}}, {"numerics": cpu}) == [cpu]  # written before numerics were recorded


def test_rerun_of_a_complete_cache_changes_no_byte_and_says_complete(cache_copy: Path, demo_data: Path,
                                                                    encode_cli: Callable) -> None:
    before = _file_digests(cache_copy)
    result = encode_cli(demo_data, cache_copy, "--batch-size", "2")  # exit 0 asserted
    assert "already complete" in result.output
    assert _file_digests(cache_copy) == before


def test_an_encode_that_yields_no_clip_fails_and_leaves_no_manifest(demo_data: Path, run_cli: Callable,
                                                                   tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_cli(["encode", demo_data, "--out", out, "--vae", "builtin:tiny",
                      "--num-frames", "21",  # scenes have 17
                      "--size", "64x64", "--workers", "0", "--no-progress"])
    assert result.exit_code == 1, result.output
    assert "no clips encoded: 3 scenes too short" in result.output
    assert not (out / "manifest.json").exists()
    verified = run_cli(["verify", out])
    assert verified.exit_code == 1 and "incomplete" in verified.output


def test_a_complete_cache_of_a_grown_dataset_gets_the_new_clips(good_cache: Path, demo_data: Path,
                                                               encode_cli: Callable, cache_io, tmp_path: Path) -> None:
    data = Path(shutil.copytree(demo_data, tmp_path / "data"))  # grown in place: DATA is part of the settings
    cache = tmp_path / "cache"
    encode_cli(data, cache)
    shutil.copytree(data / "scene_002", data / "scene_003")
    encode_cli(data, cache)
    manifest = cache_io.manifest(cache)
    assert manifest["counts"]["clips"] == 4 and manifest["counts"]["planned_clips"] == 4
    tensors = cache_io.tensors(cache)
    assert torch.equal(tensors["scene_003/000000-000008/mean"], tensors["scene_002/000000-000008/mean"])
    cache_io.same_tensors({k: v for k, v in tensors.items() if not k.startswith("scene_003/")},
                          cache_io.tensors(good_cache))
    run = json.loads((cache / "run.json").read_text())
    assert run["attempt"] == 1 and str(data / "scene_003" / "cam_0.mp4") in run["sources"]
    assert verify_cache(cache).ok


def _start_together(out: Path, barrier, results, index: int) -> None:
    from vaecache.errors import OutputError

    barrier.wait()
    try:
        acquire_lock(out, job_id=None)
        results[index] = 1
        time.sleep(0.2)  # hold it as a running job would, while the others try
    except OutputError:
        results[index] = 0


@pytest.mark.parametrize("left_behind", ["stale record", "no lock"])
def test_of_many_starters_exactly_one_takes_the_lock(tmp_path: Path, left_behind: str) -> None:
    """A stale .lock (dead pid) used to be taken over by two starters at once (413 of 2000 trials)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    starters, trials = 8, 12
    for trial in range(trials):
        out = tmp_path / f"out{trial}"
        out.mkdir()
        if left_behind == "stale record":
            (out / ".lock").write_text(json.dumps({"host": HOST, "pid": 2**22 + 12345, "job_id": None}))
        barrier = context.Barrier(starters)
        results = context.Array("i", [-1] * starters)
        procs = [context.Process(target=_start_together, args=(out, barrier, results, i)) for i in range(starters)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(30)
        assert list(results).count(1) == 1 and list(results).count(0) == starters - 1, (trial, list(results))
