"""Fixtures for the SLURM tests: a real cluster, demo data, a 1-process reference cache, sbatch helpers.

``VAECACHE_TEST_SLURM`` says which cluster the tests may use:

* unset or ``local`` (the default): only a single-node cluster the tests start themselves on this machine with
  ``.ci/slurm/start_local_slurm.sh`` (as root; it apt-installs slurmctld, slurmd and munge when missing) and stop at
  the end of the session with ``.ci/slurm/stop_local_slurm.sh`` (by pidfile). Where a cluster already answers
  ``sinfo`` (a login node) nothing is submitted to it: the tests are skipped, saying how to use it. The one
  exception is a cluster a test session started and never stopped (killed before its teardown: the session's pid,
  which the start recorded, is gone): that one is stopped by pidfile and started afresh;
* ``existing``: the cluster that answers ``sinfo`` (jobs go to its default partition);
* ``off``: skipped.

When no cluster can be had the tests are skipped with the reason, except with ``CI=true`` or
``VAECACHE_REQUIRE_SLURM=1``, where that is a test failure.

Jobs run on the machine's node(s) and read/write pytest's tmp folders, so with an existing
multi-node cluster run pytest with ``--basetemp`` on a filesystem the compute nodes share.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = REPO / "scripts" / "slurm"
START = REPO / ".ci" / "slurm" / "start_local_slurm.sh"
STOP = REPO / ".ci" / "slurm" / "stop_local_slurm.sh"

LOCAL_DIR = Path(os.environ.get("SLURM_LOCAL_DIR", "/tmp/local-slurm"))  # where the start script keeps its state
SESSION_FILE = LOCAL_DIR / "test-session.pid"
"""The pid of the test session that started the local cluster, written after the start, removed after the stop."""

COMMON_ARGS = ["--vae", "builtin:tiny", "--size", "64x64", "--workers", "0", "--no-progress"]
ENCODE_ARGS = [*COMMON_ARGS, "--num-frames", "9"]
JOB_TIMEOUT_S = float(os.environ.get("VAECACHE_SLURM_JOB_TIMEOUT", "300"))

# Launcher variables of an enclosing job or torchrun must not leak into the jobs (a stale
# SLURM_NTASKS_PER_NODE or RANK would change how vaecache sees its world).
_LEAKY_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "TORCHELASTIC_")
_LEAKY_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "OMP_NUM_THREADS"}


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without launcher variables (SLURM_CONF kept), plus VAECACHE_PYTHON=this python."""
    env = {k: v for k, v in os.environ.items()
           if k == "SLURM_CONF" or not (k.startswith(_LEAKY_PREFIXES) or k in _LEAKY_NAMES)}
    env["VAECACHE_PYTHON"] = sys.executable
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _require_slurm() -> bool:
    return os.environ.get("CI", "").lower() == "true" or os.environ.get("VAECACHE_REQUIRE_SLURM", "") == "1"


def _no_cluster(reason: str) -> None:
    if _require_slurm():
        pytest.fail(f"SLURM is required here (CI=true or VAECACHE_REQUIRE_SLURM=1) but: {reason}", pytrace=False)
    pytest.skip(reason)


def _sinfo_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    # `scontrol ping` answers at once; sinfo retries a dead controller for ~9 s before it gives up.
    if shutil.which("scontrol") is not None:
        try:
            ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            return False
        if ping.returncode != 0 or " is UP" not in ping.stdout:
            return False
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%P %T %D"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0 and bool(proc.stdout.strip())


def left_over_by() -> int | None:
    """The pid of the test session that started the local cluster and is gone without stopping it; None where no
    session file is there or its session still runs (another pytest on this machine: its cluster is not ours)."""
    try:
        pid = int(SESSION_FILE.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return pid
    except PermissionError:
        return None
    return None


@dataclass
class Cluster:
    started_here: bool
    start_s: float


SLURM_CHOICES = ("local", "existing", "off")


def cluster_plan(choice: str, running: bool, root: bool, left_over: int | None = None) -> tuple[str, str]:
    """("existing" | "start" | "restart" | "none", reason): what the session does with VAECACHE_TEST_SLURM=`choice`,
    a cluster answering `sinfo` or not, as root or not, and `left_over`: the pid of a gone test session that started
    the local cluster and never stopped it. "none" skips (or fails under CI) with the reason; "restart" stops the
    left-over cluster by its pidfiles first."""
    if choice not in SLURM_CHOICES:
        return "none", f"VAECACHE_TEST_SLURM must be one of {', '.join(SLURM_CHOICES)}, got {choice!r}"
    if choice == "off":
        return "none", "VAECACHE_TEST_SLURM=off"
    if choice == "existing":
        if running:
            return "existing", "VAECACHE_TEST_SLURM=existing"
        return "none", "VAECACHE_TEST_SLURM=existing, but no SLURM cluster answers `sinfo` here"
    if running and left_over is not None and root:
        return "restart", (f"the local cluster test session {left_over} started (and never stopped) answers `sinfo`: "
                           "stopping it by its pidfiles and starting afresh")
    if running:
        return "none", ("a SLURM cluster already answers `sinfo` here (a login node?): the tests submit only to a "
                        "cluster they start themselves; set VAECACHE_TEST_SLURM=existing to submit these test jobs "
                        "to it")
    if not root:
        return "none", (f"starting a local single-node SLURM cluster needs root ({START.relative_to(REPO)}); as root "
                        "the tests start and stop their own, or set VAECACHE_TEST_SLURM=existing to use a running "
                        "cluster")
    return "start", "no cluster answers `sinfo`: starting a local one"


@pytest.fixture(scope="session")
def slurm_cluster() -> Cluster:
    choice = os.environ.get("VAECACHE_TEST_SLURM", "local") or "local"
    action, reason = cluster_plan(choice, choice != "off" and _sinfo_answers(), os.geteuid() == 0, left_over_by())
    if action == "restart":
        stop = subprocess.run(["bash", str(STOP)], capture_output=True, text=True, timeout=300)
        print(f"\n{reason} (exit {stop.returncode}):\n{stop.stdout}{stop.stderr}")
        SESSION_FILE.unlink(missing_ok=True)
        if _sinfo_answers():
            _no_cluster(f"{reason}, but a cluster still answers `sinfo` after {STOP.relative_to(REPO)}")
    if action == "none":
        _no_cluster(reason)
    if action == "existing":
        print("\nusing the SLURM cluster that is already running (VAECACHE_TEST_SLURM=existing):\n" + subprocess.run(
            ["sinfo"], capture_output=True, text=True).stdout)
        yield Cluster(started_here=False, start_s=0.0)
        return
    if shutil.which("sbatch") is None and shutil.which("apt-get") is None:
        _no_cluster("no SLURM cluster answers `sinfo`, SLURM is not installed and apt-get is not available")
    started = time.monotonic()
    try:
        proc = subprocess.run(["bash", str(START)], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as exc:
        subprocess.run(["bash", str(STOP)], capture_output=True, text=True, timeout=120)
        _no_cluster(f"{START.relative_to(REPO)} did not finish in {exc.timeout:.0f} s")
    elapsed = time.monotonic() - started
    if proc.returncode != 0:
        subprocess.run(["bash", str(STOP)], capture_output=True, text=True, timeout=120)
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        _no_cluster(f"{START.relative_to(REPO)} failed (exit {proc.returncode}):\n{tail}")
    print(f"\nstarted a local SLURM cluster in {elapsed:.1f} s:\n{proc.stdout}")
    try:
        SESSION_FILE.write_text(f"{os.getpid()}\n")
        yield Cluster(started_here=True, start_s=elapsed)
    finally:
        stop = subprocess.run(["bash", str(STOP)], capture_output=True, text=True, timeout=300)
        print(f"\nstopped the local SLURM cluster (exit {stop.returncode}):\n{stop.stdout}{stop.stderr}")
        SESSION_FILE.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 scenes x 2 cameras x 9 frames at 64x64."""
    data = tmp_path_factory.mktemp("slurm-data") / "data"
    subprocess.run([sys.executable, "-m", "vaecache", "demo-data", str(data), "--scenes", "3", "--cameras", "2",
                    "--frames", "9", "--size", "64x64"], check=True, env=clean_env(), capture_output=True)
    return data


class References:
    """1-process reference encodes (plain ``python -m vaecache encode``, no launcher variables), run in
    the background: ``start(key, data, args)`` launches one, ``path(key)`` waits for it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs: dict[str, tuple[subprocess.Popen, Path]] = {}
        self.done: dict[str, Path | str] = {}
        self.lock = threading.Lock()
        self.wait_lock = threading.Lock()

    def start(self, key: str, data: Path, args: list[str]) -> None:
        with self.lock:
            if key in self.runs:
                return
            out = self.root / key
            cmd = [sys.executable, "-m", "vaecache", "encode", str(data), "--out", str(out), *args]
            proc = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self.runs[key] = (proc, out)

    def path(self, key: str) -> Path:
        with self.wait_lock:  # one thread collects the process; the others get the cached answer
            if key not in self.done:
                proc, out = self.runs[key]
                output, _ = proc.communicate(timeout=600)
                ok = proc.returncode == 0
                self.done[key] = out if ok else (f"1-process reference encode {key} failed "
                                                 f"(exit {proc.returncode}):\n{output}")
            result = self.done[key]
        assert isinstance(result, Path), result
        return result

    def close(self) -> None:
        for proc, _ in self.runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory):
    refs = References(tmp_path_factory.mktemp("slurm-ref"))
    try:
        yield refs
    finally:
        refs.close()


@pytest.fixture(scope="session")
def reference_cache(references: References, demo_data: Path) -> Path:
    """demo_data encoded by one plain process with ENCODE_ARGS."""
    references.start("main", demo_data, ENCODE_ARGS)
    return references.path("main")


@dataclass
class Job:
    job_id: str
    rc: int
    submit_dir: Path
    wall_s: float
    sbatch_output: str

    def log(self, job_name: str) -> Path:
        """The documented log file: %x-%j.out in the submit dir."""
        return self.submit_dir / f"{job_name}-{self.job_id}.out"


def sbatch_wait(script: str, args: list[str], submit_dir: Path, sbatch_opts: list[str] | None = None,
                env: dict[str, str] | None = None, on_submit=None) -> Job:
    """``sbatch --wait`` from ``submit_dir``; returns the job's exit code. Cancels the job by id on timeout.

    ``on_submit(job_id)`` runs while the job is queued or running (sbatch --wait prints the id first).
    """
    submit_dir.mkdir(parents=True, exist_ok=True)
    cmd = ["sbatch", "--wait", "--parsable", *(sbatch_opts or []), str(SCRIPTS / script), *args]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=submit_dir, env=env or clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    job_id = first.strip().split(";")[0]
    try:
        if not job_id.isdigit():
            proc.wait(timeout=30)
            raise AssertionError(f"sbatch did not submit {script}: {first}{proc.stdout.read()}")
        if on_submit is not None:
            on_submit(job_id)
        rest, _ = proc.communicate(timeout=max(1.0, JOB_TIMEOUT_S - (time.monotonic() - started)))
    except BaseException:
        if job_id.isdigit():
            subprocess.run(["scancel", job_id], capture_output=True)
        proc.kill()
        proc.wait()
        raise
    job = Job(job_id, proc.returncode, submit_dir, time.monotonic() - started, first + rest)
    print(f"{script} {' '.join(args)}: job {job_id} exit {job.rc} after {job.wall_s:.1f} s "
          f"({' '.join(sbatch_opts or [])})")
    return job


class SlurmHelpers:
    """What the tests need from here, as a fixture."""

    encode_args = ENCODE_ARGS
    common_args = COMMON_ARGS
    clean_env = staticmethod(clean_env)
    sbatch_wait = staticmethod(sbatch_wait)


@pytest.fixture(scope="session")
def slurm(slurm_cluster: Cluster) -> SlurmHelpers:
    """The running cluster's helpers: ``slurm.sbatch_wait(...)``, ``slurm.clean_env(...)``."""
    return SlurmHelpers()
