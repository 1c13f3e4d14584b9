"""WebDataset tars of a finished cache, one latent shape per tar, prepared for Megatron-Energon where it is
installed; and the loader stage that keeps batches single-shape under shuffling.

A cache with size or length buckets holds several latent shapes. A tar that mixed them would break
`webdataset`'s `.batched()` (it stacks tensors) and Megatron-Energon would silently zero-pad them into one
batch, so every tar holds one shape (its name says which, and each sample's JSON too). A shuffle buffer still
mixes samples of neighbouring tars, so training groups by the recorded shape: `batched_by_shape` here for
`webdataset` pipelines, Energon's `batch_group_criterion` for Energon (docs/exports.md, "Export to WebDataset").
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from vaecache.errors import ExportError
from vaecache.export.common import (
    EXPORT_INDEX,
    ExportIndex,
    ExportSummary,
    finish,
    fsync_file,
    safe_name,
    safetensors_bytes,
    source_of,
    staging,
)

TAR_MTIME = 0.0
"""mtime of every tar member: tars do not change with the time of the export."""
SAMPLES_PER_TAR = 1000
BYTES_PER_TAR = 1 << 30
ENERGON_MODES = ("auto", "on", "off")
"""--energon: prepare the export for Megatron-Energon when it is installed (auto), always (on: refused before
writing when it is not installed), or never (off)."""
ENERGON_PREPARE_ARGS = ("--non-interactive", "--split-ratio", "1,0,0", "--sample-type", "CrudeWebdataset",
                        "--no-progress", "--num-workers", "1")
"""Energon's own `energon prepare` with every answer given: all tars in the train split, samples as plain dicts
(CrudeWebdataset) for a TaskEncoder's Cooker. Run on DIR it writes DIR/.nv-meta/ (its index and dataset.yaml)."""


def webdataset_key(record: dict[str, Any]) -> str:
    """A sample's __key__: `<scene>_<first>-<last>` (a clip id's '/' cannot be in a key), through safe_name
    without dots (webdataset splits a member name at its first '.')."""
    scene, _, window = str(record["id"]).rpartition("/")
    if scene == record.get("scene") and re.fullmatch(r"[0-9]+-[0-9]+", window):  # ASCII digits (\d takes '²' too)
        return f"{safe_name(scene)}_{window}"
    return safe_name(str(record["id"]))


def latent_shape(record: dict[str, Any]) -> dict[str, list[int]]:
    """A clip's stored tensors' shapes by key, from its record: what a batch must not mix."""
    return {key: list(entry.get("shape") or []) for key, entry in sorted((record.get("tensors") or {}).items())}


def shape_tag(shape: dict[str, list[int]]) -> str:
    """The part of a tar's name that says its latent shape: `2x16x3x8x8` (cameras, C, F, H, W) when every
    stored tensor has that shape, else each key's shape joined by '-'."""
    shapes = {tuple(dims) for dims in shape.values()}
    if len(shapes) == 1:
        return "x".join(map(str, next(iter(shapes))))
    return "-".join(f"{key}{'x'.join(map(str, dims))}" for key, dims in shape.items())


def energon_available() -> bool:
    try:
        import megatron.energon.tools.prepare  # noqa: F401
    except ImportError:
        return False
    return True


def prepare_for_energon(folder: Path) -> None:
    """Run Energon's own preparation (its `energon prepare` command, in this process) on a folder of tars."""
    import contextlib

    from megatron.energon.tools.prepare import command

    chatter = io.StringIO()  # Energon prints the first samples and its steps; the export reports in one line
    try:
        with contextlib.redirect_stdout(chatter):
            command.main([str(folder), *ENERGON_PREPARE_ARGS], standalone_mode=False)
    except Exception as exc:  # click and Energon raise their own types
        raise ExportError(f"{folder}: Megatron-Energon's prepare failed ({exc}); export with --energon off and run "
                          f"`energon prepare DIR {' '.join(ENERGON_PREPARE_ARGS)}` to see why") from None


def export_webdataset(cache_dir: Path | str, target: Path, verify: str = "size",
                      samples_per_tar: int = SAMPLES_PER_TAR, energon: str = "auto",
                      on_clip: Callable[[int, int], None] | None = None,
                      storage_options: dict[str, Any] | None = None) -> ExportSummary:
    """Write WebDataset tars, one latent shape per tar (`shard-<shape>-000000.tar`, ...): one sample per clip,
    `latents.safetensors` (the clip's stored tensors: mean, logvar or sample, (cameras, C, F, H, W)) and `json`
    (its clip record plus `latent_shape`); then Energon's preparation (`energon`: auto, on, off)."""
    import webdataset

    from vaecache.training import LatentCache

    if energon not in ENERGON_MODES:
        raise ExportError(f"--energon must be one of {', '.join(ENERGON_MODES)}, got {energon!r}")
    prepare = energon == "on" or (energon == "auto" and energon_available())
    if energon == "on" and not energon_available():
        raise ExportError("--energon on: Megatron-Energon is not installed (pip install 'vaecache[energon]')")
    cache = LatentCache(cache_dir, verify=verify, storage_options=storage_options)  # a folder or a URL
    from vaecache.cache.kinds import kind_hook, module_record

    kinds = [(kind, list(cache.sets()[kind.name].values())) for kind in cache.kinds()]
    kinds = [(kind, readers) for kind, readers in kinds if readers]
    declared = {name: module for kind, _ in kinds for name, module in module_record(kind).items()}
    size = 0
    with staging(target) as folder:
        index = ExportIndex(folder / EXPORT_INDEX)
        written: dict[str, dict[str, list[int]]] = {}
        writers: dict[str, Any] = {}
        clips_of: dict[str, int] = {}
        shape_of: dict[str, dict[str, list[int]]] = {}

        def closed(name: str, shape: dict[str, list[int]]) -> None:
            fsync_file(Path(name))
            written[Path(name).name] = shape

        try:
            for number, record in enumerate(cache.records(), 1):
                shape = latent_shape(record)
                tag = shape_tag(shape)
                writer = writers.get(tag)
                if writer is None:
                    writer = writers[tag] = webdataset.ShardWriter(
                        str(folder / f"shard-{tag}-%06d.tar"), maxcount=samples_per_tar, maxsize=BYTES_PER_TAR,
                        verbose=0, mtime=TAR_MTIME, post=lambda name, shape=shape: closed(name, shape))
                key = webdataset_key(record)
                data = safetensors_bytes(cache.tensors_of(record), {"clip": record["id"]})
                extra = {**record, "latent_shape": shape}
                sample = {"__key__": key, "latents.safetensors": data}
                for kind, readers in kinds:  # each set's stored tensors; decode_sample rebuilds the item's
                    facts, stored = {}, {}
                    for reader in readers:
                        with kind_hook(kind, "export", reader.name, f"clip {record['id']}"):
                            facts[reader.name] = reader.export_facts(record["id"])
                            stored.update(reader.export_tensors(record["id"]))
                    extra[kind.summary_key()] = facts
                    sample[kind.member()] = safetensors_bytes(stored, {"clip": record["id"]})
                    size += len(sample[kind.member()])
                if declared:
                    extra["set_kinds"] = declared
                body = json.dumps(extra, sort_keys=True, ensure_ascii=False).encode()
                sample["json"] = body
                writer.write(sample)
                index.add(clip=record["id"], key=key, tar=Path(writer.fname).name,
                          renamed=not key.startswith(f"{record['scene']}_"))
                clips_of[tag] = clips_of.get(tag, 0) + 1
                shape_of[tag] = shape
                size += len(data) + len(body)
                if on_clip is not None:
                    on_clip(number, len(cache))
        finally:
            for writer in writers.values():
                writer.close()
        tars = sorted(written)
        if prepare:
            prepare_for_energon(folder)
        finish(folder, index, {
            "format": "vaecache-export", "kind": "webdataset", "source": source_of(cache), "clips": len(cache),
            "shards": tars, "shard_shapes": {name: written[name] for name in tars},
            "shapes": [{"tag": tag, "latent_shape": shape_of[tag], "clips": clips_of[tag]} for tag in sorted(clips_of)],
            "bytes": size, "renamed": index.renamed, "energon": bool(prepare),
            "sample": {"latents.safetensors": "the clip's stored tensors by key (mean, logvar, sample), "
                                              "(cameras, C, F, H, W)",
                       "json": "the clip record, plus latent_shape: each stored tensor's shape by key",
                       **{kind.member(): kind.export_description or f"the clip's {kind.name} sets' tensors"
                          for kind, _ in kinds}}})
    notes = [f"{len(written)} tar(s), one latent shape each ({len(clips_of)} shape(s)); group batches by "
             "latent_shape when a shuffle buffer mixes tars"]
    notes.append("prepared for Megatron-Energon (DIR/.nv-meta, CrudeWebdataset)" if prepare else
                 f"not prepared for Megatron-Energon ({'--energon off' if energon == 'off' else 'not installed'}): "
                 f"energon prepare DIR {' '.join(ENERGON_PREPARE_ARGS)}")
    return ExportSummary(str(target), "webdataset", len(cache), len(tars), size, index.renamed, tuple(notes))


def decode_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """A raw WebDataset (or Energon CrudeWebdataset) sample of this export as {"__key__", each stored tensor by key,
    "record", "latent_shape"}: tensors read by safetensors (no pickle). `json` may be bytes (webdataset) or already
    parsed (Energon's default decoder)."""
    from safetensors.torch import load

    from vaecache.cache.kinds import BUILTIN_MODULES, kind_hook, kind_named, recorded_kinds
    from vaecache.cache.layout import KINDS_RECORD

    record = dict(sample["json"]) if isinstance(sample["json"], dict) else json.loads(sample["json"])
    shape = record.pop("latent_shape", None)
    where = f"sample {str(sample.get('__key__'))[:80]!r}"
    # a sample names the kinds it holds as a manifest does: only built-in and installed ones are read (nothing the
    # sample names is imported)
    declared = recorded_kinds({KINDS_RECORD: record.pop("set_kinds")} if "set_kinds" in record else {}, where)
    texts: dict[str, Any] = {}  # text/<set>, text_mask/<set>, condition/<kind>, ...: as LatentCache gives them
    for name in [*BUILTIN_MODULES, *sorted(set(declared) - set(BUILTIN_MODULES))]:
        kind = kind_named(name, declared.get(name), where)
        facts = record.pop(kind.summary_key(), None)
        if facts:
            stored = load(sample[kind.member()])
            with kind_hook(kind, "decode", item=where):
                texts.update(kind.decode(stored, facts))
    return {"__key__": sample["__key__"], **load(sample["latents.safetensors"]), **texts, "record": record,
            "latent_shape": tuple((key, tuple(dims)) for key, dims in sorted((shape or {}).items()))}


def batched_by_shape(batch_size: int,
                     partial: bool = True) -> Callable[[Iterable[dict[str, Any]]], Iterator[dict[str, Any]]]:
    """A webdataset pipeline stage (`.compose(batched_by_shape(8))`) over decoded samples: it keeps one open
    batch per latent shape and yields a batch as soon as one is full, so batches never mix shapes whatever the
    shuffling before it; at the end the short batches follow (dropped when not `partial`)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")

    def stage(samples: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        from vaecache.training import collate_latents  # tensors stacked, the rest kept as lists

        open_batches: dict[Any, list[dict[str, Any]]] = {}
        for sample in samples:
            batch = open_batches.setdefault(sample["latent_shape"], [])
            batch.append(sample)
            if len(batch) == batch_size:
                del open_batches[sample["latent_shape"]]
                yield collate_latents(batch)
        if partial:
            for batch in open_batches.values():
                yield collate_latents(batch)

    return stage
