"""Shared CLI plumbing: one-line error mapping, stderr console, option parsing helpers."""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from vaecache.errors import EXIT_FAILED, VaecacheError

F = TypeVar("F", bound=Callable[..., Any])
console = Console(stderr=True, highlight=False, soft_wrap=True)


def debug_enabled() -> bool:
    return os.environ.get("VAECACHE_DEBUG", "") not in ("", "0")


def report_errors(fn: F) -> F:
    """Known failures become one red line on stderr and their exit code; a traceback only with VAECACHE_DEBUG=1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except VaecacheError as exc:
            if debug_enabled():
                raise
            console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            console.print("[red]interrupted[/red]")
            raise typer.Exit(130) from None
        except Exception as exc:
            if debug_enabled():
                raise
            console.print(f"[red]error:[/red] unexpected {type(exc).__name__}: {escape(str(exc))} "
                          "(rerun with VAECACHE_DEBUG=1 for a traceback)", soft_wrap=True)
            raise typer.Exit(EXIT_FAILED) from None

    return wrapper  # type: ignore[return-value]


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} B"


def stdout_is_tty() -> bool:
    return sys.stdout.isatty()
