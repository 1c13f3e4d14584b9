"""`vaecache report OUT`: the cache as one static page a person reads before training on it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from vaecache.cli.common import console, report_errors
from vaecache.cli.options import StorageOption


@report_errors
def report(
    out: str = typer.Argument(..., metavar="OUT", help="A cache: a folder written by encode, or its s3:// URL."),
    report_dir: Optional[Path] = typer.Option(None, "--out", "-o", metavar="REPORT_DIR",
                                              help="Folder for index.html (default: OUT-report here)."),
    clips: int = typer.Option(12, "--clips", help="Clips to sample and decode (0: tables alone).", metavar="N"),
    seed: int = typer.Option(0, "--seed", help="Seed of the sample.", metavar="N"),
    device: str = typer.Option("auto", "--device", help="Where clips are decoded: auto | cpu | cuda[:N].",
                               metavar="TEXT"),
    decode_budget: float = typer.Option(300.0, "--decode-budget", metavar="SECONDS",
                                        help="Seconds the decoding may take (default 300)."),
    storage_option: StorageOption = None,
) -> None:
    """Write a static HTML page about a cache."""
    from vaecache.report.build import ReportSettings, write_report
    from vaecache.urls import parse_storage_options

    settings = ReportSettings(clips=clips, seed=seed, device=device, decode_budget_s=decode_budget)
    written = write_report(out, report_dir, settings, dict(parse_storage_options(storage_option)),
                           on_step=lambda line: console.print(f"report: {escape(line)}", soft_wrap=True))
    scale = written.summary.get("scale") or {}
    flagged = scale.get("flagged")
    verdict = (f"{len(flagged)} of {len(scale.get('channels') or [])} latent channels off scale" if flagged
               else "every latent channel in its band" if flagged is not None else f"no scale ({scale.get('problem')})")
    console.print(escape(f"wrote {written.page} ({written.summary['sample']['clips']} clips shown, "
                         f"{written.summary['failures']['count']} skipped inputs, {verdict}; {written.seconds:.1f} s)"),
                  soft_wrap=True)
    typer.echo(str(written.page))
