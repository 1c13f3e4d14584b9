"""`vaecache verify`: run the checks, render a table, optionally write JSON; exit 0 ok / 1 problems / 2 usage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from vaecache.cli._common import console, human_bytes, report_errors
from vaecache.errors import EXIT_FAILED, EXIT_OK, UsageError
from vaecache.manifest import atomic_write_bytes
from vaecache.verify import VerifyReport, verify_cache


def report_table(report: VerifyReport) -> Table:
    table = Table(title=f"vaecache verify {report.out}")
    table.add_column("check")
    table.add_column("result")
    table.add_column("passed", justify="right")
    table.add_column("failed", justify="right")
    table.add_column("details")
    for check in report.checks:
        if check.skipped:
            status = "[dim]skipped[/dim]"
        elif check.failed:
            status = "[red]FAIL[/red]"
        else:
            status = "[green]ok[/green]"
        details = "\n".join(check.problems + ([f"... and {check.failed - len(check.problems)} more"]
                                              if check.failed > len(check.problems) else []))
        if check.note:
            details = f"{details}\n{check.note}".strip()
        table.add_row(check.name, status, str(check.passed), str(check.failed), details)
    return table


@report_errors
def verify(
    out: Path = typer.Argument(..., help="A folder written by vaecache encode."),
    quick: bool = typer.Option(False, "--quick", help="Skip hashing and value checks: sizes and headers only."),
    json_file: Optional[Path] = typer.Option(None, "--json", help="Also write the report as JSON to this file."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Shards checked in parallel (default: cores, up to 8)."),
) -> None:
    """Prove a latent cache is complete and intact."""
    if not out.exists():
        raise UsageError(f"{out}: no such folder")
    if not out.is_dir():
        raise UsageError(f"{out}: not a folder")
    report = verify_cache(out, quick=quick, threads=threads)
    console.print(report_table(report))
    summary = report.summary
    if summary:
        console.print(f"{summary['clips']} clips, {summary['views']} views, {summary['shards']} shards, "
                      f"{human_bytes(summary['bytes'])}; VAE {summary['vae']}"
                      + (" (untrained builtin)" if summary.get("untrained_vae") else ""))
    console.print("[green]cache OK[/green]" if report.ok else "[red]cache has problems[/red]")
    if json_file is not None:
        atomic_write_bytes(json_file, json.dumps(report.to_json(), indent=2).encode() + b"\n")
    raise typer.Exit(EXIT_OK if report.ok else EXIT_FAILED)
