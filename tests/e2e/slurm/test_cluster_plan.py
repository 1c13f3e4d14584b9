"""Which SLURM cluster the tests may use (VAECACHE_TEST_SLURM): never a running one unless asked."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.slurm.conftest import cluster_plan


@pytest.mark.parametrize("root", [True, False])
def test_a_running_cluster_gets_no_test_jobs_unless_asked(root: bool) -> None:
    action, reason = cluster_plan("local", running=True, root=root)
    assert action == "none" and "VAECACHE_TEST_SLURM=existing" in reason and "login node" in reason
    assert cluster_plan("existing", running=True, root=root)[0] == "existing"


def test_a_local_cluster_is_started_only_as_root_and_off_skips() -> None:
    assert cluster_plan("local", running=False, root=True)[0] == "start"
    action, reason = cluster_plan("local", running=False, root=False)
    assert action == "none" and "needs root" in reason and "VAECACHE_TEST_SLURM=existing" in reason
    assert cluster_plan("existing", running=False, root=True)[0] == "none"
    assert cluster_plan("off", running=True, root=True) == ("none", "VAECACHE_TEST_SLURM=off")
    assert "must be one of" in cluster_plan("yes", running=False, root=True)[1]


def test_a_cluster_a_killed_test_session_left_running_is_restarted_not_refused() -> None:
    action, reason = cluster_plan("local", running=True, root=True, left_over=4321)
    assert action == "restart" and "4321" in reason and "pidfiles" in reason
    assert cluster_plan("local", running=True, root=False, left_over=4321)[0] == "none"
    assert cluster_plan("existing", running=True, root=True, left_over=4321)[0] == "existing"
    assert cluster_plan("off", running=True, root=True, left_over=4321)[0] == "none"


def test_only_a_gone_session_leaves_a_cluster_over(tmp_path, monkeypatch) -> None:
    from tests.e2e.slurm import conftest

    monkeypatch.setattr(conftest, "SESSION_FILE", tmp_path / "test-session.pid")
    assert conftest.left_over_by() is None  # no session file: nobody's cluster
    conftest.SESSION_FILE.write_text(f"{os.getpid()}\n")
    assert conftest.left_over_by() is None  # a session that still runs (another pytest here) keeps its cluster
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    conftest.SESSION_FILE.write_text(f"{gone.pid}\n")
    assert conftest.left_over_by() == gone.pid
    conftest.SESSION_FILE.write_text("not a pid\n")
    assert conftest.left_over_by() is None
