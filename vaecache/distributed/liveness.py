"""Rank liveness: heartbeats in the rendezvous store, each rank watching the next, and a job that fails
naming the rank that stopped.

A collective timeout has to be long, because ranks legitimately finish their shares at different times
(a slow rank is waited for as long as it takes). A rank that is *stopped* (SIGSTOP, a hung driver, a node
that froze) is a different thing, and this module tells the two apart: every rank publishes a heartbeat
(a counter, its host and pid, what it is doing) every few seconds from a thread, which runs while the
main thread encodes or waits in a collective. Each rank watches the next rank in a ring (skipping ranks
that exited cleanly), so the work per rank is O(1) at any world size. A heartbeat that does not change
for ``timeout_s`` on the watcher's own clock (no cross-host clock comparison) fails the whole job: the
watcher posts the verdict in the store, every rank sees it within one interval and exits at once with
the stopped rank's number and host. Committed shards are kept; a rerun resumes.

The heartbeats go through a separate client connection to the job's rendezvous store (torchrun's agent
store, or the TCPStore rank 0 hosts under SLURM) with its own short timeout, so a store that stops
answering is noticed too and blamed on its host.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

from vaecache.errors import EXIT_FAILED, UsageError

log = logging.getLogger(__name__)

DEFAULT_LIVENESS_TIMEOUT_S = 60.0
MAX_INTERVAL_S = 5.0
RUNNING, EXITED, FAILED = "running", "exited", "failed"
MIN_BEAT_SPACING_S = 0.05
"""A change of what a rank is doing is published at once, but no more often than this (a loop of tiny batches)."""
FAILED_GRACE_S = 10.0
"""How long a rank that failed is given before its watcher ends the job: when every rank fails alike (an error
rank 0 handed to all), they are all gone by then; when one failed alone, the others would wait for it."""


def interval_for(timeout_s: float) -> float:
    """Seconds between heartbeats: every 5 s, or often enough for 4 beats per timeout."""
    return max(0.1, min(MAX_INTERVAL_S, timeout_s / 4))


@dataclass(frozen=True)
class Beat:
    """One heartbeat as published in the store."""

    rank: int
    host: str
    pid: int
    count: int
    state: str = RUNNING
    doing: str = ""
    wall: float = 0.0
    """The publisher's wall clock: in messages, and to pick suspects silent_ranks then watches; never a verdict."""
    space: str = ""
    """Boot id and pid namespace: a pid means the same process only where these match (containers may share
    a host name)."""

    def to_bytes(self) -> bytes:
        return json.dumps({"rank": self.rank, "host": self.host, "pid": self.pid, "count": self.count,
                           "state": self.state, "doing": self.doing, "wall": self.wall,
                           "space": self.space}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Beat:
        raw = json.loads(data)
        return cls(int(raw["rank"]), str(raw["host"]), int(raw["pid"]), int(raw["count"]), str(raw["state"]),
                   str(raw.get("doing", "")), float(raw.get("wall", 0.0)), str(raw.get("space", "")))

    def where(self) -> str:
        return f"rank {self.rank} on {self.host} (pid {self.pid})"


class RingWatch:
    """Whom this rank watches and when the watched rank counts as stopped. Pure: fed beats and times.

    The watched rank is the next one in the ring that has not exited cleanly; a rank that never published
    a beat counts from when watching it began."""

    def __init__(self, rank: int, world: int, timeout_s: float, now: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"liveness timeout must be > 0 s, got {timeout_s}")
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.exited: set[int] = set()
        self.target: int | None = None
        self._last_count: int | None = None
        self._since = now
        self._move(now)

    def _move(self, now: float) -> None:
        self.target = None
        for step in range(1, self.world):
            candidate = (self.rank + step) % self.world
            if candidate not in self.exited:
                self.target = candidate
                break
        self._last_count, self._since = None, now

    def see(self, beat: Beat | None, now: float) -> float | None:
        """Take the watched rank's current beat (None: none published yet). Returns the seconds it has been
        silent (or failed) when that exceeds the timeout (the failure grace), else None."""
        if self.target is None:
            return None
        if beat is not None and beat.state == EXITED:
            self.exited.add(self.target)
            self._move(now)
            return None
        if beat is not None and beat.state == FAILED:
            if self._last_count != beat.count:
                self._last_count, self._since = beat.count, now
            failed_for = now - self._since
            return failed_for if failed_for > min(self.timeout_s, FAILED_GRACE_S) else None
        if beat is not None and beat.count != self._last_count:
            self._last_count, self._since = beat.count, now
            return None
        silent = now - self._since
        return silent if silent > self.timeout_s else None


def stopped_message(beat: Beat | None, rank: int, silent_s: float, timeout_s: float) -> str:
    if beat is not None and beat.state == FAILED:
        return (f"{beat.where()} failed ({beat.doing}) and the others cannot finish without it. Committed shards "
                "are kept: rerun the same command to resume")
    who = beat.where() if beat is not None else f"rank {rank} (it never published a heartbeat)"
    doing = f"; last seen {beat.doing}" if beat is not None and beat.doing else ""
    return (f"{who} stopped responding: no heartbeat for {silent_s:.0f} s (--liveness-timeout {timeout_s:g} s)"
            f"{doing}. Committed shards are kept: rerun the same command to resume")


class Liveness:
    """Heartbeat publisher and ring watcher for one rank; a daemon thread between start() and stop()."""

    def __init__(self, store: Any, rank: int, world: int, timeout_s: float, *, prefix: str = "vaecache/liveness/",
                 store_where: str = "the rendezvous store", hosts_store: bool = False,
                 on_failure: Callable[[str, bool], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.rank, self.world, self.timeout_s = store, rank, world, timeout_s
        self.interval_s = interval_for(timeout_s)
        self.prefix, self.store_where = prefix, store_where
        self.host, self.pid, self.space = socket.gethostname(), os.getpid(), _process_space()
        self.doing = "starting up"
        self._count = 0
        self._clock = clock
        self._stop = threading.Event()
        self._wake = threading.Event()
        """Set by stop() and by set_doing(): the thread publishes a new phase at once, not at its next beat."""
        self._thread: threading.Thread | None = None
        self.hosts_store = hosts_store
        self._on_failure = on_failure or self._exit_job
        self._store_silent_since: float | None = None
        self.watch = RingWatch(rank, world, timeout_s, clock())

    # -- store keys -------------------------------------------------------------------------------
    def _key(self, rank: int) -> str:
        return f"{self.prefix}rank/{rank}"

    @property
    def _verdict_key(self) -> str:
        return f"{self.prefix}verdict"

    def beat(self, state: str = RUNNING) -> None:
        self._count += 1
        self.store.set(self._key(self.rank), Beat(self.rank, self.host, self.pid, self._count, state,
                                                  self.doing[:200], time.time(), self.space).to_bytes())

    def read_beat(self, rank: int) -> Beat | None:
        key = self._key(rank)
        if not self.store.check([key]):
            return None
        try:
            return Beat.from_bytes(self.store.get(key))
        except (ValueError, KeyError, TypeError):
            return None

    # -- one round of the thread ------------------------------------------------------------------
    def tick(self) -> tuple[str, bool] | None:
        """Publish, look for a verdict, watch the next rank. Returns (verdict, whether this rank prints it)."""
        now = self._clock()
        try:
            self.beat()
            if self.store.check([self._verdict_key]):
                return self.store.get(self._verdict_key).decode(errors="replace"), self.rank == 0
            target = self.watch.target
            beat = self.read_beat(target) if target is not None else None
            silent = self.watch.see(beat, now)
            while silent is None and self.watch.target not in (None, target):  # moved past an exited rank
                target = self.watch.target
                beat = self.read_beat(target)
                silent = self.watch.see(beat, now)
            self._store_silent_since = None
        except Exception as exc:  # the store host itself stopped answering (or went away)
            if self._store_silent_since is None:
                self._store_silent_since = now
                log.warning("rank %d: the rendezvous store did not answer: %s", self.rank, exc)
            silent_for = now - self._store_silent_since
            if silent_for > self.timeout_s:
                return (f"{self.store_where} stopped answering for {silent_for:.0f} s (--liveness-timeout "
                        f"{self.timeout_s:g} s): its host is stopped or gone. Committed shards are kept: rerun the "
                        "same command to resume"), True
            return None
        if silent is None:
            return None
        message = stopped_message(beat, target, silent, self.timeout_s)
        if beat is not None and beat.space and beat.space == self.space and beat.pid != self.pid:
            _kill_quietly(beat.pid)  # a stopped process ignores everything but SIGKILL, and would hold its GPU
        try:  # the first verdict wins, so every rank reports the same one
            posted = bytes(self.store.compare_set(self._verdict_key, b"", message.encode()))
        except Exception:
            posted = message.encode()
        # rank 0 prints what the job died of; the finder prints it too when rank 0 is the one that stopped
        return posted.decode(errors="replace"), self.rank == 0 or target == 0

    def _run(self) -> None:
        deadline = self._clock() + self.interval_s
        while True:
            self._wake.wait(max(0.0, deadline - self._clock()))
            self._wake.clear()
            if self._stop.is_set():
                return
            if self._clock() < deadline:  # the phase changed: publish it now, so a rank stopped right after it
                try:                      # is reported doing what it was doing (the watching waits for the tick)
                    self.beat()
                except Exception:
                    pass  # the tick names a store that stopped answering
                self._stop.wait(MIN_BEAT_SPACING_S)
                continue
            deadline = self._clock() + self.interval_s
            verdict = self.tick()
            if verdict is not None and not self._stop.is_set():
                self._on_failure(*verdict)
                return

    def set_doing(self, text: str) -> None:
        if text != self.doing:
            self.doing = text
            self._wake.set()

    def start(self) -> Liveness:
        self.beat()
        self._thread = threading.Thread(target=self._run, name="vaecache-liveness", daemon=True)
        self._thread.start()
        return self

    def stop(self, failure: str | None = None) -> None:
        """Stop watching and tell the watcher of this rank that it exited cleanly, or failed with `failure`
        (best effort)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 5)
        try:
            if failure is not None:
                self.doing = failure
            self.beat(EXITED if failure is None else FAILED)
        except Exception as exc:  # the store may already be gone with rank 0's process; nothing to tell then
            log.debug("rank %d: could not publish the exit heartbeat: %s", self.rank, exc)

    def _exit_job(self, verdict: str, announce: bool) -> None:
        """End this process at once: the main thread may be blocked in a collective with the stopped rank."""
        log.error("liveness: %s", verdict)
        if announce:
            sys.stderr.write(f"error: {verdict}\n")
        sys.stderr.flush()
        for handler in logging.getLogger().handlers + logging.getLogger("vaecache").handlers:
            try:
                handler.flush()
            except Exception:
                pass
        if self.hosts_store:  # the others read the verdict from this process's store: give them a beat to
            time.sleep(2 * self.interval_s)
        os._exit(EXIT_FAILED)

    def silent_ranks(self, older_than_s: float | None = None) -> list[str]:
        """"rank N on HOST (pid P), no heartbeat in S s (last stamped 08:01:12 UTC by its clock)" for every rank
        that stopped beating, and every rank that exited or failed: what a failed collective's message names.

        A beat stamped more than `older_than_s` ago by this host's clock only makes its rank a suspect: other
        hosts' clocks may be skewed, so a suspect is named only if its beat count then does not advance while
        this rank watches for two beat intervals. No suspect, no wait. Best effort."""
        older = 3 * self.interval_s if older_than_s is None else older_than_s
        watch = 2 * self.interval_s
        found, suspects = [], {}
        now = time.time()
        for rank in range(self.world):
            if rank == self.rank:
                continue
            try:
                beat = self.read_beat(rank)
            except Exception:
                return found
            if beat is None:
                found.append(f"rank {rank} (no heartbeat)")
            elif beat.state == EXITED:
                found.append(f"{beat.where()}, exited")
            elif beat.state == FAILED:
                found.append(f"{beat.where()}, failed: {beat.doing}")
            elif now - beat.wall > older:
                suspects[rank] = beat
        if suspects:
            time.sleep(watch)
        for rank, beat in suspects.items():
            try:
                later = self.read_beat(rank)
            except Exception:
                break
            if later is not None and later.count == beat.count:
                stamp = time.strftime("%H:%M:%S UTC", time.gmtime(beat.wall))
                found.append(f"{beat.where()}, no heartbeat in {watch:.3g} s (last stamped {stamp} by its clock)")
        return found


def _process_space() -> str:
    """"<boot id>:<pid namespace>", or "" where /proc does not tell (then no process is ever killed)."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id", encoding="ascii").read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def _kill_quietly(pid: int) -> None:
    import signal

    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


_active: Liveness | None = None


def active() -> Liveness | None:
    """The running Liveness of this process, if any (for error messages and activity notes)."""
    return _active


def set_doing(text: str) -> None:
    """Say what this rank is doing (shown when it stops responding). A no-op without liveness."""
    if _active is not None:
        _active.set_doing(text)


def check_timeout(timeout_s: float) -> None:
    if timeout_s < 0:
        raise UsageError(f"--liveness-timeout must be >= 0 seconds (0 turns it off), got {timeout_s}")


def start_liveness(rank: int, world: int, timeout_s: float, environ: dict[str, str] | None = None) -> Liveness | None:
    """Connect a client of the job's rendezvous store (MASTER_ADDR:MASTER_PORT) and start the thread.

    Returns None (and logs why) when liveness is off, the world is one process, or no TCP store can be
    reached (an outer initialiser may have used another init method)."""
    global _active
    check_timeout(timeout_s)
    if timeout_s == 0 or world <= 1:
        return None
    import torch.distributed as tdist

    env = os.environ if environ is None else environ
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not addr or not port:
        log.warning("rank %d: liveness is off: MASTER_ADDR/MASTER_PORT are not set", rank)
        return None
    interval = interval_for(timeout_s)
    try:
        store = tdist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=max(2.0, 2 * interval)),
                               wait_for_workers=False)
    except Exception as exc:
        log.warning("rank %d: liveness is off: cannot reach the rendezvous store at %s:%s: %s", rank, addr, port, exc)
        return None
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    where = (f"the rendezvous store at {addr}:{port} (torchrun's agent)" if agent
             else f"rank 0 on {addr} (it hosts the rendezvous store at {addr}:{port})")
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    _active = Liveness(store, rank, world, timeout_s, prefix=f"vaecache/liveness/{restart}/", store_where=where,
                       hosts_store=rank == 0 and not agent).start()
    log.debug("rank %d: liveness on: a heartbeat every %.1f s, watching rank %s", rank, interval, _active.watch.target)
    return _active


def stop_liveness(failure: BaseException | None = None) -> None:
    """Stop this process's heartbeats; a `failure` (an exception ending the rank) is published so the job ends
    at once, naming it, instead of the others waiting in a collective for this rank."""
    global _active
    if _active is not None:
        text = None
        if failure is not None:
            text = f"{type(failure).__name__}: {(str(failure).splitlines() or [''])[0]}"
        _active.stop(text)
        _active = None
