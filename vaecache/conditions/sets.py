"""Image-to-video condition sets of a finished cache: written by `vaecache embed --condition` (and `encode
--condition`), read by LatentCache, checked by verify. One set per kind (vaecache.conditions.kinds), through OUT's
store like the text sets (vaecache.cache.sets).

OUT/conditions/<kind>/<generation>/
  conditions-00000.safetensors  one tensor per clip, named by its clip id: (cameras, C, latent frames, h, w), the
                                VAE's posterior mean of each camera's condition video, in the VAE's dtype (what the
                                pipeline's `retrieve_latents(..., "argmax")` returns)
  clips.parquet                 id, shard, frames, the tensor's min/max/mean/std, per camera tiled and
                                units_per_forward (the out-of-memory backoff), and inputs (the sha256 of what the
                                clip's frames are: clip_inputs): every clip, in the clip table's order

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

from vaecache.cache.kinds import ComputedItem, SetKind, SetPlan, register
from vaecache.cache.layout import CONDITIONS_DIR, MANIFEST
from vaecache.cache.sets import (
    generation_of,
    loaded_on_every_rank,
    pack_shards,
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
    computed: int = 0
    """Clips whose condition was computed (the rest were committed already, or copied from the set before)."""
    copied: int = 0
    """Clips copied from the set before: the cache grew, the VAE or image encoder and the clip's frames the same."""
    resumed: int = 0
    """Shards an interrupted embed had committed, kept."""
    repaired: list[str] = field(default_factory=list)
    """Shards of the listed set found missing or damaged, computed again."""


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


class ConditionKind(SetKind):
    """Image-to-video condition sets as a kind of set (vaecache.cache.kinds): one set per condition kind, one item
    per clip (its tensor named by its clip id), linked to the clip by the hash of what its frames are."""

    name = CONDITIONS_DIR
    what = "condition set"
    shard_prefix = SHARD_PREFIX
    item_table = CLIPS_TABLE.removesuffix(".parquet")
    item_column = "id"
    metadata_key = "vaecache_condition"
    export_member = "condition.safetensors"
    sets_key = "condition_sets"
    export_description = ("each condition set's stored posterior mean of the clip's condition videos "
                          "(condition/<kind>, (cameras, C, F, H, W)); json's condition_sets gives what rebuilds the "
                          "pipeline's tensor")

    def job(self, request: ConditionRequest, store: Any, manifest: dict[str, Any], ctx: Any, device: Any,
            given: Any) -> ConditionJob:
        return ConditionJob(request, store, manifest, ctx, device)

    def refusal(self, where: str, name: str) -> str:
        return (f"{where}: the cache already holds condition set {name!r}, made with another VAE or image encoder; "
                "--replace replaces it")

    def readers(self, store: Any, manifest: dict[str, Any], verify: str) -> list[Any]:
        from vaecache.conditions.reader import ConditionSet, condition_set_names

        return [ConditionSet(store, manifest, kind, verify) for kind in condition_set_names(manifest)]

    def decode(self, stored: dict[str, Any], facts: dict[str, Any]) -> dict[str, Any]:
        from vaecache.conditions.kinds import pipeline_condition

        return {f"condition/{kind}": pipeline_condition(stored[f"condition/{kind}"], kind, int(fact["frames"]),
                                                        int(fact["temporal_factor"]), fact["latents_mean"],
                                                        fact["latents_std"])
                for kind, fact in sorted(facts.items())}

    def verify_sets(self, cache: Any, quick: bool, check_type: type) -> list[Any]:
        from vaecache.verify.conditions import check_condition_sets

        return check_condition_sets(cache, quick, check_type)

    def reencode_sets(self, cache: Any, options: Any, ctx: Any, check_type: type) -> list[Any]:
        from vaecache.distributed.context import resolve_device
        from vaecache.verify.conditions import check_condition_reencode
        from vaecache.verify.recheck import REENCODE_TOLERANCE

        device = ctx.device if ctx is not None else resolve_device(options.device)
        return check_condition_reencode(cache, options.reencode, options.seed, device, options.tolerance,
                                        REENCODE_TOLERANCE, check_type, options.vae, options.allow_pickle_weights)


class ConditionJob:
    """One `vaecache embed --condition`: the cache's VAE and/or the image encoder loaded on every rank, which all
    read the clip records (each decodes its shards' frames)."""

    def __init__(self, request: ConditionRequest, store: Any, manifest: dict[str, Any], ctx: Any,
                 device: Any) -> None:
        from vaecache.encode.fingerprint import load_recorded_vae
        from vaecache.training import LatentCache

        self.request, self.manifest, self.device = request, manifest, device
        if any(kind in LATENT_KINDS for kind in request.kinds):
            check_condition_vae(manifest.get("vae") or {}, str(store.where(MANIFEST)))
        spec = request.vae or (manifest.get("settings") or {}).get("vae_spec")
        self.vae = self.image = None
        if any(kind in LATENT_KINDS for kind in request.kinds):
            self.vae = loaded_on_every_rank(ctx, lambda: load_recorded_vae(
                store.location, manifest, spec, device, allow_pickle_weights=request.allow_pickle_weights), "VAE")
        if "image-features" in request.kinds:
            from vaecache.conditions.images import ImageEncoder

            self.image = loaded_on_every_rank(ctx, lambda: ImageEncoder(
                _absolute(request.image_encoder), request.image_convention, device), "image encoder")
            same_on_every_rank(ctx, json.loads(json.dumps(self.image.fingerprint())), "image encoder")
        self.latents = LatentCache(request.out, verify="none", storage_options=dict(request.storage_options))
        self.records = list(self.latents.records())
        self.by_id = {record["id"]: record for record in self.records}
        self.inputs = dict(clip_inputs(self.records))

    def plans(self) -> list[SetPlan]:
        shards = shard_cut(self.records, self.request.shard_bytes)
        views = sum(len(record["cameras"]) for record in self.records)
        columns = (("id", "string"), ("shard", "string"), ("frames", "int32"),
                   *((stat, "float64") for stat in ("min", "max", "mean", "std")),
                   ("tiled", "list<bool>"), ("units_per_forward", "list<int32>"), ("inputs", "string"))
        plans = []
        for kind in self.request.kinds:
            fingerprint = (image_fingerprint(self.manifest, self.image) if kind == "image-features"
                           else condition_fingerprint(self.manifest, kind, self.vae.model.dtype))
            plans.append(SetPlan(kind, fingerprint, set_generation(fingerprint, self.request.shard_bytes, self.records),
                                 shards, columns, summary={"clips": len(self.records), "views": views}))
        return plans

    def follows(self, prior: dict[str, Any], plan: SetPlan) -> bool:
        """The same VAE or image encoder: the set follows the cache's clips (an encode added some)."""
        return prior.get("fingerprint") == plan.fingerprint

    def reusable(self, prior: dict[str, Any], plan: SetPlan, item: str, facts: dict[str, Any]) -> bool:
        """The clip's frames are what they were (sets written before the inputs column are computed again)."""
        return facts.get("inputs") is not None and facts.get("inputs") == self.inputs.get(item)

    def compute(self, number: int, todo: dict[str, list[str]]) -> tuple[dict[str, dict[str, ComputedItem]],
                                                                        list[str]]:
        """The conditions of one shard's clips: each clip's frames decoded once for every kind asked. Per clip and
        kind: its tensor's stats (verify recomputes them) and, for the VAE's kinds, what the runner's out-of-memory
        backoff did per camera (tiled, units per forward), as a latent clip's record keeps them."""
        from vaecache.cache.writer import tensor_stats

        wanted = {clip for clips in todo.values() for clip in clips}
        found: dict[str, dict[str, ComputedItem]] = {kind: {} for kind in todo}
        backoffs: list[str] = []
        for record in (record for record in self.records if record["id"] in wanted):
            frames = self.latents.source_frames(record)
            for kind in (kind for kind in todo if record["id"] in todo[kind]):
                if kind == "image-features":
                    tensor = self.image.features(frames)
                    views: list[dict[str, Any]] = \
                        [{"tiled": False, "units_per_forward": len(record["cameras"])}] * len(record["cameras"])
                else:
                    result = self.vae.encode_views(condition_video(frames, kind, record["id"]))
                    if result.failed:
                        view, reason = next(iter(sorted(result.failed.items())))
                        raise VaecacheError(f"clip {record['id']} ({record['cameras'][view]}): its {kind} condition "
                                            f"did not encode ({reason})")
                    backoffs.extend(result.backoffs)
                    tensor = result.mean.cpu().contiguous()
                    views = [result.view_settings(view) for view in range(len(record["cameras"]))]
                found[kind][record["id"]] = ComputedItem(
                    {record["id"]: tensor},
                    {"frames": len(record["frames"]), **tensor_stats(tensor), "tiled": [v["tiled"] for v in views],
                     "units_per_forward": [int(v["units_per_forward"]) for v in views],
                     "inputs": self.inputs[record["id"]]})
        return found, backoffs

    def extra_tables(self, plan: SetPlan, facts: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
        return []

    def record(self, plan: SetPlan, facts: dict[str, dict[str, Any]],
               files: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        kind, vae = plan.name, self.vae
        record = {
            "generation": plan.generation, "fingerprint": plan.fingerprint,
            "fingerprint_sha256": hashlib.sha256(json.dumps(plan.fingerprint, sort_keys=True).encode()).hexdigest(),
            "clips": len(self.records), "views": plan.summary["views"], "shard_bytes": self.request.shard_bytes,
            **({"image_encoder": self.image.spec} if kind == "image-features" else {}),
            "numerics": {"device": self.device.type, "torch": torch.__version__,
                         **({"encoder_impl": vae.model.encoder_impl, "encoder_variant": vae.model.encoder_variant}
                            if vae is not None and kind != "image-features" else {})},
            **files,
            "tiled_clips": sorted(clip for clip, row in facts.items() if any(row["tiled"]))}
        return record, {}


CONDITIONS = register(ConditionKind())


def embed_conditions(request: ConditionRequest, ctx: Any = None) -> list[ConditionSummary]:
    """Add (or with `replace`, replace) the condition sets `request.kinds` to the finished cache at `request.out`,
    under OUT's lock (held by rank 0). Latents, the clip table and other sets are not touched.

    Clips are cut into shards by bytes in clip-table order; shard s is computed by rank s % world, each clip's
    frames decoded once for every kind asked, so the files do not depend on the world size. Committed shards are
    kept, a deleted or damaged one computed again, and a clip the set already held with the same frames copied
    from it (vaecache.cache.sets.embed_sets). Every rank returns the same summaries."""
    from vaecache.cache.sets import embed_sets

    started = time.perf_counter()
    summaries = []
    for outcome in embed_sets(CONDITIONS, request, ctx):
        summary = ConditionSummary(outcome.name, outcome.extra["out"], clips=outcome.extra["clips"],
                                   views=outcome.extra["views"], unchanged=outcome.unchanged,
                                   replaced=outcome.replaced, updated=outcome.updated, computed=outcome.computed,
                                   copied=outcome.copied, resumed=outcome.resumed, repaired=outcome.repaired)
        if not outcome.unchanged:
            record = outcome.record
            summary.files = len(record["shards"]) + len(record["tables"])
            summary.bytes = (sum(s["bytes"] for s in record["shards"])
                             + sum(t["bytes"] for t in record["tables"].values()))
            summary.backoffs = outcome.events
            summary.tiled_clips = list(record.get("tiled_clips") or [])
        summary.seconds = time.perf_counter() - started
        summaries.append(summary)
    return summaries


def _absolute(spec: str | None) -> str:
    """A local spec with its path made absolute (recorded: verify --reencode loads it from anywhere)."""
    from pathlib import Path

    kind, _, location = str(spec).partition(":")
    return f"{kind}:{Path(location).expanduser().absolute()}"


__all__ = ["ConditionRequest", "ConditionSummary", "condition_fingerprint", "embed_conditions"]
