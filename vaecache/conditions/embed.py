"""Image-to-video condition sets as a kind of set on the one set machinery (vaecache.cache.kinds,
vaecache.cache.embedding): what `vaecache embed --condition` computes, each clip's frames decoded once for every kind
asked, how verify checks it and what readers and exports add to an item. The layout, the request and the
fingerprints are vaecache.conditions.sets."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from vaecache.cache.kinds import ComputedItem, SetKind, SetOutcome, SetPlan, register
from vaecache.cache.layout import CONDITIONS_DIR, MANIFEST
from vaecache.conditions.kinds import LATENT_KINDS, check_condition_vae, condition_pipeline, condition_video
from vaecache.conditions.sets import (
    CLIPS_TABLE,
    SHARD_PREFIX,
    ConditionRequest,
    absolute_spec,
    clip_inputs,
    condition_fingerprint,
    image_fingerprint,
    set_generation,
    shard_cut,
)
from vaecache.distributed.agreement import loaded_on_every_rank, same_on_every_rank
from vaecache.errors import VaecacheError


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
        from vaecache.conditions.kinds import UNNAMED, pipeline_condition, pipeline_masks

        tensors: dict[str, Any] = {}
        for kind, fact in sorted(facts.items()):
            stored_tensor, pipeline = stored[f"condition/{kind}"], fact.get("pipeline", UNNAMED.name)
            tensors[f"condition/{kind}"] = pipeline_condition(
                stored_tensor, kind, int(fact["frames"]), int(fact["temporal_factor"]), fact["latents_mean"],
                fact["latents_std"], pipeline, float(fact.get("scaling_factor", 1.0)))
            tensors.update(pipeline_masks(stored_tensor, kind, int(fact["frames"]), int(fact["temporal_factor"]),
                                          pipeline))
        return tensors

    def verify_sets(self, cache: Any, quick: bool, check_type: type) -> list[Any]:
        from vaecache.conditions.checks import check_condition_sets

        return check_condition_sets(cache, quick, check_type)

    def reencode_sets(self, cache: Any, options: Any, ctx: Any, check_type: type) -> list[Any]:
        from vaecache.conditions.checks import check_condition_reencode
        from vaecache.distributed.context import resolve_device
        from vaecache.settings.dtypes import REENCODE_TOLERANCE

        device = ctx.device if ctx is not None else resolve_device(options.device)
        return check_condition_reencode(cache, options.reencode, options.seed, device, options.tolerance,
                                        REENCODE_TOLERANCE, check_type, options.vae, options.allow_pickle_weights)


class ConditionJob:
    """One `vaecache embed --condition`: the cache's VAE and/or the image encoder loaded on every rank, which all
    read the clip records (each decodes its shards' frames)."""

    def __init__(self, request: ConditionRequest, store: Any, manifest: dict[str, Any], ctx: Any,
                 device: Any) -> None:
        from vaecache.training import LatentCache
        from vaecache.vae.recorded import load_recorded_vae, recorded_spec

        self.request, self.manifest, self.device = request, manifest, device
        if any(kind in LATENT_KINDS for kind in request.kinds):
            check_condition_vae(manifest.get("vae") or {}, str(store.where(MANIFEST)), request.kinds, request.pipeline)
        self.pipeline = condition_pipeline(manifest.get("vae") or {}, request.pipeline)
        self.vae = self.image = None
        if any(kind in LATENT_KINDS for kind in request.kinds):
            spec = recorded_spec(manifest, request.vae, store.where(MANIFEST))
            self.vae = loaded_on_every_rank(ctx, lambda: load_recorded_vae(
                store.location, manifest, spec, device, allow_pickle_weights=request.allow_pickle_weights),
                "VAE").pipeline_encode()
        if "image-features" in request.kinds:
            from vaecache.conditions.images import ImageEncoder

            self.image = loaded_on_every_rank(ctx, lambda: ImageEncoder(
                absolute_spec(request.image_encoder), request.image_convention, device), "image encoder")
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
                           else condition_fingerprint(self.manifest, kind, self.vae.model.dtype, self.pipeline))
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
                    result = self.vae.encode_views(condition_video(frames, kind, record["id"], self.pipeline))
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


def embed_conditions(request: ConditionRequest, ctx: Any = None) -> list[SetOutcome]:
    """Add (or with `replace`, replace) the condition sets `request.kinds` to the finished cache at `request.out`,
    under OUT's lock (held by rank 0). Latents, the clip table and other sets are not touched.

    Clips are cut into shards by bytes in clip-table order; shard s is computed by rank s % world, each clip's
    frames decoded once for every kind asked, so the files do not depend on the world size. Committed shards are
    kept, a deleted or damaged one computed again, and a clip the set already held with the same frames copied
    from it (vaecache.cache.embedding.embed_sets). Every rank returns the same outcomes."""
    from vaecache.cache.embedding import embed_sets

    return embed_sets(CONDITIONS, request, ctx)


__all__ = ["CONDITIONS", "ConditionJob", "ConditionKind", "embed_conditions"]
