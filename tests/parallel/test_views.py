"""Sequence-parallel encode: the pure plan, and real gloo process groups against a 1-process reference.

Four launches in all (world 4, world 3, two failure scenarios); every (G, N, dtype) case runs
inside them, see _views_worker.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from vaecache.errors import DistributedError, UsageError
from vaecache.parallel import SPPlan, gather_views, pad_views, plan_sp, sp_encode

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_views_worker.py")
LAUNCH_TIMEOUT_S = 90

# ---------------------------------------------------------------------------------------------
# Pure plan
# ---------------------------------------------------------------------------------------------

PLAN_CASES = [(n, g) for n in range(1, 14) for g in range(1, 9)]


@pytest.mark.parametrize(("n", "g"), PLAN_CASES)
def test_plan_pads_to_smallest_multiple(n: int, g: int) -> None:
    plan = plan_sp(n, g)
    assert plan.padded % g == 0 and plan.padded >= n and plan.padded - g < n
    assert plan.per_rank == plan.padded // g
    assert plan.is_local == (n == 1 or g == 1)


@pytest.mark.parametrize(("n", "g"), PLAN_CASES)
def test_view_indices_cover_all_views_and_pad_with_real_ones(n: int, g: int) -> None:
    plan = plan_sp(n, g)
    per_rank = [plan.view_indices(r) for r in range(g)]
    if plan.is_local:
        assert all(idx == list(range(n)) for idx in per_rank)
        return
    flat = [i for idx in per_rank for i in idx]
    assert len(flat) == plan.padded and all(len(idx) == plan.per_rank for idx in per_rank)
    assert flat[:n] == list(range(n))  # real views first, in order, so trimming [:N] is right
    assert flat[n:] == [i % n for i in range(n, plan.padded)]  # padding repeats real views


@pytest.mark.parametrize(("n", "g"), PLAN_CASES)
def test_pad_views_matches_view_indices(n: int, g: int) -> None:
    x = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
    plan = plan_sp(n, g)
    padded = pad_views(x, plan)
    assert padded.shape[0] == plan.padded
    assert torch.equal(padded, x[[i % n for i in range(plan.padded)]])  # repeats, never zeros
    if not plan.is_local:
        for r in range(g):
            rows = padded[r * plan.per_rank : (r + 1) * plan.per_rank]
            assert torch.equal(rows, x[plan.view_indices(r)])


UNIT_CASES = [(units, unit, g) for units in range(1, 7) for unit in (1, 2, 3) for g in range(1, 6)]


@pytest.mark.parametrize(("units", "unit", "g"), UNIT_CASES)
def test_a_split_in_units_moves_whole_units_and_pads_with_real_ones(units: int, unit: int, g: int) -> None:
    """SP splits K-view units, never a unit: each rank's rows are whole units, real units first, in order."""
    n = units * unit
    plan = plan_sp(n, g, unit)
    per_rank = [plan.view_indices(r) for r in range(g)]
    if units == 1 or g == 1:
        assert plan.is_local and all(idx == list(range(n)) for idx in per_rank)
        return
    assert plan.padded == -(-units // g) * g * unit and all(len(idx) == plan.per_rank for idx in per_rank)
    flat = [i for idx in per_rank for i in idx]
    assert flat[:n] == list(range(n))
    assert flat[n:] == [i % n for i in range(n, plan.padded)]  # padding repeats whole real units
    for idx in per_rank:
        assert all(idx[k] % unit == 0 and idx[k:k + unit] == list(range(idx[k], idx[k] + unit))
                   for k in range(0, len(idx), unit))
    x = torch.arange(n, dtype=torch.float32)
    padded = pad_views(x, plan)
    for r in range(g):
        assert torch.equal(padded[r * plan.per_rank:(r + 1) * plan.per_rank], x[plan.view_indices(r)])


def test_unit_examples() -> None:
    assert plan_sp(6, 2, 3).view_indices(1) == [3, 4, 5]
    assert plan_sp(9, 2, 3).view_indices(1) == [6, 7, 8, 0, 1, 2]  # 3 units over 2 ranks: one repeated
    assert plan_sp(3, 4, 3).is_local  # one unit: nothing to split
    with pytest.raises(UsageError, match="5 views are not whole units of 3"):
        plan_sp(5, 2, 3)


def test_plan_examples() -> None:
    assert (plan_sp(5, 2).padded, plan_sp(5, 2).per_rank) == (6, 3)
    assert plan_sp(5, 2).view_indices(1) == [3, 4, 0]
    assert plan_sp(7, 4).view_indices(3) == [6, 0]
    assert plan_sp(2, 4).view_indices(3) == [1]  # more ranks than views: per_rank 1, repeats
    assert plan_sp(1, 4).view_indices(2) == [0] and plan_sp(1, 4).is_local
    assert plan_sp(6, 1).view_indices(0) == list(range(6))


@pytest.mark.parametrize(("n", "g"), [(0, 2), (3, 0), (-1, 1), (2.0, 2), (True, 2)])
def test_plan_rejects_bad_sizes(n: Any, g: Any) -> None:
    with pytest.raises(UsageError, match="must be an integer >= 1"):
        SPPlan(n, g)


def test_view_indices_rejects_rank_outside_group() -> None:
    with pytest.raises(UsageError, match="outside an SP group of 2"):
        plan_sp(5, 2).view_indices(2)


def test_pad_views_rejects_wrong_batch() -> None:
    with pytest.raises(DistributedError, match="expected 5 rows"):
        pad_views(torch.zeros(4, 2), plan_sp(5, 2))


def test_sp_encode_without_group_is_encode_fn_and_keeps_rng() -> None:
    x = torch.arange(12.0).reshape(4, 3)

    def noisy_double(v: torch.Tensor) -> torch.Tensor:
        torch.rand(5)
        return v * 2

    before = torch.get_rng_state()
    assert torch.equal(sp_encode(x, noisy_double, None), x * 2)
    assert torch.equal(torch.get_rng_state(), before)


def test_sp_encode_checks_encode_fn_output() -> None:
    with pytest.raises(DistributedError, match="expected 4 rows"):
        sp_encode(torch.zeros(4, 2), lambda v: v[:3], None)
    with pytest.raises(UsageError, match="must be a torch.Tensor"):
        sp_encode(torch.zeros(4, 2), lambda v: {"latent": v}, None)
    with pytest.raises(UsageError, match="views in dim 0"):
        sp_encode(torch.tensor(1.0), lambda v: v, None)


def test_gather_views_local_plan_needs_no_group() -> None:
    local = torch.ones(3, 2)
    assert gather_views(local, plan_sp(3, 1), None) is local
    assert gather_views(torch.ones(1, 2), plan_sp(1, 4), None).shape == (1, 2)
    with pytest.raises(UsageError, match="needs the SP process group"):
        gather_views(torch.ones(2, 2), plan_sp(3, 2), None)


# ---------------------------------------------------------------------------------------------
# Real process groups
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _clean_env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def launch(scenario: str, world: int, outdir: Path) -> tuple[list[dict[str, Any] | None], str]:
    """Start ``world`` ranks with the variables torchrun would set; return each rank's report."""
    for attempt in range(2):  # a free port can be taken between probing and binding: retry once
        outdir.mkdir(parents=True, exist_ok=True)
        for old in outdir.glob("rank-*.json"):
            old.unlink()
        env = _clean_env()
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world))
        env.update(LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")
        procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), scenario, str(outdir)],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(world)
        ]
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        logs = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                out, _ = p.communicate()
                out += f"\n[rank hung past {LAUNCH_TIMEOUT_S} s and was killed]"
            logs.append(out)
        log = "\n".join(
            f"--- rank {r} (exit {p.returncode}) ---\n{text}" for r, (p, text) in enumerate(zip(procs, logs))
        )
        if attempt == 0 and "EADDRINUSE" in log:
            continue
        reports = []
        for r in range(world):
            path = outdir / f"rank-{r}.json"
            reports.append(json.loads(path.read_text()) if path.exists() else None)
        return reports, log
    raise AssertionError("unreachable")


def _complete(reports: list[dict[str, Any] | None], log: str) -> list[dict[str, Any]]:
    for r, rep in enumerate(reports):
        assert rep is not None, f"rank {r} wrote no report\n{log}"
        assert "crash" not in rep, f"rank {r} crashed:\n{rep['crash']}\n{log}"
    return reports  # type: ignore[return-value]


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _complete(*launch("cases", 4, tmp_path_factory.mktemp("world4")))


@pytest.fixture(scope="module")
def world3(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _complete(*launch("cases", 3, tmp_path_factory.mktemp("world3")))


def _cases(reports: list[dict[str, Any]], size: int) -> list[list[dict[str, Any]]]:
    """Per rank, the cases run with SP groups of ``size``."""
    per_rank = [[c for c in rep["cases"] if c["G"] == size] for rep in reports]
    assert all(per_rank) and len({len(cs) for cs in per_rank}) == 1
    return per_rank


GROUP_SIZES = [(4, 1), (4, 2), (4, 4), (3, 1), (3, 3)]


@pytest.mark.parametrize(("world", "size"), GROUP_SIZES, ids=[f"world{w}-G{g}" for w, g in GROUP_SIZES])
def test_sp_encode_equals_single_process_reference(world: int, size: int, request: pytest.FixtureRequest) -> None:
    reports = request.getfixturevalue(f"world{world}")
    per_rank = _cases(reports, size)
    failures = [
        (r, c["group"], c["spec"], c["N"], k)
        for r, cases in enumerate(per_rank)
        for c in cases
        for k in ("sp_encode_equal", "gather_views_equal", "rng_kept")
        if not c[k]
    ]
    assert not failures, f"(rank, group, spec, N, check) that failed: {failures}"
    assert all(rep["encode_fn_consumes_rng"] for rep in reports)  # so rng_kept proves isolation
    # identical on every rank of an SP group, different across DP groups (different inputs)
    for i in range(len(per_rank[0])):
        by_dp: dict[int, set[str]] = {}
        for cases in per_rank:
            by_dp.setdefault(cases[i]["dp_rank"], set()).add(cases[i]["digest"])
        assert all(len(d) == 1 for d in by_dp.values()), per_rank[0][i]
        assert len({next(iter(d)) for d in by_dp.values()}) == len(by_dp) == world // size


def test_mesh_groups_and_context_helpers(world4: list[dict[str, Any]]) -> None:
    for rank, rep in enumerate(world4):
        assert (rep["source"], rep["backend"], rep["device"]) == ("torchrun", "gloo", "cpu")
        assert rep["mesh"] == [rank // 2, rank % 2, 2, rank % 2 == 0]
        assert rep["sp_group_ranks"] == rep["mesh_sp_group_ranks"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert rep["all_gather_object"] == [{"rank": r} for r in range(4)]
        assert rep["sp_all_gather_object"] == [10 * r for r in rep["mesh_sp_group_ranks"]]
        assert rep["broadcast_object"] == {"from": 3}
        assert rep["all_reduce"] == 6
        assert rep["initialized_after_exit"] is False  # distributed() tore down what it set up


def test_reuses_an_outer_process_group_and_leaves_it(world3: list[dict[str, Any]]) -> None:
    for rep in world3:
        assert rep["sp_group_ranks"] == [0, 1, 2]
        assert rep["initialized_after_exit"] is True


@pytest.mark.parametrize("world", [4, 3])
def test_inconsistent_ranks_raise_everywhere(world: int, request: pytest.FixtureRequest) -> None:
    for rank, rep in enumerate(request.getfixturevalue(f"world{world}")):
        for key in ("rows_mismatch", "n_mismatch", "dtype_mismatch"):
            assert rep[key] is not None, f"rank {rank}: {key} did not raise"
            assert f"rank {rank}:" in rep[key] and "ranks disagree" in rep[key]
        assert "float64" in rep["dtype_mismatch"]
        assert rep["after_errors_ok"]


def test_rank_that_never_joins_fails_init(tmp_path: Path) -> None:
    reports, log = launch("nojoin", 2, tmp_path)
    rep = reports[0]
    assert rep is not None and "crash" not in rep, log
    assert rep["error"] is not None, "distributed() returned although rank 1 never joined"
    assert rep["error"].startswith("rank 0: init_process_group"), rep["error"]
    assert rep["elapsed_s"] < 20


def test_peer_that_dies_fails_the_collective(tmp_path: Path) -> None:
    reports, log = launch("peer_dies", 2, tmp_path)
    rep = reports[0]
    assert rep is not None and "crash" not in rep, log
    assert rep["error"] is not None, "sp_encode returned although its peer died"
    assert rep["error"].startswith("rank 0: all_gather(shape check) in SP group [0, 1] failed after"), rep["error"]
    assert "a peer rank died or is stuck" in rep["error"]
    assert rep["elapsed_s"] < 20
