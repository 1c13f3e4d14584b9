"""RankInfo / hostlists / mesh are pure; distributed() is exercised here as a single process only
(the multi-process paths run in tests/parallel/test_views.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as tdist

from vaecache.distributed.context import collective_errors, distributed
from vaecache.distributed.launch import RankInfo, expand_hostlist, first_host, launcher_rank_world, slurm_master_port
from vaecache.distributed.mesh import Mesh, make_mesh
from vaecache.errors import DistributedError, UsageError

# ---------------------------------------------------------------------------------------------
# RankInfo.from_env
# ---------------------------------------------------------------------------------------------

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29400",
}

SLURM_STEP = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "6",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "2",
    "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
}


def test_single_process_when_no_launcher() -> None:
    assert RankInfo.from_env({}) == RankInfo(0, 1, 0, 1, 0, None, None, "single", None)


def test_torchrun() -> None:
    info = RankInfo.from_env(TORCHRUN)
    assert info == RankInfo(5, 8, 1, 4, 1, "10.0.0.1", 29400, "torchrun", None)


def test_torchrun_wins_over_slurm_and_keeps_job_id() -> None:
    info = RankInfo.from_env({**SLURM_STEP, **TORCHRUN})
    assert (info.source, info.rank, info.world_size, info.local_rank) == ("torchrun", 5, 8, 1)
    assert (info.master_addr, info.master_port, info.job_id) == ("10.0.0.1", 29400, "123456")


def test_torchrun_style_launcher_without_local_variables_assumes_one_node() -> None:
    info = RankInfo.from_env({"RANK": "2", "WORLD_SIZE": "4"})
    assert (info.local_rank, info.local_world_size, info.node_rank) == (2, 4, 0)
    assert (info.master_addr, info.master_port) == (None, None)


def test_slurm_step() -> None:
    info = RankInfo.from_env(SLURM_STEP)
    assert info == RankInfo(6, 8, 2, 4, 1, "gpu07", 29500 + 123456 % 20000, "slurm", "123456")


def test_slurm_ntasks_per_node_is_the_last_resort_and_master_from_env() -> None:
    env = {k: v for k, v in SLURM_STEP.items() if k not in ("SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE")}
    env |= {"SLURM_NTASKS_PER_NODE": "4", "MASTER_ADDR": "head", "MASTER_PORT": "1234"}
    info = RankInfo.from_env(env)
    assert (info.local_world_size, info.master_addr, info.master_port) == (4, "head", 1234)


def test_slurm_step_layout_wins_over_the_jobs_ntasks_per_node() -> None:
    # sbatch --ntasks-per-node=2 --wrap "srun -n1 ...": the job's request is inherited by the step.
    env = {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODEID": "0",
           "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2",
           "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_NODELIST": "n2"}
    info = RankInfo.from_env(env)
    assert (info.world_size, info.local_world_size) == (1, 1)
    assert info.master_addr == "n2"  # rank 0 of the step runs on the step's first node


def test_slurm_uneven_tasks_per_node_and_old_nodelist_name() -> None:
    env = {k: v for k, v in SLURM_STEP.items() if k != "SLURM_JOB_NODELIST"}
    env |= {"SLURM_NTASKS": "7", "SLURM_PROCID": "6", "SLURM_NODEID": "2", "SLURM_LOCALID": "1"}
    env |= {"SLURM_TASKS_PER_NODE": "3,2(x2)", "SLURM_NODELIST": "rack1-n[3-5]"}
    info = RankInfo.from_env(env)
    assert (info.local_world_size, info.node_rank, info.master_addr) == (2, 2, "rack1-n3")


def test_sbatch_batch_shell_is_a_single_process() -> None:
    batch = {k: v for k, v in SLURM_STEP.items() if k != "SLURM_STEP_ID"} | {"SLURM_PROCID": "0"}
    info = RankInfo.from_env(batch)
    assert (info.source, info.rank, info.world_size, info.job_id) == ("single", 0, 1, "123456")


def test_slurm_step_with_one_task() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "3", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODELIST": "a1"}
    info = RankInfo.from_env(env)
    assert (info.source, info.rank, info.world_size, info.local_world_size) == ("slurm", 0, 1, 1)
    assert (info.master_addr, info.master_port) == ("a1", 29500 + (7 + 1009 * 3) % 20000)


def test_uses_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("SLURM_") or key in TORCHRUN:
            monkeypatch.delenv(key)
    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    assert RankInfo.from_env().rank == 5


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, r"RANK='x' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"rank 2 is outside world size 2"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, r"rank -1 is outside world size 2"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, r"world size 0 must be >= 1"),
        ({"WORLD_SIZE": "2"}, r"RANK is not set"),
        ({"RANK": "0"}, r"WORLD_SIZE is not set"),
        ({**TORCHRUN, "LOCAL_RANK": "4"}, r"local rank 4 is outside local world size 4"),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "16"}, r"local world size 16 must be in 1..8"),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, r"master port 70000 is not a valid TCP port"),
        ({**TORCHRUN, "MASTER_PORT": "http"}, r"MASTER_PORT='http' is not an integer"),
        ({**SLURM_STEP, "SLURM_PROCID": "8"}, r"rank 8 is outside world size 8 \(from slurm"),
        ({**SLURM_STEP, "SLURM_TASKS_PER_NODE": "4(x"}, r"cannot parse SLURM_TASKS_PER_NODE"),
        ({**SLURM_STEP, "SLURM_NODEID": "2"}, r"SLURM_NODEID=2 but SLURM_TASKS_PER_NODE='4\(x2\)' lists only 2"),
        ({k: v for k, v in SLURM_STEP.items() if k != "SLURM_JOB_NODELIST"}, r"MASTER_ADDR is not set"),
        ({k: v for k, v in SLURM_STEP.items() if k != "SLURM_PROCID"}, r"SLURM_PROCID is not set"),
        ({k: v for k, v in SLURM_STEP.items() if k != "SLURM_LOCALID"}, r"SLURM_LOCALID is not set"),
        ({**SLURM_STEP, "SLURM_JOB_NODELIST": "gpu[07-"}, r"cannot parse hostlist"),
        ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "x"}, r"SLURM_NTASKS='x' is not an integer"),
    ],
)
def test_bad_environment(env: dict[str, str], match: str) -> None:
    with pytest.raises(DistributedError, match=match):
        RankInfo.from_env(env)


# ---------------------------------------------------------------------------------------------
# Hostlists
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node[001-004,007],gpu12", "node001"),
        ("a1", "a1"),
        ("rack1-n[3-5]", "rack1-n3"),
        ("gpu12,node[001-004]", "gpu12"),
        ("node[7,001-002]", "node7"),
        ("r[2-3]n[08-10]", "r2n08"),
        ("  host-a  ", "host-a"),
        ("n[0-99999999999]", "n0"),  # only the first host is expanded
        ("x[09-11]y", "x09y"),
    ],
)
def test_first_host(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


def test_expand_hostlist() -> None:
    got = list(expand_hostlist("node[001-003,007],gpu12,r[1-2]n[8-9]"))
    assert got == ["node001", "node002", "node003", "node007", "gpu12", "r1n8", "r1n9", "r2n8", "r2n9"]
    assert list(expand_hostlist("n[9-11]")) == ["n9", "n10", "n11"]


BAD_HOSTLISTS = ["", "  ", "node[1-", "node]1[", "node[a-b]", "node[5-3]", "n[[1]]", "a,,b", "n[]"]


@pytest.mark.parametrize("nodelist", BAD_HOSTLISTS)
def test_bad_hostlist(nodelist: str) -> None:
    with pytest.raises(DistributedError, match="cannot parse hostlist"):
        list(expand_hostlist(nodelist))


def test_slurm_master_port() -> None:
    assert slurm_master_port(None) == 29500
    assert slurm_master_port("123456") == 29500 + 3456
    assert slurm_master_port("19999") == 49499
    assert 29500 <= slurm_master_port("abc") < 49500
    assert slurm_master_port("abc") == slurm_master_port("abc")


# ---------------------------------------------------------------------------------------------
# Mesh
# ---------------------------------------------------------------------------------------------


def test_mesh_contiguous_sp_groups() -> None:
    meshes = [make_mesh(r, 8, 2) for r in range(8)]
    assert [m.sp_group_ranks(d) for m in meshes[:1] for d in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [(m.dp_rank, m.sp_rank, m.is_writer) for m in meshes[4:6]] == [(2, 0, True), (2, 1, False)]
    assert all(m.dp_size == 4 for m in meshes)
    for m in meshes:
        assert m.rank in m.sp_group_ranks(m.dp_rank) == m.sp_group_ranks()


@pytest.mark.parametrize(("world", "sp"), [(1, 1), (4, 1), (4, 4), (6, 3), (12, 4)])
def test_mesh_partitions_the_world(world: int, sp: int) -> None:
    meshes = [make_mesh(r, world, sp) for r in range(world)]
    groups = [meshes[0].sp_group_ranks(d) for d in range(world // sp)]
    assert sorted(r for g in groups for r in g) == list(range(world))
    assert sum(m.is_writer for m in meshes) == world // sp
    assert all(m.rank == m.dp_rank * sp + m.sp_rank for m in meshes)


def test_mesh_rejects_sp_size_that_does_not_divide_world() -> None:
    with pytest.raises(UsageError, match=r"--sp-size 3 must divide the world size 8 .*choose one of: 1, 2, 4, 8"):
        make_mesh(0, 8, 3)
    with pytest.raises(UsageError, match="--sp-size must be >= 1"):
        make_mesh(0, 8, 0)
    with pytest.raises(UsageError, match="rank 8 is outside world size 8"):
        Mesh(8, 8, 2)
    with pytest.raises(UsageError, match="dp rank 4 is outside 0..3"):
        make_mesh(0, 8, 2).sp_group_ranks(4)


# ---------------------------------------------------------------------------------------------
# distributed() as one process, and error translation
# ---------------------------------------------------------------------------------------------


def test_single_process_context() -> None:
    with distributed(sp_size=1, device="cpu", environ={}) as ctx:
        assert (ctx.backend, ctx.sp_group, ctx.device, ctx.is_distributed) == (None, None, torch.device("cpu"), False)
        assert (ctx.mesh.world_size, ctx.mesh.is_writer, ctx.info.source) == (1, True, "single")
        ctx.barrier()
        assert ctx.all_gather_object({"a": 1}) == [{"a": 1}]
        assert ctx.broadcast_object("x") == "x"
        assert ctx.sp_all_gather_object(7) == [7]
        assert ctx.all_reduce_sum(3) == 3
        assert not tdist.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_auto_device_is_cpu_without_cuda() -> None:
    with distributed(environ={}) as ctx:
        assert ctx.device == torch.device("cpu")
    with pytest.raises(UsageError, match="CUDA is not available"):
        with distributed(device="cuda", environ={}):
            pass


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sp_size": 2}, UsageError, "--sp-size 2 must divide the world size 1"),
        ({"device": "tpu"}, UsageError, "is not a device"),
        ({"timeout_s": 0}, UsageError, "timeout must be > 0"),
    ],
)
def test_distributed_rejects_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        with distributed(environ={}, **kwargs):
            pass


def test_missing_master_address_fails_before_any_network(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(DistributedError, match="MASTER_ADDR is not set"):
        with distributed(device="cpu", environ={"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}):
            pass
    assert "MASTER_PORT" not in os.environ and not tdist.is_initialized()


def test_collective_errors_translate_peer_failures_only() -> None:
    with pytest.raises(DistributedError) as info:
        with collective_errors("all_gather", label="SP group [2, 3]", rank=2, timeout_s=600):
            raise RuntimeError("[pair.cc:537] Read error: Connection reset by peer")
    message = str(info.value)
    assert message.startswith("rank 2: all_gather in SP group [2, 3] failed after 0.0 s")
    assert "a peer rank died or is stuck; timeout 600 s" in message and "Connection reset" in message
    assert isinstance(info.value.__cause__, RuntimeError)

    with pytest.raises(DistributedError, match=r"rank 1: barrier in .* failed after 0.0 s: NCCL error") as info:
        with collective_errors("barrier", rank=1):
            raise tdist.DistBackendError("NCCL error: invalid usage")
    assert "peer" not in str(info.value)  # not a timeout: do not blame a peer
    with pytest.raises(DistributedError, match=r"rank 0: monitored barrier in world group failed .* peer rank died"):
        with collective_errors("monitored barrier", label="world group", rank=0):
            raise RuntimeError("[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 3000 ms")
    with pytest.raises(DistributedError, match=r"init_process_group .*a peer rank died or is stuck; timeout 5 s"):
        with collective_errors("init_process_group", rank=0, timeout_s=5):
            raise tdist.DistStoreError("Timed out after 6 seconds waiting for clients. 1/2 clients joined.")
    with pytest.raises(ValueError, match="not a collective problem"):
        with collective_errors("all_gather", rank=0):
            raise ValueError("not a collective problem")


@pytest.mark.parametrize("env", [
    {}, TORCHRUN, SLURM_STEP, {"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "1"},
    {**SLURM_STEP, "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_TASKS_PER_NODE": "1", "SLURM_LOCALID": "0",
     "SLURM_NODEID": "0"},
])
def test_the_cli_and_the_run_read_one_rank_rule(env: dict[str, str]) -> None:
    """The CLI's torch-free answer (launcher_rank_world) is the rank and world RankInfo sets up with."""
    info = RankInfo.from_env(env)
    assert launcher_rank_world(env) == (info.rank, info.world_size)
