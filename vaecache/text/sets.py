"""Named sets of text embeddings in a finished cache: written by `vaecache embed`, read by LatentCache, checked by
verify. Everything goes through OUT's store (vaecache.cache.store), so a folder and an s3:// cache are one code path.

OUT/text/<set>/<generation>/
  embeddings-00000.safetensors  one tensor per distinct cleaned prompt, named by the sha256 of its text:
                                (tokens, hidden) in the stored dtype, rows trimmed to the attention mask
                                HunyuanVideo's sets also hold `<sha256>/pooled`: CLIP-L's pooled output, (hidden,);
                                HunyuanVideo 1.5's `<sha256>/glyph`: ByT5's rows of its quoted text, (glyph tokens,
                                hidden), none where it quotes nothing
  prompts.parquet               key, text (cleaned), tokens, truncated, shard (and pooled_tokens, pooled_truncated)
  clips.parquet                 id, key: every clip of the cache, in the clip table's order

manifest.json's "text" object holds each set: its fingerprint (the encoder, tokenizer and weights' sha256,
length, layer, dtypes, cleaning, batch shape), where its captions came from, counts, and every file with its
byte count and sha256. The generation is a hash of the fingerprint and the (clip, prompt) pairs: the same
inputs write the same files. A set becomes part of the cache when the manifest naming it is written (one atomic
write); what a crash leaves before that is not listed, and verify names it until the next embed removes it.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from vaecache.cache.layout import MANIFEST, TEXT_DIR
from vaecache.cache.sets import (
    SetShards,
    pack_shards,
)
from vaecache.errors import DatasetError, ManifestError, UsageError, first_line

SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
EMBEDDINGS_PREFIX = "embeddings-"
PROMPTS_TABLE = "prompts.parquet"
CLIPS_TABLE = "clips.parquet"
DEFAULT_SHARD_BYTES = 256 << 20
POOLED_SUFFIX = "/pooled"
"""A prompt's pooled output is stored beside its rows as `<sha256>/pooled` (HunyuanVideo's CLIP-L)."""
GLYPH_SUFFIX = "/glyph"
"""A prompt's glyph rows are stored beside its rows as `<sha256>/glyph` (HunyuanVideo 1.5's ByT5)."""


def check_set_name(name: str) -> str:
    if not isinstance(name, str) or not SET_NAME.fullmatch(name):
        raise UsageError(f"--set must be 1-64 letters, digits, '.', '_' or '-' (starting with a letter or digit), "
                         f"got {name!r}")
    return name


STAT_NAMES = ("min", "max", "mean", "std")
"""Per-prompt statistics of its stored rows (and of its pooled output: pooled_min, ...), columns of the prompt table
(cache.writer.tensor_stats); sets embedded before they were recorded have none."""


def prompt_key(cleaned: str) -> str:
    return hashlib.sha256(cleaned.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class EmbedRequest:
    """What `vaecache embed` was asked to do (validated here; the CLI only parses)."""

    out: str
    text_encoder: str
    set_name: str = "default"
    caption_field: str = "caption"
    captions: Path | None = None
    require_caption_field: bool = True
    """A caption field no clip's metadata has is refused (a typo); encode's embed, which has no --caption-field,
    embeds a dataset without captions as the empty prompt instead."""
    replace: bool = False
    dtype: str = "fp32"
    compute_dtype: str = "fp32"
    batch: int = 8
    shard_bytes: int = DEFAULT_SHARD_BYTES
    device: str = "auto"
    length: int | None = None
    layer: int | None = None
    allow_pickle_weights: bool = False
    storage_options: tuple[tuple[str, Any], ...] = ()
    convention: str = "pipeline"
    """--text-convention: the pipeline's embedding, or musubi-tuner's (HunyuanVideo's CLIP, HunyuanVideo 1.5,
    Kandinsky 5)."""
    k5_template: str | None = None
    """--k5-template: Kandinsky 5 in musubi's convention with its video template (None, "video") or its image one."""

    def __post_init__(self) -> None:
        from vaecache.settings.dtypes import check_dtype_name
        from vaecache.text.families import TEXT_CONVENTIONS, check_text_spec, musubi_templates

        if self.convention not in TEXT_CONVENTIONS:
            raise UsageError(f"--text-convention must be one of {', '.join(TEXT_CONVENTIONS)}, got {self.convention!r}")
        if self.k5_template is not None and self.k5_template not in musubi_templates():
            raise UsageError(f"--k5-template must be one of {', '.join(musubi_templates())}, got {self.k5_template!r}")

        check_text_spec(self.text_encoder)
        check_set_name(self.set_name)
        check_dtype_name(self.dtype)
        check_dtype_name(self.compute_dtype)
        if not self.caption_field or not isinstance(self.caption_field, str):
            raise UsageError("--caption-field must name a key of the clips' metadata")
        if self.batch < 1:
            raise UsageError(f"--text-batch must be >= 1, got {self.batch}")
        if self.shard_bytes < 1:
            raise UsageError(f"--shard-size must be at least 1 byte, got {self.shard_bytes}")
        if self.length is not None and self.length < 1:
            raise UsageError(f"--text-length must be >= 1, got {self.length}")


# ----------------------------------------------------------------------------- captions


def record_caption(record: dict[str, Any], caption_field: str) -> tuple[Any, dict[str, Any]]:
    """(its caption or None, its metadata) of one clip record: metadata[caption_field], the metadata a JSON object or
    its text (anything else holds no caption)."""
    metadata = record.get("metadata") or {}
    if isinstance(metadata, str):
        metadata = json.loads(metadata)
    if not isinstance(metadata, dict):
        metadata = {}
    return metadata.get(caption_field), metadata


def clip_captions(records: Iterable[dict[str, Any]], caption_field: str, captions: dict[str, str | None] | None,
                  require_field: bool = True) -> Iterator[tuple[str, str]]:
    """(clip id, caption) for every clip, in table order, as the records stream by: from `captions` (clip id ->
    text) where given, else from each clip's metadata[caption_field]; a clip without one (no such key, null or "")
    gets the empty prompt. A caption that is not text, a --caption-field that no clip's metadata has (a typo would
    embed every clip as the empty prompt; unless not `require_field`: encode's embed, which has no --caption-field,
    embeds a dataset without captions as the empty prompt), or a captions mapping that misses a clip or names one
    the cache lacks, is a DatasetError naming them (raised once the records are read: nothing is written before)."""
    seen = 0
    field_found = False
    first_fields: list[str] | None = None
    matched: set[str] = set()  # with a captions file only (as large as the file's mapping)
    missing: list[str] = []
    for record in records:
        clip = record["id"]
        seen += 1
        if captions is not None:
            matched.add(clip)
            if clip not in captions:
                if len(missing) < 4:
                    missing.append(clip)
                else:
                    missing.append("")
                continue
            text = captions[clip]
        else:
            text, metadata = record_caption(record, caption_field)
            if first_fields is None:
                first_fields = sorted(metadata)
            field_found = field_found or caption_field in metadata
        if text is not None and not isinstance(text, str):
            raise DatasetError(f"clip {clip}: its {caption_field!r} is {type(text).__name__}, not text")
        yield clip, text or ""
    if captions is None and seen and not field_found and require_field:
        fields = ", ".join(first_fields or []) or "none"
        raise DatasetError(f"--caption-field {caption_field!r}: no clip's metadata has it (the first clip's has: "
                           f"{fields[:200]})")
    if missing:
        named = [clip for clip in missing if clip]
        raise DatasetError(f"the captions file has no caption for {len(missing)} clip(s) of the cache: "
                           f"{', '.join(named[:3])}{' ...' if len(missing) > 3 else ''}")
    if captions is not None and len(captions) > seen - len(missing):
        extra = sorted(clip for clip in captions if clip not in matched)
        raise DatasetError(f"the captions file names {len(extra)} clip(s) the cache does not hold: "
                           f"{', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}")


def plan_prompts(pairs: Iterable[tuple[str, str]], clean: Any, clip_keys: list[tuple[str, str]]) -> dict[str, str]:
    """Each (clip, caption) cleaned and keyed by the sha256 of its cleaned text, appended to `clip_keys` as (clip,
    key); returns the distinct cleaned prompts by key. Streams: a caption repeated by nearby clips (a scene's
    cameras and clips) is cleaned once (an LRU of 65536 captions), and every clip's key is the one string of its
    prompt: ~210 bytes a clip on rank 0 (scripts/bench_text.py --plan-clips)."""
    cleaned: dict[str, str] = {}
    interned: dict[str, str] = {}

    @functools.lru_cache(maxsize=1 << 16)
    def key_of(caption: str) -> str:
        text = clean(caption)
        key = prompt_key(text)
        cleaned.setdefault(key, text)
        return interned.setdefault(key, key)

    for clip, caption in pairs:
        clip_keys.append((clip, key_of(caption)))
    return cleaned


class _Pairs(list):
    """A JSON object as its (key, value) pairs, in file order (json's object_pairs_hook): duplicates kept to be
    named."""


def read_captions_file(path: Path) -> tuple[dict[str, str | None], dict[str, Any]]:
    """A --captions FILE: a JSON object {clip id: caption} or JSON Lines {"id": ..., "caption": ...}. Returns the
    mapping and the file's identity (name, bytes, sha256: recorded with the set). Read whole, so only a regular file
    of at most half the machine's memory (a FIFO would block, /dev/zero never end); a clip named twice, in either
    form, or a line without "caption" is a DatasetError naming the file, the line and the clip."""
    data = _read_bounded(path)
    identity = {"kind": "file", "path": str(path.resolve()), "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest()}
    try:
        text = data.decode("utf-8")
        mapping: dict[str, Any] = {}
        if path.suffix == ".jsonl":
            for number, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("id"), str):
                    raise DatasetError(f"{path}:{number}: each line must be an object with a text \"id\"")
                if row["id"] in mapping:
                    raise DatasetError(f"{path}:{number}: clip {row['id']} is captioned twice")
                if "caption" not in row:
                    raise DatasetError(f"{path}:{number}: clip {row['id']} has no \"caption\" (null or \"\" for the "
                                       "empty prompt)")
                mapping[row["id"]] = row["caption"]
        else:
            parsed = json.loads(text, object_pairs_hook=_Pairs)
            if not isinstance(parsed, _Pairs):
                raise DatasetError(f"{path}: a captions file is a JSON object {{clip id: caption}} (or .jsonl lines)")
            for clip, caption in parsed:
                if clip in mapping:
                    raise DatasetError(f"{path}: clip {clip} is captioned twice")
                mapping[clip] = dict(caption) if isinstance(caption, _Pairs) else caption
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise DatasetError(f"{path}: the captions file does not parse ({first_line(exc, 200)})") from None
    for clip, caption in mapping.items():
        if caption is not None and not isinstance(caption, str):
            raise DatasetError(f"{path}: the caption of clip {clip} is {type(caption).__name__}, not text")
    return mapping, identity


def _read_bounded(path: Path) -> bytes:
    import stat

    from vaecache.text.encoder import machine_memory

    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise DatasetError(f"{path}: --captions is not a regular file (a pipe, a device or a folder), so it "
                               "cannot be read whole")
        limit = machine_memory() // 2 or 1 << 34
        if info.st_size > limit:
            raise DatasetError(f"{path}: the captions file is {info.st_size} bytes, more than half this machine's "
                               f"memory ({limit} bytes): split it, or caption the clips in their metadata")
        with open(path, "rb") as handle:
            data = handle.read(info.st_size + 1)
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read the captions file ({exc.strerror or exc})") from None
    if len(data) != info.st_size:
        raise DatasetError(f"{path}: the captions file changed while it was read ({info.st_size} bytes, then "
                           f"{len(data)})")
    return data


# ----------------------------------------------------------------------------- writing


# ----------------------------------------------------------------------------- reading


def text_set_names(manifest: dict[str, Any]) -> list[str]:
    return sorted((manifest.get("text") or {}))


class TextSet:
    """One set of a finished cache, read through its store: `rows(clip)` -> (tokens, hidden), `padded(clip)` ->
    the pipeline's tensor (zeros to the family's length) and its mask."""

    def __init__(self, store: Any, manifest: dict[str, Any], name: str, verify: str = "size") -> None:
        import pyarrow.parquet as pq

        self.verify = verify
        entries = manifest.get("text") or {}
        if name not in entries:
            raise KeyError(f"{store.location}: no text set {name!r} (sets: {', '.join(sorted(entries)) or 'none'})")
        self.name, self.entry, self.store = name, entries[name], store
        fingerprint = self.entry.get("fingerprint") or {}
        self.length = int(fingerprint.get("length") or 0)
        self.hidden_size = int(fingerprint.get("hidden_size") or 0)
        tables = self.entry.get("tables") or {}
        try:
            clips = pq.read_table(io.BytesIO(store.read(_entry_file(store, name, tables.get("clips")))))
            prompts = pq.read_table(io.BytesIO(store.read(_entry_file(store, name, tables.get("prompts")))))
        except FileNotFoundError as exc:
            raise ManifestError(f"{store.location}: text set {name!r}: a table is missing ({exc})") from None
        self._key_of = dict(zip(clips.column("id").to_pylist(), clips.column("key").to_pylist()))
        self._own_key = own_prompt_key(self.entry, clips)
        self._shard_of = dict(zip(prompts.column("key").to_pylist(), prompts.column("shard").to_pylist()))
        self._text_of = dict(zip(prompts.column("key").to_pylist(), prompts.column("text").to_pylist()))
        self._tokens_of = dict(zip(prompts.column("key").to_pylist(), prompts.column("tokens").to_pylist()))
        self.pooled_hidden_size = int((fingerprint.get("pooled") or {}).get("hidden_size") or 0)
        self.pooled_length = int((fingerprint.get("pooled") or {}).get("length") or 0)
        self._pooled_tokens_of = (dict(zip(prompts.column("key").to_pylist(),
                                           prompts.column("pooled_tokens").to_pylist()))
                                  if "pooled_tokens" in prompts.column_names else {})
        self.glyph_hidden_size = int((fingerprint.get("glyph") or {}).get("hidden_size") or 0)
        self.glyph_length = int((fingerprint.get("glyph") or {}).get("length") or 0)
        self._glyph_tokens_of = (dict(zip(prompts.column("key").to_pylist(),
                                          prompts.column("glyph_tokens").to_pylist()))
                                 if "glyph_tokens" in prompts.column_names else {})
        self._shards = SetShards(store, self.entry, verify, f"text set {name!r}")
        self.family = str(fingerprint.get("family") or "")
        self.padding = str(fingerprint.get("padding") or "right")
        self.features = fingerprint.get("features") if isinstance(fingerprint.get("features"), dict) else None
        """LTX-2's: {"extractor", "layers", "video_width", "audio_width"}; else None."""

    def key(self, clip: str) -> str:
        try:
            return self._key_of[clip]
        except KeyError:
            raise KeyError(f"clip {clip} has no embedding in text set {self.name!r}") from None

    def check_record(self, record: dict[str, Any]) -> None:
        """The prompt the set links clip `record` to is its own caption's (one hash, by the recorded cleaning), as
        LatentCache reads it: a set whose clip table was remapped (and its hash recomputed) is refused here, not
        handed to training. Nothing is checked where the cleaning cannot be repeated (verify's note says why)."""
        if self._own_key is None or self.verify == "none":
            return
        clip = record["id"]
        linked, own = self.key(clip), self._own_key(record)
        if own is not None and linked != own:
            raise ManifestError(f"{self.store.location}: text set {self.name!r}: clip {clip} is linked to prompt "
                                f"{linked[:12]}, but its own caption is prompt {own[:12]} (the set's clip table was "
                                "changed): `vaecache verify` names every such clip; embed the set again with --replace")

    def prompt_keys(self) -> list[str]:
        return list(self._shard_of)

    def prompt_text(self, key: str) -> str:
        return self._text_of[key]

    def key_rows(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)

    def key_tensor(self, name: str, key: str) -> torch.Tensor:
        """The tensor `name` stored in the shard of prompt `key` (its rows, or `<key>/glyph`)."""
        return self._handle(key).get_tensor(name)

    def _handle(self, key: str) -> Any:
        """The (cached) handle of the shard holding prompt `key`."""
        return self._shards.open(self._shard_of[key], f"prompt {key[:12]}")

    def tokens(self, clip: str) -> int:
        """The clip's prompt's token count (the rows its mask marks)."""
        return int(self._tokens_of.get(self.key(clip)) or 0)

    def text(self, clip: str) -> str:
        """The clip's prompt as embedded (after the family's cleaning)."""
        return self._text_of.get(self.key(clip), "")

    def rows(self, clip: str) -> torch.Tensor:
        key = self.key(clip)
        if key not in self._shard_of:
            raise ManifestError(f"{self.store.location}: text set {self.name!r}: prompt {key[:12]} of clip {clip} "
                                "is in no shard")
        return self.key_rows(key)

    def pooled(self, clip: str) -> torch.Tensor:
        """The clip's prompt's pooled output (HunyuanVideo's CLIP-L pooler_output), (hidden,)."""
        key = self.key(clip)
        if not self.pooled_hidden_size:
            raise KeyError(f"text set {self.name!r} ({self.family} family) stores no pooled output")
        if key not in self._shard_of:
            raise ManifestError(f"{self.store.location}: text set {self.name!r}: prompt {key[:12]} of clip {clip} "
                                "is in no shard")
        return self._handle(key).get_tensor(f"{key}{POOLED_SUFFIX}")

    def glyph(self, clip: str) -> torch.Tensor:
        """The glyph encoder's rows of the clip's prompt's quoted text (HunyuanVideo 1.5's ByT5), (glyph tokens,
        hidden): none where it quotes nothing."""
        key = self.key(clip)
        if not self.glyph_hidden_size:
            raise KeyError(f"text set {self.name!r} ({self.family} family) stores no glyph rows")
        if key not in self._shard_of:
            raise ManifestError(f"{self.store.location}: text set {self.name!r}: prompt {key[:12]} of clip {clip} "
                                "is in no shard")
        return self._handle(key).get_tensor(f"{key}{GLYPH_SUFFIX}")

    def glyph_tokens(self, clip: str) -> int:
        return int(self._glyph_tokens_of.get(self.key(clip)) or 0)

    def pooled_tokens(self, clip: str) -> int:
        """The clip's prompt's token count for the pooled encoder (its attention mask's ones)."""
        return int(self._pooled_tokens_of.get(self.key(clip)) or 0)

    def item(self, clip: str) -> dict[str, torch.Tensor]:
        """What LatentCache's item holds of this set: text/<set> and text_mask/<set> as the pipeline returns them,
        text_pooled/<set> where the family has a pooled output, text_glyph/<set> and text_glyph_mask/<set> where it
        has glyph rows (HunyuanVideo 1.5's ByT5, zero rows to its length as the pipeline's mask leaves them unused),
        and for LTX-2 text/<set> its video features and text_audio/<set> its audio features (what its trainer calls
        video_prompt_embeds and audio_prompt_embeds)."""
        embeds, mask = self.padded(clip)
        tensors = {**feature_tensors(self.name, embeds, self.features), f"text_mask/{self.name}": mask}
        if self.pooled_hidden_size:
            tensors[f"text_pooled/{self.name}"] = self.pooled(clip)
        if self.glyph_hidden_size:
            tensors[f"text_glyph/{self.name}"], tensors[f"text_glyph_mask/{self.name}"] = pipeline_tensor(
                self.glyph(clip), self.glyph_length, self.glyph_tokens(clip))
        return tensors

    def export_tensors(self, clip: str) -> dict[str, torch.Tensor]:
        """The stored rows (and pooled output) a WebDataset sample carries; `decode` pads them again."""
        tensors = {f"text/{self.name}": self.rows(clip).contiguous()}
        if self.pooled_hidden_size:
            tensors[f"text_pooled/{self.name}"] = self.pooled(clip).contiguous()
        if self.glyph_hidden_size:
            tensors[f"text_glyph/{self.name}"] = self.glyph(clip).contiguous()
        return tensors

    def export_facts(self, clip: str) -> dict[str, Any]:
        return {"length": self.length, "tokens": self.tokens(clip),
                **({"padding": self.padding} if self.padding != "right" else {}),
                **({"features": self.features} if self.features else {}),
                **({"glyph_length": self.glyph_length, "glyph_tokens": self.glyph_tokens(clip)}
                   if self.glyph_hidden_size else {})}

    def padded(self, clip: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(length, hidden) as the pipeline returns it (Wan: zero rows after the prompt's; LTX-Video, CogVideoX:
        every row as stored) and the (length,) bool mask of the prompt's tokens."""
        return pipeline_tensor(self.rows(clip), self.length, self.tokens(clip), self.padding)


def own_prompt_key(entry: dict[str, Any], clips: Any) -> Callable[[dict[str, Any]], str | None] | None:
    """record -> the key of the clip's own caption cleaned as the set recorded (read from its metadata, or for a
    --captions set from the caption its clip table keeps; None where it keeps none), or None where this vaecache
    cannot repeat the set's cleaning (an unknown one, another ftfy)."""
    from vaecache.models.base import CLEANINGS
    from vaecache.text.families import installed_version

    fingerprint = entry.get("fingerprint") or {}
    cleaning, source = fingerprint.get("cleaning"), entry.get("captions") or {}
    if cleaning not in CLEANINGS or (cleaning == "wan" and fingerprint.get("ftfy") != installed_version("ftfy")):
        return None
    clean = functools.lru_cache(maxsize=1 << 12)(lambda text: prompt_key(CLEANINGS[cleaning](text)))
    if source.get("kind") == "file":
        if "caption" not in clips.column_names:
            return None
        kept = dict(zip(clips.column("id").to_pylist(), clips.column("caption").to_pylist()))

        def from_table(record: dict[str, Any]) -> str | None:
            text = kept.get(record["id"], 0)
            return clean(text or "") if text is None or isinstance(text, str) else None

        return from_table
    if source.get("kind") != "clip metadata":
        return None
    caption_field = str(source.get("field") or "caption")

    def from_metadata(record: dict[str, Any]) -> str | None:
        text = record_caption(record, caption_field)[0]
        return clean(text or "") if text is None or isinstance(text, str) else None

    return from_metadata


def pipeline_tensor(rows: torch.Tensor, length: int, tokens: int,
                    padding: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """Stored rows as the pipeline returns them: (length, hidden), zero rows after the stored ones, and the
    (length,) bool mask of the prompt's `tokens`: the first ones, or with `padding` "left" (LTX-2) the last."""
    embeds = rows.new_zeros((length, rows.shape[1]))
    embeds[:rows.shape[0]] = rows
    mask = torch.zeros(length, dtype=torch.bool)
    if padding == "left":
        mask[length - tokens:] = tokens > 0
    else:
        mask[:tokens] = True
    return embeds, mask


def feature_tensors(name: str, embeds: torch.Tensor, features: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    """text/<set> (and, LTX-2, text_audio/<set>) of a prompt's padded rows: LTX-2's sets hold the video features and
    the audio features side by side (vaecache.text.ltx2); V1's audio features are its video features."""
    if not features:
        return {f"text/{name}": embeds}
    from vaecache.text.ltx2 import split_features

    video, audio = split_features(embeds, int(features["video_width"]), int(features["audio_width"]))
    return {f"text/{name}": video, f"text_audio/{name}": audio}


def _entry_file(store: Any, name: str, entry: Any) -> str:
    file = entry.get("file") if isinstance(entry, dict) else None
    if not isinstance(file, str) or not file.startswith(f"{TEXT_DIR}/{name}/"):
        raise ManifestError(f"{store.where(MANIFEST)}: text set {name!r}: a table entry {entry!r} is not a file of "
                            f"{TEXT_DIR}/{name}/")
    return store.checked_name(file, f"text set {name}")


__all__ = ["EmbedRequest", "TextSet", "clip_captions", "feature_tensors", "pack_shards",
           "pipeline_tensor",
           "plan_prompts", "prompt_key",
           "read_captions_file", "text_set_names"]
