"""`vaecache plan`: parse options, build the plan, render it to stderr, optionally write JSON."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from vaecache.cli._common import (MaxFramePixelsOption, DecoderOption, FitOption, FramesPolicyOption, NumFramesOption, SizeOption, VaeOption,
                                  check_json_target, console, human_bytes, report_errors, write_json)
from vaecache.settings.loader import check_option_syntax, load_toml, parse_bytes, pop_clip_options
from vaecache.errors import DatasetError, UsageError

if TYPE_CHECKING:
    from vaecache.settings.commands import PlanConfig
    from vaecache.planning.report import PlanReport

MAX_ROWS = 16
# Encode options a shared TOML may hold that do not change the plan.
_ENCODE_ONLY = ("out", "shard_size", "seed", "on_error", "overwrite", "timeout_s", "progress",
                "hash_sources", "allow_other_numerics")


def build_plan_config(data: Path, options: dict[str, Any], config_file: Path | None) -> PlanConfig:
    """CLI flags override the TOML file (the same file `vaecache encode --config` reads)."""
    merged: dict[str, Any] = load_toml(config_file) if config_file else {}
    merged.update({key: value for key, value in options.items() if value is not None})
    check_option_syntax(merged)
    for key in _ENCODE_ONLY + ("data",):
        merged.pop(key, None)
    if not merged.get("vae"):
        raise UsageError("--vae is required (builtin:tiny, builtin:small, diffusers:PATH[#subfolder] or "
                         "python:module:function)")
    clip = pop_clip_options(merged)
    budget = merged.pop("memory_budget", None)
    if budget is not None:
        try:
            budget = parse_bytes(budget)
        except UsageError:
            raise UsageError(f"--memory-budget must be a byte count like 8GiB or 500MB, got {budget!r}") from None
    from vaecache.settings.commands import PlanConfig

    return PlanConfig(data=Path(data), clip=clip, memory_budget=budget, **merged)


def summary_table(report: PlanReport) -> Table:
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
        rows.append(("measured", f"{m.seconds_per_view:.3f} s/view on {m.device} ({m.views} views of {escape(m.clip_id)})"))
        if m.peak_bytes is not None:
            per_view = human_bytes(m.peak_per_view_bytes) if m.peak_per_view_bytes is not None else "unknown"
            rows.append(("peak memory", f"{human_bytes(m.peak_bytes)} ({per_view} per view; {m.method})"))
        if m.backoffs:
            rows.append(("OOM backoffs while measuring", f"{len(m.backoffs)}"))
    if report.eta_s is not None:
        rows.append(("ETA", _duration(report.eta_s) + f" on {cfg['world_size']} ranks"))
    if cfg.get("memory_budget") is not None:
        fits = report.fits_views_per_forward
        rows.append((f"views per forward in {human_bytes(cfg['memory_budget'])}", "unknown" if fits is None else f"{fits}"))
    for row in rows:
        table.add_row(*row)
    return table


def ranks_table(report: PlanReport) -> Table:
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
    table = Table(title=f"buckets (--fit {report.config.get('fit', 'cover')})")
    for name in ("bucket", "latent (c, t, h, w)", "clips", "views", "bytes", "source kept", "padding", "max distortion"):
        table.add_column(name, justify="left" if name == "bucket" else "right")
    for row in report.buckets:
        shape = str(tuple(row["view_shape"]))
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
def plan(
    data: Path = typer.Argument(..., help="Dataset: DATA/<scene>/<camera>.mp4, a folder of videos, or a .jsonl index."),
    vae: VaeOption = None,
    num_frames: NumFramesOption = None,
    size: SizeOption = None,
    frame_stride: Optional[int] = typer.Option(None, "--frame-stride", help="Use every S-th source frame (default 1)."),
    frames_policy: FramesPolicyOption = None,
    fit: FitOption = None,
    decoder: DecoderOption = None,
    window_stride: Optional[int] = typer.Option(None, "--window-stride", help="Source frames between clip starts."),
    max_clips_per_scene: Optional[int] = typer.Option(None, "--max-clips-per-scene", help="Keep the first K clips of each scene."),
    max_frame_pixels: MaxFramePixelsOption = None,
    cameras: Optional[str] = typer.Option(None, "--cameras", help="Comma-separated camera order (default: names sorted)."),
    world_size: Optional[int] = typer.Option(None, "--world-size", help="Ranks to plan for (default 1)."),
    sp_size: Optional[int] = typer.Option(None, "--sp-size", help="Ranks per sequence-parallel group (default 1)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Clips per batch (default 1)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="fp32 | bf16 | fp16 (default fp32)."),
    device: Optional[str] = typer.Option(None, "--device", help="Where to measure: auto | cpu | cuda[:N] (default auto)."),
    store: Optional[str] = typer.Option(None, "--store", help="mean-logvar (default) | mean | sample: what is counted in bytes."),
    tiling: Optional[bool] = typer.Option(None, "--tiling/--no-tiling", help="Measure with the VAE's own tiling."),
    compiled: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="Measure with the encoder compiled "
                                            "(torch.compile; the warm-up forward pays the compile)."),
    channels_last: Optional[bool] = typer.Option(None, "--channels-last/--no-channels-last", help="Measure with "
                                                 "convolution weights and inputs in channels-last memory format."),
    views_per_forward: Optional[str] = typer.Option(None, "--views-per-forward", help="auto | all | K: views of one clip "
                                                    "per VAE forward (default auto: all on CUDA, 1 on CPU; K must "
                                                    "divide the cameras)."),
    memory_budget: Optional[str] = typer.Option(None, "--memory-budget", help="Device memory per rank, e.g. 8GiB: report the largest micro-batch that fits."),
    measure: bool = typer.Option(True, "--measure/--no-measure", help="Encode one real clip to measure time and memory."),
    allow_pickle_weights: bool = typer.Option(False, "--allow-pickle-weights", help="Let a diffusers VAE folder holding only pickled .bin weights load (pickle runs code: trust the folder)."),
    json_file: Optional[Path] = typer.Option(None, "--json", help="Also write the report as JSON to this file ('-': stdout)."),
    config: Optional[Path] = typer.Option(None, "--config", help="TOML file with encode options (flags win)."),
) -> None:
    """Dry run: scenes, clips, latent shapes and bytes, the split over ranks, a measured ETA."""
    options = {
        "vae": vae, "num_frames": num_frames, "size": size, "frame_stride": frame_stride,
        "frames_policy": frames_policy, "fit": fit, "decoder": decoder,
        "window_stride": window_stride, "max_clips_per_scene": max_clips_per_scene, "max_frame_pixels": max_frame_pixels, "cameras": cameras,
        "world_size": world_size, "sp_size": sp_size, "batch_size": batch_size, "dtype": dtype, "device": device,
        "store": store, "tiling": tiling, "compiled": compiled, "channels_last": channels_last,
        "views_per_forward": views_per_forward,
        "memory_budget": memory_budget, "measure": None if measure else False,
        "allow_pickle_weights": allow_pickle_weights or None,
        "clip_ids": json_file is not None,  # only the JSON report lists every group's clip ids
    }
    if not data.exists():
        raise DatasetError(f"{data}: dataset path does not exist")
    check_json_target(json_file)
    cfg = build_plan_config(data, options, config)
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
