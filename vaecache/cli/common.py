"""Shared CLI plumbing: one-line error mapping, stderr console, launcher env, JSON output.

Nothing here imports torch, diffusers, decord or av: `--help` and usage errors must answer at once.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from vaecache import stop
from vaecache.distributed.launch import launcher_rank_world
from vaecache.errors import EXIT_FAILED, EXIT_INTERRUPTED, DatasetError, UsageError, VaecacheError

F = TypeVar("F", bound=Callable[..., Any])
console = Console(stderr=True, highlight=False, soft_wrap=True)
QUIET_RANK_EXIT_DELAY_S = 10.0  # rank 0 can still be importing torch on a loaded node; its exit ends the wait
"""How long a rank that leaves a usage error for rank 0 to print waits before it exits."""


def debug_enabled() -> bool:
    return os.environ.get("VAECACHE_DEBUG", "") not in ("", "0")


def is_launcher_rank0() -> bool:
    return launcher_rank_world()[0] == 0


def report_errors(fn: F) -> F:
    """Known failures become one red line on stderr and their exit code; a traceback only with VAECACHE_DEBUG=1.

    A usage error is printed by rank 0 only: every rank finds the same mistake. Ctrl-C before the
    encode loop took over the signals (importing torch, loading the VAE) is one line, not a traceback.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stop.begin_command()
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except VaecacheError as exc:
            if debug_enabled():
                raise
            if not (isinstance(exc, UsageError) and not is_launcher_rank0()):
                console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
                tell_launcher(f"error: {exc}", exc.exit_code)
            else:  # the launcher tears the job down at the first exit: let rank 0's message out first
                time.sleep(QUIET_RANK_EXIT_DELAY_S)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            if debug_enabled():
                raise
            console.print(f"[red]{escape(interrupted_message(fn.__name__))}[/red]", soft_wrap=True)
            tell_launcher(interrupted_message(fn.__name__), EXIT_INTERRUPTED)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except Exception as exc:
            if debug_enabled():
                raise
            console.print(f"[red]error:[/red] unexpected {type(exc).__name__}: {escape(str(exc))} "
                          "(rerun with VAECACHE_DEBUG=1 for a traceback)", soft_wrap=True)
            tell_launcher(f"error: unexpected {type(exc).__name__}: {exc}", EXIT_FAILED)
            raise typer.Exit(EXIT_FAILED) from None

    return wrapper  # type: ignore[return-value]


TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
"""Where torchrun asks a worker to leave its error (torch.distributed.elastic.multiprocessing.errors): the message
becomes the "traceback" line of the root cause in torchrun's failure summary, the last thing torchrun prints."""


def tell_launcher(line: str, exit_code: int) -> None:
    """Under torchrun, leave vaecache's one line (and its exit code, which torchrun replaces with 1) where torchrun's
    failure summary shows it; nothing elsewhere. Best effort: a launcher that cannot be told is no error."""
    path = os.environ.get(TORCHELASTIC_ERROR_FILE)
    if not path:
        return
    record = {"message": {"message": f"vaecache exit {exit_code}: {(line.splitlines() or [''])[0][:2000]}",
                          "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(record, handle)
    except OSError:
        pass


WRITE_AT_THE_END = ("plan", "verify")
"""Commands whose only write is their final atomic --json write."""


def interrupted_message(command: str) -> str:
    """What a Ctrl-C that ended `command` means for its output."""
    if stop.stop_handling_began():
        return ("interrupted: abandoned the batch in flight; shards committed before it are kept "
                "(rerun the same command to resume)")
    if command == "encode":  # before run_encode's StopRequest: importing torch, resolving the options
        return "interrupted during start-up; nothing was written"
    if command in WRITE_AT_THE_END:
        return "interrupted; nothing was written"
    return "interrupted"


def write_json(target: Path, payload: Any) -> None:
    """Write `payload` as indented JSON to a file (atomically) or, for `-`, to stdout."""
    data = json.dumps(payload, indent=2).encode() + b"\n"
    if str(target) == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return
    from vaecache.cache.io import atomic_write_bytes

    atomic_write_bytes(target, data)


SHOWN_FAILURES = 10


def failure_lines(failures: list[dict[str, Any]], out: str, shown: int = SHOWN_FAILURES) -> list[str]:
    """`skipped PATH: reason` for the first `shown` failures, and where the rest are."""
    lines = [f"skipped {failure_subject(f)}: {f.get('reason')}" for f in failures[:shown]]
    if len(failures) > shown:
        lines.append(f"... and {len(failures) - shown} more: vaecache inspect {out} --failures")
    return lines


class LiveFailures:
    """Prints `skipped PATH: reason` for the first `shown` failure records a rank writes, as it writes them (prefixed
    with the rank when there are several), then once where the rest are; remembers what it printed, so the end of
    the run lists only the others."""

    def __init__(self, out: Path, rank: int = 0, world: int = 1, shown: int = SHOWN_FAILURES) -> None:
        self.out, self.shown = out, shown
        self.prefix = f"rank {rank}: " if world > 1 else ""
        self.printed: set[tuple[str, str, str, str]] = set()
        self.seen = 0

    def __call__(self, record: dict[str, Any]) -> None:
        from vaecache.cache.failures import failure_identity

        self.seen += 1
        if self.seen <= self.shown:
            self.printed.add(failure_identity(record))
            console.print(escape(f"{self.prefix}skipped {failure_subject(record)}: {record.get('reason')}"),
                          soft_wrap=True)
        elif self.seen == self.shown + 1:
            console.print(escape(f"{self.prefix}more inputs skipped: vaecache inspect {self.out} --failures lists "
                                 "every one"), soft_wrap=True)

    def not_printed(self, failures: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from vaecache.cache.failures import failure_identity

        return [f for f in failures if failure_identity(f) not in self.printed]


def failure_subject(failure: dict[str, Any]) -> str:
    """What a failure record is about: its file (and camera), else its clip or scene."""
    where = failure.get("path") or failure.get("clip") or failure.get("scene")
    camera = failure.get("camera")
    return f"{where} ({camera})" if camera and failure.get("path") else str(where)


def note_untrained_vae(out: Any) -> None:
    """Say so when the cache in `out` (a store, vaecache.cache.store) was encoded by an untrained VAE (builtin:tiny):
    its latents mean nothing."""
    from vaecache.errors import VaecacheError

    try:
        vae = json.loads(out.read("manifest.json")).get("vae") or {}
    except (OSError, ValueError, VaecacheError):
        return  # the command itself names a missing or damaged manifest
    if vae.get("untrained"):
        console.print(f"[yellow]note:[/yellow] {escape(str(vae.get('spec')))} is an untrained VAE with random weights "
                      "(for demos and tests; its latents mean nothing to a real model)", soft_wrap=True)


def check_dataset_exists(data: Path | str) -> None:
    """Refuse a DATA that does not exist (exit 2) before any work; a brace pattern of shards is checked by the layout,
    which names a missing shard."""
    from vaecache.sources.braces import is_brace_pattern
    from vaecache.urls import is_url

    if is_url(str(data)):  # object storage: listed by start-up, which names what is missing
        return
    data = Path(data)
    if not data.exists() and not is_brace_pattern(str(data)):
        raise DatasetError(f"{data}: dataset path does not exist")


def check_json_target(target: Path | None) -> None:
    """Refuse a --json file whose folder does not exist before any work is done."""
    if target is None or str(target) == "-":
        return
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{target}: --json folder {parent} does not exist")
    if target.is_dir():
        raise UsageError(f"{target}: --json must name a file or '-', not a folder")


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} B"
