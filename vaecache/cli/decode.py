"""`vaecache decode`: one clip's latents back to frames with the recorded VAE; an mp4 grid and PSNR/SSIM."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.markup import escape

from vaecache.cli.common import check_json_target, console, note_untrained_vae, report_errors, write_json
from vaecache.cli.options import StorageOption
from vaecache.errors import UsageError

if TYPE_CHECKING:  # rich tables load when a command runs, not for --help
    from rich.table import Table

    from vaecache.decode.preview import PreviewReport


def report_table(report: PreviewReport) -> Table:
    from rich.table import Table

    table = Table(title=f"vaecache decode {escape(report.clip)} ({escape(report.latent_key)} latents)")
    table.add_column("camera")
    table.add_column("frames", justify="right")
    table.add_column("PSNR dB", justify="right")
    table.add_column("SSIM", justify="right")
    for camera in report.cameras:
        table.add_row(escape(camera.camera), str(camera.frames), f"{camera.psnr_db:.2f}", f"{camera.ssim:.4f}")
    return table


@report_errors
def decode(
    out: str = typer.Argument(..., metavar="OUT", help="A cache: a folder written by encode, or its s3:// URL."),
    clip: Optional[str] = typer.Option(None, "--clip", help="The clip's id (default: the first clip).", metavar="ID"),
    output: Optional[Path] = typer.Option(None, "--output", "-o",
                                          help="The mp4 to write (default: CLIP_ID.mp4 here).", metavar="MP4"),
    vae: Optional[str] = typer.Option(None, "--vae", help="The VAE (default: the recorded spec).", metavar="SPEC",
                                      rich_help_panel="VAE"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N.", metavar="TEXT",
                               rich_help_panel="VAE"),
    chunk_frames: int = typer.Option(4, "--chunk-frames", help="Latent frames decoded at a time (same result).",
                                     metavar="N", rich_help_panel="VAE"),
    tiling: bool = typer.Option(False, "--tiling", help="Decode in tiles (frames too large to decode whole).",
                                rich_help_panel="VAE",
                                metavar=""),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output file.", metavar=""),
    allow_pickle_weights: bool = typer.Option(False, "--allow-pickle-weights",
                                              help="Let pickled .bin weights load (runs code).",
                                              rich_help_panel="VAE", metavar=""),
    json_file: Optional[Path] = typer.Option(None, "--json", help="Also write the report as JSON here ('-': stdout).",
                                             metavar="FILE"),
    storage_option: StorageOption = None,
) -> None:
    """Decode one clip beside its source: an mp4, PSNR, SSIM."""
    from vaecache.cache.store import open_store
    from vaecache.decode.preview import PreviewSettings, check_output, default_output
    from vaecache.urls import parse_storage_options

    storage_options = dict(parse_storage_options(storage_option))
    store = open_store(out, storage_options)
    store.check_present()
    note_untrained_vae(store)
    settings = PreviewSettings(vae=vae, device=device, chunk_frames=chunk_frames, tiling=tiling, overwrite=overwrite,
                               allow_pickle_weights=allow_pickle_weights)
    if clip is None:
        from vaecache.cache.reader import CacheReader

        clip = next(iter(CacheReader(store).clip_ids()), None)
        if clip is None:
            raise UsageError(f"{out}: the cache holds no clip to decode")
        console.print(f"no --clip: decoding the first clip, {escape(clip)}", soft_wrap=True)
    output = output if output is not None else default_output(clip)
    check_output(output, overwrite)
    check_json_target(json_file)

    from vaecache.decode.preview import decode_preview

    report = decode_preview(store.location, clip, output, settings, storage_options=storage_options)
    console.print(report_table(report))
    for note in report.notes:
        console.print(f"note: {escape(note)}", soft_wrap=True)
    height, width = report.grid
    console.print(escape(f"wrote {report.output}: {width}x{height}, {report.frames} frames at {report.fps:g} fps "
                         f"(top: source, bottom: decoded; decoded {report.decode_mode}, {report.chunks} chunk(s), "
                         f"at most {report.max_frames_in_flight} frames per camera in flight"
                         f"{', tiled' if report.tiling else ''}; {report.seconds:.1f} s)"), soft_wrap=True)
    if json_file is not None:
        write_json(json_file, report.to_json())
