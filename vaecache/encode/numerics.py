"""What decides the last bits of the latents besides the settings: torch, the device kind and, on CPU, the
instruction set and the intra-op thread count; and how a rank's cores are shared between the encode and its
decode workers."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from vaecache.differences import describe_differences
from vaecache.distributed.context import DistContext
from vaecache.errors import UsageError

log = logging.getLogger("vaecache")


def run_numerics(device: torch.device, threads: int) -> dict[str, Any]:
    """What decides the last bits of the latents besides the settings: torch, the device kind and, on CPU, the
    kernels' instruction set and the intra-op thread count (oneDNN splits a convolution's work by it).

    Part of the run fingerprint: a resume on another kind of GPU, another torch or (CPU) another thread count
    would otherwise add latents that differ from the committed ones in the last bits, unnoticed."""
    numerics: dict[str, Any] = {"torch": torch.__version__, "device": device.type}
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        numerics.update(gpu=torch.cuda.get_device_name(device), capability=f"{major}.{minor}",
                        cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    elif device.type == "cpu":
        numerics.update(cpu_capability=torch.backends.cpu.get_cpu_capability(), threads=threads)
    return numerics


def peer_numerics(ctx: DistContext, numerics: dict[str, Any], allow_other: bool) -> list[dict[str, Any]]:
    """Every rank's numerics, gathered: the ones other than this rank's (none unless `allow_other`: a rank computing
    with other numerics is a UsageError naming it, since its latents would differ in the last bits)."""
    others: list[dict[str, Any]] = []
    for peer, theirs in enumerate(ctx.all_gather_object(numerics)):
        if theirs == numerics or theirs in others:
            continue
        if not allow_other:
            differ = "; ".join(describe_differences(numerics, theirs))
            raise UsageError(f"rank {peer} computes with other numerics than rank {ctx.info.rank} ({differ}): its "
                             "latents would differ in the last bits; run every rank on the same kind of device and "
                             "torch (on CPU the same OMP_NUM_THREADS), or --allow-other-numerics to accept that "
                             "(recorded)")
        others.append(theirs)
    return others


@dataclass(frozen=True)
class ThreadBudget:
    """A rank's share of its machine's cores: the torch intra-op threads of the encode, and the FFmpeg threads per
    video each of its decode workers opens."""

    torch: int
    decode: int


def thread_budget(device: torch.device, ranks_on_node: int, workers: int, recorded: int | None = None,
                  warn: bool = True) -> ThreadBudget:
    """On CPU, give the VAE the cores this rank can use (this machine's, shared by `ranks_on_node` ranks) minus its
    decode workers, and set torch's thread count to it; OMP_NUM_THREADS wins, then the count `recorded` by the cache
    being resumed (another count would change the latents' last bits; `warn`: say so). The decode workers share
    what the encode leaves (decode_thread_budget).

    torch's default (every core) plus decode workers oversubscribes the machine, and busy-waiting
    OpenMP threads then slow the encode several-fold as soon as anything else runs."""
    cores = cores_per_rank(ranks_on_node)
    if device.type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        fitting = max(1, cores - workers)
        if recorded and recorded != fitting and warn:
            log.warning("resuming with %d torch threads per rank, as the cache records (this machine would give %d): "
                        "another count changes the latents' last bits", recorded, fitting)
        torch.set_num_threads(recorded or fitting)
    threads = torch.get_num_threads()
    # On CUDA the main thread only launches kernels and copies: one core.
    return ThreadBudget(threads, decode_thread_budget(cores, workers, threads if device.type == "cpu" else 1))


@contextlib.contextmanager
def torch_threads_kept() -> Iterator[None]:
    """torch's intra-op thread count as it was found, once the block ends: an encode or a plan run inside a
    longer-lived process (a notebook, a test session) sets its own count and then leaves the caller's alone."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def cores_per_rank(ranks_on_node: int) -> int:
    """This process's usable cores shared by `ranks_on_node` ranks (at least one each)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, ranks_on_node))


def decode_thread_budget(cores: int, workers: int, main_threads: int) -> int:
    """FFmpeg threads per video a decode worker opens: the `cores` of a rank its main process leaves, shared by
    its `workers` (with none, the main process decodes between forwards and may use every core).

    FFmpeg's own default (a thread per core of the machine, in every worker) had decoding preempt the encode:
    on 2 cores with one worker the same forward ran 4-7% slower inside vaecache than alone (scripts/bench.py)."""
    if not workers:
        return max(1, cores)
    return max(1, (cores - main_threads) // workers)
