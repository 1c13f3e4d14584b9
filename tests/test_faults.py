"""One fault-injection grammar (VAECACHE_FAULT) for shard crashes, ENOSPC and VAE out-of-memory."""

from __future__ import annotations

import pytest

from vaecache import faults
from vaecache.errors import UsageError
from vaecache.faults import FAULT_ENV, OomFault, OomInjector, ShardFault


def test_one_value_holds_shard_and_oom_faults() -> None:
    assert faults.parse("crash-after-commit:3@1, oom:*>1:untiled,enospc:2") == (
        ShardFault("crash-after-commit", 3, 1), OomFault(None, 1, True), ShardFault("enospc", 2))
    assert faults.parse("") == () and faults.parse("oom:2") == (OomFault(2),)


@pytest.mark.parametrize("text", ["crash:1", "enospc:x", "enospc:0", "oom:lots", "oom:2>", "oom:*:tiled",
                                  "crash-mid-write:1@r"])
def test_bad_values_are_usage_errors_naming_the_variable(text: str) -> None:
    with pytest.raises(UsageError, match=FAULT_ENV):
        faults.parse(text)


def test_should_fail_matches_point_shard_and_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "oom:1,crash-before-record:2@1")
    assert faults.should_fail("crash-before-record", 2, 1)
    assert not faults.should_fail("crash-before-record", 2, 0)
    assert not faults.should_fail("crash-before-record", 1, 1) and not faults.should_fail("enospc", 2, 1)
    monkeypatch.setenv(FAULT_ENV, "enospc:1")
    assert faults.should_fail("enospc", 1, 0) and faults.should_fail("enospc", 1, 5)
    monkeypatch.delenv(FAULT_ENV)
    assert not faults.should_fail("enospc", 1, 0) and faults.oom_injector() is None


def test_oom_injector_counts_and_filters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "enospc:3,oom:2>1")
    injector = faults.oom_injector()
    assert isinstance(injector, OomInjector) and injector.fault == OomFault(2, 1)
    assert [injector(units, False) for units in (1, 2, 4, 3)] == [False, True, True, False]
    assert injector.injected == 2
    untiled = OomInjector(OomFault(None, untiled_only=True))
    assert [untiled(1, tiled) for tiled in (False, True, False)] == [True, False, True]
    monkeypatch.setenv(FAULT_ENV, "oom:1,oom:2")
    with pytest.raises(UsageError, match="at most one oom fault"):
        faults.oom_injector()


def test_disk_full_is_enospc() -> None:
    error = faults.disk_full("shard-000001.safetensors")
    assert error.errno == 28 and error.filename == "shard-000001.safetensors"
