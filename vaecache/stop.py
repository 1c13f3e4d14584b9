"""Graceful stop on SIGTERM / SIGUSR1 (what SLURM sends before a kill or requeue) and a first Ctrl-C."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

log = logging.getLogger("vaecache")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

_stop_handling_began = False
"""Whether this command reached the point where a stop request commits work instead of killing start-up."""


def begin_command() -> None:
    """Mark the start of a CLI command: a Ctrl-C from here on is a start-up interrupt until StopRequest takes over."""
    global _stop_handling_began
    _stop_handling_began = False


def stop_handling_began() -> bool:
    """True once a StopRequest was entered in this command (the encode run proper has begun)."""
    return _stop_handling_began


class StopRequest:
    """Context manager: while active, the signals above set a flag instead of killing the process.

    The encode loop polls `requested` between batches, commits its open shard and exits. A second
    Ctrl-C abandons the batch in flight: it raises KeyboardInterrupt, after saying so.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}
        self.signal_name: str | None = None

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self._event.is_set():
            log.warning("second Ctrl-C: abandoning the batch in flight; shards committed before it are kept")
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        self._event.set()
        log.warning("received %s: stopping once the batch in flight is committed (a second Ctrl-C abandons it)",
                    self.signal_name)

    def __enter__(self) -> "StopRequest":
        global _stop_handling_began
        _stop_handling_began = True
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def ignore_stop_signals(_worker_id: int = 0) -> None:
    """DataLoader worker init: let the main process decide when to stop (it shuts the workers down)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
