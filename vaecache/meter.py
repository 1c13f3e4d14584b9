"""The progress meter on stderr: a live rich bar in a terminal, periodic plain lines anywhere else (the per-rank
progress logs of committed shards are vaecache.cache.progress).

A SLURM log or a redirected stderr cannot show a redrawn bar (it fills with carriage returns), so there
a line like `encode: 120/480 clips (25%), 3.10 clips/s, ETA 01:56, 00:38 elapsed` is printed at the first
step, every VAECACHE_PROGRESS_INTERVAL seconds (default 30) and at the end. The meter is tqdm's.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable, ContextManager, Iterator

from rich.console import Console

Advance = Callable[[int, int], None]
"""advance(steps_done_now, total): the callback the encode loop, hashing and probing call."""

DEFAULT_INTERVAL_S = 30.0
INTERVAL_ENV = "VAECACHE_PROGRESS_INTERVAL"
_LINE_FORMAT = ("{desc}: {n_fmt}/{total_fmt}{unit} ({percentage:.0f}%), {rate_noinv_fmt}, ETA {remaining}, "
                "{elapsed} elapsed")
"""Always units per second (tqdm's rate_fmt turns slow rates into seconds per unit: "2.00s/ clips")."""


def interval_from_env() -> float:
    """Seconds between progress lines when stderr is not a terminal."""
    raw = os.environ.get(INTERVAL_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_INTERVAL_S
    except ValueError:
        return DEFAULT_INTERVAL_S
    return value if value >= 0 else DEFAULT_INTERVAL_S


class MeterLines:
    """Counts steps and prints one plain line per interval: never a carriage return, never a redraw."""

    def __init__(self, label: str, unit: str, write: Callable[[str], None], interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.unit, self._write, self.interval_s, self._clock = label, unit, write, interval_s, clock
        self.done = 0
        self.total: int | None = None
        self._start = clock()
        self._last_line: float | None = None
        self._done_at_last_line = -1

    def advance(self, steps: int, total: int) -> None:
        self.done += steps
        self.total = total
        now = self._clock()
        if self._last_line is None or now - self._last_line >= self.interval_s or self.done >= total:
            self._emit(now)

    def close(self) -> None:
        """Print the final count unless the last line already showed it."""
        if self._last_line is not None and self.done != self._done_at_last_line:
            self._emit(self._clock())

    def line(self, now: float) -> str:
        from tqdm import tqdm

        text = tqdm.format_meter(self.done, self.total, now - self._start, prefix=self.label, unit=f" {self.unit}",
                                 bar_format=_LINE_FORMAT)
        return " ".join(text.split())

    def _emit(self, now: float) -> None:
        self._write(self.line(now))
        self._last_line, self._done_at_last_line = now, self.done


@contextmanager
def meter(label: str, unit: str, console: Console, enabled: bool = True,
             interval_s: float | None = None) -> Iterator[Advance]:
    """Yield an `advance(steps, total)` callback that shows progress on `console` (stderr)."""
    if not enabled:
        yield lambda steps, total: None
        return
    if console.is_terminal:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                       TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False)
        task = None

        def advance_bar(steps: int, total: int) -> None:
            nonlocal task
            if task is None:
                task = bar.add_task(label, total=total)
            bar.update(task, advance=steps, total=total)

        with bar:
            yield advance_bar
        return
    lines = MeterLines(label, unit, lambda text: console.print(text, markup=False, highlight=False, soft_wrap=True),
                          interval_from_env() if interval_s is None else interval_s)
    try:
        yield lines.advance
    finally:
        lines.close()


MeterFactory = Callable[[str, str], ContextManager[Advance]]
"""meter(label, unit) -> a context that yields an Advance (vaecache.meter.meter, bound to a console)."""


@contextmanager
def meter_phase(meter: MeterFactory | None, label: str, unit: str) -> Iterator[Advance]:
    if meter is None:
        yield lambda steps, total: None
        return
    with meter(label, unit) as advance:
        yield advance
