"""Distributed state: who am I (torchrun / SLURM / single), the DP x SP mesh, init and teardown.

This is the one module that calls ``torch.distributed.init_process_group`` and
``destroy_process_group``. Everything else receives a :class:`DistContext` (or just a process
group) from :func:`distributed`::

    with distributed(sp_size=2, timeout_s=600) as ctx:
        clips = assign(all_clips, ctx.mesh.dp_rank, ctx.mesh.dp_size)
        latents = sp_encode(x, vae.encode, ctx.sp_group)
        if ctx.mesh.is_writer:
            ...

Parsing the environment (:meth:`RankInfo.from_env`, :func:`first_host`) and building the mesh
(:func:`make_mesh`) are pure and tested without processes.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import time
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist
from torch.distributed import ProcessGroup

from vaecache.errors import DistributedError, UsageError

__all__ = [
    "DistContext",
    "Mesh",
    "RankInfo",
    "collective_errors",
    "distributed",
    "expand_hostlist",
    "first_host",
    "make_mesh",
    "slurm_master_port",
]

log = logging.getLogger(__name__)

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
        if "RANK" in env or "WORLD_SIZE" in env:
            return cls._from_torchrun(env, job_id)
        ntasks = _env_int(env, "SLURM_NTASKS", _env_int(env, "SLURM_NPROCS", 1))
        if _slurm_in_step(env) and (ntasks > 1 or "SLURM_PROCID" in env):
            return cls._from_slurm(env, ntasks, job_id)
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
            raise DistributedError("none of SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE is set")
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


# ---------------------------------------------------------------------------------------------
# Mesh (pure)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mesh:
    """World = DP x SP. SP groups are contiguous blocks of sp_size ranks.

    With world 8 and sp_size 2 the SP groups are [0, 1], [2, 3], [4, 5], [6, 7]; each is one
    data-parallel replica (dp_rank 0..3) and its sp_rank 0 member writes the results.
    """

    rank: int
    world_size: int
    sp_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise UsageError(f"world size must be >= 1, got {self.world_size}")
        if self.sp_size < 1:
            raise UsageError(f"--sp-size must be >= 1, got {self.sp_size}")
        if self.world_size % self.sp_size != 0:
            choices = ", ".join(str(d) for d in range(1, self.world_size + 1) if self.world_size % d == 0)
            raise UsageError(
                f"--sp-size {self.sp_size} must divide the world size {self.world_size} "
                f"({self.world_size} processes cannot form groups of {self.sp_size}); "
                f"choose one of: {choices}"
            )
        if not 0 <= self.rank < self.world_size:
            raise UsageError(f"rank {self.rank} is outside world size {self.world_size}")

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas (SP groups)."""
        return self.world_size // self.sp_size

    @property
    def dp_rank(self) -> int:
        """Which SP group (data shard) this rank belongs to."""
        return self.rank // self.sp_size

    @property
    def sp_rank(self) -> int:
        """Position of this rank inside its SP group."""
        return self.rank % self.sp_size

    @property
    def is_writer(self) -> bool:
        """One rank per SP group writes output: the group's sp_rank 0."""
        return self.sp_rank == 0

    def sp_group_ranks(self, dp_rank: int | None = None) -> list[int]:
        """Global ranks of SP group ``dp_rank`` (default: this rank's group)."""
        dp = self.dp_rank if dp_rank is None else dp_rank
        if not 0 <= dp < self.dp_size:
            raise UsageError(f"dp rank {dp} is outside 0..{self.dp_size - 1}")
        return list(range(dp * self.sp_size, (dp + 1) * self.sp_size))


def make_mesh(rank: int, world_size: int, sp_size: int) -> Mesh:
    """Pure: the DP x SP layout for ``rank``; raises UsageError when sp_size does not divide world."""
    return Mesh(rank=rank, world_size=world_size, sp_size=sp_size)


# ---------------------------------------------------------------------------------------------
# Collective error translation
# ---------------------------------------------------------------------------------------------

# What gloo / NCCL / the TCP store say when a peer is gone or late.
_PEER_FAILURE = re.compile(
    r"timed?[ _-]?out|connection (?:reset|closed|refused)|closed by peer|broken pipe"
    r"|failed to pass monitoredbarrier|remote worker|watchdog|ncclRemoteError",
    re.IGNORECASE,
)
# Other failures inside the communication library (reported as DistributedError, without blaming a peer).
_BACKEND_FAILURE = re.compile(r"\bgloo\b|\bnccl\b|ProcessGroup|c10d|TCPStore", re.IGNORECASE)


_DIST_ERROR: type[Exception] = getattr(tdist, "DistError", RuntimeError)  # torch < 2.1 lacks it


def _classify(exc: BaseException) -> str | None:
    """"peer" (timeout / dead peer), "backend" (other communication failure) or None (not ours)."""
    if not isinstance(exc, RuntimeError):  # torch.distributed.DistError is a RuntimeError
        return None
    if _PEER_FAILURE.search(str(exc)):
        return "peer"
    if isinstance(exc, _DIST_ERROR) or _BACKEND_FAILURE.search(str(exc)):
        return "backend"
    return None


def group_timeout_s(group: ProcessGroup | None) -> float | None:
    """The collective timeout of ``group`` in seconds, when torch exposes it (else None)."""
    if group is None:
        group = tdist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return float(group._get_backend(torch.device(device)).options._timeout.total_seconds())
        except Exception:  # private API; only used to make a message more helpful
            continue
    return None


def describe_group(group: ProcessGroup | None) -> tuple[int, str]:
    """(this process's global rank, a label like ``SP group [2, 3]``) for error messages."""
    try:
        rank = tdist.get_rank()
    except Exception:
        rank = -1
    if group is None or group is tdist.group.WORLD:
        try:
            return rank, f"world group of {tdist.get_world_size()}"
        except Exception:
            return rank, "world group"
    try:
        return rank, f"SP group {tdist.get_process_group_ranks(group)}"
    except Exception:
        return rank, "SP group"


@contextmanager
def collective_errors(
    op: str,
    group: ProcessGroup | None = None,
    label: str | None = None,
    *,
    rank: int | None = None,
    timeout_s: float | None = None,
) -> Iterator[None]:
    """Re-raise a collective's failure as DistributedError naming this rank and the group.

    Timeouts and dead peers say so (with the elapsed time and the timeout); other errors from the
    communication backend are wrapped plainly; anything else (bad arguments, programming errors)
    passes through unchanged.
    """
    start = time.monotonic()
    try:
        yield
    except DistributedError:
        raise
    except Exception as exc:
        kind = _classify(exc)
        if kind is None:
            raise
        group_rank, where = describe_group(group)
        who = group_rank if rank is None else rank
        if label is not None:
            where = label
        elapsed = time.monotonic() - start
        timeout = group_timeout_s(group) if timeout_s is None else timeout_s
        limit = f"; timeout {timeout:g} s" if timeout is not None else ""
        why = f" (a peer rank died or is stuck{limit})" if kind == "peer" else ""
        raise DistributedError(f"rank {who}: {op} in {where} failed after {elapsed:.1f} s{why}: {exc}") from exc


# ---------------------------------------------------------------------------------------------
# Runtime context
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class DistContext:
    """What :func:`distributed` hands to the rest of the program."""

    info: RankInfo
    mesh: Mesh
    device: torch.device
    backend: str | None
    """``"nccl"``, ``"gloo"`` (or whatever an outer initialiser chose); None for a single process."""
    sp_group: ProcessGroup | None = None
    """This rank's SP ``ProcessGroup``; None when sp_size == 1 (``sp_encode`` then runs locally)."""
    timeout_s: float = 600.0

    @property
    def is_distributed(self) -> bool:
        """True when collectives go over a process group (world > 1)."""
        return self.backend is not None

    def _reduce_device(self) -> torch.device:
        # NCCL only moves CUDA tensors; gloo (and the cpu part of a mixed backend) moves CPU ones.
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def barrier(self) -> None:
        """World barrier (no-op for a single process). On gloo it names the ranks that never arrive."""
        if not self.is_distributed:
            return
        with collective_errors("barrier", timeout_s=self.timeout_s):
            if self.backend == "gloo":
                tdist.monitored_barrier(timeout=timedelta(seconds=self.timeout_s), wait_all_ranks=True)
            elif self.backend == "nccl" and self.device.type == "cuda":
                tdist.barrier(device_ids=[self.device.index])
            else:
                tdist.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), indexed by global rank."""
        if not self.is_distributed:
            return [obj]
        out: list[Any] = [None] * self.info.world_size
        with collective_errors("all_gather_object", timeout_s=self.timeout_s):
            tdist.all_gather_object(out, obj)
        return out

    def sp_all_gather_object(self, obj: Any) -> list[Any]:
        """Every SP-group member's ``obj``, indexed by sp_rank (``[obj]`` when sp_size == 1)."""
        if self.sp_group is None:
            return [obj]
        out: list[Any] = [None] * self.mesh.sp_size
        with collective_errors("all_gather_object", self.sp_group, timeout_s=self.timeout_s):
            tdist.all_gather_object(out, obj, group=self.sp_group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        if not self.is_distributed:
            return obj
        box = [obj]
        with collective_errors("broadcast_object", timeout_s=self.timeout_s):
            tdist.broadcast_object_list(box, src=src, device=self._reduce_device())
        return box[0]

    def _all_reduce_int(self, value: int, op: Any, name: str) -> int:
        if not self.is_distributed:
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.int64, device=self._reduce_device())
        with collective_errors(name, timeout_s=self.timeout_s):
            tdist.all_reduce(t, op=op)
        return int(t.item())

    def all_reduce_max(self, value: int) -> int:
        """Largest ``value`` over all ranks (``value`` itself for a single process)."""
        return self._all_reduce_int(value, tdist.ReduceOp.MAX, "all_reduce(max)")

    def all_reduce_min(self, value: int) -> int:
        """Smallest ``value`` over all ranks (``value`` itself for a single process)."""
        return self._all_reduce_int(value, tdist.ReduceOp.MIN, "all_reduce(min)")

    def all_reduce_sum(self, value: int) -> int:
        """Sum of ``value`` over all ranks (``value`` itself for a single process)."""
        return self._all_reduce_int(value, tdist.ReduceOp.SUM, "all_reduce(sum)")


def _pick_device(device: str, info: RankInfo) -> torch.device:
    """"auto" | "cpu" | "cuda" | "cuda:N" -> a torch.device (cuda: one GPU per local rank)."""
    spec = device.strip().lower()
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        spec = "cuda"
    if spec == "cuda" or spec.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device} but CUDA is not available on this machine")
        count = torch.cuda.device_count()
        if spec == "cuda":
            if count >= info.local_world_size:
                index = info.local_rank
            elif count == 1:
                index = 0  # the launcher bound one GPU to each task (e.g. srun --gpus-per-task=1)
            else:
                raise DistributedError(
                    f"rank {info.rank}: {info.local_world_size} processes on this node but only "
                    f"{count} CUDA devices are visible; launch at most one process per GPU"
                )
        else:
            try:
                index = int(spec.split(":", 1)[1])
            except ValueError:
                raise UsageError(f"--device {device!r} is not a device (use auto, cpu, cuda or cuda:N)") from None
            if not 0 <= index < count:
                raise UsageError(f"--device {device}: only {count} CUDA devices are visible")
        return torch.device("cuda", index)
    raise UsageError(f"--device {device!r} is not a device (use auto, cpu, cuda or cuda:N)")


def _new_sp_groups(mesh: Mesh, timeout: timedelta, backend: str | None) -> ProcessGroup | None:
    """Create every SP group (same order on every rank, as torch requires); return this rank's."""
    mine = None
    for dp in range(mesh.dp_size):
        ranks = mesh.sp_group_ranks(dp)
        with collective_errors("new_group", label=f"SP group {ranks}", timeout_s=timeout.total_seconds()):
            # timeout must be given: new_group does not inherit the world group's timeout.
            group = tdist.new_group(ranks=ranks, timeout=timeout, backend=backend)
        if dp == mesh.dp_rank:
            mine = group
    return mine


@contextmanager
def distributed(
    sp_size: int = 1,
    device: str = "auto",
    timeout_s: float = 600.0,
    environ: Mapping[str, str] | None = None,
) -> Iterator[DistContext]:
    """Set up torch.distributed for this process (when world > 1) and always tear it down.

    Reads :meth:`RankInfo.from_env`, checks ``sp_size`` against the world size before any
    network traffic, picks the device, initialises NCCL (CUDA) or gloo (CPU) with ``env://`` and
    ``timeout_s``, and creates the SP groups. When torch.distributed was already initialised by the
    caller it is reused and left initialised (only the SP groups made here are destroyed).
    """
    if timeout_s <= 0:
        raise UsageError(f"distributed timeout must be > 0 s, got {timeout_s}")
    info = RankInfo.from_env(environ)
    mesh = make_mesh(info.rank, info.world_size, sp_size)
    dev = _pick_device(device, info)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = timedelta(seconds=timeout_s)

    owns_world = False
    sp_group = None
    backend: str | None = None
    env_added: list[str] = []
    try:
        outer = tdist.is_available() and tdist.is_initialized()
        if outer and (tdist.get_world_size(), tdist.get_rank()) != (info.world_size, info.rank):
            raise DistributedError(
                f"torch.distributed is already initialised as rank {tdist.get_rank()} of "
                f"{tdist.get_world_size()}, but the environment ({info.source}) says rank {info.rank} "
                f"of {info.world_size}"
            )
        if info.world_size > 1:
            if outer:
                backend = str(tdist.get_backend())
                log.debug("rank %d: reusing the existing %s process group", info.rank, backend)
            else:
                backend = "nccl" if dev.type == "cuda" else "gloo"
                env_added = _export_master(info)
                kwargs: dict[str, Any] = {}
                if backend == "nccl" and "device_id" in inspect.signature(tdist.init_process_group).parameters:
                    kwargs["device_id"] = dev
                where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
                log.debug("rank %d/%d: init %s at %s", info.rank, info.world_size, backend, where)
                with collective_errors(
                    "init_process_group",
                    label=f"rendezvous at {where} (world {info.world_size}, {backend})",
                    rank=info.rank,
                    timeout_s=timeout_s,
                ):
                    tdist.init_process_group(
                        backend=backend,
                        init_method="env://",
                        rank=info.rank,
                        world_size=info.world_size,
                        timeout=timeout,
                        **kwargs,
                    )
                owns_world = True
            if mesh.sp_size > 1:
                # An outer mixed backend ("cpu:gloo,cuda:nccl") is kept for the groups as well.
                sp_group = _new_sp_groups(mesh, timeout, None)
        yield DistContext(info, mesh, dev, backend, sp_group, float(timeout_s))
    finally:
        try:
            if owns_world:
                tdist.destroy_process_group()
            elif sp_group is not None and tdist.is_initialized():
                tdist.destroy_process_group(sp_group)
        except Exception as exc:  # never hide the error that brought us here
            log.warning("rank %d: destroying the process group failed: %s", info.rank, exc)
        for key in env_added:
            os.environ.pop(key, None)


def _export_master(info: RankInfo) -> list[str]:
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
