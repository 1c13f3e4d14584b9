"""`vaecache verify`: run the checks, render a table, optionally write JSON; exit 0 ok / 1 problems / 2 usage."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.markup import escape

from vaecache.cli.common import check_json_target, console, human_bytes, report_errors, write_json
from vaecache.cli.options import StorageOption
from vaecache.errors import EXIT_FAILED, EXIT_OK, UsageError

if TYPE_CHECKING:  # the meter and rich tables load when a command runs, not for --help
    from rich.table import Table

    from vaecache.verify.integrity import VerifyReport


def report_table(report: VerifyReport) -> Table:
    from rich.table import Table

    # At 80 columns the details wrap, never a check's name or its counts (no outer edge: more room for details).
    table = Table(title=f"vaecache verify {escape(report.out)}", show_edge=False, pad_edge=False)
    table.add_column("check", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("passed", justify="right", no_wrap=True)
    table.add_column("failed", justify="right", no_wrap=True)
    table.add_column("details", overflow="fold")  # fold, never cut: the details name the broken shard or clip
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
        table.add_row(check.name, status, str(check.passed), str(check.failed), escape(details))
    return table


def problem_lines(report: VerifyReport) -> list[str]:
    """Each problem on one line (table cells wrap at terminal width; these stay greppable)."""
    lines = [f"{check.name}: {problem}" for check in report.checks for problem in check.problems]
    lines += [f"{check.name}: {check.note}" for check in report.checks if check.failed and check.note]
    return lines


@report_errors
def verify(
    out: str = typer.Argument(..., metavar="OUT", help="A cache: a folder written by encode, or its s3:// URL."),
    quick: bool = typer.Option(False, "--quick", help="Sizes and headers only: no hashing.",
                               metavar=""),
    json_file: Optional[Path] = typer.Option(None, "--json", help="Also write the report as JSON here ('-': stdout).",
                                             metavar="FILE"),
    threads: Optional[int] = typer.Option(None, "--threads", help="Shards checked at once (default: cores, up to 8).",
                                          metavar="N"),
    dataset: Optional[str] = typer.Option(None, "--dataset",
                                          help="Also check against DATA: clips missing, or without a source.",
                                          metavar="DATA", rich_help_panel="Against the source"),
    reencode: int = typer.Option(0, "--reencode", help="Decode and re-encode K clips and compare.", metavar="K",
                                 rich_help_panel="Against the source"),
    vae: Optional[str] = typer.Option(None, "--vae", help="--reencode: the VAE (default: the recorded spec).",
                                      metavar="SPEC", rich_help_panel="Against the source"),
    seed: int = typer.Option(0, "--seed", help="--reencode: which clips it picks.", metavar="N",
                             rich_help_panel="Against the source"),
    device: str = typer.Option("auto", "--device", help="--reencode: auto | cpu | cuda.", metavar="TEXT",
                               rich_help_panel="Against the source"),
    tolerance: Optional[float] = typer.Option(None, "--tolerance",
                                              help="--reencode: allowed difference (of the max).", metavar="X",
                                              rich_help_panel="Against the source"),
    allow_pickle_weights: bool = typer.Option(False, "--allow-pickle-weights",
                                              help="Let pickled .bin weights load (runs code).",
                                              rich_help_panel="Against the source", metavar=""),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress on stderr (default on).",
                                  metavar=""),
    repair: bool = typer.Option(False, "--repair", help="Delete stray shards no commit claims.", metavar=""),
    storage_option: StorageOption = None,
) -> None:
    """Prove a cache complete and intact."""
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    check_json_target(json_file)
    from vaecache.meter import meter
    from vaecache.storage import set_data_storage_options
    from vaecache.urls import Url, location, parse_storage_options

    storage_options = dict(parse_storage_options(storage_option))
    set_data_storage_options(storage_options)  # DATA at a URL (--dataset) is read with them too
    data = location(dataset) if dataset is not None else None
    if data is not None and not isinstance(data, Url) and not data.exists():
        from vaecache.sources.braces import is_brace_pattern

        if not is_brace_pattern(str(dataset)):  # shards named by a pattern: the layout names a missing one
            raise UsageError(f"{dataset}: --dataset path does not exist")
    if reencode < 0:
        raise UsageError(f"--reencode must be >= 0, got {reencode}")

    from vaecache.cache.store import open_store

    store = open_store(out, storage_options)
    store.check_present()  # light: refused before torch loads

    from vaecache.distributed.context import distributed
    from vaecache.settings.commands import VerifyOptions
    from vaecache.verify.recheck import verify as verify_out

    options = VerifyOptions(quick=quick, threads=threads, dataset=data, reencode=reencode, vae=vae, seed=seed,
                            device=device, allow_pickle_weights=allow_pickle_weights, tolerance=tolerance,
                            repair=repair, storage_options=tuple(storage_options.items()))
    with distributed(device=device if reencode else "cpu") as ctx:  # under torchrun the shards are split
        label = "verify" if ctx.info.world_size == 1 else f"verify (rank 0's share of {ctx.info.world_size} ranks)"
        with meter(label, "shards", console, enabled=progress and ctx.info.rank == 0) as on_progress:
            report = verify_out(store, options, ctx=ctx, on_progress=on_progress)
        if ctx.info.rank != 0:
            raise typer.Exit(EXIT_OK if report.ok else EXIT_FAILED)
    _print_report(report, json_file)


def _print_report(report: VerifyReport, json_file: Path | None) -> None:
    """What --repair deleted, the table, one line per problem, the summary and the verdict; exits 0 (ok) or 1."""
    if report.repaired:
        console.print(f"--repair deleted {len(report.repaired)} stray shard(s): "
                      f"{escape(', '.join(report.repaired[:3]))}" + (" ..." if len(report.repaired) > 3 else ""),
                      soft_wrap=True)
    console.print(report_table(report))
    for line in problem_lines(report):
        console.print(f"[red]FAIL[/red] {escape(line)}", soft_wrap=True)
    summary = report.summary
    if summary:
        console.print(f"{summary['clips']} clips, {summary['views']} views, {summary['shards']} shards, "
                      f"{human_bytes(summary['bytes'])}; VAE {summary['vae']}"
                      + (" (untrained builtin)" if summary.get("untrained_vae") else ""))
    console.print("[green]cache OK[/green]" if report.ok else "[red]cache has problems[/red]")
    if json_file is not None:
        write_json(json_file, report.to_json())
    raise typer.Exit(EXIT_OK if report.ok else EXIT_FAILED)
