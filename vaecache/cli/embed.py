"""`vaecache embed`: a named set of text-encoder embeddings of the clips' captions, and image-to-video condition
sets, added to a finished cache."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from vaecache.cli.common import console, human_bytes, report_errors
from vaecache.cli.options import StorageOption


@report_errors
def embed(
    out: str = typer.Argument(..., metavar="OUT", help="A finished cache (a folder, or s3://bucket/prefix)."),
    text_encoder: Optional[str] = typer.Option(None, "--text-encoder", help="diffusers:PATH[#SUBFOLDER] (a "
                                     "pipeline folder: its model_index.json names the family: Wan, LTX-Video, "
                                     "CogVideoX) | transformers:PATH (any encoder with its tokenizer, with "
                                     "--text-length). Local files only."),
    condition: Optional[str] = typer.Option(None, "--condition", help="KIND[,KIND]: image-to-video conditions of "
                                            "each clip's cameras from the frames encode saw: first-frame (the first "
                                            "frame then zeros) | first-last (FLF2V: first, zeros, last), encoded with "
                                            "the cache's own VAE as WanImageToVideoPipeline.prepare_latents builds "
                                            "them | image-features (the first frame through --image-encoder). One set "
                                            "per kind."),
    image_encoder: Optional[str] = typer.Option(None, "--image-encoder", help="image-features: diffusers:PATH (a "
                                                "pipeline folder with image_encoder/ and image_processor/ or "
                                                "feature_extractor/) | transformers:PATH (a CLIP or SigLIP vision "
                                                "model with its preprocessor_config.json). Local files only."),
    image_convention: Optional[str] = typer.Option(None, "--image-convention", help="image-features: "
                                                   "wan-diffusers (default: CLIP processor, hidden_states[-2], fp32) "
                                                   "| wan-musubi (bicubic squash to the image size, "
                                                   "hidden_states[-2], fp16: what musubi's export needs) | "
                                                   "wan-flf2v-diffusers (CLIP on the first and last frames as one "
                                                   "two-image batch: FLF2V's pair) | "
                                                   "framepack-diffusers (SigLIP, last_hidden_state) | "
                                                   "hunyuanvideo15-diffusers (SigLIP on the 8-bit frame, "
                                                   "last_hidden_state, fp32) | hunyuanvideo15-musubi (the same, "
                                                   "fp16: musubi's siglip)."),
    condition_pipeline: Optional[str] = typer.Option(None, "--condition-pipeline", help="first-frame/first-last: "
                                                     "the image-to-video pipeline they follow: auto (default: the "
                                                     "VAE family's own: Wan 2.1/2.2, Wan 2.2 TI2V, HunyuanVideo 1.5) | "
                                                     "kandinsky5 (a HunyuanVideo VAE cache: Kandinsky 5 I2V's image "
                                                     "latent)."),
    vae: Optional[str] = typer.Option(None, "--vae", help="--condition: another path to the cache's VAE (its "
                                      "fingerprint must be the recorded one; default the recorded --vae)."),
    kind: Optional[str] = typer.Option(None, "--kind", help="MODULE: the sets of a kind of tensor declared outside "
                                       "vaecache (a module that registers one vaecache.cache.kinds.SetKind; "
                                       "docs/architecture.md); the module is recorded, so verify and the readers "
                                       "import it."),
    audio_vae: Optional[str] = typer.Option(None, "--audio-vae", help="diffusers:PATH[#SUBFOLDER] (a folder holding "
                                            "an AutoencoderKLLTX2Audio, e.g. an LTX-2 pipeline's #audio_vae): each "
                                            "clip's sound, cut exactly to its frames, encoded into an audio set."),
    audio_camera: Optional[str] = typer.Option(None, "--audio-camera", help="--audio-vae: whose video's sound "
                                               "(default: the first camera whose video has an audio track)."),
    audio_missing: Optional[str] = typer.Option(None, "--audio-missing", help="--audio-vae: a clip without sound "
                                                "(no track, or one not covering its window): skip (default: its row "
                                                "records why, no tensor) | silence (the latents of silence, its row "
                                                "saying why)."),
    set_name: Optional[str] = typer.Option(None, "--set", help="The text set's (or --kind's, or --audio-vae's set's) "
                                           "name (default: default; a cache holds several)."),
    caption_field: Optional[str] = typer.Option(None, "--caption-field", help="The key of each clip's metadata that "
                                                "holds its caption (default: caption; clips without it get the empty "
                                                "prompt)."),
    captions: Optional[Path] = typer.Option(None, "--captions", help="Captions by clip id instead of the clips' "
                                            "metadata: a JSON object {id: caption} or .jsonl lines {\"id\", "
                                            "\"caption\"}; every clip must be named."),
    replace: bool = typer.Option(False, "--replace", help="Replace a set of this name made with another encoder or "
                                 "other captions (without it that is refused)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Text: the stored dtype, fp32 (default) | bf16 | fp16 "
                                        "(a condition is stored in the VAE's dtype)."),
    compute_dtype: Optional[str] = typer.Option(None, "--compute-dtype", help="Text: what the encoder computes in "
                                                "(recorded): fp32 (default) | bf16."),
    text_batch: Optional[int] = typer.Option(None, "--text-batch", help="Prompts per forward (default 8), a fixed "
                                             "shape (recorded: the bits do not depend on anything else)."),
    text_length: Optional[int] = typer.Option(None, "--text-length", help="transformers:PATH: tokens per prompt."),
    text_layer: Optional[int] = typer.Option(None, "--text-layer", help="transformers:PATH: the hidden state to "
                                             "store (index into hidden_states; default the last hidden state)."),
    text_convention: Optional[str] = typer.Option(None, "--text-convention", help="pipeline (default: the "
                                                  "pipeline's own prompt embedding, diffusers') | musubi "
                                                  "(musubi-tuner's, where it embeds otherwise: HunyuanVideo and "
                                                  "FramePack (CLIP tokenized by its pinned transformers' slow class), "
                                                  "HunyuanVideo 1.5, Kandinsky 5: what its text caches hold)."),
    k5_template: Optional[str] = typer.Option(None, "--k5-template", help="Kandinsky 5 with --text-convention "
                                              "musubi: video (default: the template musubi's sampling uses) | image "
                                              "(what musubi's caching script embeds with: its items have no frame "
                                              "count)."),
    shard_size: str = typer.Option("256MiB", "--shard-size", help="Bytes per embeddings shard; a condition shard "
                                   "holds clips of this many bytes of float32 latents."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda[:N]."),
    allow_pickle_weights: bool = typer.Option(False, "--allow-pickle-weights", help="Load an encoder whose folder "
                                              "holds only pickled .bin weights."),
    storage_option: StorageOption = None,
) -> None:
    """Embed the clips' captions with a text encoder into a named set (--text-encoder), their image-to-video
    conditions (--condition), and/or their sound with an audio VAE (--audio-vae), in a finished cache; latents
    untouched. Under torchrun or SLURM the shards are split
    across the ranks (the same files at any world size)."""
    from vaecache.audio.embed import AUDIO, AudioRequest, embed_audio
    from vaecache.cache.embedding import embed_kind
    from vaecache.cache.kinds import SetRequest
    from vaecache.conditions.embed import embed_conditions
    from vaecache.conditions.sets import ConditionRequest
    from vaecache.distributed.context import distributed
    from vaecache.errors import UsageError
    from vaecache.settings.options import parse_bytes
    from vaecache.text.embed import embed_cache
    from vaecache.text.sets import EmbedRequest
    from vaecache.urls import parse_storage_options

    text_only = {"--set": None if kind is not None or audio_vae is not None else set_name,
                 "--caption-field": caption_field,
                 "--captions": captions, "--dtype": dtype,
                 "--compute-dtype": compute_dtype, "--text-batch": text_batch, "--text-length": text_length,
                 "--text-layer": text_layer, "--text-convention": text_convention, "--k5-template": k5_template}
    given = [flag for flag, value in text_only.items() if value is not None]
    if text_encoder is None and given:
        raise UsageError(f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to --text-encoder (the text set)")
    kinds = [part.strip() for part in (condition or "").split(",")]
    if "image-features" not in kinds and (image_encoder is not None or image_convention is not None):
        raise UsageError(f"{'--image-encoder' if image_encoder is not None else '--image-convention'} applies to "
                         "--condition image-features")
    if vae is not None and not {"first-frame", "first-last"} & set(kinds):
        raise UsageError("--vae applies to --condition first-frame or first-last (the kinds the cache's VAE encodes)")
    if condition_pipeline is not None and not {"first-frame", "first-last"} & set(kinds):
        raise UsageError("--condition-pipeline applies to --condition first-frame or first-last")
    if audio_vae is None and (audio_camera is not None or audio_missing is not None):
        raise UsageError(f"{'--audio-camera' if audio_camera is not None else '--audio-missing'} applies to "
                         "--audio-vae")
    if set_name is not None and sum(given is not None for given in (text_encoder, kind, audio_vae)) > 1:
        raise UsageError("--set names one set: give it with one of --text-encoder, --kind and --audio-vae")
    if text_encoder is None and condition is None and kind is None and audio_vae is None:
        raise UsageError("embed needs --text-encoder SPEC (caption embeddings) and/or --condition KIND "
                         "(image-to-video conditions), --audio-vae SPEC (audio latents), or --kind MODULE")
    storage = tuple(parse_storage_options(storage_option))
    request = None if text_encoder is None else EmbedRequest(
        out=out, text_encoder=text_encoder, set_name=set_name or "default", caption_field=caption_field or "caption",
        captions=captions, replace=replace, dtype=dtype or "fp32", compute_dtype=compute_dtype or "fp32",
        batch=8 if text_batch is None else text_batch, shard_bytes=parse_bytes(shard_size), device=device,
        length=text_length, layer=text_layer, allow_pickle_weights=allow_pickle_weights, storage_options=storage,
        convention=text_convention or "pipeline", k5_template=k5_template)
    conditions = None if condition is None else ConditionRequest(
        out=out, kinds=condition, replace=replace, shard_bytes=parse_bytes(shard_size), device=device, vae=vae,
        allow_pickle_weights=allow_pickle_weights, storage_options=storage, image_encoder=image_encoder,
        image_convention=image_convention or "wan-diffusers", pipeline=condition_pipeline or "auto")
    declared = None if kind is None else SetRequest(
        out=out, module=kind, set_name=set_name or "default", replace=replace, shard_bytes=parse_bytes(shard_size),
        device=device, storage_options=storage)
    declared_kind = declared.kind() if declared is not None else None
    sound = None if audio_vae is None else AudioRequest(
        out=out, audio_vae=audio_vae, camera=audio_camera, missing=audio_missing or "skip",
        set_name=set_name or "default", replace=replace, shard_bytes=parse_bytes(shard_size), device=device,
        allow_pickle_weights=allow_pickle_weights, storage_options=storage)
    with distributed(device=device) as ctx:  # under torchrun the shards are split across the ranks
        summary = embed_cache(request, ctx=ctx) if request is not None else None
        condition_summaries = embed_conditions(conditions, ctx=ctx) if conditions is not None else []
        outcomes = embed_kind(declared, ctx=ctx) if declared is not None else []
        audio_outcomes = embed_audio(sound, ctx=ctx) if sound is not None else []
        if ctx.info.rank != 0:
            return
    if summary is not None:
        _print_text_summary(summary)
    for done in condition_summaries:
        _print_condition_summary(done)
    for outcome in outcomes:
        _print_kind_summary(declared_kind, outcome)
    for outcome in audio_outcomes:
        _print_kind_summary(AUDIO, outcome)
        left = {key: value for key, value in outcome.extra.items() if key in ("skipped", "silenced") and value}
        if left:
            console.print(escape("  clips without sound: " + ", ".join(f"{count} {what}" for what, count in
                                                                        left.items())), soft_wrap=True)
        named = outcome.extra.get("without_sound") or []
        for clip, reason in named:
            console.print(escape(f"    {clip}: {reason}"), soft_wrap=True)
        more = sum(left.values()) - len(named)
        if more > 0:
            console.print(escape(f"    ... and {more} more (vaecache inspect {outcome.extra.get('out')} lists them)"),
                          soft_wrap=True)


def _print_condition_summary(summary) -> None:
    if summary.unchanged:
        console.print(escape(f"condition set {summary.kind!r} of {summary.out} is up to date ({summary.clips} clips, "
                             f"{summary.views} views): nothing written"), soft_wrap=True)
        return
    verb = ("repaired" if summary.repaired and not (summary.replaced or summary.updated) else
            "replaced" if summary.replaced else "updated" if summary.updated else "added")
    console.print(escape(f"{verb} condition set {summary.kind!r} in {summary.out}: {summary.clips} clips, "
                         f"{summary.views} views, {summary.files} files, {human_bytes(summary.bytes)}, "
                         f"{summary.seconds:.1f} s"), soft_wrap=True)
    _print_work(summary, "clip(s)")
    for event in summary.backoffs[:3]:
        console.print(escape(f"  {event}"), soft_wrap=True)
    if summary.tiled_clips:
        console.print(escape(f"  {len(summary.tiled_clips)} clip(s) needed the VAE's tiling for their {summary.kind} "
                             f"condition (out of memory untiled; recorded per camera), e.g. "
                             f"{', '.join(summary.tiled_clips[:3])}"), soft_wrap=True)


def _print_text_summary(summary) -> None:
    if summary.unchanged:
        console.print(escape(f"text set {summary.set_name!r} of {summary.out} is up to date ({summary.clips} clips, "
                             f"{summary.prompts} distinct prompts): nothing written"), soft_wrap=True)
        return
    verb = ("repaired" if summary.repaired and not (summary.replaced or summary.updated) else
            "replaced" if summary.replaced else "updated" if summary.updated else "added")
    console.print(escape(f"{verb} text set {summary.set_name!r} in {summary.out}: {summary.clips} clips, "
                         f"{summary.prompts} distinct prompts ({summary.empty_clips} clips with the empty prompt), "
                         f"{summary.files} files, {human_bytes(summary.bytes)}, {summary.seconds:.1f} s"),
                  soft_wrap=True)
    _print_work(summary, "prompt(s)")
    if summary.empty_clips:
        console.print(escape(f"  {summary.empty_clips} clip(s) have no caption (missing, null or empty) and the empty "
                             f"prompt, e.g. {', '.join(summary.empty_examples)}"), soft_wrap=True)
    if summary.truncated_prompts:
        console.print(escape(f"  {summary.truncated_prompts} prompt(s) were longer than the encoder's length and "
                             f"truncated, e.g. clip(s) {', '.join(summary.truncated_examples)}"), soft_wrap=True)


def _print_kind_summary(kind, outcome) -> None:
    what = f"{kind.what} {outcome.name!r}"
    if outcome.unchanged:
        console.print(escape(f"{what} of {outcome.extra['out']} is up to date: nothing written"), soft_wrap=True)
        return
    verb = ("repaired" if outcome.repaired and not (outcome.replaced or outcome.updated) else
            "replaced" if outcome.replaced else "updated" if outcome.updated else "added")
    record = outcome.record
    size = sum(s["bytes"] for s in record["shards"]) + sum(t["bytes"] for t in record["tables"].values())
    console.print(escape(f"{verb} {what} in {outcome.extra['out']}: {len(record['shards'])} shard(s), "
                         f"{human_bytes(size)}"), soft_wrap=True)
    _print_work(outcome, "item(s)")


def _print_work(summary, items: str) -> None:
    """What ran the encoder, and what was kept, copied or repaired instead."""
    parts = [f"{summary.computed} {items} computed"]
    if summary.copied:
        parts.append(f"{summary.copied} copied from the set before")
    if summary.resumed:
        parts.append(f"{summary.resumed} shard(s) an interrupted run committed kept")
    console.print(escape("  " + ", ".join(parts)), soft_wrap=True)
    if summary.repaired:
        console.print(escape(f"  {len(summary.repaired)} shard(s) missing or damaged, computed again: "
                             f"{', '.join(summary.repaired[:3])}{' ...' if len(summary.repaired) > 3 else ''}"),
                      soft_wrap=True)
