"""End to end under torchrun: any world size and SP size stores the same bytes as one process."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from vaecache.demodata import DemoDataSpec, write_demo_dataset

pytestmark = pytest.mark.slow

ARGS = ["--vae", "builtin:tiny", "--num-frames", "9", "--size", "64x64", "--no-progress"]


@pytest.fixture(scope="module")
def single(procs):
    return lambda data, out, *extra: procs.vaecache("encode", data, "--out", out, *ARGS, *extra)


@pytest.fixture(scope="module")
def torchrun(procs):
    return lambda nproc, data, out, *extra: procs.torchrun(nproc, "encode", data, "--out", out, *ARGS, *extra)


@pytest.fixture(scope="module")
def verify_ok(procs):
    def check(out: Path) -> None:
        result = procs.vaecache("verify", out)
        assert result.returncode == 0, result.stderr
    return check


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    # 5 scenes x 3 cameras: 15 views, divisible by neither 2 nor 4; 2 clips per scene.
    root = tmp_path_factory.mktemp("e2e-data")
    write_demo_dataset(root, DemoDataSpec(scenes=5, cameras=3, frames=18, height=64, width=64, seed=7))
    return root


def _single_process_cache(data, out, cache_io, single, *extra) -> dict[str, torch.Tensor]:
    result = single(data, out, "--workers", "0", *extra)
    assert result.returncode == 0, result.stderr
    found = cache_io.tensors(out)
    assert len(found) == 5 * 2 * 2
    return found


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory, cache_io, single) -> dict[str, torch.Tensor]:
    """One process, one view per forward (--views-per-forward auto on CPU)."""
    out = tmp_path_factory.mktemp("e2e-ref") / "out"
    found = _single_process_cache(data, out, cache_io, single)
    assert cache_io.manifest(out)["settings"]["views_per_forward"] == 1
    return found


@pytest.fixture(scope="module")
def reference_all(data, tmp_path_factory, cache_io, single) -> dict[str, torch.Tensor]:
    """One process, the 3 cameras of a clip in one forward (the children all run one OpenMP thread)."""
    out = tmp_path_factory.mktemp("e2e-ref-all") / "out"
    found = _single_process_cache(data, out, cache_io, single, "--views-per-forward", "all")
    assert cache_io.manifest(out)["settings"]["views_per_forward"] == 3
    assert {clip["encode"]["units_per_forward"] for clip in cache_io.clips(out)} == {3}
    return found


@pytest.fixture(scope="module")
def reference_fast(data, tmp_path_factory, cache_io, single) -> dict[str, torch.Tensor]:
    """One process, one view per forward, --encoder-impl fast."""
    out = tmp_path_factory.mktemp("e2e-ref-fast") / "out"
    return _single_process_cache(data, out, cache_io, single, "--encoder-impl", "fast")


@pytest.mark.parametrize("nproc, extra", [
    (2, ["--workers", "1"]),
    (4, ["--sp-size", "2", "--batch-size", "3", "--workers", "0",
         "--views-per-forward", "all"]),  # 3 clips over 2 ranks
    (3, ["--sp-size", "3", "--workers", "1", "--encoder-impl", "fast"]),  # each rank encodes one camera of a clip
], ids=["dp2", "dp2xsp2-b3-all", "sp3-fast"])
def test_torchrun_output_equals_single_process(cache_io, nproc, extra, data, reference, reference_all, tmp_path,
                                               torchrun, verify_ok, request):
    out = tmp_path / "out"
    result = torchrun(nproc, data, out, *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = (request.getfixturevalue("reference_fast") if "fast" in extra
                else reference_all if "all" in extra else reference)
    cache_io.same_tensors(cache_io.tensors(out), expected)
    verify_ok(out)
    assert len(list((out / "logs").glob("rank-*.log"))) == nproc


def test_sp_size_must_divide_world(data, tmp_path, torchrun):
    result = torchrun(3, data, tmp_path / "out", "--sp-size", "2", "--workers", "0")
    assert result.returncode != 0
    assert "--sp-size 2 must divide the world size 3" in result.stderr


def test_kill_9_of_two_rank_job_then_rerun_with_other_world_size(cache_io, data, reference, tmp_path, procs, torchrun,
                                                                 verify_ok):
    out = tmp_path / "out"
    with open(tmp_path / "killed.stderr", "w+") as stderr:
        proc = subprocess.Popen(procs.torchrun_cmd(2, "encode", data, "--out", out, *ARGS, "--shard-size", "1",
                                                   "--workers", "0"),
                                env=procs.env(), stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
        deadline = time.monotonic() + 120
        shards = out / "shards"
        while time.monotonic() < deadline and proc.poll() is None:
            if shards.is_dir() and any(p.suffix == ".safetensors" for p in shards.iterdir()):
                break
            time.sleep(0.01)
        stderr.seek(0)
        assert proc.poll() is None, f"the job ended (exit {proc.returncode}) before a shard:\n{stderr.read()[-3000:]}"
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks, mid-flight
    proc.wait()
    assert not (out / "manifest.json").exists()
    rerun = torchrun(3, data, out, "--shard-size", "1", "--workers", "0")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    verify_ok(out)
    cache_io.same_tensors(cache_io.tensors(out), reference)


def test_two_ranks_name_their_skipped_inputs_once_each(torchrun, tmp_path):
    data = tmp_path / "data"
    write_demo_dataset(data, DemoDataSpec(scenes=4, cameras=1, frames=9, height=64, width=64, seed=3))
    for scene in (1, 2):  # a broken video in each rank's block of clips
        (data / f"scene_{scene:03d}" / "cam_0.mp4").write_bytes(b"\x00" * 500)
    out = tmp_path / "out"
    result = torchrun(2, data, out, "--workers", "0")
    assert result.returncode == 1, result.stderr[-3000:]  # torchrun's code for any nonzero exit; its summary says 3:
    last = [line.strip() for line in result.stderr.splitlines() if line.strip().startswith("traceback :")][-1]
    assert last == (f"traceback : vaecache exit 3: done, but 2 input(s) were skipped: vaecache inspect {out} "
                    "--failures lists them"), result.stderr[-3000:]
    named = [line for line in result.stderr.splitlines() if "skipped " in line and "cam_0.mp4" in line]
    subjects = sorted({line.split("skipped ")[1].split(":")[0] for line in named})
    assert subjects == sorted(str(data / f"scene_{s:03d}" / "cam_0.mp4") + " (cam_0)" for s in (1, 2)), named
    live = [line for line in named if line.startswith("rank ")]
    assert len(live) == 2 and len(named) == 2, named  # each by its own rank, as it happened, and not again at the end


def test_a_rank_whose_vae_does_not_load_stops_every_rank_at_once_with_its_line(data, tmp_path, procs):
    """Rank 1's copy of the VAE fails to load (as a damaged file on its node's disk would): rank 0 is told by name at
    once, not left in the next collective until the timeout."""
    import subprocess

    (tmp_path / "one_rank_vae.py").write_text(
        "import os\n"
        "import torch\n\n\n"
        "class Pool(torch.nn.Module):\n"
        "    vaecache_spatial_factor = 4\n"
        "    vaecache_has_logvar = False\n\n"
        "    def encode(self, x):\n"
        "        return torch.nn.functional.avg_pool3d(x, (1, 4, 4))\n\n\n"
        "def make():\n"
        "    if os.environ.get('RANK') == '1':\n"
        "        raise RuntimeError('/node1/vae.safetensors: not a readable safetensors file')\n"
        "    return Pool()\n")
    env = procs.env(PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    started = time.monotonic()
    result = subprocess.run(procs.torchrun_cmd(2, "encode", data, "--out", tmp_path / "out", "--vae",
                                               "python:one_rank_vae:make", "--num-frames", "9", "--size", "64x64",
                                               "--no-progress", "--workers", "0", "--store", "mean",
                                               "--timeout", "120"),
                            capture_output=True, text=True, env=env, timeout=180)
    assert result.returncode != 0
    assert ("rank 1 could not load its VAE: RuntimeError: /node1/vae.safetensors: not a readable safetensors file"
            in result.stderr), result.stderr[-3000:]
    assert time.monotonic() - started < 90
