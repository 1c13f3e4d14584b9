"""The text kind at vaecache's edges, importable without torch: `vaecache embed --text-encoder` and its flags, the
request they make, encode's --text-encoder (checked at start-up, embedded once the cache is finished) and the lines a
run prints of a text set."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from vaecache.edges import EmbedShared, KindEdges, KindOption
from vaecache.errors import UsageError

if TYPE_CHECKING:
    from vaecache.cache.kinds import SetOutcome


class TextEdges(KindEdges):
    kind = "text"
    panel = "Text (--text-encoder)"
    asked_by = "text_encoder"
    takes_set_name = True
    items = "prompt(s)"
    options = (
        KindOption("text_encoder", "--text-encoder", str, "Embed the captions: diffusers:DIR | transformers:DIR.",
                   metavar="SPEC"),
        KindOption("caption_field", "--caption-field", str, "Metadata key of the caption (default caption).",
                   metavar="KEY"),
        KindOption("captions", "--captions", Path, "Captions by clip id: a .json or .jsonl file.", metavar="FILE"),
        KindOption("dtype", "--dtype", str, "Stored dtype: fp32 (default) | bf16 | fp16.", metavar="TEXT"),
        KindOption("compute_dtype", "--compute-dtype", str, "Computed in: fp32 (default) | bf16.", metavar="TEXT"),
        KindOption("text_batch", "--text-batch", int, "Prompts per forward (default 8).", metavar="N"),
        KindOption("text_length", "--text-length", int, "transformers:DIR: tokens per prompt.", metavar="N"),
        KindOption("text_layer", "--text-layer", int, "transformers:DIR: the hidden state kept.", metavar="N"),
        KindOption("text_convention", "--text-convention", str, "pipeline (default) | musubi.", metavar="TEXT"),
        KindOption("k5_template", "--k5-template", str, "Kandinsky 5, musubi: video (default) | image.",
                   metavar="TEXT"),
    )

    def check_given(self, given: dict[str, Any], shared: EmbedShared) -> None:
        if self.asked(given):
            return
        misplaced = [option.flag for option in self.options[1:] if given.get(option.name) is not None]
        if shared.set_name is not None and not given.get("kind") and not given.get("audio_vae"):
            misplaced.insert(0, "--set")  # no other kind asked names a set: --set is the text set's
        if misplaced:
            raise UsageError(f"{', '.join(misplaced)} appl{'y' if len(misplaced) > 1 else 'ies'} to --text-encoder "
                             "(the text set)")

    def request(self, given: dict[str, Any], shared: EmbedShared) -> Any:
        from vaecache.text.sets import EmbedRequest

        return EmbedRequest(
            out=shared.out, text_encoder=given["text_encoder"], set_name=shared.set_name or "default",
            caption_field=given["caption_field"] or "caption", captions=given["captions"], replace=shared.replace,
            dtype=given["dtype"] or "fp32", compute_dtype=given["compute_dtype"] or "fp32",
            batch=8 if given["text_batch"] is None else given["text_batch"], shard_bytes=shared.shard_bytes,
            device=shared.device, length=given["text_length"], layer=given["text_layer"],
            allow_pickle_weights=shared.allow_pickle_weights, storage_options=shared.storage_options,
            convention=given["text_convention"] or "pipeline", k5_template=given["k5_template"])

    def embed(self, request: Any, ctx: Any) -> list[SetOutcome]:
        from vaecache.text.embed import embed_cache

        return embed_cache(request, ctx)  # the captions file is read before OUT's lock

    def encode_request(self, cfg: Any) -> Any | None:
        if not cfg.text.encoder:
            return None
        from vaecache.text.sets import EmbedRequest

        return EmbedRequest(out=str(cfg.out.location), text_encoder=cfg.text.encoder, device=cfg.parallel.device,
                            require_caption_field=False, allow_pickle_weights=cfg.vae.allow_pickle_weights,
                            storage_options=cfg.out.storage_options)

    def check_at_start(self, request: Any) -> None:
        from vaecache.text.encoder import check_text_encoder

        check_text_encoder(request.text.encoder)

    def counts(self, outcome: SetOutcome) -> str:
        return f"{outcome.extra['clips']} clips, {outcome.extra['prompts']} distinct prompts"

    def notes(self, outcome: SetOutcome) -> list[str]:
        record = outcome.record or {}
        lines = []
        if record.get("empty_prompt_clips"):
            lines.append(f"{record['empty_prompt_clips']} clip(s) have no caption (missing, null or empty) and the "
                         f"empty prompt, e.g. {', '.join(outcome.extra.get('empty_examples') or [])}")
        if record.get("truncated_prompts"):
            lines.append(f"{record['truncated_prompts']} prompt(s) were longer than the encoder's length and "
                         f"truncated, e.g. clip(s) {', '.join(outcome.extra.get('examples') or [])}")
        return lines


EDGES = TextEdges()
