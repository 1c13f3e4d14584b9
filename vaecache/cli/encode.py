"""`vaecache encode`: check usage, build the config, run the pipeline inside the distributed context.

Usage is checked before torch is imported, so a typo answers at once; torch, diffusers and the
decoders load only for a command that will run.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import typer
from rich.markup import escape

from vaecache.cli.common import (
    LiveFailures,
    check_dataset_exists,
    check_json_target,
    console,
    failure_lines,
    human_bytes,
    is_launcher_rank0,
    launcher_rank_world,
    report_errors,
    tell_launcher,
    write_json,
)
from vaecache.cli.early_checks import check_before_torch
from vaecache.cli.embed import outcome_lines
from vaecache.cli.options import ConfigOption, DataArgument, with_setting_flags
from vaecache.errors import EXIT_OK, EXIT_PARTIAL, UsageError
from vaecache.settings.options import ENCODE

if TYPE_CHECKING:  # the settings tables, the meter and rich tables load when a command runs, not for --help
    from rich.table import Table

    from vaecache.encode.summary import EncodeSummary
    from vaecache.settings.commands import EncodeConfig


def build_config(data: Path, flags: dict[str, Any], config_file: Path | None) -> EncodeConfig:
    """The encode settings: flags (option name -> value, None: not given) over the TOML file."""
    from vaecache.settings.loader import load_settings

    return load_settings(ENCODE, data, flags, config_file)  # type: ignore[return-value]


def check_usage_before_start(cfg: EncodeConfig, environ: dict[str, str] | None = None) -> None:
    """What can be refused without torch: the dataset path and the SP size against the ranks launched."""
    check_dataset_exists(cfg.source.location)
    _, world = launcher_rank_world(environ)
    sp_size = cfg.parallel.sp_size
    if sp_size > 1 and world == 1:
        raise UsageError(f"--sp-size {sp_size} needs {sp_size} ranks (or a multiple): "
                         f"torchrun --nproc-per-node {sp_size} -m vaecache encode ... "
                         f"(or srun --ntasks {sp_size} vaecache encode ...)")


def starting_lines(shown: bool) -> Callable[[str], None]:
    """`say(text)`: one dim line on stderr as start-up begins each step (its first before torch is imported, so a
    first run is never silent); nothing with --no-progress, nor on the ranks but rank 0 of a launcher."""
    if not shown or not is_launcher_rank0():
        return lambda text: None
    started = time.perf_counter()
    return lambda text: console.print(f"[dim]{time.perf_counter() - started:5.1f} s  {escape(text)} ...[/dim]",
                                      soft_wrap=True)


def summary_json(summary: EncodeSummary) -> dict[str, Any]:
    """What the summary table shows, as JSON (encode --json)."""
    payload = {field.name: getattr(summary, field.name) for field in dataclasses.fields(summary)}
    payload["out"] = str(summary.out)
    payload["views_per_s"] = summary.views_per_s
    payload["exit_code"] = summary.exit_code
    payload["empty_buckets"] = summary.empty_buckets
    return payload


@report_errors
@with_setting_flags(ENCODE)
def encode(
    data: DataArgument,
    config: ConfigOption = None,
    json_file: Optional[Path] = typer.Option(None, "--json",
                                             help="Also write the summary as JSON here ('-': stdout).", metavar="FILE"),
    *,
    flags: dict[str, Any],
) -> None:
    """Encode a video dataset into latent shards and a manifest."""
    cfg = build_config(data, flags, config)
    check_usage_before_start(cfg)
    check_json_target(json_file)
    check_before_torch(cfg, encode=True)
    say = starting_lines(cfg.progress)
    say("importing torch and diffusers")

    from vaecache.distributed.context import distributed
    from vaecache.encode.command import run_encode
    from vaecache.meter import meter

    parallel = cfg.parallel
    with distributed(sp_size=parallel.sp_size, device=parallel.device, timeout_s=parallel.timeout_s,
                     liveness_timeout_s=parallel.liveness_timeout_s) as ctx:
        is_rank0 = ctx.info.rank == 0
        if is_rank0 and cfg.vae.spec == "builtin:tiny":
            console.print("[yellow]note:[/yellow] builtin:tiny is an untrained VAE with random weights "
                          "(for demos and tests; its latents mean nothing to a real model)")
        elif is_rank0 and cfg.vae.spec == "builtin:small":
            console.print("[yellow]note:[/yellow] builtin:small is a small VAE trained only on synthetic demo "
                          "footage (for demos and tests, not for real video)")
        live = LiveFailures(cfg.out.location, ctx.info.rank, ctx.info.world_size)
        summary = run_encode(cfg, ctx, meter=lambda label, unit: meter(
            label, unit, console, enabled=is_rank0 and cfg.progress), on_failure=live,
            say=say if is_rank0 else None)
        added = []  # each kind's sets asked of encode, once the cache is finished (complete, or with skipped inputs)
        if not summary.stopped and summary.exit_code in (EXIT_OK, EXIT_PARTIAL):
            from vaecache.edges import kind_edges

            for edges in kind_edges():
                request = edges.encode_request(cfg)
                if request is not None:
                    added.extend((edges, edges.set_kind(request).what, outcome)
                                 for outcome in edges.embed(request, ctx))
    if summary.stopped:
        stopped = (f"rank {ctx.info.rank} stopped by {summary.stopped}: committed shards are kept; rerun the same "
                   "command to resume")
        console.print(f"[yellow]{escape(stopped)}[/yellow]")
        tell_launcher(stopped, summary.exit_code)
    elif is_rank0:
        if summary.already_complete:
            console.print(f"{escape(str(summary.out))} is already complete: nothing to encode"
                          + ("" if summary.rewritten else ", nothing changed"))
        for rewritten in summary.rewritten:
            console.print(f"[yellow]repaired:[/yellow] {escape(rewritten)}", soft_wrap=True)
        if summary.repaired:
            console.print(f"[yellow]repaired:[/yellow] {len(summary.repaired)} damaged shard(s) dropped and their "
                          f"clips encoded again ({escape('; '.join(summary.repaired[:3]))})", soft_wrap=True)
        console.print(summary_table(summary))
        if live.seen <= live.shown:  # the rest (other ranks', earlier runs') once more under the table
            for line in failure_lines(live.not_printed(summary.skipped), str(summary.out)):
                console.print(escape(line), soft_wrap=True)
        for edges, what, outcome in added:
            for line in outcome_lines(edges, what, outcome):
                console.print(escape(line), soft_wrap=True)
    if is_rank0 and json_file is not None:
        write_json(json_file, summary_json(summary))
    if summary.exit_code == EXIT_PARTIAL:  # torchrun reports any nonzero exit as a failure: say what it is
        tell_launcher(f"done, but {len(summary.skipped)} input(s) were skipped: vaecache inspect {summary.out} "
                      "--failures lists them", summary.exit_code)
    raise typer.Exit(summary.exit_code)


def summary_table(summary: EncodeSummary) -> Table:
    from rich.table import Table

    table = Table(title=f"vaecache encode -> {escape(str(summary.out))}", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right", overflow="fold")  # never cut the failures.parquet path
    shapes = ", ".join(f"{k} {tuple(v)}" for k, v in summary.latent_shape.items()) or "-"
    rows = [
        ("clips encoded now", f"{summary.clips}"),
        ("clips already committed (resumed)", f"{summary.resumed_clips}"),
        ("clips planned", f"{summary.planned_clips} from {summary.scenes} scenes"),
        ("views", f"{summary.views}"),
        ("frames", f"{summary.frames}"),
        ("latent shape per clip", shapes if summary.latent_shape or not summary.buckets else "per bucket"),
        *([("buckets (clips planned)", ", ".join(f"{b['name']}: {b['clips']}" for b in summary.buckets)),
           ("empty buckets", ", ".join(summary.empty_buckets) or "-")] if summary.buckets else []),
        ("shards / bytes written", f"{summary.shards} / {human_bytes(summary.bytes_written)}"),
        ("skipped inputs", f"{len(summary.skipped)}" + (f" (see {escape(str(summary.out))}/failures.parquet)"
                                                        if summary.skipped else "")),
        ("OOM backoffs", f"{len(summary.backoffs)}"),
        ("cameras left out (not encoded)", ", ".join(f"{escape(name)} ({count} scenes)"
                                                     for name, count in sorted(summary.left_out_cameras.items()))
                                           or "-"),
        ("ranks", f"{summary.world_size} (SP {summary.sp_size})"),
        ("wall time", f"{summary.wall_s:.1f} s (start-up {summary.startup_s:.1f}, encode {summary.encode_s:.1f}, "
                      f"finalize {summary.finalize_s:.1f})"),
        ("views/s", f"{summary.views_per_s:.2f}"),
    ]
    for row in rows:
        table.add_row(*row)
    return table
