"""Process-group set-up and teardown, and the collectives the rest of the program uses.

This is the one module that calls ``torch.distributed.init_process_group`` and
``destroy_process_group``. Everything else receives a :class:`DistContext` (or just a process
group) from :func:`distributed`.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as tdist
from torch.distributed import ProcessGroup

from vaecache.distributed import liveness
from vaecache.distributed.launch import RankInfo, export_master
from vaecache.distributed.mesh import Mesh, make_mesh
from vaecache.errors import DistributedError, UsageError, VaecacheError

log = logging.getLogger(__name__)
T = TypeVar("T")

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


def _classify(exc: BaseException) -> str | None:
    """"peer" (timeout / dead peer), "backend" (other communication failure) or None (not ours)."""
    if not isinstance(exc, RuntimeError):  # torch.distributed.DistError is a RuntimeError
        return None
    if _PEER_FAILURE.search(str(exc)):
        return "peer"
    if isinstance(exc, tdist.DistError) or _BACKEND_FAILURE.search(str(exc)):
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
        why = f" (a peer rank died or is stuck{limit}{_silent_note()})" if kind == "peer" else ""
        raise DistributedError(f"rank {who}: {op} in {where} failed after {elapsed:.1f} s{why}: {exc}") from exc


def _silent_note() -> str:
    """"; silent: rank 3 on node7 (pid 812), no heartbeat in 10 s (...)" from the heartbeats, where there are any."""
    live = liveness.active()
    names = live.silent_ranks() if live is not None else []
    if not names:
        return ""
    more = f" and {len(names) - 8} more" if len(names) > 8 else ""
    return "; silent: " + "; ".join(names[:8]) + more


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

    def send_each(self, make: Callable[[int], bytes | bytearray] | None, src: int = 0) -> bytearray:
        """Rank ``src`` makes each other rank's bytes in turn (``make(rank)``, one rank's in memory at a time) and
        sends them to it alone; every rank but ``src`` returns what it got (``src``: empty). Plain bytes, never
        unpickled: the caller chooses their format (JSON where they hold data). Should ``make`` fail, the ranks not
        served yet hear it as a DistributedError and ``src`` raises the error."""
        out = bytearray()
        if not self.is_distributed:
            return out
        device = self._reduce_device()
        with collective_errors("send_each", timeout_s=self.timeout_s):
            if self.info.rank == src:
                failure: Exception | None = None
                for rank in range(self.info.world_size):
                    if rank == src:
                        continue
                    data: bytes | bytearray = b""
                    if failure is None:
                        try:
                            data = make(rank)  # type: ignore[misc]
                        except Exception as exc:  # the others must not wait for bytes that never come
                            failure = exc
                    size = -1 if failure is not None else len(data)
                    tdist.send(torch.tensor([size], dtype=torch.int64, device=device), dst=rank)
                    if size > 0:
                        tdist.send(torch.frombuffer(bytearray(data) if isinstance(data, bytes) else data,
                                                    dtype=torch.uint8).to(device), dst=rank)
                    del data
                if failure is not None:
                    raise failure
                return out
            size = torch.zeros(1, dtype=torch.int64, device=device)
            tdist.recv(size, src=src)
            if int(size.item()) < 0:
                raise DistributedError(f"rank {self.info.rank}: rank {src} failed to make this rank's share")
            if size.item() > 0:
                out = bytearray(int(size.item()))
                if device.type == "cpu":  # received straight into `out`, no copy
                    tdist.recv(torch.frombuffer(out, dtype=torch.uint8), src=src)
                else:
                    got = torch.empty(len(out), dtype=torch.uint8, device=device)
                    tdist.recv(got, src=src)
                    out[:] = got.cpu().numpy().tobytes()
        return out

    def _all_reduce_int(self, value: int, op: Any, name: str) -> int:
        if not self.is_distributed:
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.int64, device=self._reduce_device())
        with collective_errors(name, timeout_s=self.timeout_s):
            tdist.all_reduce(t, op=op)
        return int(t.item())

    def all_reduce_sum(self, value: int) -> int:
        """Sum of ``value`` over all ranks (``value`` itself for a single process)."""
        return self._all_reduce_int(value, tdist.ReduceOp.SUM, "all_reduce(sum)")

    def on_rank0(self, fn: Callable[[], T]) -> T:
        """Run fn on rank 0 and hand its result, or its error, to every rank (so no rank waits forever)."""
        payload: Any = None
        if self.info.rank == 0:
            try:
                payload = ("ok", fn())
            except Exception as exc:  # every rank must hear of it, or they would wait in the broadcast
                payload = ("error", exc if isinstance(exc, VaecacheError)
                           else VaecacheError(f"rank 0: {type(exc).__name__}: {exc}"))
        payload = self.broadcast_object(payload)
        if payload[0] == "error":
            raise payload[1]
        return payload[1]

    def sp_any(self, flag: bool) -> bool:
        """True on every rank of this SP group if any of them has the flag set."""
        if self.mesh.sp_size == 1:
            return flag
        return any(self.sp_all_gather_object(flag))


def resolve_device(device: str, info: RankInfo | None = None) -> torch.device:
    """"auto" | "cpu" | "cuda" | "cuda:N" -> a torch.device (cuda: one GPU per local rank of `info`).

    The one device resolver: encode and verify --reencode get it through :func:`distributed`, plan
    calls it for its single process (info None)."""
    if info is None:
        info = RankInfo.from_env({})
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
    liveness_timeout_s: float = liveness.DEFAULT_LIVENESS_TIMEOUT_S,
) -> Iterator[DistContext]:
    """Set up torch.distributed for this process (when world > 1) and always tear it down.

    Reads :meth:`RankInfo.from_env`, checks ``sp_size`` against the world size before any
    network traffic, picks the device, initialises NCCL (CUDA) or gloo (CPU) with ``env://`` and
    ``timeout_s``, creates the SP groups and starts the heartbeats (:mod:`vaecache.distributed.liveness`; a rank
    silent for ``liveness_timeout_s`` fails the job naming it; 0 turns that off). When torch.distributed was already
    initialised by the caller it is reused and left initialised (only the SP groups made here are destroyed).
    """
    if timeout_s <= 0:
        raise UsageError(f"distributed timeout must be > 0 s, got {timeout_s}")
    liveness.check_timeout(liveness_timeout_s)
    info = RankInfo.from_env(environ)
    mesh = make_mesh(info.rank, info.world_size, sp_size)
    dev = resolve_device(device, info)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = timedelta(seconds=timeout_s)

    owns_world = False
    failure: BaseException | None = None
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
                env_added = export_master(info)
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
            liveness.start_liveness(info.rank, info.world_size, liveness_timeout_s)
        try:
            yield DistContext(info, mesh, dev, backend, sp_group, float(timeout_s))
        except Exception as exc:
            failure = exc
            raise
    finally:
        liveness.stop_liveness(failure)
        try:
            if owns_world:
                tdist.destroy_process_group()
            elif sp_group is not None and tdist.is_initialized():
                tdist.destroy_process_group(sp_group)
        except Exception as exc:  # never hide the error that brought us here
            log.warning("rank %d: destroying the process group failed: %s", info.rank, exc)
        for key in env_added:
            os.environ.pop(key, None)
