"""Text-embedding sets as a kind of set on the one set machinery (vaecache.cache.kinds, vaecache.cache.embedding):
what `vaecache embed --text-encoder` computes, how verify checks it and what readers and exports add to an item. The
layout, the request, the captions and the reader are vaecache.text.sets."""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any

import torch

from vaecache.cache.kinds import ComputedItem, SetKind, SetOutcome, SetPlan, register
from vaecache.cache.layout import TEXT_DIR
from vaecache.cache.sets import generation_of, pack_shards
from vaecache.distributed.agreement import loaded_on_every_rank, same_on_every_rank
from vaecache.text.sets import (
    CLIPS_TABLE,
    EMBEDDINGS_PREFIX,
    GLYPH_SUFFIX,
    POOLED_SUFFIX,
    PROMPTS_TABLE,
    STAT_NAMES,
    EmbedRequest,
    TextSet,
    clip_captions,
    feature_tensors,
    pipeline_tensor,
    plan_prompts,
    prompt_key,
    read_captions_file,
    text_set_names,
)


class TextKind(SetKind):
    """Text-embedding sets as a kind of set (vaecache.cache.kinds): one item per distinct cleaned prompt, keyed by the
    sha256 of its text; the clip table links every clip to its prompt."""

    name = TEXT_DIR
    what = "text set"
    shard_prefix = EMBEDDINGS_PREFIX
    item_table = PROMPTS_TABLE.removesuffix(".parquet")
    item_column = "key"
    metadata_key = "vaecache_text_set"
    export_member = "text.safetensors"
    sets_key = "text_sets"
    export_description = ("each text set's stored rows of the clip's prompt (text/<set>; HunyuanVideo's pooled output "
                          "text_pooled/<set>; HunyuanVideo 1.5's glyph rows text_glyph/<set>); json's text_sets gives "
                          "each set's length and token count")

    def job(self, request: EmbedRequest, store: Any, manifest: dict[str, Any], ctx: Any, device: Any,
            given: Any) -> TextJob:
        return TextJob(request, store, ctx, device, given)

    def refusal(self, where: str, name: str) -> str:
        return (f"{where}: the cache already holds text set {name!r}, made with another encoder or other captions; "
                "--replace replaces it, --set NAME adds another")

    def readers(self, store: Any, manifest: dict[str, Any], verify: str) -> list[Any]:
        return [TextSet(store, manifest, name, verify) for name in text_set_names(manifest)]

    def decode(self, stored: dict[str, Any], facts: dict[str, Any]) -> dict[str, Any]:
        tensors: dict[str, Any] = {}
        for name, fact in sorted(facts.items()):
            embeds, tensors[f"text_mask/{name}"] = pipeline_tensor(
                stored[f"text/{name}"], int(fact["length"]), int(fact["tokens"]), str(fact.get("padding", "right")))
            tensors.update(feature_tensors(name, embeds, fact.get("features")))
            if f"text_pooled/{name}" in stored:
                tensors[f"text_pooled/{name}"] = stored[f"text_pooled/{name}"]
            if f"text_glyph/{name}" in stored:
                tensors[f"text_glyph/{name}"], tensors[f"text_glyph_mask/{name}"] = pipeline_tensor(
                    stored[f"text_glyph/{name}"], int(fact["glyph_length"]), int(fact["glyph_tokens"]))
        return tensors

    def verify_sets(self, cache: Any, quick: bool, check_type: type) -> list[Any]:
        from vaecache.text.checks import check_text_sets

        return check_text_sets(cache, quick, check_type)

    def reencode_sets(self, cache: Any, options: Any, ctx: Any, check_type: type) -> list[Any]:
        from vaecache.distributed.context import resolve_device
        from vaecache.settings.dtypes import REENCODE_TOLERANCE
        from vaecache.text.checks import check_text_reembed

        device = ctx.device if ctx is not None else resolve_device(options.device)
        return check_text_reembed(cache, options.reencode, options.seed, device, options.tolerance,
                                  REENCODE_TOLERANCE, check_type, options.allow_pickle_weights)


class TextJob:
    """One `vaecache embed --text-encoder`: the encoder loaded on every rank; rank 0 reads the clips' captions."""

    def __init__(self, request: EmbedRequest, store: Any, ctx: Any, device: Any, given: Any) -> None:
        from vaecache.text.encoder import load_text_encoder

        self.request, self.store, self.ctx, self.device = request, store, ctx, device
        self.captions, self.source = given if given is not None else (None, None)
        self.encoder = loaded_on_every_rank(ctx, lambda: load_text_encoder(
            request.text_encoder, device, compute_dtype=request.compute_dtype, dtype=request.dtype,
            length=request.length, layer=request.layer, batch=request.batch,
            allow_pickle_weights=request.allow_pickle_weights, convention=request.convention,
            k5_template=request.k5_template), "text encoder")
        self.fingerprint = self.encoder.fingerprint()
        same_on_every_rank(ctx, self.fingerprint, "text encoder")
        self.clip_keys: list[tuple[str, str]] = []  # rank 0's: (clip, prompt key) of every clip, for the tables
        self.cleaned: dict[str, str] = {}

    def plans(self) -> list[SetPlan]:
        from vaecache.cache.reader import CacheReader

        def plan() -> tuple[dict[str, str], str, int]:
            """Rank 0 reads the records; the other ranks need only the distinct prompts and the generation (what
            is broadcast), not a list as long as the cache."""
            cleaned = plan_prompts(clip_captions(CacheReader(self.store).clip_records(), self.request.caption_field,
                                                 self.captions, self.request.require_caption_field),
                                   self.encoder.clean, self.clip_keys)
            generation = generation_of({"fingerprint": self.fingerprint, "captions": self.source,
                                        "shard_bytes": self.request.shard_bytes}, self.clip_keys)
            return cleaned, generation, len(self.clip_keys)

        self.cleaned, generation, clip_count = self.ctx.on_rank0(plan) if self.ctx is not None else plan()
        keys = sorted(self.cleaned)
        row_bytes = self.encoder.hidden_size * torch.empty((), dtype=self.encoder.dtype).element_size()
        tokens = self.encoder.token_counts([self.cleaned[key] for key in keys])
        shards = pack_shards(keys, [count * row_bytes for count in tokens], self.encoder.batch,
                             self.request.shard_bytes)
        pooled = self.encoder.pooled_model is not None
        glyph = self.encoder.glyph_model is not None
        columns = (("key", "string"), ("text", "string"), ("tokens", "int32"), ("truncated", "bool"),
                   ("shard", "string"),
                   *((("pooled_tokens", "int32"), ("pooled_truncated", "bool")) if pooled else ()),
                   *((("glyph_tokens", "int32"), ("glyph_truncated", "bool")) if glyph else ()),
                   *((f"{prefix}{stat}", "float64")
                     for prefix in ("", *(("pooled_",) if pooled else ()), *(("glyph_",) if glyph else ()))
                     for stat in STAT_NAMES))
        return [SetPlan(self.request.set_name, self.fingerprint, generation, shards, columns,
                        summary={"clips": clip_count, "prompts": len(keys)})]

    def follows(self, prior: dict[str, Any], plan: SetPlan) -> bool:
        """The same encoder and captions source: the set follows the cache's clips (an encode added some)."""
        return prior.get("fingerprint") == plan.fingerprint and prior.get("captions") == self.source

    def reusable(self, prior: dict[str, Any], plan: SetPlan, item: str, facts: dict[str, Any]) -> bool:
        return True  # a prompt's key is the hash of its text, and its rows do not depend on its batch's others

    def compute(self, number: int, todo: dict[str, list[str]]) -> tuple[dict[str, dict[str, ComputedItem]],
                                                                        list[str]]:
        """Embed the prompts of one shard: each prompt's rows (and pooled output), its table row with the stats of
        what is stored (verify recomputes them from the bytes: a row altered or two prompts' rows swapped are
        named)."""
        from vaecache.cache.writer import tensor_stats

        found: dict[str, dict[str, ComputedItem]] = {}
        for name, keys in todo.items():
            embeddings = self.encoder.embed([self.cleaned[key] for key in keys])
            found[name] = {}
            for key, e in zip(keys, embeddings):
                tensors = {key: e.rows.contiguous()}
                facts: dict[str, Any] = {"text": self.cleaned[key], "tokens": e.tokens, "truncated": e.truncated}
                if e.pooled is not None:
                    tensors[f"{key}{POOLED_SUFFIX}"] = e.pooled.contiguous()
                    facts.update(pooled_tokens=e.pooled_tokens, pooled_truncated=e.pooled_truncated)
                if e.glyph is not None:
                    tensors[f"{key}{GLYPH_SUFFIX}"] = e.glyph.contiguous()
                    facts.update(glyph_tokens=e.glyph_tokens, glyph_truncated=e.glyph_truncated)
                facts.update(tensor_stats(e.rows))
                if e.pooled is not None:
                    facts.update({f"pooled_{stat}": value for stat, value in tensor_stats(e.pooled).items()})
                if e.glyph is not None:
                    facts.update({f"glyph_{stat}": value for stat, value in tensor_stats(e.glyph).items()})
                found[name][key] = ComputedItem(tensors, facts)
        return found, []

    def extra_tables(self, plan: SetPlan, facts: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
        """The clip table; with a --captions file it keeps each clip's caption as the file gave it, so that verify
        can prove the clip's link to its prompt once the file is gone."""
        import pyarrow as pa

        captions = self.captions
        table = pa.table({"id": pa.array([c for c, _ in self.clip_keys], pa.string()),
                          "key": pa.array([k for _, k in self.clip_keys], pa.string()),
                          **({"caption": pa.array([captions[c] for c, _ in self.clip_keys], pa.string())}
                             if captions is not None else {})})
        return [(CLIPS_TABLE.removesuffix(".parquet"), table)]

    def record(self, plan: SetPlan, facts: dict[str, dict[str, Any]],
               files: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        counts: dict[str, int] = {}
        for _, key in self.clip_keys:
            counts[key] = counts.get(key, 0) + 1
        truncated = {key for key, row in facts.items() if row["truncated"]}
        truncated_pooled = {key for key, row in facts.items() if row.get("pooled_truncated")}
        truncated_glyph = {key for key, row in facts.items() if row.get("glyph_truncated")}
        record = {
            "generation": plan.generation, "fingerprint": self.fingerprint,
            "fingerprint_sha256": hashlib.sha256(json.dumps(self.fingerprint, sort_keys=True).encode()).hexdigest(),
            "spec": self.encoder.spec, "captions": self.source, "clips": len(self.clip_keys), "prompts": len(facts),
            "empty_prompt_clips": counts.get(prompt_key(""), 0), "truncated_prompts": len(truncated),
            **({"truncated_pooled_prompts": len(truncated_pooled)} if self.encoder.pooled_model is not None else {}),
            **({"truncated_glyph_prompts": len(truncated_glyph),
                "glyph_prompts": sum(1 for row in facts.values() if row.get("glyph_tokens"))}
               if self.encoder.glyph_model is not None else {}),
            "numerics": {"device": self.device.type, "torch": torch.__version__},
            **files,
        }
        empty = prompt_key("")
        return record, {"examples": [clip for clip, key in self.clip_keys if key in truncated][:5],
                        "empty_examples": list(itertools.islice(
                            (clip for clip, key in self.clip_keys if key == empty), 5))}


TEXT = register(TextKind())


def embed_cache(request: EmbedRequest, ctx: Any = None) -> list[SetOutcome]:
    """Add (or with `replace`, replace) the embedding set `request.set_name` to the finished cache at
    `request.out`, under OUT's lock (held by rank 0). Latents and the clip table are not touched.

    Under torchrun (`ctx` from vaecache.distributed.distributed) the shards are split across the ranks: shard s
    holds the prompts of a fixed run of batches in key order and rank s % world embeds and writes it, so the
    files do not depend on the world size; rank 0 then writes both tables and the manifest. Committed shards are
    kept, a deleted or damaged one computed again, and a prompt the set already held copied from it
    (vaecache.cache.embedding.embed_sets). Every rank returns the same outcome."""
    from vaecache.cache.embedding import embed_sets

    def read_source() -> tuple[dict[str, str | None] | None, dict[str, Any]]:
        if request.captions is not None:
            return read_captions_file(request.captions)
        return None, {"kind": "clip metadata", "field": request.caption_field}

    return embed_sets(TEXT, request, ctx, before_lock=read_source)


__all__ = ["TEXT", "TextJob", "TextKind", "embed_cache"]
