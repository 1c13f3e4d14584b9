"""`vaecache plan`: parse options, build the plan, render it to stderr, optionally write JSON."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.markup import escape

from vaecache.cli.common import check_dataset_exists, check_json_target, console, human_bytes, report_errors, write_json
from vaecache.cli.early_checks import check_before_torch
from vaecache.cli.options import ConfigOption, DataArgument, with_setting_flags
from vaecache.settings.options import PLAN

if TYPE_CHECKING:  # the settings tables and rich tables load when a command runs, not for --help
    from rich.table import Table

    from vaecache.planning.report import PlanReport
    from vaecache.settings.commands import PlanConfig

MAX_ROWS = 16


def build_plan_config(data: Path, flags: dict[str, Any], config_file: Path | None,
                      clip_ids: bool = True) -> PlanConfig:
    """The plan settings: flags over the TOML file (the same file `vaecache encode --config` reads)."""
    from vaecache.settings.loader import load_settings

    return load_settings(PLAN, data, flags, config_file, extra={"clip_ids": clip_ids})  # type: ignore[return-value]


def summary_table(report: PlanReport) -> Table:
    from rich.table import Table

    cfg = report.config
    table = Table(title=f"vaecache plan {escape(cfg['data'])}", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    keys = "+".join(report.stored)
    rows = [
        ("VAE", f"{escape(cfg['vae'])} ({report.vae['family']}{', untrained' if report.vae['untrained'] else ''})"),
        ("scenes", f"{len(report.scenes) + len(report.skipped)} ({len(report.skipped)} skipped)"),
        ("clips", f"{report.clips}"),
        ("cameras per clip", f"{report.cameras}"),
        ("views", f"{report.views}"),
        ("frames", f"{report.frames}"),
        *([("latent shape per view", f"{tuple(report.latent_shape)} (c, t, h, w)"),
           ("latent shape per clip", f"{(report.cameras, *report.latent_shape)}")] if not report.buckets else
          [("buckets", f"{len(report.buckets)} ({len(report.empty_buckets)} empty; shapes in the bucket table)")]),
        (f"bytes ({keys}, {report.dtype})", f"{human_bytes(report.total_bytes)} "
                                             + ("" if report.buckets else
                                                f"({human_bytes(report.bytes_per_view * report.cameras)} per clip)")),
        ("ranks", f"{cfg['world_size']} = DP {cfg['dp_size']} x SP {cfg['sp_size']}, batch {cfg['batch_size']} clips"),
        ("padding waste", f"{report.encoded_views - report.views} of {report.encoded_views} encodes "
                          f"({100 * report.padding_waste:.1f}%)"),
    ]
    m = report.measurement
    if m is not None:
        rows.append(("measured", f"{m.seconds_per_view:.3f} s/view on {m.device} "
                                 f"({m.views} views of {escape(m.clip_id)})"))
        if m.peak_bytes is not None:
            per_view = human_bytes(m.peak_per_view_bytes) if m.peak_per_view_bytes is not None else "unknown"
            rows.append(("peak memory", f"{human_bytes(m.peak_bytes)} ({per_view} per view; {m.method})"))
        if m.backoffs:
            rows.append(("OOM backoffs while measuring", f"{len(m.backoffs)}"))
    if report.eta_s is not None:
        rows.append(("ETA", _duration(report.eta_s) + f" on {cfg['world_size']} ranks"))
    if cfg.get("memory_budget") is not None:
        fits = report.fits_views_per_forward
        rows.append((f"views per forward in {human_bytes(cfg['memory_budget'])}",
                     "unknown" if fits is None else f"{fits}"))
    for row in rows:
        table.add_row(*row)
    return table


def ranks_table(report: PlanReport) -> Table:
    from rich.table import Table

    table = Table(title="work per DP group (SP group of ranks)")
    for name in ("dp", "ranks", "clips", "batches", "views", "views per rank", "padded"):
        table.add_column(name, justify="right")
    for share in report.shares[:MAX_ROWS]:
        ranks = f"{share.ranks[0]}" if len(share.ranks) == 1 else f"{share.ranks[0]}-{share.ranks[-1]}"
        table.add_row(str(share.dp_rank), ranks, str(share.clips), str(share.batches), str(share.views),
                      str(share.views_per_rank), str(share.padded_views))
    if len(report.shares) > MAX_ROWS:
        busiest = max(s.views_per_rank for s in report.shares)
        table.add_row("...", "", "", "", "", f"max {busiest}", f"{len(report.shares) - MAX_ROWS} more groups")
    return table


def scenes_table(report: PlanReport) -> Table:
    from rich.table import Table

    table = Table(title="scenes")
    for name in ("scene", "cameras", "source frames", "clips"):
        table.add_column(name, justify="right" if name != "scene" else "left")
    for row in report.scenes[:MAX_ROWS]:
        table.add_row(escape(row["scene"]), str(row["cameras"]), str(row["source_frames"]), str(row["clips"]))
    if len(report.scenes) > MAX_ROWS:
        table.add_row(f"... {len(report.scenes) - MAX_ROWS} more", "", "", "")
    for skip in report.skipped[:MAX_ROWS]:
        table.add_row(escape(skip["scene"]), "", "", f"[yellow]skipped[/yellow]: {escape(skip['reason'])}")
    if len(report.skipped) > MAX_ROWS:
        table.add_row(f"... {len(report.skipped) - MAX_ROWS} more skipped", "", "", "")
    return table


def buckets_table(report: PlanReport) -> Table:
    """The bucket histogram: clips, views, bytes and what the fit mode does to the sources of each bucket."""
    from rich.table import Table

    # Short headers and no outer edge: the whole table fits 80 columns, and no cell is cut or wrapped.
    table = Table(title=f"buckets (--fit {report.config.get('fit', 'cover')})", show_edge=False, pad_edge=False,
                  caption="latent c,t,h,w; kept, padded: shares of source, bucket; aspect: max distortion")
    for name in ("bucket", "latent", "clips", "views", "bytes", "kept", "padded", "aspect"):
        table.add_column(name, justify="left" if name == "bucket" else "right", no_wrap=True)
    for row in report.buckets:
        shape = "(" + ",".join(str(v) for v in row["view_shape"]) + ")"
        if not row["clips"]:
            table.add_row(row["name"], shape, "0", "0", "-", "", "", "[yellow]empty[/yellow]")
            continue
        table.add_row(row["name"], shape, str(row["clips"]), str(row["views"]), human_bytes(row["bytes"]),
                      f"{100 * row['mean_kept']:.1f}%", f"{100 * row['mean_padded']:.1f}%",
                      f"{row['max_distortion']:.3f}x")
    return table


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


@report_errors
@with_setting_flags(PLAN)
def plan(
    data: DataArgument,
    config: ConfigOption = None,
    json_file: Optional[Path] = typer.Option(None, "--json", help="Also write the report as JSON here ('-': stdout).",
                                             metavar="FILE"),
    *,
    flags: dict[str, Any],
) -> None:
    """Dry run: clips, shapes, bytes, ranks, a measured ETA."""
    check_dataset_exists(data)
    check_json_target(json_file)
    cfg = build_plan_config(data, flags, config, clip_ids=json_file is not None)  # only the JSON lists clip ids
    check_before_torch(cfg, encode=False)
    from vaecache.encode.dry_run import build_plan

    report = build_plan(cfg)
    console.print(scenes_table(report))
    console.print(ranks_table(report))
    if report.buckets:
        console.print(buckets_table(report))
    console.print(summary_table(report))
    for note in report.notes:
        console.print(f"[dim]note:[/dim] {escape(note)}", soft_wrap=True)
    if json_file is not None:
        write_json(json_file, report.to_json())
