"""`vaecache inspect`: what a cache holds (or one clip), without a full verify; --json for programs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape

from vaecache.cli.common import check_json_target, console, failure_lines, human_bytes, report_errors, write_json
from vaecache.cli.options import StorageOption
from vaecache.errors import UsageError


def _summary_lines(info: dict[str, Any]) -> list[str]:
    vae, counts, failures = info["vae"], info.get("counts") or {}, info["failures"]
    settings = info.get("settings") or {}
    lines = [
        f"cache {info['out']} (format {info['format_version']}, created {info.get('created_at')})",
        f"VAE {vae.get('spec')} ({vae.get('family')}{', untrained' if vae.get('untrained') else ''}), "
        f"weights {str(vae.get('weights_sha256'))[:12]}, "
        f"normalization {(vae.get('normalization') or {}).get('formula')}",
        f"settings: {settings.get('num_frames')} frames, {settings.get('height')}x{settings.get('width')}, "
        f"store {settings.get('store')}, dtype {settings.get('dtype')}",
        f"{counts.get('clips')} clips, {counts.get('views')} views, {counts.get('shards')} shards, "
        f"{human_bytes(info['bytes']['shards'])} of shards",
    ]
    producer = info.get("producer") or {}
    history = producer.get("numerics_history") or []
    if len(history) > 1:
        lines.append(f"latents computed with {len(history)} numerics (resumed with --allow-other-numerics): "
                     + "; ".join(_numerics_text(n) for n in history))
    elif producer.get("numerics"):
        lines.append(f"latents computed with {_numerics_text(producer['numerics'])}")
    for shape in info["shapes"]:
        lines.append(f"  {shape['clips']} clips of shape {json.dumps(shape['shape'])}")
    if info.get("buckets"):
        lines.append(f"buckets: {json.dumps(info['buckets'])}")
    lines.append(f"{failures['count']} failures"
                 + "".join(f"\n  {n} {reason}" for reason, n in failures["by_reason"].items()))
    for kind, sets in (info.get("sets") or {}).items():
        for name, facts in sets.items():
            lines.append(f"{kind} set {name}: {facts['clips']} clips, {facts['shards']} shard(s), "
                         f"{human_bytes(facts['bytes'])}" + (f" (declared by {facts['module']})"
                                                             if facts.get("module") else ""))
            for left in facts.get("without_sound") or []:
                lines.append(f"  {left['id']}: {left['reason']}")
            if facts.get("not_installed"):
                lines.append(f"  {kind} is not read: {facts['not_installed']}")
    return lines


def _numerics_text(numerics: dict[str, Any]) -> str:
    if numerics.get("device") == "cuda":
        where = f"{numerics.get('gpu')} (sm {numerics.get('capability')}, CUDA {numerics.get('cuda')})"
    else:
        where = f"{numerics.get('device')} {numerics.get('cpu_capability') or ''} {numerics.get('threads')} threads"
    return f"{' '.join(where.split())}, torch {numerics.get('torch')}"


def _clip_lines(info: dict[str, Any]) -> list[str]:
    record = info["record"]
    lines = [f"clip {info['clip']}: scene {record.get('scene')}, cameras {record.get('cameras')}, "
             f"frames {record.get('frames', [None])[0]}..{record.get('frames', [None])[-1]} @ {record.get('fps')} fps, "
             f"shard {record.get('shard')}"]
    if record.get("metadata"):
        lines.append(f"metadata: {json.dumps(record['metadata'], ensure_ascii=False)}")
    for key, entry in info["tensors"].items():
        stats = entry["stats"]
        lines.append(f"  {key} {entry['shape']} {entry['dtype']}: min {stats['min']:.4g} max {stats['max']:.4g} "
                     f"mean {stats['mean']:.4g} std {stats['std']:.4g}")
    return lines


@report_errors
def inspect(
    out: str = typer.Argument(..., metavar="OUT", help="A cache: a folder written by encode, or its s3:// URL."),
    clip: Optional[str] = typer.Option(None, "--clip", help="Show this clip: its record and statistics.", metavar="ID"),
    failures: bool = typer.Option(False, "--failures", help="List every skipped input.", metavar=""),
    clips: bool = typer.Option(False, "--clips", help="List every clip id.",
                               metavar=""),
    json_file: Optional[Path] = typer.Option(None, "--json", help="Also write it as JSON here ('-': stdout).",
                                             metavar="FILE"),
    storage_option: StorageOption = None,
) -> None:
    """What a cache holds: VAE, settings, shapes, counts."""
    from vaecache.cache.store import open_store
    from vaecache.urls import parse_storage_options

    where = open_store(out, dict(parse_storage_options(storage_option)))
    where.check_present()
    if (failures or clips) and clip is not None:
        raise UsageError("--failures and --clips list the whole cache; they do not go with --clip")
    check_json_target(json_file)
    from vaecache.cache.inspect import inspect_cache, inspect_clip

    info = (inspect_clip(where, clip) if clip is not None else inspect_cache(where, with_failures=True))
    records = info["failures"].pop("records", []) if clip is None else []
    for line in (_clip_lines(info) if clip is not None else _summary_lines(info)):
        console.print(escape(line), soft_wrap=True)
    if clip is None:
        for line in failure_lines(records, str(out), len(records) if failures else 5):
            console.print(escape(line), soft_wrap=True)
    if failures:
        info["failures"]["records"] = records
    if clips:
        from vaecache.cache.reader import CacheReader

        info["clip_ids"] = list(CacheReader(where).clip_ids())
        for clip_id in info["clip_ids"]:
            console.print(escape(clip_id), soft_wrap=True)
    if json_file is not None:
        write_json(json_file, info)
