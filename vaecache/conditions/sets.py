"""Image-to-video condition sets of a finished cache: written by `vaecache embed --condition` (and `encode
--condition`), read by LatentCache, checked by verify. One set per kind (vaecache.conditions.kinds), through OUT's
store like the text sets (vaecache.cache.sets).

OUT/conditions/<kind>/<generation>/
  conditions-00000.safetensors  one tensor per clip, named by its clip id: (cameras, C, latent frames, h, w), the
                                VAE's posterior mean of each camera's condition video, in the VAE's dtype (what the
                                pipeline's `retrieve_latents(..., "argmax")` returns)
  clips.parquet                 id, shard, frames, the tensor's min/max/mean/std, and per camera tiled and
                                units_per_forward (the out-of-memory backoff): every clip, in the clip table's order

The frames are the clip's as encode saw them (LatentCache.source_frames: its sources, frame indices, resize and
fit, decode backend); the VAE is the cache's own, loaded with its recorded settings and fingerprint-checked, and it
encodes through the same runner as the latents (views batched as recorded, out-of-memory backoff). manifest.json's
"conditions" object holds each set's record; the set becomes part of the cache when that manifest is written.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vaecache import faults
from vaecache.cache.layout import CONDITIONS_DIR, MANIFEST
from vaecache.cache.sets import (
    delete_unlisted,
    file_entry,
    generation_of,
    loaded_on_every_rank,
    pack_shards,
    parquet_bytes,
    same_on_every_rank,
)
from vaecache.conditions.kinds import (
    LATENT_KINDS,
    REFERENCE,
    check_condition_vae,
    condition_video,
    parse_condition_kinds,
)
from vaecache.errors import UsageError, VaecacheError

SHARD_PREFIX = "conditions-"
CLIPS_TABLE = "clips.parquet"
DEFAULT_SHARD_BYTES = 256 << 20


@dataclass(frozen=True)
class ConditionRequest:
    """What `vaecache embed --condition` was asked to do (validated here; the CLI only parses)."""

    out: str
    kinds: tuple[str, ...]
    replace: bool = False
    shard_bytes: int = DEFAULT_SHARD_BYTES
    device: str = "auto"
    vae: str | None = None
    """Another path to the cache's VAE (its fingerprint must be the recorded one); default the recorded spec."""
    allow_pickle_weights: bool = False
    storage_options: tuple[tuple[str, Any], ...] = ()
    image_encoder: str | None = None
    """image-features: the image encoder's spec (vaecache.conditions.images)."""
    image_convention: str = "wan-diffusers"

    def __post_init__(self) -> None:
        kinds = parse_condition_kinds(self.kinds)
        if not kinds:
            raise UsageError("--condition: name at least one kind")
        object.__setattr__(self, "kinds", kinds)
        if "image-features" in kinds:
            from vaecache.conditions.images import check_image_options

            check_image_options(self.image_encoder, self.image_convention)
        elif self.image_encoder is not None:
            raise UsageError("--image-encoder applies to --condition image-features")
        if self.shard_bytes < 1:
            raise UsageError(f"--shard-size must be at least 1 byte, got {self.shard_bytes}")


@dataclass
class ConditionSummary:
    kind: str
    out: str
    clips: int = 0
    views: int = 0
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    unchanged: bool = False
    replaced: bool = False
    updated: bool = False
    """Rewritten for the cache's current clips with the same VAE or image encoder (no --replace needed)."""
    backoffs: list[str] = field(default_factory=list)
    tiled_clips: list[str] = field(default_factory=list)
    """Clips whose condition the out-of-memory backoff encoded with the VAE's tiling (other latents than the
    pipeline's untiled encode; recorded per camera in the set's clip table)."""


def condition_fingerprint(manifest: dict[str, Any], kind: str, dtype: torch.dtype) -> dict[str, Any]:
    """What decides a set's bytes: the kind and reference, the cache's VAE (as recorded, with its encode
    settings), the frame rule, the stored dtype."""
    vae = {k: v for k, v in (manifest.get("vae") or {}).items() if k not in ("spec", "encoder_variant")}
    settings = manifest.get("settings") or {}
    return {"kind": kind, "reference": REFERENCE, "vae": vae,
            "vae_settings": {k: settings.get(k) for k in ("dtype", "tiling", "views_per_forward", "decoder")},
            "frame_rule": manifest.get("frame_rule"), "stored_dtype": str(dtype).removeprefix("torch."),
            "stored": "posterior mean of the condition video, (cameras, C, latent frames, h, w)"}


def image_fingerprint(manifest: dict[str, Any], encoder: Any) -> dict[str, Any]:
    """What decides an image-features set's bytes: the encoder, its processor and convention, how frames decode."""
    settings = manifest.get("settings") or {}
    return {"kind": "image-features", "reference": encoder.fingerprint()["reference"],
            "image_encoder": encoder.fingerprint(), "frames": {"decoder": settings.get("decoder")},
            "stored_dtype": str(encoder.stored_dtype).removeprefix("torch."),
            "stored": "features of each camera's first frame, (cameras, tokens, hidden)"}


def clip_inputs(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(clip id, a hash of what its frames are: sources, their recorded identity, frame indices (per camera where a
    rig's cameras differ), image-sequence files, bucket, cameras) for every clip: with the fingerprint, what a set's
    generation hashes, so verify can tell a set made from other clips."""
    return [(record["id"], hashlib.sha256(json.dumps(
        [record.get("sources"), record.get("source_identity"), record.get("frames"), record.get("camera_frames"),
         record.get("frame_files"), record.get("bucket"), record.get("cameras")],
        sort_keys=True, default=str).encode()).hexdigest()) for record in records]


def set_generation(fingerprint: dict[str, Any], shard_bytes: int, records: list[dict[str, Any]]) -> str:
    return generation_of({"fingerprint": fingerprint, "shard_bytes": shard_bytes}, clip_inputs(records))


def shard_cut(records: list[dict[str, Any]], shard_bytes: int) -> list[list[str]]:
    """Clips into shards, in clip-table order, by their latents' size in float32 bytes: one cut for every kind (each
    clip's frames are decoded once for all of them), a function of the clips alone, whichever kinds run together."""
    ids = [record["id"] for record in records]
    return pack_shards(ids, [int(torch.Size(latent_shape(record)).numel()) * 4 for record in records], 1,
                       shard_bytes)


def latent_shape(record: dict[str, Any]) -> list[int]:
    """The clip's latent shape as its record gives it: (cameras, C, F, h, w)."""
    tensors = record.get("tensors") or {}
    entry = tensors.get("mean") or tensors.get("sample") or next(iter(tensors.values()), {})
    return list(entry.get("shape") or [])


def embed_conditions(request: ConditionRequest, ctx: Any = None) -> list[ConditionSummary]:
    """Add (or with `replace`, replace) the condition sets `request.kinds` to the finished cache at `request.out`,
    under OUT's lock (held by rank 0). Latents, the clip table and other sets are not touched.

    Clips are cut into shards by bytes in clip-table order; shard s is computed by rank s % world, each clip's
    frames decoded once for every kind asked, so the files do not depend on the world size. Rank 0 writes each
    set's clip table and the manifest last. Every rank returns the same summaries."""
    from contextlib import ExitStack

    from vaecache.cache.lock import held_lock
    from vaecache.cache.reader import CacheReader
    from vaecache.cache.store import open_store
    from vaecache.distributed.context import resolve_device
    from vaecache.encode.fingerprint import load_recorded_vae
    from vaecache.training import LatentCache

    started = time.perf_counter()
    rank, world = (ctx.info.rank, ctx.info.world_size) if ctx is not None else (0, 1)
    store = open_store(request.out, dict(request.storage_options))
    summaries = {kind: ConditionSummary(kind, str(store.location)) for kind in request.kinds}
    with ExitStack() as stack:
        def prepare() -> dict[str, Any]:
            store.check_present()
            stack.enter_context(held_lock(store, ctx.info.job_id if ctx is not None else None))
            cache = CacheReader(store)
            if any(kind in LATENT_KINDS for kind in request.kinds):
                check_condition_vae(cache.manifest.get("vae") or {}, str(store.where(MANIFEST)))
            return cache.manifest

        manifest = ctx.on_rank0(prepare) if ctx is not None else prepare()
        device = ctx.device if ctx is not None else resolve_device(request.device)
        spec = request.vae or (manifest.get("settings") or {}).get("vae_spec")
        vae = image = None
        if any(kind in LATENT_KINDS for kind in request.kinds):
            vae = loaded_on_every_rank(ctx, lambda: load_recorded_vae(
                store.location, manifest, spec, device, allow_pickle_weights=request.allow_pickle_weights), "VAE")
        if "image-features" in request.kinds:
            from vaecache.conditions.images import ImageEncoder

            image = loaded_on_every_rank(ctx, lambda: ImageEncoder(_absolute(request.image_encoder),
                                                                   request.image_convention, device), "image encoder")
            same_on_every_rank(ctx, json.loads(json.dumps(image.fingerprint())), "image encoder")
        latents = LatentCache(request.out, verify="none", storage_options=dict(request.storage_options))
        records = list(latents.records())
        by_id = {record["id"]: record for record in records}
        shards = shard_cut(records, request.shard_bytes)
        existing = manifest.get("conditions") or {}
        todo: dict[str, tuple[dict[str, Any], str]] = {}
        for kind in request.kinds:
            fingerprint = (image_fingerprint(manifest, image) if kind == "image-features"
                           else condition_fingerprint(manifest, kind, vae.model.dtype))
            generation = set_generation(fingerprint, request.shard_bytes, records)
            summaries[kind].clips = len(records)
            summaries[kind].views = sum(len(record["cameras"]) for record in records)
            old = existing.get(kind)
            if old is not None and old.get("generation") == generation:
                def mend(kind: str = kind, old: dict[str, Any] = old) -> None:
                    delete_unlisted(store, f"{CONDITIONS_DIR}/{kind}", old)

                ctx.on_rank0(mend) if ctx is not None else mend()
                summaries[kind].unchanged = True
                continue
            # the same VAE or image encoder: the set follows the cache's clips (an encode added some)
            follows = old is not None and old.get("fingerprint") == fingerprint
            if old is not None and not request.replace and not follows:
                raise UsageError(f"{store.where(MANIFEST)}: the cache already holds condition set {kind!r}, made "
                                 "with another VAE or image encoder; --replace replaces it")
            summaries[kind].replaced = old is not None and request.replace
            summaries[kind].updated = old is not None and not request.replace
            todo[kind] = (fingerprint, generation)
        written: list[dict[str, Any]] = []
        if todo:
            mine = [(number, part) for number, part in enumerate(shards) if number % world == rank]
            for count, (number, part) in enumerate(mine, 1):
                written.extend(_write_shards(store, latents, {"vae": vae, "image": image}, todo, number,
                                             [by_id[c] for c in part]))
                if faults.should_fail("crash-after-condition-shard", count, rank):
                    faults.crash()
        parts = ctx.all_gather_object(written) if ctx is not None else [written]
        results = sorted((result for part in parts for result in part), key=lambda r: r["entry"]["file"])

        def finish() -> dict[str, Any]:
            records_by_kind = {}
            for kind, (fingerprint, generation) in todo.items():
                mine = [result for result in results if result["kind"] == kind]
                records_by_kind[kind] = {
                    "generation": generation, "fingerprint": fingerprint,
                    "fingerprint_sha256": hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest(),
                    "clips": len(records), "views": summaries[kind].views, "shard_bytes": request.shard_bytes,
                    **({"image_encoder": image.spec} if kind == "image-features" else {}),
                    "numerics": {"device": device.type, "torch": torch.__version__,
                                 **({"encoder_impl": vae.model.encoder_impl,
                                     "encoder_variant": vae.model.encoder_variant}
                                    if vae is not None and kind != "image-features" else {})},
                    **_write_table(store, f"{CONDITIONS_DIR}/{kind}/{generation}", mine, records)}
            if records_by_kind:
                updated = {**manifest, "conditions": {**existing, **records_by_kind}}
                store.write(MANIFEST, (json.dumps(updated, indent=2) + "\n").encode())
                for kind, record in records_by_kind.items():
                    delete_unlisted(store, f"{CONDITIONS_DIR}/{kind}", record)
            return records_by_kind

        done = ctx.on_rank0(finish) if ctx is not None else finish()
    backoffs = [event for result in results for event in result.get("backoffs", [])]
    for kind, record in done.items():
        summary = summaries[kind]
        summary.files = len(record["shards"]) + len(record["tables"])
        summary.bytes = sum(s["bytes"] for s in record["shards"]) + sum(t["bytes"] for t in record["tables"].values())
        summary.backoffs = backoffs
        summary.tiled_clips = list(record.get("tiled_clips") or [])
    for summary in summaries.values():
        summary.seconds = time.perf_counter() - started
    return [summaries[kind] for kind in request.kinds]


def _write_shards(store: Any, latents: Any, encoders: dict[str, Any], todo: dict[str, tuple[dict[str, Any], str]],
                  number: int, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Shard `number` of every kind in `todo`: each clip's frames decoded once, each kind's condition computed. Per
    clip and kind: its tensor's stats (verify recomputes them) and, for the VAE's kinds, what the runner's
    out-of-memory backoff did per camera (tiled, units per forward), as a latent clip's record keeps them."""
    from safetensors.torch import save

    from vaecache.cache.writer import tensor_stats

    tensors: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in todo}
    facts: dict[str, dict[str, dict[str, Any]]] = {kind: {} for kind in todo}
    backoffs: list[str] = []
    for record in records:
        frames = latents.source_frames(record)
        for kind in todo:
            if kind == "image-features":
                tensor = encoders["image"].features(frames)
                views: list[dict[str, Any]] = [{"tiled": False, "units_per_forward": len(record["cameras"])}] * \
                    len(record["cameras"])
            else:
                result = encoders["vae"].encode_views(condition_video(frames, kind, record["id"]))
                if result.failed:
                    view, reason = next(iter(sorted(result.failed.items())))
                    raise VaecacheError(f"clip {record['id']} ({record['cameras'][view]}): its {kind} condition did "
                                        f"not encode ({reason})")
                backoffs.extend(result.backoffs)
                tensor = result.mean.cpu().contiguous()
                views = [result.view_settings(view) for view in range(len(record["cameras"]))]
            tensors[kind][record["id"]] = tensor
            facts[kind][record["id"]] = {"stats": tensor_stats(tensor), "tiled": [v["tiled"] for v in views],
                                         "units_per_forward": [int(v["units_per_forward"]) for v in views]}
    results = []
    for kind, (_, generation) in todo.items():
        file = f"{CONDITIONS_DIR}/{kind}/{generation}/{SHARD_PREFIX}{number:05d}.safetensors"
        # one metadata key: safetensors writes a header's metadata in hash-map order (see text sets)
        data = save(tensors[kind], metadata={"vaecache_condition": kind})
        store.write(file, data)
        results.append({"kind": kind, "entry": file_entry(file, data, tensors=len(tensors[kind])),
                        "clips": [record["id"] for record in records], "facts": facts[kind],
                        "backoffs": [] if results else backoffs})
    return results


def _absolute(spec: str | None) -> str:
    """A local spec with its path made absolute (recorded: verify --reencode loads it from anywhere)."""
    from pathlib import Path

    kind, _, location = str(spec).partition(":")
    return f"{kind}:{Path(location).expanduser().absolute()}"


def _write_table(store: Any, folder: str, results: list[dict[str, Any]],
                 records: list[dict[str, Any]]) -> dict[str, Any]:
    import pyarrow as pa

    shard_of = {clip: result["entry"]["file"] for result in results for clip in result["clips"]}
    facts = {clip: fact for result in results for clip, fact in result["facts"].items()}
    ids = [r["id"] for r in records]
    table = pa.table({"id": pa.array(ids, pa.string()),
                      "shard": pa.array([shard_of[clip] for clip in ids], pa.string()),
                      "frames": pa.array([len(r["frames"]) for r in records], pa.int32()),
                      **{stat: pa.array([facts[clip]["stats"][stat] for clip in ids], pa.float64())
                         for stat in ("min", "max", "mean", "std")},
                      "tiled": pa.array([facts[clip]["tiled"] for clip in ids], pa.list_(pa.bool_())),
                      "units_per_forward": pa.array([facts[clip]["units_per_forward"] for clip in ids],
                                                    pa.list_(pa.int32()))})
    data = parquet_bytes(table)
    file = f"{folder}/{CLIPS_TABLE}"
    store.write(file, data)
    return {"shards": [result["entry"] for result in results],
            "tables": {"clips": file_entry(file, data, rows=table.num_rows)},
            "tiled_clips": sorted(clip for clip in ids if any(facts[clip]["tiled"]))}


__all__ = ["ConditionRequest", "ConditionSummary", "condition_fingerprint", "embed_conditions"]
