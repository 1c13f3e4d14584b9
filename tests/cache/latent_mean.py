"""A kind of set declared outside vaecache (the worked example of docs/architecture.md, "How to add a kind"): each
clip's latents averaged over time, (cameras, C, h, w) float32. Everything but what is written here (the lock,
shards across ranks, commits, resume and repair, copying into a grown cache, the tables, the manifest, verify's
file and item checks, LatentCache's item, the WebDataset export) is vaecache's set machinery."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from vaecache.cache.kinds import ComputedItem, SetKind, SetPlan, register
from vaecache.cache.sets import generation_of, pack_shards
from vaecache.cache.writer import tensor_stats


def latent_key(record: dict[str, Any]) -> str:
    """The stored tensor a clip's mean is taken of: its posterior mean, else its sample."""
    return "mean" if "mean" in (record.get("tensors") or {}) else "sample"


def latents_sha256(record: dict[str, Any]) -> str:
    """What links an item to its clip: the clip's latent tensor as its record places it (shard and offsets)."""
    return hashlib.sha256(json.dumps((record.get("tensors") or {}).get(latent_key(record)),
                                     sort_keys=True).encode()).hexdigest()


class LatentMeanKind(SetKind):
    name = "latent-mean"
    what = "latent-mean set"
    shard_prefix = "means-"
    item_table = "clips"
    item_column = "id"
    metadata_key = "vaecache_latent_mean"
    export_description = "each clip's latents averaged over time (latent-mean/<set>, (cameras, C, h, w))"

    def job(self, request: Any, store: Any, manifest: dict[str, Any], ctx: Any, device: Any,
            given: Any) -> LatentMeanJob:
        return LatentMeanJob(request, manifest)

    def check_item(self, cache: Any, clip: str, tensors: dict[str, Any], row: dict[str, Any]) -> str | None:
        records = getattr(cache, "_latent_mean_records", None)
        if records is None:
            records = cache._latent_mean_records = {record["id"]: record for record in cache.clip_records()}
        record = records[clip]
        shape = list(record["tensors"][latent_key(record)]["shape"])
        expected = shape[:2] + shape[3:]
        if list(tensors[clip].shape) != expected:
            return f"a mean of shape {tuple(tensors[clip].shape)}, its clip's latents give {tuple(expected)}"
        if row.get("latents") != latents_sha256(record):
            return "made from other latents than the clip's"
        return None


class LatentMeanJob:
    def __init__(self, request: Any, manifest: dict[str, Any]) -> None:
        from vaecache.training import LatentCache

        self.request = request
        self.latents = LatentCache(request.out, verify="sha256", storage_options=dict(request.storage_options))
        self.records = {record["id"]: record for record in self.latents.records()}
        self.fingerprint = {"kind": LatentMeanKind.name, "latents": manifest.get("fingerprint_sha256"),
                            "stored": "latents averaged over time, float32"}

    def plans(self) -> list[SetPlan]:
        ids = list(self.records)
        sizes = [4 * int(torch.Size(self.records[clip]["tensors"][latent_key(self.records[clip])]["shape"]).numel())
                 for clip in ids]
        pairs = [(clip, latents_sha256(self.records[clip])) for clip in ids]
        generation = generation_of({"fingerprint": self.fingerprint, "shard_bytes": self.request.shard_bytes}, pairs)
        columns = (("id", "string"), ("shard", "string"), *((stat, "float64") for stat in ("min", "max", "mean",
                                                                                           "std")),
                   ("latents", "string"))
        return [SetPlan(self.request.set_name, self.fingerprint, generation,
                        pack_shards(ids, sizes, 1, self.request.shard_bytes), columns, summary={"clips": len(ids)})]

    def follows(self, prior: dict[str, Any], plan: SetPlan) -> bool:
        return prior.get("fingerprint") == plan.fingerprint

    def reusable(self, prior: dict[str, Any], plan: SetPlan, item: str, facts: dict[str, Any]) -> bool:
        return facts.get("latents") == latents_sha256(self.records[item])

    def compute(self, number: int, todo: dict[str, list[str]]) -> tuple[dict[str, dict[str, ComputedItem]],
                                                                        list[str]]:
        found: dict[str, dict[str, ComputedItem]] = {}
        for name, clips in todo.items():
            found[name] = {}
            for clip in clips:
                record = self.records[clip]
                mean = self.latents.tensors_of(record)[latent_key(record)].float().mean(dim=2).contiguous()
                facts = {**tensor_stats(mean), "latents": latents_sha256(record)}
                found[name][clip] = ComputedItem({clip: mean}, facts)
        return found, []

    def extra_tables(self, plan: SetPlan, facts: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
        return []

    def record(self, plan: SetPlan, facts: dict[str, dict[str, Any]],
               files: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"generation": plan.generation, "fingerprint": plan.fingerprint, "clips": len(facts), **files}, {}


LATENT_MEAN = register(LatentMeanKind())
