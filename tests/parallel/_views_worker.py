"""One rank of the multi-process tests in test_parallel.py (run as a script, torchrun-style env).

    RANK=.. WORLD_SIZE=.. LOCAL_RANK=.. MASTER_ADDR=.. MASTER_PORT=.. python _views_worker.py SCENARIO OUTDIR

Each rank writes OUTDIR/rank-<r>.json; the test process reads and judges them. Every check that
can be done locally (torch.equal against the single-process reference, RNG state) is done here;
cross-rank comparisons (digests) are done by the test.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from vaecache.distributed.context import distributed
from vaecache.errors import DistributedError
from vaecache.parallel import gather_views, plan_sp, sp_encode

# (name, per-view shape, dtype). Values are small integers so every encode below is exact and a
# view's latent cannot depend on which other views share its batch.
SPECS: list[tuple[str, tuple[int, ...], torch.dtype]] = [
    ("video-f32", (3, 2, 4, 4), torch.float32),
    ("video-bf16", (2, 1, 4, 2), torch.bfloat16),
    ("mat-f16", (5,), torch.float16),
    ("vec-i16", (), torch.int16),  # gloo cannot all_gather int16: exercises the bytes path
]
MAX_VIEWS = 9


def encode_fn(x: torch.Tensor) -> torch.Tensor:
    """A stand-in VAE: per-view, deterministic, changes shape, and consumes the global RNG."""
    torch.rand(3)  # sp_encode must hide this from the caller
    if x.dim() == 5:  # (B, C, T, H, W) -> (B, 2C, T, H/2, W/2)
        b, c, t, h, w = x.shape
        y = x.reshape(b, c, t, h // 2, 2, w // 2, 2).sum((4, 6))
        return torch.cat([y, y * y - 1], dim=1)
    if x.dim() == 2:
        return torch.cat([x * 2 + 1, x * x], dim=1)
    return x * 3 - 1


def make_input(spec_index: int, num_views: int, group_size: int, dp_rank: int) -> torch.Tensor:
    """Deterministic views; different for every DP group, so a gather on the wrong group shows."""
    _, shape, dtype = SPECS[spec_index]
    gen = torch.Generator().manual_seed(100_000 * spec_index + 1_000 * group_size + 10 * num_views + dp_rank)
    x = torch.randint(-4, 5, (num_views, *shape), generator=gen).to(dtype)
    x.view(num_views, -1)[:, 0] = dp_rank  # every view carries its DP group: no two groups collide
    return x


def digest(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw + str((tuple(t.shape), t.dtype)).encode()).hexdigest()[:16]


def contiguous_groups(world: int, size: int) -> Any:
    """Create every contiguous group of ``size`` (same order on every rank); return this rank's."""
    mine = None
    for start in range(0, world, size):
        group = tdist.new_group(list(range(start, start + size)))
        if start <= tdist.get_rank() < start + size:
            mine = group
    return mine


def run_cases(rank: int, groups: dict[str, tuple[int, Any]]) -> list[dict[str, Any]]:
    """sp_encode and gather_views for every (group, spec, N) against encode_fn(x) on one process."""
    results = []
    for label, (size, group) in groups.items():
        dp_rank, sp_rank = rank // size, rank % size
        for spec_index, (spec_name, _, _) in enumerate(SPECS):
            for n in range(1, MAX_VIEWS + 1):
                x = make_input(spec_index, n, size, dp_rank)
                with torch.random.fork_rng(devices=[]):
                    reference = encode_fn(x)

                before = torch.get_rng_state()
                out = sp_encode(x, encode_fn, group)
                rng_kept = torch.equal(before, torch.get_rng_state())

                plan = plan_sp(n, size)
                mine = x[plan.view_indices(sp_rank)]  # precompute path: build only this rank's views
                with torch.random.fork_rng(devices=[]):
                    local = encode_fn(mine)
                gathered = gather_views(local, plan, group)

                results.append(
                    {
                        "group": label,
                        "G": size,
                        "spec": spec_name,
                        "N": n,
                        "dp_rank": dp_rank,
                        "sp_encode_equal": bool(out.dtype == reference.dtype and torch.equal(out, reference)),
                        "gather_views_equal": bool(
                            gathered.dtype == reference.dtype and torch.equal(gathered, reference)
                        ),
                        "rng_kept": rng_kept,
                        "digest": digest(out),
                    }
                )
    return results


def expect_distributed_error(fn: Any) -> str | None:
    try:
        fn()
    except DistributedError as exc:
        return str(exc)
    return None


def scenario_cases(rank: int, world: int) -> dict[str, Any]:
    """World 4: SP groups of 1, 2 (from distributed()), 4. World 3: 1 and 3, reusing an outer init."""
    report: dict[str, Any] = {}
    sp_size = 2 if world == 4 else world
    outer = world == 3
    if outer:  # someone else initialised torch.distributed: distributed() must reuse and keep it
        tdist.init_process_group(
            "gloo", init_method="env://", rank=rank, world_size=world, timeout=timedelta(seconds=30)
        )
    rng_sanity = torch.get_rng_state()
    encode_fn(torch.zeros(1))
    report["encode_fn_consumes_rng"] = not torch.equal(rng_sanity, torch.get_rng_state())

    with distributed(sp_size=sp_size, device="cpu", timeout_s=30) as ctx:
        report["source"] = ctx.info.source
        report["backend"] = ctx.backend
        report["device"] = str(ctx.device)
        report["mesh"] = [ctx.mesh.dp_rank, ctx.mesh.sp_rank, ctx.mesh.dp_size, ctx.mesh.is_writer]
        report["sp_group_ranks"] = tdist.get_process_group_ranks(ctx.sp_group)
        report["mesh_sp_group_ranks"] = ctx.mesh.sp_group_ranks(ctx.mesh.dp_rank)
        report["all_gather_object"] = ctx.all_gather_object({"rank": rank})
        report["sp_all_gather_object"] = ctx.sp_all_gather_object(rank * 10)
        report["broadcast_object"] = ctx.broadcast_object({"from": rank}, src=world - 1)
        report["all_reduce"] = ctx.all_reduce_sum(rank)
        ctx.barrier()

        groups: dict[str, tuple[int, Any]] = {"G=1 (None)": (1, None)}
        singles = contiguous_groups(world, 1)
        groups["G=1 (group)"] = (1, singles)
        groups[f"G={sp_size} (distributed)"] = (sp_size, ctx.sp_group)
        if world == 4:
            groups["G=4"] = (4, contiguous_groups(world, 4))
        start = time.perf_counter()
        report["cases"] = run_cases(rank, groups)
        report["cases_s"] = time.perf_counter() - start

        # Inconsistent input must raise DistributedError on every rank of the group, not hang one.
        group, sp_rank = ctx.sp_group, ctx.mesh.sp_rank
        plan = plan_sp(3, sp_size)  # per_rank 2 (G=2) or 1 (G=3)
        rows = plan.per_rank + (1 if sp_rank == 0 else 0)
        report["rows_mismatch"] = expect_distributed_error(
            lambda: gather_views(torch.zeros(rows, 2), plan, group)
        )
        n = 4 if sp_rank == 0 else 3  # per_rank 2 either way for G=2; N differs
        report["n_mismatch"] = expect_distributed_error(
            lambda: sp_encode(torch.zeros(n, 2), encode_fn, group)
        )
        dtype = torch.float32 if sp_rank == 0 else torch.float64
        report["dtype_mismatch"] = expect_distributed_error(
            lambda: sp_encode(torch.zeros(5, 2, dtype=dtype), encode_fn, group)
        )
        # the group still works after the refused calls
        x = make_input(0, 5, sp_size, ctx.mesh.dp_rank)
        report["after_errors_ok"] = bool(torch.equal(sp_encode(x, encode_fn, group), encode_fn(x)))

    report["initialized_after_exit"] = tdist.is_initialized()
    if outer:
        tdist.destroy_process_group()
    return report


def scenario_nojoin(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 never joins; rank 0 must get DistributedError from init after the timeout."""
    if rank == 1:
        return {"skipped": True}
    start = time.perf_counter()
    try:
        with distributed(sp_size=2, device="cpu", timeout_s=3):
            return {"error": None}
    except DistributedError as exc:
        return {"error": str(exc), "elapsed_s": time.perf_counter() - start}


def scenario_peer_dies(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 joins, then dies before the encode; rank 0's sp_encode must raise DistributedError."""
    with distributed(sp_size=2, device="cpu", timeout_s=5) as ctx:
        ctx.barrier()
        if rank == 1:
            os._exit(0)  # vanish without tearing anything down, like a crashed or OOM-killed rank
        start = time.perf_counter()
        x = make_input(0, 4, 2, 0)
        try:
            sp_encode(x, encode_fn, ctx.sp_group)
            return {"error": None}
        except DistributedError as exc:
            return {"error": str(exc), "elapsed_s": time.perf_counter() - start}


SCENARIOS = {"cases": scenario_cases, "nojoin": scenario_nojoin, "peer_dies": scenario_peer_dies}


def main() -> int:
    scenario, outdir = sys.argv[1], Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        report = SCENARIOS[scenario](rank, world)
    except BaseException:
        report = {"crash": traceback.format_exc()}
        print(report["crash"], file=sys.stderr)  # the launcher looks for EADDRINUSE here
    (outdir / f"rank-{rank}.json").write_text(json.dumps(report))
    return 1 if "crash" in report else 0


if __name__ == "__main__":
    sys.exit(main())
