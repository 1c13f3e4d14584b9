"""Heartbeats and the ring watch: a stopped rank is named with its host; a slow one that beats is waited for."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as tdist

from vaecache.distributed import liveness
from vaecache.distributed.context import collective_errors
from vaecache.distributed.liveness import EXITED, Beat, Liveness, RingWatch, interval_for
from vaecache.errors import DistributedError


def beat(rank: int, count: int, state: str = liveness.RUNNING) -> Beat:
    return Beat(rank, "node7", 4242, count, state)


def test_ring_watch_waits_while_the_count_moves_and_names_the_silence():
    watch = RingWatch(rank=0, world=3, timeout_s=10, now=0.0)
    assert watch.target == 1
    for t in range(0, 100, 5):  # a slow rank that still beats is waited for as long as it takes
        assert watch.see(beat(1, t), float(t)) is None
    assert watch.see(beat(1, 95), 104.0) is None  # unchanged for 9 s: not yet
    assert watch.see(beat(1, 95), 106.0) == pytest.approx(11.0)


def test_ring_watch_skips_ranks_that_exited_and_counts_a_missing_beat_from_the_start():
    watch = RingWatch(rank=2, world=4, timeout_s=5, now=0.0)
    assert watch.target == 3
    assert watch.see(beat(3, 1, EXITED), 1.0) is None
    assert watch.target == 0  # wraps around the ring
    assert watch.see(None, 5.5) is None  # counted from when watching rank 0 began (1.0)
    assert watch.see(None, 6.5) == pytest.approx(5.5)
    alone = RingWatch(rank=0, world=2, timeout_s=5, now=0.0)
    alone.see(beat(1, 1, EXITED), 0.0)
    assert alone.target is None and alone.see(None, 1e6) is None


def test_interval_is_at_most_5_s_and_four_beats_per_timeout():
    assert interval_for(60) == 5.0
    assert interval_for(2) == 0.5
    with pytest.raises(ValueError):
        RingWatch(0, 2, 0, 0.0)


@pytest.fixture
def store():
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=2), wait_for_workers=False)
    yield master


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _ranks(store, world: int, clock: Clock, timeout_s: float = 10) -> list[Liveness]:
    verdicts: list[tuple[int, str, bool]] = []
    ranks = []
    for rank in range(world):
        live = Liveness(store, rank, world, timeout_s, clock=clock,
                        on_failure=lambda message, announce, rank=rank: verdicts.append((rank, message, announce)))
        ranks.append(live)
    for live in ranks:
        live.beat()
    return ranks


def test_a_rank_that_stops_beating_is_named_with_host_pid_and_what_it_was_doing(store):
    clock = Clock()
    r0, r1, r2 = _ranks(store, 3, clock)
    r1.doing = "encoding clip scene_0003/f000000 (batch 4 of 9)"
    for step in range(1, 4):  # all beat: nobody is declared
        clock.now = step * 4.0
        assert [r.tick() for r in (r0, r1, r2)] == [None, None, None]
    for step in range(4, 8):  # rank 1 is stopped: only ranks 0 and 2 tick
        clock.now = step * 4.0
        found = r0.tick()
        r2.tick()
    assert found is not None
    message, announce = found
    assert message.startswith(f"rank 1 on {socket.gethostname()} (pid ")
    assert "no heartbeat for 12 s (--liveness-timeout 10 s)" in message
    assert "last seen encoding clip scene_0003/f000000 (batch 4 of 9)" in message
    assert "Committed shards are kept" in message and announce  # rank 0 prints it
    # every other rank reads the same verdict from the store within one tick, and only rank 0 prints
    assert r2.tick() == (message, False)
    assert r1.tick() == (message, False)


def test_a_new_phase_is_published_at_once_not_at_the_next_beat(store):
    """A rank that moves on and is stopped before its next beat (5 s apart) is reported doing what it was doing
    then (it was once "last seen starting up" with two shards committed)."""
    import time

    live = Liveness(store, 1, 2, 60.0, on_failure=lambda *_: None).start()
    try:
        assert live.interval_s == 5.0 and live.read_beat(1).doing == "starting up"
        for phase in ("loading the VAE builtin:tiny", "encoding clip s/000000-000008 (batch 3 of 9)"):
            live.set_doing(phase)
            deadline = time.monotonic() + 2
            while live.read_beat(1).doing != phase and time.monotonic() < deadline:
                time.sleep(0.01)
            assert live.read_beat(1).doing == phase
    finally:
        live.stop()
    assert live.read_beat(1).state == "exited"


def test_the_finder_prints_when_rank_0_is_the_one_that_stopped(store):
    clock = Clock()
    r0, r1 = _ranks(store, 2, clock, timeout_s=3)
    clock.now = 1.0
    r1.tick()
    clock.now = 5.0
    message, announce = r1.tick()
    assert message.startswith("rank 0 on ") and announce


def test_an_exited_rank_is_not_blamed_and_the_watch_moves_on(store):
    clock = Clock()
    r0, r1, r2 = _ranks(store, 3, clock, timeout_s=3)
    r1.stop()  # publishes its exit (its thread was never started)
    for step in range(1, 6):
        clock.now = step * 2.0
        assert r0.tick() is None
        r2.tick()
    assert r0.watch.target == 2 and 1 in r0.watch.exited


def test_a_store_that_stops_answering_is_blamed_on_its_host():
    clock = Clock()
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=1), wait_for_workers=False)
    client = tdist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=1),
                            wait_for_workers=False)
    live = Liveness(client, 1, 2, 3, clock=clock, store_where="rank 0 on head01 (it hosts the rendezvous store)")
    live.beat()
    del master  # the store's process is gone
    clock.now = 1.0
    assert live.tick() is None
    clock.now = 5.0
    message, announce = live.tick()
    assert message.startswith("rank 0 on head01 (it hosts the rendezvous store) stopped answering for 4 s") and announce


def test_a_failed_collective_names_the_silent_ranks_by_their_counts_not_their_clocks(store, monkeypatch):
    clock = Clock()
    r0, r1, r2, r3 = _ranks(store, 4, clock)
    store.set(r0._key(2), Beat(2, "node9", 77, 5, wall=1.0).to_bytes())  # stopped: its count stays at 5
    store.set(r0._key(3), Beat(3, "node8", 88, 5, wall=1.0).to_bytes())  # alive, its wall clock far behind
    beating = threading.Timer(0.1, lambda: store.set(r0._key(3), Beat(3, "node8", 88, 6, wall=2.0).to_bytes()))
    beating.start()
    r1.stop()
    monkeypatch.setattr(liveness, "_active", r0)
    monkeypatch.setattr(r0, "interval_s", 0.25)  # watches for two intervals
    with pytest.raises(DistributedError) as info:
        with collective_errors("all_gather_object", timeout_s=30):
            raise RuntimeError("Connection closed by peer")
    beating.join()
    text = str(info.value)
    assert "a peer rank died or is stuck; timeout 30 s; silent:" in text
    assert f"rank 1 on {socket.gethostname()} (pid " in text and "exited" in text
    assert "rank 2 on node9 (pid 77), no heartbeat in 0.5 s (last stamped 00:00:01 UTC by its clock)" in text
    assert "node8" not in text


def test_liveness_timeout_is_validated_and_off_for_one_process():
    with pytest.raises(Exception, match="--liveness-timeout must be >= 0"):
        liveness.check_timeout(-1)
    assert liveness.start_liveness(0, 1, 60) is None
    assert liveness.start_liveness(0, 4, 0) is None


def test_a_rank_that_failed_alone_ends_the_job_after_the_grace_naming_its_error(store):
    """A rank leaving with an exception (a full disk on one rank) must not leave the others waiting in a
    collective for --timeout: its watcher ends the job once the failure grace has passed."""
    clock = Clock()
    r0, r1, r2 = _ranks(store, 3, clock, timeout_s=60)
    r1.stop("OutputError: /out/shards/a000-r00001-000003.safetensors: no space left on device")
    clock.now = 5.0
    assert r0.tick() is None  # within the grace: when every rank fails alike they are all gone by now
    clock.now = 16.0
    message, announce = r0.tick()
    assert message.startswith(f"rank 1 on {socket.gethostname()} (pid ")
    assert "failed (OutputError: /out/shards/a000-r00001-000003.safetensors: no space left on device)" in message
    assert announce and r2.tick() == (message, False)


def test_distributed_publishes_the_exception_that_ended_the_rank(monkeypatch):
    published = []
    monkeypatch.setattr(liveness, "_active", type("Live", (), {"stop": lambda self, text: published.append(text)})())
    liveness.stop_liveness(OSError(28, "No space left on device"))
    assert published == ["OSError: [Errno 28] No space left on device"] and liveness.active() is None
