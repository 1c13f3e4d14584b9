"""`vaecache encode`: check usage, build the config, run the pipeline inside the distributed context.

Usage is checked before torch is imported, so a typo answers at once; torch, diffusers and the
decoders load only for a command that will run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from vaecache.cli._common import (MaxFramePixelsOption, REQUIRED_PANEL, DecoderOption, FitOption, FramesPolicyOption, NumFramesOption, SizeOption, VaeOption,
                                  check_json_target, console,
                                  human_bytes, launcher_rank_world, report_errors, write_json)
from vaecache.settings.commands import EncodeConfig
from vaecache.settings.loader import check_option_syntax, load_toml, parse_bytes, pop_clip_options
from vaecache.errors import DatasetError, UsageError
from vaecache.progress import progress as progress_reporter

if TYPE_CHECKING:
    from vaecache.encode.summary import EncodeSummary

def build_config(data: Path, out: Path | None, vae: str | None, options: dict[str, Any], config_file: Path | None) -> EncodeConfig:
    """CLI flags override the TOML file; both use the long option names."""
    merged: dict[str, Any] = load_toml(config_file) if config_file else {}
    merged.update({key: value for key, value in options.items() if value is not None})
    check_option_syntax(merged)
    toml_out, toml_vae = merged.pop("out", None), merged.pop("vae", None)  # flags win over the file
    out = out if out is not None else toml_out
    if out is None:
        raise UsageError("--out is required: the folder the latent cache is written to")
    vae = vae or toml_vae
    if not vae:
        raise UsageError("--vae is required (builtin:tiny, builtin:small, diffusers:PATH or python:module:function); "
                         "there is no default, so a forgotten flag cannot produce silent garbage")
    clip = pop_clip_options(merged)
    if "shard_size" in merged:
        merged["shard_size"] = parse_bytes(merged["shard_size"])
    merged.pop("data", None)
    return EncodeConfig(data=Path(data), out=Path(out), vae=vae, clip=clip, **merged)


def check_usage_before_start(cfg: EncodeConfig, environ: dict[str, str] | None = None) -> None:
    """What can be refused without torch: the dataset path and the SP size against the ranks launched."""
    if not cfg.data.exists():
        raise DatasetError(f"{cfg.data}: dataset path does not exist")
    _, world = launcher_rank_world(environ)
    if cfg.sp_size > 1 and world == 1:
        raise UsageError(f"--sp-size {cfg.sp_size} needs {cfg.sp_size} ranks (or a multiple): "
                         f"torchrun --nproc-per-node {cfg.sp_size} -m vaecache encode ... "
                         f"(or srun --ntasks {cfg.sp_size} vaecache encode ...)")


def summary_json(summary: EncodeSummary) -> dict[str, Any]:
    """What the summary table shows, as JSON (encode --json)."""
    payload = {field.name: getattr(summary, field.name) for field in dataclasses.fields(summary)}
    payload["out"] = str(summary.out)
    payload["views_per_s"] = summary.views_per_s
    payload["exit_code"] = summary.exit_code
    payload["empty_buckets"] = summary.empty_buckets
    return payload


@report_errors
def encode(
    data: Path = typer.Argument(..., help="Dataset: DATA/<scene>/<camera>.mp4, a folder of videos, or a .jsonl index."),
    # Required, yet Optional here: each may come from --config instead (checked in build_config).
    out: Optional[Path] = typer.Option(None, "--out", "-o", rich_help_panel=REQUIRED_PANEL,
                                       help="Output folder for shards and manifest. \\[required, or in --config]"),
    vae: VaeOption = None,
    num_frames: NumFramesOption = None,
    size: SizeOption = None,
    frame_stride: Optional[int] = typer.Option(None, "--frame-stride", help="Use every S-th source frame (default 1)."),
    frames_policy: FramesPolicyOption = None,
    fit: FitOption = None,
    decoder: DecoderOption = None,
    window_stride: Optional[int] = typer.Option(None, "--window-stride", help="Source frames between clip starts (default: no overlap)."),
    max_clips_per_scene: Optional[int] = typer.Option(None, "--max-clips-per-scene", help="Keep the first K clips of each scene."),
    max_frame_pixels: MaxFramePixelsOption = None,
    cameras: Optional[str] = typer.Option(None, "--cameras", help="Comma-separated camera order (default: names sorted)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="fp32 | bf16 | fp16: VAE compute and stored dtype (default fp32)."),
    device: Optional[str] = typer.Option(None, "--device", help="auto | cpu | cuda (auto: cuda:LOCAL_RANK when available)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Clips per batch (B*cameras views)."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Decode worker processes per rank (default 2)."),
    shard_size: Optional[str] = typer.Option(None, "--shard-size", help="Roll shards at this many bytes (default 256MiB)."),
    store: Optional[str] = typer.Option(None, "--store", help="mean-logvar (default) | mean | sample"),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for --store sample noise (per clip and camera)."),
    sp_size: Optional[int] = typer.Option(None, "--sp-size", help="Ranks per sequence-parallel group (world = DP x SP)."),
    sp_mode: Optional[str] = typer.Option(None, "--sp-mode", help="views (default): split the views of a batch over the "
                                          "SP group | spatial: split every view's rows into bands (Wan VAEs; recorded)."),
    on_error: Optional[str] = typer.Option(None, "--on-error", help="skip (default: record bad inputs, go on) | fail"),
    tiling: Optional[bool] = typer.Option(None, "--tiling/--no-tiling", help="Use the VAE's own tiling: less memory, different latents (recorded)."),
    compiled: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="Run the encoder through torch.compile "
                                            "(compiled once per input shape; its kernels may round differently: recorded)."),
    channels_last: Optional[bool] = typer.Option(None, "--channels-last/--no-channels-last", help="Convolution weights "
                                                 "and inputs in channels-last memory format (other kernels, other "
                                                 "rounding: recorded)."),
    views_per_forward: Optional[str] = typer.Option(None, "--views-per-forward", help="auto | all | K: views of one clip "
                                                    "per VAE forward (default auto: all on CUDA, 1 on CPU; K must "
                                                    "divide the cameras). "
                                                    "Latents depend on K only, never on batch, SP or world size "
                                                    "(recorded); SP splits batches in units of K views."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Discard what OUT holds and start over."),
    hash_sources: bool = typer.Option(False, "--hash-sources", help="Record each source video's sha256 (besides size "
                                      "and mtime): a resume then tells changed content from a touched file."),
    allow_other_numerics: bool = typer.Option(False, "--allow-other-numerics", help="Resume OUT on other numerics than "
                                              "it records (another GPU model, torch or CPU thread count; ranks too "
                                              "may differ): latents added may differ in the last bits; the manifest "
                                              "lists every numerics used."),
    allow_pickle_weights: bool = typer.Option(False, "--allow-pickle-weights", help="Let a diffusers VAE folder holding only pickled .bin weights load (pickle runs code: trust the folder)."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Seconds before a stuck collective fails the job (default 1800)."),
    liveness_timeout: Optional[float] = typer.Option(None, "--liveness-timeout", help="Seconds without a heartbeat "
                                                     "before a stopped rank fails the job, named with its host "
                                                     "(default 60; 0: off)."),
    config: Optional[Path] = typer.Option(None, "--config", help="TOML file with these options (flags win)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress on rank 0: a bar in a terminal, "
                                  "a line every 30 s (VAECACHE_PROGRESS_INTERVAL) in a log."),
    json_file: Optional[Path] = typer.Option(None, "--json", help="Also write the summary as JSON to this file "
                                             "('-': stdout), from rank 0."),
) -> None:
    """Encode a video dataset into safetensors latent shards plus a manifest."""
    options = {
        "num_frames": num_frames, "size": size, "frame_stride": frame_stride, "frames_policy": frames_policy,
        "fit": fit, "decoder": decoder, "window_stride": window_stride,
        "max_clips_per_scene": max_clips_per_scene, "max_frame_pixels": max_frame_pixels, "cameras": cameras, "dtype": dtype, "device": device,
        "batch_size": batch_size, "workers": workers, "shard_size": shard_size, "store": store, "seed": seed,
        "sp_size": sp_size, "sp_mode": sp_mode, "on_error": on_error, "overwrite": overwrite or None, "timeout_s": timeout,
        "liveness_timeout_s": liveness_timeout,
        "progress": None if progress else False, "tiling": tiling, "compiled": compiled, "channels_last": channels_last,
        "views_per_forward": views_per_forward,
        "allow_pickle_weights": allow_pickle_weights or None, "hash_sources": hash_sources or None,
        "allow_other_numerics": allow_other_numerics or None,
    }
    cfg = build_config(data, out, vae, options, config)
    check_usage_before_start(cfg)
    check_json_target(json_file)

    from vaecache.distributed.context import distributed
    from vaecache.encode.run import run_encode

    with distributed(sp_size=cfg.sp_size, device=cfg.device, timeout_s=cfg.timeout_s,
                     liveness_timeout_s=cfg.liveness_timeout_s) as ctx:
        is_rank0 = ctx.info.rank == 0
        if is_rank0 and cfg.vae == "builtin:tiny":
            console.print("[yellow]note:[/yellow] builtin:tiny is an untrained VAE with random weights "
                          "(for demos and tests; its latents mean nothing to a real model)")
        elif is_rank0 and cfg.vae == "builtin:small":
            console.print("[yellow]note:[/yellow] builtin:small is a small VAE trained only on synthetic demo "
                          "footage (for demos and tests, not for real video)")
        summary = run_encode(cfg, ctx, progress=lambda label, unit: progress_reporter(
            label, unit, console, enabled=is_rank0 and cfg.progress))
    if summary.stopped:
        console.print(f"[yellow]rank {ctx.info.rank} stopped by {summary.stopped}[/yellow]: committed shards are kept; "
                      "rerun the same command to resume")
    elif is_rank0:
        if summary.already_complete:
            console.print(f"{escape(str(summary.out))} is already complete: nothing to encode, nothing changed")
        if summary.repaired:
            console.print(f"[yellow]repaired:[/yellow] {len(summary.repaired)} damaged shard(s) dropped and their clips "
                          f"encoded again ({escape('; '.join(summary.repaired[:3]))})", soft_wrap=True)
        console.print(summary_table(summary))
    if is_rank0 and json_file is not None:
        write_json(json_file, summary_json(summary))
    raise typer.Exit(summary.exit_code)


def summary_table(summary: EncodeSummary) -> Table:
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
        ("skipped inputs", f"{len(summary.skipped)}" + (f" (see {escape(str(summary.out))}/failures.parquet)" if summary.skipped else "")),
        ("OOM backoffs", f"{len(summary.backoffs)}"),
        ("cameras left out (not encoded)", ", ".join(f"{escape(name)} ({count} scenes)"
                                                     for name, count in sorted(summary.left_out_cameras.items())) or "-"),
        ("ranks", f"{summary.world_size} (SP {summary.sp_size})"),
        ("wall time", f"{summary.wall_s:.1f} s (start-up {summary.startup_s:.1f}, encode {summary.encode_s:.1f}, "
                      f"finalize {summary.finalize_s:.1f})"),
        ("views/s", f"{summary.views_per_s:.2f}"),
    ]
    for row in rows:
        table.add_row(*row)
    return table
