"""Which SLURM cluster the tests may use (VAECACHE_TEST_SLURM): never a running one unless asked."""

from __future__ import annotations

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
