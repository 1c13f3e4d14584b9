"""Who am I: rank, world and rendezvous address read from the launcher (torchrun, SLURM, or none). Pure."""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from vaecache.errors import DistributedError

DEFAULT_MASTER_PORT = 29500
"""Base of the MASTER_PORT derived from a SLURM job id (see :func:`slurm_master_port`)."""

_SLURM_PORT_SPAN = 20000


# ---------------------------------------------------------------------------------------------
# Hostlists (pure)
# ---------------------------------------------------------------------------------------------


def _split_top_level(text: str, what: str) -> list[str]:
    """Split on commas that are not inside ``[...]``."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise DistributedError(f"cannot parse {what} {text!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise DistributedError(f"cannot parse {what} {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise DistributedError(f"cannot parse {what} {text!r}: unbalanced '['")
    parts.append(text[start:])
    return parts


def _expand_bracket(body: str, nodelist: str) -> Iterator[str]:
    """Expand the inside of one ``[...]``: ``001-004,007`` -> 001 002 003 004 007 (width kept)."""
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise DistributedError(f"cannot parse hostlist {nodelist!r}: bad range {item!r}")
        if not sep:
            yield lo
            continue
        first, last = int(lo), int(hi)
        if last < first:
            raise DistributedError(f"cannot parse hostlist {nodelist!r}: range {item!r} runs backwards")
        width = len(lo)  # SLURM keeps the zero padding of the lower bound
        for n in range(first, last + 1):
            yield str(n).zfill(width)


def _expand_host_pattern(pattern: str, nodelist: str) -> Iterator[str]:
    """Expand one host pattern that may hold several bracket groups (``r[1-2]n[01-02]``)."""
    if not pattern:
        raise DistributedError(f"cannot parse hostlist {nodelist!r}: empty host name")
    match = re.search(r"\[([^\]]*)\]", pattern)
    if match is None:
        if "[" in pattern or "]" in pattern:
            raise DistributedError(f"cannot parse hostlist {nodelist!r}: stray bracket in {pattern!r}")
        yield pattern
        return
    head, tail = pattern[: match.start()], pattern[match.end() :]
    for value in _expand_bracket(match.group(1), nodelist):
        for rest in _expand_host_pattern(tail, nodelist) if tail else iter(("",)):
            yield head + value + rest


def expand_hostlist(nodelist: str) -> Iterator[str]:
    """Lazily expand a SLURM hostlist (``node[001-004,007],gpu12``) into host names, in order."""
    text = nodelist.strip()
    if not text:
        raise DistributedError("cannot parse hostlist: it is empty")
    for pattern in _split_top_level(text, "hostlist"):
        yield from _expand_host_pattern(pattern.strip(), nodelist)


def first_host(nodelist: str) -> str:
    """First host of a SLURM hostlist: ``"node[001-004,007],gpu12"`` -> ``"node001"``.

    Pure python (no ``scontrol``); only the first host is expanded, so huge ranges are cheap.
    """
    return next(expand_hostlist(nodelist))


def _tasks_per_node(value: str) -> list[int]:
    """Expand SLURM_TASKS_PER_NODE (``"2(x3),1"`` -> ``[2, 2, 2, 1]``)."""
    counts: list[int] = []
    for item in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise DistributedError(f"cannot parse SLURM_TASKS_PER_NODE={value!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def slurm_master_port(job_id: str | None, step_id: str | None = None) -> int:
    """MASTER_PORT used when SLURM did not provide one: ``29500 + (job_id + 1009 * step_id) % 20000``.

    Every task of a step derives the same port without talking to each other; two jobs sharing a
    first node collide only when their ids are equal modulo 20000, and two concurrent steps of one
    job get different ports. A non-numeric id is hashed (crc32) first; no id gives 29500.
    """
    if not job_id:
        return DEFAULT_MASTER_PORT
    number = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    step = int(step_id) if step_id and step_id.isdigit() else 0
    return DEFAULT_MASTER_PORT + (number + 1009 * step) % _SLURM_PORT_SPAN


# ---------------------------------------------------------------------------------------------
# RankInfo (pure)
# ---------------------------------------------------------------------------------------------


def _env_int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None or raw.strip() == "":
        if default is None:
            raise DistributedError(f"{key} is not set (needed to work out this process's rank)")
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise DistributedError(f"{key}={raw!r} is not an integer") from None


def _slurm_in_step(env: Mapping[str, str]) -> bool:
    """True inside an ``srun`` step; False in an sbatch batch shell (which has no step id)."""
    return "SLURM_STEP_ID" in env or "SLURM_STEPID" in env


def _tolerant_int(env: Mapping[str, str], *names: str, default: int) -> int:
    for name in names:
        try:
            return int(env[name])
        except (KeyError, ValueError):
            continue
    return default


def launcher_of(env: Mapping[str, str], strict: bool = False) -> str:
    """The one rule for who launched this process: "torchrun" (RANK or WORLD_SIZE set), "slurm" (inside an srun
    step with more than one task or a SLURM_PROCID: the sbatch batch shell itself is a single process), or
    "single". `strict`: an unparsable task count is a DistributedError (else it counts as one task)."""
    if "RANK" in env or "WORLD_SIZE" in env:
        return "torchrun"
    if _slurm_in_step(env) and (_slurm_tasks(env, strict) > 1 or "SLURM_PROCID" in env):
        return "slurm"
    return "single"


def _slurm_tasks(env: Mapping[str, str], strict: bool) -> int:
    if strict:
        return _env_int(env, "SLURM_NTASKS", _env_int(env, "SLURM_NPROCS", 1))
    return _tolerant_int(env, "SLURM_NTASKS", "SLURM_NPROCS", default=1)


def launcher_rank_world(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(rank, world size) the launcher gave this process, by launcher_of's rule, reading nothing but the
    environment (the CLI asks before torch is imported, to print a usage error once, on rank 0). Unparsable values
    count as rank 0 of 1; RankInfo.from_env reports them properly when the run sets up."""
    env = os.environ if environ is None else environ
    source = launcher_of(env)
    if source == "torchrun":
        return _tolerant_int(env, "RANK", default=0), _tolerant_int(env, "WORLD_SIZE", default=1)
    if source == "slurm":
        return _tolerant_int(env, "SLURM_PROCID", default=0), _slurm_tasks(env, strict=False)
    return 0, 1


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job, read from the launcher's environment variables."""

    rank: int
    """Global rank, 0 <= rank < world_size."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank among the processes on this node; picks the GPU."""
    local_world_size: int
    """Number of processes on this node."""
    node_rank: int
    """Index of this node."""
    master_addr: str | None
    """Rendezvous host (None for a single process, or when the launcher gave none)."""
    master_port: int | None
    """Rendezvous port (None for a single process, or when the launcher gave none)."""
    source: str
    """Which launcher the values came from: ``"torchrun"``, ``"slurm"`` or ``"single"``."""
    job_id: str | None = None
    """SLURM_JOB_ID when present, whatever the source."""

    def __post_init__(self) -> None:
        where = f"(from {self.source} environment)"
        if self.world_size < 1:
            raise DistributedError(f"world size {self.world_size} must be >= 1 {where}")
        if not 0 <= self.rank < self.world_size:
            raise DistributedError(f"rank {self.rank} is outside world size {self.world_size} {where}")
        if not 1 <= self.local_world_size <= self.world_size:
            raise DistributedError(
                f"local world size {self.local_world_size} must be in 1..{self.world_size} {where}"
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise DistributedError(
                f"local rank {self.local_rank} is outside local world size {self.local_world_size} {where}"
            )
        if self.node_rank < 0:
            raise DistributedError(f"node rank {self.node_rank} must be >= 0 {where}")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise DistributedError(f"master port {self.master_port} is not a valid TCP port {where}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RankInfo:
        """Read torchrun variables first, then a SLURM step, else a single process (rank 0 of 1).

        SLURM counts only inside a step (``srun``: SLURM_STEP_ID set) with more than one task or a
        SLURM_PROCID, so the sbatch batch shell itself runs as a single process.
        """
        env = os.environ if environ is None else environ
        job_id = env.get("SLURM_JOB_ID") or None
        source = launcher_of(env, strict=True)
        if source == "torchrun":
            return cls._from_torchrun(env, job_id)
        if source == "slurm":
            return cls._from_slurm(env, _slurm_tasks(env, strict=True), job_id)
        return cls(0, 1, 0, 1, 0, None, None, "single", job_id)

    @classmethod
    def _from_torchrun(cls, env: Mapping[str, str], job_id: str | None) -> RankInfo:
        if "RANK" not in env or "WORLD_SIZE" not in env:
            missing = "RANK" if "RANK" not in env else "WORLD_SIZE"
            raise DistributedError(
                f"{missing} is not set although other torchrun variables are (RANK and WORLD_SIZE go together)"
            )
        rank = _env_int(env, "RANK")
        world = _env_int(env, "WORLD_SIZE")
        # torchrun sets all of these; other torchrun-style launchers may not: assume one node.
        local_world = _env_int(env, "LOCAL_WORLD_SIZE", world)
        local_rank = _env_int(env, "LOCAL_RANK", rank % max(local_world, 1))
        node_rank = _env_int(env, "GROUP_RANK", rank // max(local_world, 1))
        port = _env_int(env, "MASTER_PORT") if env.get("MASTER_PORT") else None
        addr = env.get("MASTER_ADDR") or None
        return cls(rank, world, local_rank, local_world, node_rank, addr, port, "torchrun", job_id)

    @classmethod
    def _from_slurm(cls, env: Mapping[str, str], ntasks: int, job_id: str | None) -> RankInfo:
        rank = _env_int(env, "SLURM_PROCID")
        node_rank = _env_int(env, "SLURM_NODEID", 0 if ntasks == 1 else None)
        # The step's layout first: SLURM_NTASKS_PER_NODE is the job's request and is inherited by
        # every step, even one launched with another layout (e.g. srun -n1 inside a bigger job).
        layout_key = next((k for k in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if env.get(k)), None)
        if layout_key is not None:
            counts = _tasks_per_node(env[layout_key])
            if node_rank >= len(counts):
                raise DistributedError(
                    f"SLURM_NODEID={node_rank} but {layout_key}={env[layout_key]!r} lists only {len(counts)} nodes"
                )
            local_world = counts[node_rank]
        elif env.get("SLURM_NTASKS_PER_NODE"):
            local_world = _env_int(env, "SLURM_NTASKS_PER_NODE")
        elif ntasks == 1:
            local_world = 1
        else:
            raise DistributedError("none of SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE "
                                   "is set")
        local_rank = _env_int(env, "SLURM_LOCALID", 0 if local_world == 1 else None)
        addr = env.get("MASTER_ADDR") or None
        if addr is None:
            # Rank 0 runs on the step's first node, which is not the job's first node with srun -w/-x/--relative.
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if not nodelist:
                raise DistributedError(
                    "MASTER_ADDR is not set and neither is SLURM_STEP_NODELIST or SLURM_JOB_NODELIST to derive it from"
                )
            addr = first_host(nodelist)
        port = (_env_int(env, "MASTER_PORT") if env.get("MASTER_PORT")
                else slurm_master_port(job_id, env.get("SLURM_STEP_ID")))
        return cls(rank, ntasks, local_rank, local_world, node_rank, addr, port, "slurm", job_id)


def export_master(info: RankInfo) -> list[str]:
    """Put MASTER_ADDR/PORT from ``info`` into os.environ for env:// when missing; return what was added."""
    wanted = {}
    for key, value in (("MASTER_ADDR", info.master_addr), ("MASTER_PORT", info.master_port)):
        if os.environ.get(key):
            continue
        if value is None:
            raise DistributedError(
                f"rank {info.rank}: {key} is not set; the launcher ({info.source}) must provide the rendezvous address"
            )
        wanted[key] = str(value)
    os.environ.update(wanted)
    return list(wanted)
