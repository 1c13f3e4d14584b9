"""scripts/slurm/*.sbatch on a real SLURM cluster, checked against a 1-process encode.

Run: ``python -m pytest tests/e2e/slurm -v -p no:cacheprovider`` (starts a local single-node cluster
when none answers ``sinfo`` and this is root; see conftest.py). The local cluster's node has as
many CPUs as the machine (2 in CI), so 2-task jobs ask for ``--cpus-per-task=1 --overcommit``.

To keep the run short, the jobs of the selected tests are submitted together when the first of
them starts, and the 1-process reference encodes run meanwhile; each test then waits for its own
job(s) and checks them. SLURM runs as many at once as the node has CPUs (1 CPU each).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

# Under pytest-xdist (CI: -n 2 --dist loadgroup) every test of this file runs on one worker: see ONE_WORKER in
# tests/conftest.py (one local cluster per session, and the jobs of all these tests submitted together).
pytestmark = pytest.mark.slurm

TWO_TASKS = ["--ntasks=2", "--cpus-per-task=1", "--overcommit"]
ONE_CPU = ["--cpus-per-task=1"]


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------


def load_cache(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    shards = sorted((out / "shards").glob("*.safetensors"))
    assert shards, f"no shards in {out}/shards"
    for shard in shards:
        for name, tensor in load_file(shard).items():
            assert name not in tensors, f"{name} is stored twice ({shard.name})"
            tensors[name] = tensor
    return tensors


def assert_same_cache(out: Path, reference: Path) -> None:
    got, want = load_cache(out), load_cache(reference)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(got[name], want[name]), f"{name} differs from the 1-process run"


def vaecache_verify(out: Path) -> None:
    """`vaecache verify OUT` must exit 0 (run in-process: the same CLI, without a 3 s interpreter start)."""
    from typer.testing import CliRunner

    from vaecache.cli.app import app

    result = CliRunner().invoke(app, ["verify", str(out)])
    assert result.exit_code == 0, f"vaecache verify {out} exit {result.exit_code}:\n{result.output}"


def job_failure(job, out: Path | None = None, name: str = "vaecache-encode") -> str:
    """Everything useful when a job went wrong: its log and vaecache's per-rank logs."""
    parts = [f"job {job.job_id} exit {job.rc}; sbatch said: {job.sbatch_output.strip()}"]
    log = job.log(name)
    parts.append(f"--- {log}\n{log.read_text(errors='replace') if log.exists() else '(missing)'}")
    logs = out / "logs" if out is not None else None
    for rank_log in sorted(logs.glob("rank-*.log")) if logs is not None and logs.is_dir() else []:
        parts.append(f"--- {rank_log}\n{rank_log.read_text(errors='replace')}")
    return "\n".join(parts)


def assert_two_ranks_ran(job, out: Path, name: str = "vaecache-encode") -> None:
    for rank in (0, 1):
        rank_log = out / "logs" / f"rank-{rank:05d}.log"
        assert rank_log.is_file(), f"{rank_log} missing\n{job_failure(job, out, name)}"
        assert f"rank {rank}/2 " in rank_log.read_text(), f"{rank_log} is not from rank {rank} of 2"


# --------------------------------------------------------------------------------------------
# the jobs, submitted together
# --------------------------------------------------------------------------------------------

# job key -> test that checks it
_JOB_TESTS = {
    "dp2": "test_encode_sbatch_two_tasks_match_one_process[dp2]",
    "sp2": "test_encode_sbatch_two_tasks_match_one_process[sp2]",
    "torchrun": "test_encode_torchrun_sbatch_usr1_requeue_matches_one_process",
    "usage": "test_encode_sbatch_passes_vaecache_exit_code",
    "verify": "test_verify_sbatch",
    "requeue": "test_encode_sbatch_usr1_stops_requeues_and_resumes",
}

# The requeue job: 3 clips per scene (5-frame windows every 2 frames) = 9 batches of one clip, SP 2
# so both ranks see every batch, one shard per clip. The signal goes out when the first shard is
# committed, so there are batches left to stop before, however slow the machine.
REQUEUE_ARGS = ["--num-frames", "5", "--window-stride", "2"]
REQUEUE_JOB_ARGS = [*REQUEUE_ARGS, "--sp-size", "2", "--batch-size", "1", "--shard-size", "1"]


class Jobs:
    """The selected tests' jobs, submitted at once; ``result(key)`` waits for one: (Job, OUT, extra)."""

    def __init__(self, slurm, data: Path, references, root: Path, wanted: set[str]) -> None:
        self.slurm, self.data, self.references, self.root = slurm, data, references, root
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="sbatch")
        self.futures: dict[str, Future] = {}
        if "requeue" in wanted or "torchrun" in wanted:
            references.start("requeue", data, [*slurm.common_args, *REQUEUE_ARGS])
        if "requeue" in wanted:
            self._submit("requeue", lambda: self._requeue_job("requeue", "encode.sbatch", TWO_TASKS))
        if "torchrun" in wanted:  # --oversubscribe undoes the script's --exclusive so jobs can share the node
            self._submit("torchrun", lambda: self._requeue_job(
                "torchrun", "encode-torchrun.sbatch", ["--nodes=1", "--oversubscribe", *ONE_CPU],
                slurm.clean_env(VAECACHE_NPROC_PER_NODE="2")))
        if "dp2" in wanted:
            self._submit_encode("dp2", ["--sp-size", "1"])
        if "sp2" in wanted:
            self._submit_encode("sp2", ["--sp-size", "2"])
        if "usage" in wanted:  # no --vae: vaecache exits 2 before it touches anything
            self._submit("usage", lambda: self._sbatch("usage", "encode.sbatch", [
                str(data), str(root / "usage" / "out"), "--num-frames", "9", "--size", "64x64"],
                ["--ntasks=1", *ONE_CPU]))
        references.start("main", data, slurm.encode_args)
        if "verify" in wanted:
            self._submit("verify-good", lambda: self._sbatch("verify-good", "verify.sbatch",
                                                             [str(references.path("main"))], ONE_CPU))
            self._submit("verify-bad", self._verify_broken)

    def _submit(self, key: str, fn) -> None:
        self.futures[key] = self.pool.submit(fn)

    def _sbatch(self, key: str, script: str, args: list[str], opts: list[str], env=None, on_submit=None):
        return self.slurm.sbatch_wait(script, args, self.root / key / "submit", opts, env=env, on_submit=on_submit)

    def _submit_encode(self, key: str, extra: list[str], script: str = "encode.sbatch", opts: list[str] = TWO_TASKS,
                       env=None) -> None:
        out = self.root / key / "out"
        args = [str(self.data), str(out), *self.slurm.encode_args, *extra]
        self._submit(key, lambda: (self._sbatch(key, script, args, opts, env), out))

    def _verify_broken(self):
        broken = self.root / "verify-bad" / "cache"
        shutil.copytree(self.references.path("main"), broken)
        shard = sorted((broken / "shards").glob("*.safetensors"))[0]
        raw = bytearray(shard.read_bytes())
        raw[-1] ^= 0xFF  # flip bits in the last tensor's data: hash and values no longer match
        shard.write_bytes(bytes(raw))
        return self._sbatch("verify-bad", "verify.sbatch", [str(broken), "--threads", "1"], ONE_CPU)

    def _requeue_job(self, key: str, script: str, opts: list[str], env=None):
        """Run ``script`` with REQUEUE_JOB_ARGS; send the batch shell SIGUSR1 once the first shard is
        committed, and let the requeued job start soon. Returns (Job, OUT, events)."""
        out = self.root / key / "out"
        progress = out / "progress" / "rank-00000.jsonl"
        events: dict[str, object] = {}

        def interrupt(job_id: str) -> None:
            deadline = time.monotonic() + 240
            polls = 0
            while not (progress.exists() and progress.read_text().strip()):
                polls += 1
                if time.monotonic() > deadline or (polls % 20 == 0 and _job_over(job_id)):
                    return  # never got to a first shard: the test reports the job's logs
                time.sleep(0.05)
            # what --signal=B:USR1@120 does before the time limit: SIGUSR1 to the batch shell only
            subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)
            events["signalled"] = True
            # A requeued job may start only after AuthInfo cred_expire (30 s on the CI cluster, 120 s by
            # default); ask for it to start sooner so the test stays short. Not at once: slurmd refuses
            # ("Job credential revoked") a launch credential from the same second as the old attempt's end.
            while time.monotonic() < deadline:
                info = _scontrol_job(job_id)
                if int(info.get("Restarts", "0") or 0) >= 1 and info.get("JobState") == "PENDING":
                    time.sleep(2.5)
                    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True)
                    events["restart_now"] = True
                    return
                if _job_over(job_id, info):
                    return
                time.sleep(0.1)

        args = [str(self.data), str(out), *self.slurm.common_args, *REQUEUE_JOB_ARGS]
        return self._sbatch(key, script, args, opts, env=env, on_submit=interrupt), out, events

    def result(self, key: str):
        return self.futures[key].result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _job_over(job_id: str, info: dict[str, str] | None = None) -> bool:
    info = _scontrol_job(job_id) if info is None else info
    return not info or info.get("JobState") in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                                 "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def _scontrol_job(job_id: str) -> dict[str, str]:
    proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    fields: dict[str, str] = {}
    for item in proc.stdout.split():
        key, sep, value = item.partition("=")
        if sep:
            fields.setdefault(key, value)
    return fields


@pytest.fixture(scope="module")
def jobs(request, slurm, demo_data, references, tmp_path_factory):
    selected = {item.name for item in request.session.items if item.module is request.module}
    wanted = {key for key, test in _JOB_TESTS.items() if test in selected}
    pool = Jobs(slurm, demo_data, references, tmp_path_factory.mktemp("jobs"), wanted)
    try:
        yield pool
    finally:
        pool.close()


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sp_size", [1, 2], ids=["dp2", "sp2"])
def test_encode_sbatch_two_tasks_match_one_process(jobs, reference_cache, sp_size):
    """sbatch --ntasks=2 encode.sbatch: 2 ranks (DP 2 or SP 2), output equal to the 1-process run."""
    job, out = jobs.result(f"{'dp' if sp_size == 1 else 'sp'}2")
    assert job.rc == 0, job_failure(job, out)
    log = job.log("vaecache-encode")
    assert log.is_file(), f"job log not at the documented place {log}: {list(job.submit_dir.iterdir())}"
    text = log.read_text()
    assert f"job {job.job_id} attempt 0" in text and "ranks finished with exit code 0" in text, text
    assert f"2 (SP {sp_size})" in text, text  # rank 0's summary table: "ranks | 2 (SP n)"
    assert_two_ranks_ran(job, out)
    vaecache_verify(out)
    assert_same_cache(out, reference_cache)


def test_encode_torchrun_sbatch_usr1_requeue_matches_one_process(jobs, references):
    """encode-torchrun.sbatch: one srun task runs torchrun with 2 ranks on the node. SIGUSR1 to the
    batch shell becomes SIGTERM to torchrun and its ranks (they commit and stop), the job is
    requeued, and the second attempt completes the cache exactly like the 1-process run."""
    job, out, events = jobs.result("torchrun")
    name = "vaecache-encode-torchrun"
    text = job.log(name).read_text() if job.log(name).exists() else ""
    assert events.get("signalled"), job_failure(job, out, name)
    for expected in ("1 nodes x 2 ranks", "batch shell got SIGUSR1", f"requeued job {job.job_id}",
                     f"job {job.job_id} attempt 1", "torchrun finished with exit code 0"):
        assert expected in text, f"{expected!r} not in the job log\n{job_failure(job, out, name)}"
    assert job.rc == 0, job_failure(job, out, name)
    rank0 = (out / "logs" / "rank-00000.log").read_text()
    assert "stopped early (SIGTERM)" in rank0, rank0
    assert re.search(r"attempt 1, [1-8] clips already committed", rank0), f"no resume:\n{rank0}"
    assert_two_ranks_ran(job, out, name)
    vaecache_verify(out)
    assert_same_cache(out, references.path("requeue"))


def test_encode_sbatch_passes_vaecache_exit_code(jobs):
    """A usage error inside vaecache (no --vae) comes back as the job's exit code 2."""
    job = jobs.result("usage")
    assert job.rc == 2, job_failure(job)
    assert "--vae is required" in job.log("vaecache-encode").read_text()


def test_verify_sbatch(jobs):
    """verify.sbatch: exit 0 on a good cache, 1 on a cache with a corrupted shard."""
    job = jobs.result("verify-good")
    assert job.rc == 0, job_failure(job, name="vaecache-verify")
    assert "cache OK" in job.log("vaecache-verify").read_text()
    job = jobs.result("verify-bad")
    assert job.rc == 1, job_failure(job, name="vaecache-verify")
    assert "cache has problems" in job.log("vaecache-verify").read_text()


def test_encode_sbatch_usr1_stops_requeues_and_resumes(jobs, references):
    """The time-limit warning (--signal=B:USR1) reaches the batch shell only: the script forwards it
    to the ranks, they commit and exit 75, the script requeues the job and the next attempt resumes
    and ends with exactly the 1-process result."""
    job, out, events = jobs.result("requeue")
    text = job.log("vaecache-encode").read_text() if job.log("vaecache-encode").exists() else ""
    assert events.get("signalled"), job_failure(job, out)
    for expected in ("batch shell got SIGUSR1", "ranks finished with exit code 75", f"requeued job {job.job_id}",
                     f"job {job.job_id} attempt 1"):
        assert expected in text, f"{expected!r} not in the job log\n{job_failure(job, out)}"
    assert job.rc == 0, job_failure(job, out)
    rank0 = (out / "logs" / "rank-00000.log").read_text()
    assert "stopped early (SIGUSR1)" in rank0, rank0
    resumed = re.findall(r"attempt 1, (\d+) clips already committed", rank0)
    assert resumed and 0 < int(resumed[-1]) < 9, f"the second attempt did not resume:\n{rank0}"
    assert_two_ranks_ran(job, out)
    vaecache_verify(out)
    assert_same_cache(out, references.path("requeue"))
