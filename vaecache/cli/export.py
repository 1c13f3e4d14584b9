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
    out: str = typer.Argument(..., metavar="OUT", help="A folder written by vaecache encode, or its URL "
                              "(s3://bucket/prefix)."),
    format: str = typer.Option(..., "--format", help="musubi (musubi-tuner's latent cache) | webdataset (tar shards) | "
                               "ltx2 (LTX-2's trainer's .precomputed folder)."),
    dest: Path = typer.Option(..., "--out", "-o", help="Folder to create (must not exist); written beside it as "
                              ".NAME.tmp-PID and renamed when complete."),
    arch: Optional[str] = typer.Option(None, "--arch", help="musubi: architecture short name (wan, hv, k5, fp, hv15; "
                                       "qi is refused with the reason); default from the VAE family (Wan: wan, "
                                       "HunyuanVideo: hv, HunyuanVideo 1.5: hv15)."),
    fp_latent_window_size: int = typer.Option(9, "--fp-latent-window-size", help="musubi --arch fp: latent frames "
                                              "per FramePack section (musubi's fp_latent_window_size); a clip must "
                                              "have sections * 4 * window + 1 frames."),
    fp_mode: str = typer.Option("inverted", "--fp-mode", help="musubi --arch fp: inverted (musubi's default "
                                "sampling) | f1 (its --f1, vanilla sampling)."),
    samples_per_tar: int = typer.Option(1000, "--samples-per-tar", help="webdataset: clips per tar shard (each tar "
                                        "holds one latent shape)."),
    energon: str = typer.Option("auto", "--energon", help="webdataset: prepare DIR for Megatron-Energon with its own "
                                "`energon prepare`: auto (when installed) | on | off."),
    verify: str = typer.Option("size", "--verify", help="Check each shard when first read: size | sha256 | none."),
    text_set: str = typer.Option("auto", "--text-set", help="musubi: the text set (vaecache embed) written as "
                                 "musubi's text-encoder caches: NAME | auto (the cache's only set, if it has one) | "
                                 "none. ltx2: the LTX-2 text set written as conditions: NAME | auto (the cache's only "
                                 "set of the ltx2 family, if it has one) | none."),
    condition: str = typer.Option("auto", "--condition", help="musubi: the image-to-video condition written as "
                                  "musubi's Wan I2V latents_image: auto (the cache's first-frame set, if it has one) | "
                                  "first-frame | none (musubi has no first-last convention: refused)."),
    audio_set: str = typer.Option("auto", "--audio-set", help="ltx2: the audio set (vaecache embed --audio-vae) "
                                  "written as audio_latents: NAME | auto (the cache's only set, if it has one) | "
                                  "none."),
    storage_option: StorageOption = None,
) -> None:
    """Export a cache to the layout a trainer reads: musubi-tuner, WebDataset (Megatron-Energon) or LTX-2's trainer."""
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
