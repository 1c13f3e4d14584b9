"""A rank stopped with SIGSTOP fails the job within the liveness timeout, named with its host and pid;
what was committed is kept and a rerun completes the cache."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vaecache.demodata import DemoDataSpec, write_demo_dataset

pytestmark = pytest.mark.slow

SLOW_VAE = textwrap.dedent("""
    import time
    import types
    import torch

    class Slow(torch.nn.Module):
        vaecache_spatial_factor = 2
        vaecache_latent_channels = 4

        def __init__(self):
            super().__init__()
            self.pool = torch.nn.AvgPool3d((1, 2, 2))

        def encode(self, x):
            time.sleep(0.2)
            mean = self.pool(torch.cat([x, x[:, :1]], 1))
            return types.SimpleNamespace(mean=mean, logvar=torch.zeros_like(mean))

    def make():
        return Slow()
""")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_stopped_rank_fails_the_job_named_and_a_rerun_completes(tmp_path: Path, procs):
    data = tmp_path / "data"
    write_demo_dataset(data, DemoDataSpec(scenes=4, cameras=2, frames=27, height=32, width=32, seed=3))
    (tmp_path / "slow_vae.py").write_text(SLOW_VAE)
    out = tmp_path / "out"
    args = ["encode", data, "--out", out, "--vae", "python:slow_vae:make", "--num-frames", "9", "--size", "32x32",
            "--workers", "0", "--shard-size", "1", "--no-progress", "--liveness-timeout", "3"]
    port = str(_free_port())
    ranks = []
    for rank in range(2):
        env = procs.env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONPATH=os.pathsep.join(
                            [str(tmp_path), os.environ.get("PYTHONPATH", "")]))
        ranks.append(subprocess.Popen([sys.executable, "-m", "vaecache", *map(str, args)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 120
        while not list((out / "shards").glob("*-r00001-*.safetensors")):  # rank 1 committed a clip
            assert time.monotonic() < deadline and ranks[1].poll() is None, ranks[1].communicate()[1][-2000:]
            time.sleep(0.05)
        os.kill(ranks[1].pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, err = ranks[0].communicate(timeout=60)
        took = time.monotonic() - stopped_at
        assert ranks[0].returncode == 1, err[-3000:]
        assert f"rank 1 on {socket.gethostname()} (pid {ranks[1].pid}) stopped responding" in err
        assert "--liveness-timeout 3 s" in err and "; last seen " in err
        assert took < 20, f"the job took {took:.0f} s to notice"
        assert ranks[1].wait(timeout=10) == -signal.SIGKILL  # the finder killed it: same host
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert not (out / "manifest.json").exists()
    rerun = procs.vaecache(*args,
                           env={"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])})
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert procs.vaecache("verify", out).returncode == 0
