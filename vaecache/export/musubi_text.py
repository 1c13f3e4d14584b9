"""musubi-tuner's text-encoder caches: which text set each architecture's caching would have made, and its files
(dataset/cache_io.py's save_text_encoder_output_cache_*, musubi-tuner commit 30c658c)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from vaecache.errors import ExportError
from vaecache.export.common import safetensors_bytes, write_new_file

if TYPE_CHECKING:
    import torch

    from vaecache.export.musubi import MusubiArch

MUSUBI_FORMAT_VERSION = "1.0.1"
"""musubi-tuner's cache `format_version` metadata (dataset/cache_io.py, save_latent_cache_common)."""


MUSUBI_TEXT_FAMILIES = {"wan": ("wan",), "hv": ("hunyuanvideo-musubi", "hunyuanvideo"),
                        "fp": ("hunyuanvideo-musubi", "hunyuanvideo"), "hv15": ("hunyuanvideo-1.5-musubi",),
                        "k5": ("kandinsky5-musubi",)}
"""The text-set families whose embeddings each musubi architecture's text-encoder cache holds (the first is musubi's
own; HunyuanVideo's diffusers set differs from it only in CLIP's tokenization: see `check_clip_tokenization`)."""


def musubi_text_set(cache: Any, spec: MusubiArch, text_set: str, where: Path | str) -> Any:
    """The TextSet to export as musubi text-encoder caches, or None ("none", or "auto" without exactly one set); an
    ExportError where musubi keeps no such cache for the architecture or the set is not the family's."""
    names = cache.text_sets
    if text_set == "none" or (text_set == "auto" and len(names) != 1):
        return None
    name = names[0] if text_set == "auto" else text_set
    if name not in names:
        raise ExportError(f"{where}: no text set {name!r} (sets: {', '.join(names) or 'none'})")
    texts = cache.sets()["text"][name]  # the kind's reader, as LatentCache's items read it
    if spec.short == "k5" and texts.family == "kandinsky5":
        raise ExportError(f"{where}: text set {name!r} holds diffusers' Kandinsky 5 conditioning, which is not "
                          "musubi-tuner's: its kandinsky5/models/text_embedders.py uses the authors' template ('promt "
                          "engineer'), crop 129 and the caption as given, so its text caches would differ; embed a "
                          "set with --text-convention musubi (or pass --text-set none)")
    if spec.short == "hv15" and texts.family == "hunyuanvideo-1.5":
        raise ExportError(f"{where}: text set {name!r} holds diffusers' HunyuanVideo 1.5 conditioning, which is not "
                          "musubi-tuner's: its hunyuan_video_1_5_text_encoder.py uses another system-message layout "
                          "and crop, and ByT5 at 128 tokens with another glyph order, so its text caches would differ; "
                          "embed a set with --text-convention musubi (or pass --text-set none)")
    if texts.family not in MUSUBI_TEXT_FAMILIES.get(spec.short, ()):
        raise ExportError(f"{where}: text set {name!r} ({texts.family or 'unknown'} family) cannot be exported for "
                          f"--arch {spec.short}: musubi-tuner's text caches vaecache writes are Wan's (varlen_t5, "
                          "from a wan set), HunyuanVideo's and FramePack's (llm and clipL, from a hunyuanvideo set) "
                          "and HunyuanVideo 1.5's and Kandinsky 5's (from sets embedded with --text-convention "
                          "musubi); pass --text-set none")
    check_clip_tokenization(cache, texts, where)
    return texts


def check_clip_tokenization(cache: Any, texts: Any, where: Path | str) -> None:
    """musubi tokenizes CLIP prompts with its pinned transformers' slow class (vaecache.text.clip_slow); a set whose
    CLIP rows came from the tokenizers-backed class (diffusers' convention, or a musubi set embedded before vaecache
    0.7) holds musubi's rows only for prompts both tokenize alike: an ExportError names the first clip whose prompt
    they do not (curly quotes, HTML entities, full-width characters)."""
    from vaecache.text import clip_slow

    pooled = (texts.entry.get("fingerprint") or {}).get("pooled_encoder") or {}
    if not texts.pooled_length or (pooled.get("tokenization") or {}).get("name") == clip_slow.NAME:
        return
    for record in cache.records():
        text = texts.text(record["id"])
        if not clip_slow.tokenized_alike(text):
            raise ExportError(f"{where}: text set {texts.name!r}: clip {record['id']}'s prompt {text[:60]!r} is "
                              "tokenized otherwise by musubi-tuner's CLIP (its pinned transformers' slow "
                              "CLIPTokenizer runs ftfy.fix_text first), so its pooled output differs from musubi's: "
                              "embed the set again with --text-convention musubi --replace")


def write_text_cache(folder: Path, texts: Any, spec: MusubiArch, item: str, clip: str,
                      written: dict[str, tuple[str, str]]) -> int:
    """`cache/<item>_<arch>_te.safetensors` as musubi's save_text_encoder_output_cache_wan writes it
    (dataset/cache_io.py: `varlen_t5_<dtype>`, the prompt's rows; metadata architecture, caption1, format_version),
    once per item; an ExportError where two clips of one item have different prompts (musubi keeps one caption
    per item: it would train one clip on the other's caption). Returns the bytes written (0: already written)."""
    key = texts.key(clip)
    if item in written:
        if written[item][0] != key:
            raise ExportError(f"musubi item {item}: clips {written[item][1]} and {clip} have different captions in "
                              f"text set {texts.name!r}; musubi-tuner keeps one caption per item (video), so they "
                              "cannot be exported together: split the scene, or export without --text-set")
        return 0
    data = safetensors_bytes(musubi_text_tensors(spec, texts, clip),
                             {"architecture": spec.full, "caption1": texts.text(clip),
                              "format_version": MUSUBI_FORMAT_VERSION})
    write_new_file(folder / "cache" / f"{item}_{spec.short}_te.safetensors", data)
    written[item] = (key, clip)
    return len(data)


def musubi_text_tensors(spec: MusubiArch, texts: Any, clip: str) -> dict[str, torch.Tensor]:
    """A clip's text-encoder cache tensors in musubi's keys (dataset/cache_io.py): Wan's
    save_text_encoder_output_cache_wan, `varlen_t5_<dtype>` (the prompt's rows); HunyuanVideo's
    save_text_encoder_output_cache, called for the LLM and for CLIP-L: `llm_<dtype>` (every row of the 256, as its
    TextEncoder.encode crops them), `llm_mask` (the cropped attention mask, int64 as the tokenizer returns it),
    `clipL_<dtype>` (the pooled output) and `clipL_mask` (CLIP's attention mask over its 77 tokens); HunyuanVideo
    1.5's save_text_encoder_output_cache_hunyuan_video_1_5: `varlen_vl_embed_<dtype>` (Qwen2.5-VL's rows trimmed to
    the mask, as hv_1_5_cache_text_encoder_outputs.py trims them) and `varlen_byt5_embed_<dtype>` (ByT5's rows of the
    glyph text trimmed to its mask: none where the prompt quotes nothing); Kandinsky 5's
    save_text_encoder_output_cache_kandinsky5: `text_embeds_<dtype>` (the rows trimmed to the mask),
    `pooled_embed_<dtype>` (CLIP's pooled output) and `attention_mask` (bool, one per row, as its caching keeps it)."""
    import torch

    def dtype_name(tensor: torch.Tensor) -> str:
        return str(tensor.dtype).removeprefix("torch.")

    if spec.short == "wan":
        rows = texts.rows(clip)
        return {f"varlen_t5_{dtype_name(rows)}": rows.contiguous()}
    if spec.short == "fp":  # save_text_encoder_output_cache_framepack, from a HunyuanVideo set
        from vaecache.export.framepack import framepack_text_tensors

        return framepack_text_tensors(texts, clip)
    if spec.short == "k5":  # save_text_encoder_output_cache_kandinsky5: the rows, the pooled output, a bool mask
        rows, pooled = texts.rows(clip), texts.pooled(clip)
        return {f"text_embeds_{dtype_name(rows)}": rows.contiguous(),
                f"pooled_embed_{dtype_name(pooled)}": pooled.contiguous(),
                "attention_mask": torch.ones(rows.shape[0], dtype=torch.bool)}
    if spec.short == "hv15":
        rows, glyph = texts.rows(clip), texts.glyph(clip)
        return {f"varlen_vl_embed_{dtype_name(rows)}": rows.contiguous(),
                f"varlen_byt5_embed_{dtype_name(glyph)}": glyph.contiguous()}
    embeds, mask = texts.padded(clip)
    pooled = texts.pooled(clip)
    clip_mask = torch.zeros(texts.pooled_length, dtype=torch.int64)
    clip_mask[:texts.pooled_tokens(clip)] = 1
    return {f"llm_{dtype_name(embeds)}": embeds.contiguous(), "llm_mask": mask.to(torch.int64),
            f"clipL_{dtype_name(pooled)}": pooled.contiguous(), "clipL_mask": clip_mask}


__all__ = ["MUSUBI_FORMAT_VERSION", "MUSUBI_TEXT_FAMILIES", "check_clip_tokenization", "musubi_text_set",
           "musubi_text_tensors", "write_text_cache"]
