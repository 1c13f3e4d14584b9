"""`vaecache export`: a finished cache into musubi-tuner's latent cache, WebDataset tars or LTX-2's trainer's
precomputed folder (streaming, atomic)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from vaecache.cli.common import console, human_bytes, note_untrained_vae, report_errors
from vaecache.cli.options import StorageOption
from vaecache.errors import UsageError


@report_errors
def export(
    out: str = typer.Argument(..., metavar="OUT", help="A cache: a folder written by encode, or its s3:// URL."),
    format: str = typer.Option(..., "--format", help="musubi | webdataset | ltx2.", metavar="FORMAT"),
    dest: Path = typer.Option(..., "--out", "-o", help="Folder to create (must not exist).", metavar="DIR"),
    arch: Optional[str] = typer.Option(None, "--arch",
                                       help="Architecture: wan, hv, k5, fp, hv15 (default: the VAE's).",
                                       metavar="NAME", rich_help_panel="musubi"),
    fp_latent_window_size: int = typer.Option(9, "--fp-latent-window-size",
                                              help="--arch fp: latent frames per section.", metavar="N",
                                              rich_help_panel="musubi"),
    fp_mode: str = typer.Option("inverted", "--fp-mode", help="--arch fp: inverted (default) | f1.", metavar="MODE",
                                rich_help_panel="musubi"),
    samples_per_tar: int = typer.Option(1000, "--samples-per-tar", help="Clips per tar shard (default 1000).",
                                        metavar="N", rich_help_panel="webdataset"),
    energon: str = typer.Option("auto", "--energon", help="Prepare for Megatron-Energon: auto | on | off.",
                                metavar="MODE", rich_help_panel="webdataset"),
    verify: str = typer.Option("size", "--verify", help="Check each shard read: size | sha256 | none.", metavar="MODE"),
    text_set: str = typer.Option("auto", "--text-set", help="Text set written: NAME | auto | none (ltx2 too).",
                                 metavar="NAME", rich_help_panel="musubi"),
    condition: str = typer.Option("auto", "--condition", help="I2V latents: auto | first-frame | none.",
                                  metavar="KIND", rich_help_panel="musubi"),
    audio_set: str = typer.Option("auto", "--audio-set", help="Audio set written: NAME | auto | none.",
                                  metavar="NAME", rich_help_panel="ltx2"),
    storage_option: StorageOption = None,
) -> None:
    """Export a cache for musubi-tuner, WebDataset or LTX-2."""
    from vaecache.cache.layout import VERIFY_MODES  # the cache and export packages load when export runs
    from vaecache.export import ENERGON_MODES, EXPORT_FORMATS, export_ltx2, export_musubi, export_webdataset

    if format not in EXPORT_FORMATS:
        raise UsageError(f"--format must be one of {', '.join(EXPORT_FORMATS)}, got {format!r}")
    if verify not in VERIFY_MODES:
        raise UsageError(f"--verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
    if arch is not None and format != "musubi":
        raise UsageError("--arch applies to --format musubi only")
    if energon not in ENERGON_MODES:
        raise UsageError(f"--energon must be one of {', '.join(ENERGON_MODES)}, got {energon!r}")
    if energon != "auto" and format != "webdataset":
        raise UsageError("--energon applies to --format webdataset only")
    if (fp_latent_window_size != 9 or fp_mode != "inverted") and (format != "musubi" or arch != "fp"):
        raise UsageError("--fp-latent-window-size and --fp-mode apply to --format musubi --arch fp only")
    if text_set != "auto" and format not in ("musubi", "ltx2"):
        raise UsageError("--text-set applies to --format musubi and ltx2 only")
    if condition != "auto" and format != "musubi":
        raise UsageError("--condition applies to --format musubi only")
    if audio_set != "auto" and format != "ltx2":
        raise UsageError("--audio-set applies to --format ltx2 only")
    if samples_per_tar < 1:
        raise UsageError(f"--samples-per-tar must be >= 1, got {samples_per_tar}")
    from vaecache.cache.store import open_store
    from vaecache.urls import parse_storage_options

    options = dict(parse_storage_options(storage_option))
    cache = open_store(out, options)
    cache.check_present()
    note_untrained_vae(cache)
    if format == "musubi":
        summary = export_musubi(cache.location, dest, arch=arch, verify=verify, storage_options=options,
                                text_set=text_set, condition=condition, fp_window=fp_latent_window_size,
                                fp_mode=fp_mode)
    elif format == "ltx2":
        summary = export_ltx2(cache.location, dest, audio_set=audio_set, text_set=text_set, verify=verify,
                              storage_options=options)
    else:
        summary = export_webdataset(cache.location, dest, verify=verify, samples_per_tar=samples_per_tar,
                                    energon=energon, storage_options=options)
    renamed = f", {summary.renamed} names mapped to safe ones (see index.jsonl)" if summary.renamed else ""
    unit = "tar shards" if format == "webdataset" else "files"
    console.print(escape(f"exported {summary.clips} clips as {summary.format} to {summary.out}: {summary.files} "
                         f"{unit}, {human_bytes(summary.bytes)}{renamed}"),
                  soft_wrap=True)
    for note in summary.notes:
        console.print(escape(f"  {note}"), soft_wrap=True)
