"""Helpers shared by the benchmark scripts: machine facts, load, medians, RSS sampling, timed subprocesses.

Not part of the vaecache package: the scripts put their own folder on sys.path and import this.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

SCRIPTS = Path(__file__).resolve().parent


def cpu_model() -> str:
    """The CPU model name as lscpu prints it (from /proc/cpuinfo; platform.processor() elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_avg() -> list[float]:
    """1, 5 and 15 minute load averages (what `uptime` shows); other jobs on the cores show up here."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine_info(device: str | None = None) -> dict[str, Any]:
    """CPU, cores, memory, versions and the load at the start. Imports torch only if it is already imported."""
    from importlib import metadata

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    torch = sys.modules.get("torch")
    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": usable,
        "memory_gib": _mem_total_gib(),
        "python": platform.python_version(),
        "torch": torch.__version__ if torch else metadata.version("torch"),
        "torch_threads": torch.get_num_threads() if torch else None,
        "cuda": (torch.cuda.get_device_name(0) if torch.cuda.is_available() else None) if torch else None,
        "device": device,
        "load_avg_at_start": load_avg(),
    }
    return info


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (the smallest value with at least q of the values at or below it)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])


def rnd(value: float, digits: int = 3) -> float:
    return float(f"{value:.{digits}g}") if value == value and value not in (float("inf"), float("-inf")) else value


# --------------------------------------------------------------------------- memory


def _mem_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in KiB. PSS splits pages shared with forked workers between them."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
                    break
    except OSError:
        try:
            with open(f"/proc/{pid}/status") as handle:
                for line in handle:
                    if line.startswith("VmRSS:"):
                        rss = pss = int(line.split()[1])
        except OSError:
            pass
    return rss, pss


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/children") as handle:
                    found.extend(int(x) for x in handle.read().split())
            except OSError:
                continue
    except OSError:
        pass
    return found


def tree_mem_mb(pid: int | None = None) -> tuple[float, float]:
    """(RSS, PSS) of a process plus all its descendants (DataLoader workers, torchrun ranks), in MiB.

    Summed RSS counts pages shared by forked processes once per process; PSS counts them once in total.
    """
    root = os.getpid() if pid is None else pid
    rss = pss = 0
    stack, seen = [root], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        r, p = _mem_kib(current)
        rss, pss = rss + r, pss + p
        stack.extend(_children(current))
    return rss / 1024, pss / 1024


class RssSampler:
    """Samples RSS and PSS of this process and its descendants every `interval` s; `.peak_mb` (RSS) and
    `.peak_pss_mb` after the block. Sampling misses spikes shorter than the interval."""

    def __init__(self, interval: float = 0.05, pid: int | None = None) -> None:
        self.interval, self.pid = interval, pid
        self.peak_mb = 0.0
        self.peak_pss_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        rss, pss = tree_mem_mb(self.pid)
        self.peak_mb, self.peak_pss_mb = max(self.peak_mb, rss), max(self.peak_pss_mb, pss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def cpu_seconds() -> float:
    """user+sys CPU of this process (all threads) plus its reaped children (e.g. finished DataLoader workers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def pid_cpu_seconds(pid: int) -> float:
    """user+sys CPU so far of another running process (Linux /proc; 0.0 where it cannot be read)."""
    import os

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


class Endpoint(str):
    """A server's URL that also names its process (`pid`), so a benchmark can charge the server its own CPU."""

    pid: int


def maxrss_mb(who: int = resource.RUSAGE_SELF) -> float:
    """Lifetime peak RSS (Linux reports KiB)."""
    return resource.getrusage(who).ru_maxrss / 1024


# --------------------------------------------------------------------------- subprocesses


@dataclass
class Timed:
    """A finished subprocess: wall seconds, CPU seconds of it and all its descendants, output."""

    returncode: int
    wall_s: float
    cpu_s: float
    stdout: str
    stderr: str


HWM_SOURCE = textwrap.dedent("""
    def hwm_mb():
        # VmHWM: this process's peak RSS. Not getrusage's ru_maxrss, which a child inherits across exec.
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
""")
"""Source of `hwm_mb()` for the scripts benchmarks run in a fresh child process (`python -c HWM_SOURCE + ...`)."""


def run_timed(cmd: Sequence[str], env: dict[str, str] | None = None, timeout: float = 1800.0,
              cwd: str | Path | None = None) -> Timed:
    """Run cmd to completion. CPU time is the RUSAGE_CHILDREN delta: user+sys of every reaped descendant."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(list(map(str, cmd)), env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Timed(proc.returncode, wall, cpu, proc.stdout, proc.stderr)


def check(result: Timed, what: str) -> None:
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-25:])
        raise SystemExit(f"{what} failed with exit code {result.returncode}:\n{tail}")


def child_env(threads: int | None = None, pythonpath: Sequence[Path] = ()) -> dict[str, str]:
    """os.environ without launcher variables (so a child is never mistaken for a rank of this job)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "VAECACHE_FAULT"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                         "GROUP_RANK", "TORCHELASTIC_RUN_ID")}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if pythonpath:
        parts = [str(p) for p in pythonpath] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def torchrun_cmd(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")


def log_span_s(log_file: Path, last_marker: str = " done: ") -> float | None:
    """Seconds between the first line of a vaecache rank log and the line containing `last_marker`.

    The first line is written after the VAE is loaded and OUT is prepared; `done:` after the manifest.
    """
    def stamp(line: str) -> float | None:
        match = _LOG_TIME.match(line)
        if not match:
            return None
        return time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")) + int(match.group(2)) / 1000

    try:
        lines = log_file.read_text().splitlines()
    except OSError:
        return None
    first = next((stamp(line) for line in lines if stamp(line) is not None), None)
    last = next((stamp(line) for line in reversed(lines) if last_marker in line and stamp(line) is not None), None)
    if first is None or last is None:
        return None
    return last - first


# --------------------------------------------------------------------------- output


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width table (stderr; stdout carries the JSON)."""
    cells = [[str(c) for c in header]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(cells[0], widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in cells[1:]]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def emit(result: dict[str, Any], human: str) -> None:
    """Human table to stderr, JSON to stdout."""
    print(human, file=sys.stderr)
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    sys.stdout.flush()


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def s3_server(log_file: Path, nice: int = 0) -> Iterator[Endpoint]:
    """moto's standalone S3 server (a real S3-protocol server process, `moto[server]` from the test extras) on a
    free loopback port, its request log in `log_file`; the AWS environment of this process points at it while the
    block runs. `nice` > 0: the server runs at that lower CPU priority (nice(1)). Yields the endpoint URL (its
    `pid`: the server's process)."""
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    log = open(log_file, "wb")
    server = subprocess.Popen([*(["nice", "-n", str(nice)] if nice else []),
                               sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=log)
    saved = {name: os.environ.get(name) for name in S3_ENV}
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": endpoint})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=2).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"moto's S3 server did not start on {endpoint} "
                                     "(pip install 'moto[server]')") from None
                time.sleep(0.2)
        served = Endpoint(endpoint)
        served.pid = server.pid
        yield served
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


S3_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3")


def s3_requests(log_file: Path, start: int) -> tuple[dict[str, int], int]:
    """Requests the S3 server logged after byte `start` of its log, by kind (LIST: a GET with a listing query; GET
    range: a GET answered 206), and the log's new end."""
    import re

    data = Path(log_file).read_bytes()
    counts: dict[str, int] = {}
    for line in data[start:].decode("utf-8", "replace").splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)  # werkzeug colours some status codes
        found = re.search(r'"(GET|PUT|POST|HEAD|DELETE) ([^ ]*) HTTP/[0-9.]+" ([0-9]{3})', line)
        if not found:
            continue
        method, target, status = found.groups()
        kind = "LIST" if method == "GET" and ("list-type=" in target or "prefix=" in target or "delimiter=" in target) \
            else "GET range" if method == "GET" and status == "206" else method
        counts[kind] = counts.get(kind, 0) + 1
    return counts, len(data)
