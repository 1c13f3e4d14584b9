"""The report's text section: the most repeated prompts and the clips with none, from a text set's own tables (the
prompts it embedded, the prompt each clip uses) or, for a cache without one, from the clips' captions; and each
sampled clip's prompt. Streamed in two passes over one column, in bounded memory whatever the number of clips or
distinct prompts (`frequent_items`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vaecache.cache.reader import CacheReader

FREQUENT_CAPACITY = 4096
"""Counters `frequent_items` keeps: every prompt used by more than 1/4097 of the clips is found, and counted exactly."""
SHOWN_PROMPTS = 20
SHOWN_EMPTY = 10
DEFAULT_CAPTION_FIELD = "caption"
"""The metadata key read as a clip's caption where no text set says which (vaecache embed's own default)."""


def frequent_items(stream: Callable[[], Iterable[Hashable]], top: int,
                   capacity: int = FREQUENT_CAPACITY) -> tuple[list[tuple[Hashable, int]], int]:
    """The `top` most frequent items of `stream()` with their exact counts, and the number of items: two passes, in
    memory for 2·`capacity` items whatever the stream's length or variety. Pass one is Misra and Gries' frequent
    items with batched decrements (each decrement takes the (capacity+1)-th largest count from every counter, so no
    item loses more than n/(capacity+1) and every item more frequent than that survives); pass two counts the
    survivors exactly. An item rarer than n/(capacity+1) may be missed where the top list has room for it."""
    counters: dict[Hashable, int] = {}
    total = 0
    for item in stream():
        total += 1
        counters[item] = counters.get(item, 0) + 1
        if len(counters) > 2 * capacity:
            cut = sorted(counters.values(), reverse=True)[capacity]
            counters = {key: value - cut for key, value in counters.items() if value > cut}
    candidates = set(counters)
    exact = Counter(item for item in stream() if item in candidates)
    return exact.most_common(top), total


@dataclass(frozen=True)
class RepeatedPrompt:
    text: str
    clips: int
    tokens: int | None = None
    """The rows its embedding holds in the text set (None without a text set)."""


@dataclass
class TextSection:
    """What the page shows of the cache's prompts."""

    source: str
    """Where the prompts come from: a text set (its name) or the clips' metadata field."""
    clips: int = 0
    repeated: list[RepeatedPrompt] = field(default_factory=list)
    empty_clips: int = 0
    empty_examples: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "clips": self.clips, "empty_clips": self.empty_clips,
                "empty_examples": self.empty_examples,
                "repeated": [{"text": p.text, "clips": p.clips, "tokens": p.tokens} for p in self.repeated]}


def text_set_tables(reader: CacheReader, name: str) -> tuple[str, str]:
    """The store names of text set `name`'s prompt table and clip table (its manifest record's)."""
    entry = (reader.manifest.get("text") or {})[name]
    where = f"{reader.store.where('manifest.json')}: text.{name}.tables"
    return (reader.store.checked_name(entry["tables"]["prompts"]["file"], where),
            reader.store.checked_name(entry["tables"]["clips"]["file"], where))


def _column(reader: CacheReader, name: str, columns: list[str] | None) -> Iterator[pa.RecordBatch]:
    """A set table's `columns` (None: all), batch by batch."""
    table = pq.ParquetFile(reader.store.table_source(name))
    yield from table.iter_batches(batch_size=65536, columns=columns)


def text_set_section(reader: CacheReader, name: str) -> TextSection:
    """The repeated and empty prompts of text set `name`: counted over its clip table's `key` column, their texts and
    token counts looked up in its prompt table."""
    prompts_name, clips_name = text_set_tables(reader, name)

    def keys() -> Iterator[str]:
        for batch in _column(reader, clips_name, ["key"]):
            yield from batch.column(0).to_pylist()

    top, total = frequent_items(keys, SHOWN_PROMPTS + 1)
    empty_keys: set[str] = set()
    text_of: dict[str, tuple[str, int]] = {}
    wanted = {key for key, _ in top}
    for batch in _column(reader, prompts_name, ["key", "text", "tokens"]):
        empty = pc.equal(pc.utf8_trim_whitespace(batch.column("text")), "")
        empty_keys.update(batch.filter(empty).column("key").to_pylist())
        chosen = batch.filter(pc.is_in(batch.column("key"), pa.array(sorted(wanted), pa.string())))
        for key, text, tokens in zip(*(chosen.column(c).to_pylist() for c in ("key", "text", "tokens"))):
            text_of[key] = (text, tokens)
    section = TextSection(source=f"text set {name!r}", clips=total)
    section.repeated = [RepeatedPrompt(text_of[key][0], count, text_of[key][1]) for key, count in top
                        if count > 1 and key in text_of and key not in empty_keys][:SHOWN_PROMPTS]
    if empty_keys:
        for batch in _column(reader, clips_name, ["id", "key"]):
            chosen = batch.filter(pc.is_in(batch.column("key"), pa.array(sorted(empty_keys), pa.string())))
            section.empty_clips += chosen.num_rows
            room = SHOWN_EMPTY - len(section.empty_examples)
            section.empty_examples.extend(chosen.column("id").to_pylist()[:max(0, room)])
    return section


def caption_section(reader: CacheReader, caption_field: str = DEFAULT_CAPTION_FIELD) -> TextSection:
    """The repeated and empty captions of the clips' metadata[caption_field] (a cache without a text set)."""
    from vaecache.report.tables import clip_batches

    def captions() -> Iterator[tuple[str, str | None]]:
        for batch in clip_batches(reader, ["id", "extra"]):
            for clip, extra in zip(batch.column("id").to_pylist(), batch.column("extra").to_pylist()):
                yield clip, record_caption_of(extra, caption_field)

    section = TextSection(source=f"the clips' metadata field {caption_field!r} (no text set)")
    passes = 0

    def texts() -> Iterator[str]:  # the first of frequent_items' two passes also counts the clips without one
        nonlocal passes
        passes += 1
        for clip, text in captions():
            if text and text.strip():
                yield text
            elif passes == 1:
                section.empty_clips += 1
                if len(section.empty_examples) < SHOWN_EMPTY:
                    section.empty_examples.append(clip)

    top, total = frequent_items(texts, SHOWN_PROMPTS)
    section.clips = total + section.empty_clips
    section.repeated = [RepeatedPrompt(str(text), count) for text, count in top if count > 1]
    return section


def record_caption_of(extra: str | None, caption_field: str) -> str | None:
    """metadata[caption_field] of a clip table row's `extra` JSON, where it is text."""
    from vaecache.cache.table import loads_extra
    from vaecache.text.sets import record_caption

    if not extra:
        return None
    try:
        caption, _ = record_caption(loads_extra(extra), caption_field)
    except ValueError:  # metadata kept as text that is not JSON
        return None
    return caption if isinstance(caption, str) else None


@dataclass(frozen=True)
class ClipPrompt:
    """A sampled clip's prompt: its caption, and in each text set the text embedded and the rows it holds."""

    caption: str | None
    sets: list[dict[str, Any]]
    """Per text set: name, text (as cleaned), tokens (the embedding's rows), truncated."""


def clip_prompts(reader: CacheReader, records: list[dict[str, Any]]) -> dict[str, ClipPrompt]:
    """Each record's caption (the first text set's captions field, else DEFAULT_CAPTION_FIELD) and its row in every
    text set, looked up for these clips only."""
    from vaecache.text.sets import record_caption

    sets = sorted(reader.manifest.get("text") or {})
    first = (reader.manifest.get("text") or {}).get(sets[0]) if sets else None
    captions = (first or {}).get("captions") or {}
    caption_field = captions.get("field") if captions.get("kind") == "clip metadata" else DEFAULT_CAPTION_FIELD
    ids = [record["id"] for record in records]
    rows: dict[str, list[dict[str, Any]]] = {clip: [] for clip in ids}
    for name in sets:
        prompts_name, clips_name = text_set_tables(reader, name)
        key_of: dict[str, str] = {}
        caption_of: dict[str, str] = {}
        for batch in _column(reader, clips_name, None):
            chosen = batch.filter(pc.is_in(batch.column("id"), pa.array(ids, pa.string())))
            for row in chosen.to_pylist():
                key_of[row["id"]] = row["key"]
                if row.get("caption") is not None:
                    caption_of[row["id"]] = row["caption"]
        found: dict[str, dict[str, Any]] = {}
        for batch in _column(reader, prompts_name, ["key", "text", "tokens", "truncated"]):
            chosen = batch.filter(pc.is_in(batch.column("key"), pa.array(sorted(set(key_of.values())), pa.string())))
            found.update({row["key"]: row for row in chosen.to_pylist()})
        for clip in ids:
            prompt = found.get(key_of.get(clip, ""))
            if prompt is not None:
                rows[clip].append({"name": name, "text": prompt["text"], "tokens": prompt["tokens"],
                                   "truncated": bool(prompt["truncated"]), "caption": caption_of.get(clip)})
    result = {}
    for record in records:
        caption, _ = record_caption(record, caption_field or DEFAULT_CAPTION_FIELD)
        given = next((row["caption"] for row in rows[record["id"]] if row.get("caption") is not None), None)
        caption = given if given is not None else caption
        result[record["id"]] = ClipPrompt(caption if isinstance(caption, str) else None, rows[record["id"]])
    return result


__all__ = ["ClipPrompt", "RepeatedPrompt", "TextSection", "caption_section", "clip_prompts", "frequent_items",
           "text_set_section"]
