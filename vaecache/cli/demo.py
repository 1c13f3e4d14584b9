"""`vaecache demo-data` and `vaecache demo`."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer
from rich.markup import escape

from vaecache.cli.common import console, report_errors
from vaecache.errors import EXIT_OK


@report_errors
def demo_data(
    root: Path = typer.Argument(..., help="Folder to write DIR/<scene>/<camera>.mp4 into."),
    scenes: int = typer.Option(3, "--scenes", help="Number of scenes.", metavar="N"),
    cameras: int = typer.Option(2, "--cameras", help="Cameras per scene.", metavar="N"),
    frames: int = typer.Option(17, "--frames", help="Frames per video.", metavar="N"),
    size: str = typer.Option("64x64", "--size", help="HxW of the videos (even numbers).", metavar="HxW"),
    fps: int = typer.Option(10, "--fps", help="Frame rate.", metavar="N"),
    seed: int = typer.Option(0, "--seed", help="Seed: same seed, same videos.", metavar="N"),
) -> None:
    """Write a synthetic multi-camera dataset of h264 mp4 files."""
    from vaecache.settings.buckets import parse_size

    height, width = parse_size(size)
    from vaecache.demodata import DemoDataSpec, write_demo_dataset  # PyAV: loaded only when it will run

    spec = DemoDataSpec(scenes=scenes, cameras=cameras, frames=frames, height=height, width=width, fps=fps, seed=seed)
    paths = write_demo_dataset(root, spec)
    console.print(f"wrote {len(paths)} videos ({scenes} scenes x {cameras} cameras, {frames} frames, {height}x{width} "
                  f"@ {fps} fps) to {root}", markup=False)


@report_errors
def demo(
    root: Path = typer.Option(Path("vaecache-demo"), "--dir", help="Where the data, the cache and the preview go.",
                              metavar="DIR"),
) -> None:
    """Demo data encoded, verified, decoded and reported, in one go."""
    from vaecache.cli.encode import starting_lines

    say = starting_lines(True)
    say("importing torch and diffusers")
    from vaecache.cli.decode import report_table as preview_table
    from vaecache.cli.encode import summary_table
    from vaecache.cli.verify import report_table
    from vaecache.decode.preview import decode_preview
    from vaecache.demodata import DemoDataSpec, write_demo_dataset
    from vaecache.distributed.context import distributed
    from vaecache.encode.command import run_encode
    from vaecache.meter import meter
    from vaecache.settings.clip import ClipSettings, SamplingConfig
    from vaecache.settings.commands import EncodeConfig
    from vaecache.settings.parts import DecodeConfig, OutConfig, SourceConfig, VaeConfig
    from vaecache.training import LatentCache
    from vaecache.verify.integrity import verify_cache

    data, out, preview, report_dir = root / "data", root / "cache", root / "preview.mp4", root / "report"
    spec = DemoDataSpec(scenes=3, cameras=2, frames=17, height=64, width=64, fps=10, seed=0)
    write_demo_dataset(data, spec)
    console.print(f"1/5 demo data: {spec.scenes} scenes x {spec.cameras} cameras of {spec.frames} frames in {data}",
                  markup=False)
    cfg = EncodeConfig(SourceConfig(data), VaeConfig("builtin:small"),
                       ClipSettings(SamplingConfig(num_frames=9), 64, 64), OutConfig(out, overwrite=True),
                       decode=DecodeConfig(workers=0))
    console.print("2/5 encoding with builtin:small (a tiny Wan VAE trained on demo-style footage; these scenes "
                  "were held out of its training), the same as:")
    console.print("    " + shlex.join(["vaecache", "encode", str(data), "--out", str(out), "--vae", "builtin:small",
                                       "--num-frames", "9", "--size", "64x64", "--workers", "0", "--overwrite"]),
                  markup=False, soft_wrap=True)
    with distributed(sp_size=1, device="cpu") as ctx:
        summary = run_encode(cfg, ctx, meter=lambda label, unit: meter(label, unit, console), say=say)
    console.print(summary_table(summary))
    console.print("3/5 verify: every shard hashed and its tensors checked, the same as: vaecache verify "
                  f"{out}", markup=False, soft_wrap=True)
    report = verify_cache(out)
    console.print(report_table(report))
    if not report.ok:
        raise typer.Exit(1)
    clip_id = LatentCache(out, verify="none").ids()[0]
    console.print(f"4/5 preview: decoding clip {clip_id} (source above, reconstruction below)", markup=False)
    shown = decode_preview(out, clip_id, preview, overwrite=True, device="cpu")
    console.print(preview_table(shown))
    mean_psnr = sum(camera.psnr_db for camera in shown.cameras) / len(shown.cameras)
    page = _demo_report(out, report_dir)
    console.print(f"preview: {preview} (PSNR {mean_psnr:.1f} dB, mean over cameras)\ndata: {data}\n"
                  f"cache: {out} (manifest.json, clips.parquet, shards/)\nlogs: {out / 'logs'}\n"
                  f"report: {page}\n"
                  f"next: vaecache verify {out}; vaecache decode {out} --clip ID; vaecache report {out}", markup=False)
    raise typer.Exit(EXIT_OK)


def _demo_report(out: Path, report_dir: Path) -> str:
    """Step 5: the cache's report page (vaecache report), or why not (the report extra is not installed)."""
    from vaecache.errors import MissingExtraError
    from vaecache.report.build import ReportSettings, write_report

    console.print(f"5/5 report: the cache's page, the same as: vaecache report {out} --out {report_dir} --device cpu",
                  markup=False, soft_wrap=True)
    try:
        written = write_report(out, report_dir, ReportSettings(device="cpu"))
    except MissingExtraError as exc:
        console.print(f"[yellow]note:[/yellow] no report: {escape(str(exc))}", soft_wrap=True)
        return f"not written ({exc})"
    return f"{written.page} (open it in a browser)"
