"""`vaecache index`: probe every video of DATA once into a JSONL index that encode and plan read without
opening a video. Runs alone or as every rank of torchrun / srun; a killed run resumes where it stopped."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from vaecache.cli.common import check_dataset_exists, console, report_errors
from vaecache.cli.options import StorageOption
from vaecache.settings.options import DEFAULT_PROBE_WORKERS, parse_cameras, parse_columns


@report_errors
def index(
    data: str = typer.Argument(..., metavar="DATA",
                               help="Dataset folder, index, table, .tar shards, LeRobot or nuScenes root, or s3:// "
                                    "URL."),
    output: Path = typer.Option(..., "--output", "-o", help="The index to write (INDEX.jsonl).", metavar="INDEX"),
    cameras: Optional[str] = typer.Option(None, "--cameras", help="Camera order and selection: a,b,c.", metavar="A,B",
                                          rich_help_panel="Input"),
    workers: int = typer.Option(DEFAULT_PROBE_WORKERS, "--workers", help="Probe threads per rank.", metavar="N",
                                rich_help_panel="Input"),
    fps: Optional[float] = typer.Option(None, "--fps", help="Frame rate of image sequences without times.",
                                        metavar="X", rich_help_panel="Input"),
    nuscenes_version: Optional[str] = typer.Option(None, "--nuscenes-version",
                                                   help="Which nuScenes tables (v1.0-mini, ...).", metavar="V",
                                                   rich_help_panel="Input"),
    column: Optional[str] = typer.Option(None, "--column", help="ROLE=NAME: a table's column for a role.",
                                         metavar="ROLE=NAME", rich_help_panel="Input"),
    timeout: float = typer.Option(1800.0, "--timeout", help="Seconds a rank waits for the others.", metavar="S",
                                  rich_help_panel="Ranks and progress"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress on stderr (default on).",
                                  rich_help_panel="Ranks and progress", metavar=""),
    storage_option: StorageOption = None,
) -> None:
    """Probe every camera once into an index for encode and plan."""
    check_dataset_exists(data)
    from vaecache.sources.indexing import IndexConfig
    from vaecache.storage import set_data_storage_options
    from vaecache.urls import location, parse_storage_options

    set_data_storage_options(dict(parse_storage_options(storage_option)))
    cfg = IndexConfig(data=location(data), output=output, cameras=parse_cameras(cameras) or None if cameras else None,
                      workers=workers, frame_rate=fps, nuscenes_version=nuscenes_version,
                      columns=parse_columns(column))

    from vaecache.distributed.context import distributed
    from vaecache.meter import meter
    from vaecache.sources.indexing import describe_ranks, run_index

    with distributed(sp_size=1, device="cpu", timeout_s=timeout) as ctx:
        is_rank0 = ctx.info.rank == 0
        label = "index" if ctx.info.world_size == 1 else f"index (rank 0's share of {ctx.info.world_size} ranks)"
        with meter(label, "scenes", console, enabled=is_rank0 and progress) as advance:
            summary = run_index(cfg, ctx, advance)
    if is_rank0:
        from rich.table import Table

        table = Table(title=f"vaecache index -> {escape(str(summary.output))}", show_header=False)
        table.add_column("what")
        table.add_column("value", justify="right", overflow="fold")
        for row in (("scenes", f"{summary.scenes}"), ("usable", f"{summary.usable}"),
                    ("rejected", f"{summary.rejected}" + (f" (see {escape(str(summary.rejected_file))})"
                                                          if summary.rejected else "")),
                    ("probed now", f"{summary.probed}"), ("from an earlier run", f"{summary.reused}"),
                    ("ranks", f"{ctx.info.world_size} x {workers} threads"),
                    ("per rank", describe_ranks(summary.ranks)), ("wall time", f"{summary.wall_s:.1f} s")):
            table.add_row(*row)
        console.print(table)
    raise typer.Exit(summary.exit_code)
