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
    data: str = typer.Argument(..., metavar="DATA", help="Dataset: DATA/<scene>/<camera>.mp4 or "
                               "DATA/<scene>/<camera>/<frames>, a folder of videos or of frame folders, a .jsonl "
                               "index, a .csv/.tsv/.parquet table, WebDataset .tar shards, a LeRobot dataset or a "
                               "nuScenes root; or the s3:// URL of any of them."),
    output: Path = typer.Option(..., "--output", "-o", help="The index to write (INDEX.jsonl); unusable scenes go to "
                                "INDEX.rejected.jsonl beside it."),
    cameras: Optional[str] = typer.Option(None, "--cameras", help="Comma-separated camera order "
                                          "(default: names sorted)."),
    workers: int = typer.Option(DEFAULT_PROBE_WORKERS, "--workers", help="Threads probing videos in each rank."),
    fps: Optional[float] = typer.Option(None, "--fps", help="Frame rate of image-sequence cameras whose frames carry "
                                        "no times (written into each line)."),
    nuscenes_version: Optional[str] = typer.Option(None, "--nuscenes-version", help="Which tables of a nuScenes "
                                                   "root (v1.0-mini, v1.0-trainval, ...)."),
    column: Optional[str] = typer.Option(None, "--column", help="ROLE=NAME[,ROLE=NAME...]: which column of a "
                                         ".csv/.tsv/.parquet table plays a role (path, id, start, end, start_frame, "
                                         "end_frame, ranges)."),
    timeout: float = typer.Option(1800.0, "--timeout", help="Seconds a rank waits for the others at the end."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress on rank 0: a bar in a terminal, "
                                  "a line every 30 s (VAECACHE_PROGRESS_INTERVAL) in a log.", metavar=""),
    storage_option: StorageOption = None,
) -> None:
    """Probe every camera once (frame count, fps, size, codec, first and last frame time) into a JSONL index for
    encode and plan; a nuScenes root's tables are read once here, into one line per scene."""
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
