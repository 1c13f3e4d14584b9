"""`vaecache inspect`: what a cache holds, from manifest.json and a few clip-table columns (no shard is read),
and for one clip its record and statistics computed from its tensors (one shard read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vaecache.cache.failures import reason_counts
from vaecache.cache.reader import CacheReader
from vaecache.cache.table import CLIP_TABLE, open_table


def latent_shapes(reader: CacheReader) -> list[dict[str, Any]]:
    """Distinct per-clip latent shapes ({stored key: shape}) with their clip counts, most clips first; read
    from the clip table's tensor columns alone (a cache with size buckets holds several)."""
    counts: dict[tuple[tuple[str, tuple[int, ...]], ...], int] = {}

    def add(keys: list[str] | None, shapes: list[list[int]] | None) -> None:
        key = tuple(sorted((k, tuple(s or ())) for k, s in zip(keys or [], shapes or [])))
        counts[key] = counts.get(key, 0) + 1

    if reader.version == 1:
        for record in reader.clip_records():
            tensors = record.get("tensors") or {}
            add(list(tensors), [entry.get("shape") for entry in tensors.values()])
    else:
        table = open_table(reader.table_source(reader.clips_name), CLIP_TABLE, where=reader.clips_path)
        for batch in table.iter_batches(batch_size=65536, columns=["tensor_keys", "tensor_shapes"]):
            for keys, shapes in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
                add(keys, shapes)
    return [{"shape": {k: list(s) for k, s in key}, "clips": n}
            for key, n in sorted(counts.items(), key=lambda item: (-item[1], repr(item[0])))]


def inspect_cache(out: Path | str, with_failures: bool = False,
                  storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The cache at a glance: VAE, settings, latent shapes and buckets, counts, bytes, failures by reason (and with
    `with_failures` every failure record, under failures.records). `out` may be a URL: its manifest and tables
    are read, no shard is."""
    reader = CacheReader(out, storage_options)
    manifest = reader.manifest
    vae = manifest.get("vae") or {}
    failures = reader.failure_records()
    shards = manifest.get("shards") or []
    tables = {}
    for kind, name in (("clips", reader.clips_name), ("failures", reader.failures_name)):
        try:
            tables[kind] = reader.store.size(name)
        except FileNotFoundError:
            continue
    return {
        "out": str(reader.out),
        "format_version": reader.version,
        "created_at": manifest.get("created_at"),
        "producer": manifest.get("producer"),
        "vae": {"family": vae.get("family"), "spec": vae.get("spec"), "weights_sha256": vae.get("weights_sha256"),
                "untrained": vae.get("untrained"), "precision": vae.get("precision"),
                "normalization": vae.get("normalization"), "fingerprint_sha256": manifest.get("fingerprint_sha256")},
        "frame_rule": manifest.get("frame_rule"),
        "settings": manifest.get("settings"),
        "latent": manifest.get("latent"),
        "buckets": manifest.get("buckets"),
        "shapes": latent_shapes(reader),
        "counts": manifest.get("counts"),
        "bytes": {"shards": sum(int(s.get("bytes", 0)) for s in shards),
                  **{f"{k}_table": v for k, v in tables.items()}},
        "failures": {"count": len(failures), "by_reason": reason_counts(failures),
                     **({"records": failures} if with_failures else {})},
        "sets": set_summaries(manifest, reader.store),
    }


def set_summaries(manifest: dict[str, Any], store: Any = None) -> dict[str, dict[str, Any]]:
    """Every set the manifest lists, by kind (the built-in ones and those it records; vaecache.cache.kinds) and name:
    clips, shards and bytes, from the manifest alone (no kind's module is imported), and for a kind declared outside
    vaecache its module and, where no installed package declares it, why its sets cannot be read. With `store`, an
    audio set's clips without sound are listed with why (from its clip table)."""
    from vaecache.cache.kinds import not_installed, recorded_kinds
    from vaecache.cache.layout import AUDIO_DIR
    from vaecache.cache.layout import BUILTIN_SET_KINDS as BUILTIN_MODULES

    declared = recorded_kinds(manifest)
    found: dict[str, dict[str, Any]] = {}
    for kind in [*BUILTIN_MODULES, *sorted(declared)]:
        sets = manifest.get(kind)
        if not isinstance(sets, dict) or not sets:
            continue
        found[kind] = {}
        missing = not_installed(kind, declared[kind]) if kind in declared and kind not in BUILTIN_MODULES else None
        for name, record in sorted(sets.items()):
            record = record if isinstance(record, dict) else {}
            files = [*(record.get("shards") or []), *(record.get("tables") or {}).values()]
            found[kind][name] = {"clips": record.get("clips"), "shards": len(record.get("shards") or []),
                                 "bytes": sum(int(f.get("bytes", 0)) for f in files if isinstance(f, dict)),
                                 **({"module": declared[kind]} if kind in declared else {}),
                                 **({"not_installed": missing} if missing else {})}
            if store is not None and kind == AUDIO_DIR and (record.get("skipped") or record.get("silenced")):
                found[kind][name]["without_sound"] = clips_without_sound(store, record)
    return found


def clips_without_sound(store: Any, record: dict[str, Any]) -> list[dict[str, str]]:
    """An audio set's clips that hold no sound of their own (skipped, or silence in its place), each with why: its
    clip table's `audio` column."""
    import io

    import pyarrow.parquet as pq

    entry = (record.get("tables") or {}).get("clips")
    file = entry.get("file") if isinstance(entry, dict) else None
    if not isinstance(file, str):
        return []
    from vaecache.errors import ClipTableError, first_line

    try:
        table = pq.read_table(io.BytesIO(store.read(store.checked_name(file, "audio set"))), columns=["id", "audio"])
    except (OSError, ValueError, KeyError) as exc:  # pyarrow's errors are these
        raise ClipTableError(f"{store.where(file)}: the audio set's clip table does not read ({first_line(exc)})") \
            from None
    return [{"id": clip, "reason": reason} for clip, reason in zip(table.column("id").to_pylist(),
                                                                   table.column("audio").to_pylist()) if reason]


def inspect_clip(out: Path | str, clip_id: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """One clip: its record, and per stored tensor its shape, dtype and min/max/mean/std computed from the
    tensor (beside the stats recorded at encode time). `out` may be a URL (ranged reads of that clip alone)."""
    reader = CacheReader(out, storage_options)
    record = next((record for record in reader.clip_records() if record.get("id") == clip_id), None)
    if record is None:
        from vaecache.errors import UsageError

        example = next(iter(reader.clip_ids()), None)
        like = f" (clip ids look like {example!r})" if example else ""
        raise UsageError(f"{reader.out}: no clip {clip_id!r}{like}")
    entry = reader.shard_files().get(reader.shard_of(record))
    if entry is None or reader.store.size(reader.shard_of(record)) != entry.get("bytes"):
        from vaecache.errors import ShardChecksumError

        raise ShardChecksumError(f"{reader.store.where(reader.shard_of(record))}: not the shard manifest.json lists "
                                 "(missing from it, or of another size)")
    from vaecache.cache.writer import tensor_stats  # torch: one clip's tensors are read

    tensors = {key: {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                     "stats": tensor_stats(tensor),
                     "recorded_stats": (record["tensors"][key] or {}).get("stats")}
               for key, tensor in reader.clip_tensors(record).items()}
    return {"out": str(reader.out), "clip": clip_id, "record": record, "tensors": tensors}


__all__ = ["inspect_cache", "inspect_clip", "latent_shapes", "set_summaries"]
