"""verify's checks of a cache's text-embedding sets (vaecache.text.sets): for each set, its files as the manifest
lists them (bytes and sha256), every clip of the clip table embedded once (a missing clip named, whatever the
recorded hashes say), every prompt a clip uses stored with the recorded token count, the set's hidden size and
dtype, finite values, and nothing in the set's folder the manifest does not list."""

from __future__ import annotations

import hashlib
import io
import math
from pathlib import Path
from typing import Any

from safetensors.torch import load as safetensors_load

from vaecache.cache.layout import TEXT_DIR
from vaecache.cache.sets import Recomputed, check_set_files, unlisted_set_checks
from vaecache.errors import VaecacheError
from vaecache.settings.dtypes import SAFETENSORS_NAMES, canonical_dtype_name
from vaecache.text.families import family_named
from vaecache.text.sets import GLYPH_SUFFIX, POOLED_SUFFIX


def check_text_sets(cache: Any, quick: bool, check_type: type) -> list[Any]:
    """One report row per set (`check_type` is integrity.Check)."""
    sets = cache.manifest.get(TEXT_DIR) or {}
    ids: list[str] | None = None
    rows = unlisted_set_checks(cache, TEXT_DIR, "text set", sets, check_type)
    for name in sorted(sets):
        if ids is None:
            ids = list(cache.clip_ids())
        check = check_type(f"text set {name}" + (" (size only, --quick)" if quick else ""))
        try:
            _check_set(cache, name, sets[name], ids, quick, check)
        except (KeyError, TypeError, ValueError, OSError, VaecacheError) as exc:
            check.fail(f"text set {name}: {type(exc).__name__}: {exc}")
        rows.append(check)
    return rows


def _check_set(cache: Any, name: str, entry: Any, ids: list[str], quick: bool, check: Any) -> None:
    import pyarrow.parquet as pq

    store = cache.store
    prefix = f"{TEXT_DIR}/{name}/"
    if not isinstance(entry, dict) or not isinstance(entry.get("generation"), str):
        check.fail(f"text set {name}: its manifest entry is not a set record")
        return
    fingerprint = entry.get("fingerprint") or {}
    hidden, length = fingerprint.get("hidden_size"), fingerprint.get("length")
    stored = SAFETENSORS_NAMES.get(fingerprint.get("stored_dtype", ""))
    full = fingerprint.get("storage") == "every row of the length"
    contents = check_set_files(store, f"text set {name}", prefix, entry, quick, check)
    tables = entry.get("tables") or {}
    clips_file, prompts_file = (tables.get("clips") or {}).get("file"), (tables.get("prompts") or {}).get("file")
    if clips_file not in contents or prompts_file not in contents:
        return
    clips = pq.read_table(io.BytesIO(contents[clips_file]))
    prompts = pq.read_table(io.BytesIO(contents[prompts_file]))
    key_of: dict[str, str] = {}
    for clip, key in zip(clips.column("id").to_pylist(), clips.column("key").to_pylist()):
        if clip in key_of:
            check.fail(f"text set {name}: clip {clip} is embedded twice")
        key_of[clip] = key
    missing = [clip for clip in ids if clip not in key_of]
    for clip in missing[:5]:
        check.fail(f"text set {name}: clip {clip} has no embedding")
    if len(missing) > 5:
        check.fail(f"text set {name}: {len(missing) - 5} more clips have no embedding")
    known = set(ids)
    for clip in [clip for clip in key_of if clip not in known][:5]:
        check.fail(f"text set {name}: embeds clip {clip}, which the cache does not hold")
    tokens = dict(zip(prompts.column("key").to_pylist(), prompts.column("tokens").to_pylist()))
    _check_declared_length(name, fingerprint, tokens, check)
    shard_of = dict(zip(prompts.column("key").to_pylist(), prompts.column("shard").to_pylist()))
    for key in sorted({key for key in key_of.values() if key not in tokens})[:5]:
        check.fail(f"text set {name}: prompt {key[:12]} (of clip "
                   f"{next(c for c, k in key_of.items() if k == key)}) is not in its prompt table")
    stats_of = _recorded_stats(prompts, "", check)
    pooled_stats_of = _recorded_stats(prompts, "pooled_", None) if stats_of is not None else None
    glyph_stats_of = _recorded_stats(prompts, "glyph_", None) if stats_of is not None else None
    stored_keys: set[str] = set()
    pooled_keys: set[str] = set()
    glyph_keys: set[str] = set()
    pooled_hidden = int((fingerprint.get("pooled") or {}).get("hidden_size") or 0)
    glyph_hidden = int((fingerprint.get("glyph") or {}).get("hidden_size") or 0)
    glyph_tokens = (dict(zip(prompts.column("key").to_pylist(), prompts.column("glyph_tokens").to_pylist()))
                    if "glyph_tokens" in prompts.column_names else {})
    for shard in entry.get("shards") or []:
        file = shard.get("file")
        if file not in contents:
            continue
        tensors = safetensors_load(contents[file])
        for key, tensor in tensors.items():
            if key.endswith(POOLED_SUFFIX):
                base = key[:-len(POOLED_SUFFIX)]
                pooled_keys.add(base)
                _check_beside(check, store.where(file), file, shard_of.get(base), base, "pooled output", tensor,
                              (pooled_hidden,), pooled_stats_of)
                continue
            if key.endswith(GLYPH_SUFFIX):
                base = key[:-len(GLYPH_SUFFIX)]
                glyph_keys.add(base)
                _check_beside(check, store.where(file), file, shard_of.get(base), base, "glyph rows", tensor,
                              (glyph_tokens.get(base), glyph_hidden), glyph_stats_of)
                continue
            stored_keys.add(key)
            if shard_of.get(key) != file:
                check.fail(f"{store.where(file)}: holds prompt {key[:12]}, which its prompt table places elsewhere")
            elif tensor.dim() != 2 or tensor.shape[1] != hidden or tensor.shape[0] != (length if full else
                                                                                         tokens.get(key)):
                check.fail(f"{store.where(file)}: prompt {key[:12]} has shape {tuple(tensor.shape)}, expected "
                           f"({length if full else tokens.get(key)}, {hidden})")
            elif stored and SAFETENSORS_NAMES.get(str(tensor.dtype).removeprefix("torch.")) != stored:
                check.fail(f"{store.where(file)}: prompt {key[:12]} is {tensor.dtype}, the set stores {stored}")
            elif not tensor.isfinite().all():
                check.fail(f"{store.where(file)}: prompt {key[:12]} holds non-finite values")
            elif stats_of is not None and not _same_stats(tensor, stats_of.get(key)):
                check.fail(f"{store.where(file)}: prompt {key[:12]}'s rows do not match the stats its prompt table "
                           "records (altered, or another prompt's)")
    if not quick:
        for key in sorted(set(tokens) - stored_keys)[:5]:
            check.fail(f"text set {name}: prompt {key[:12]} is in the prompt table and in no shard")
        if pooled_hidden:
            for key in sorted(set(tokens) - pooled_keys)[:5]:
                check.fail(f"text set {name}: prompt {key[:12]} has no pooled output in its shard")
        if glyph_hidden:
            for key in sorted(set(tokens) - glyph_keys)[:5]:
                check.fail(f"text set {name}: prompt {key[:12]} has no glyph rows in its shard")
        texts = dict(zip(prompts.column("key").to_pylist(), prompts.column("text").to_pylist()))
        stored_captions = (dict(zip(clips.column("id").to_pylist(), clips.column("caption").to_pylist()))
                           if "caption" in clips.column_names else None)
        _check_links(cache, name, entry, key_of, texts, check, stored_captions)


def _check_beside(check: Any, where: Any, file: str, placed: str | None, base: str, what: str, tensor: Any,
                  expected: tuple[Any, ...], stats_of: dict[str, dict[str, float]] | None) -> None:
    """A tensor stored beside a prompt's rows (its pooled output, its glyph rows): in the shard the prompt table
    places the prompt in, of the `expected` shape, finite, and matching the stats the table records for it."""
    if placed != file:
        check.fail(f"{where}: holds the {what} of prompt {base[:12]}, which its prompt table places elsewhere")
    elif tuple(tensor.shape) != expected or not tensor.isfinite().all():
        check.fail(f"{where}: prompt {base[:12]}: {what} of shape {tuple(tensor.shape)} (expected {expected}) or "
                   "with non-finite values")
    elif stats_of is not None and not _same_stats(tensor, stats_of.get(base)):
        check.fail(f"{where}: prompt {base[:12]}: {what} not matching the stats its prompt table records (altered, "
                   "or another prompt's)")


def _recorded_stats(prompts: Any, prefix: str, check: Any) -> dict[str, dict[str, float]] | None:
    """Each prompt's recorded stats (columns `prefix` + min, max, mean, std), or None for a set embedded before they
    were recorded (a note on `check`, when given, says its rows were checked without them)."""
    from vaecache.text.sets import STAT_NAMES

    names = [f"{prefix}{stat}" for stat in STAT_NAMES]
    if not all(name in prompts.column_names for name in names):
        if check is not None:
            check.note = (check.note + "; " if check.note else "") + \
                "no per-prompt stats recorded (embedded before they were): rows checked for shape and finiteness only"
        return None
    columns = [prompts.column(name).to_pylist() for name in names]
    return {key: dict(zip(STAT_NAMES, values))
            for key, *values in zip(prompts.column("key").to_pylist(), *columns)}


def _same_stats(tensor: Any, recorded: dict[str, float] | None) -> bool:
    from vaecache.cache.writer import STATS_RTOL, tensor_stats

    if not recorded:
        return False
    found = tensor_stats(tensor)
    return all(isinstance(recorded.get(stat), float)
               and math.isclose(found[stat], recorded[stat], rel_tol=STATS_RTOL, abs_tol=1e-9) for stat in found)


def recorded_batch(fingerprint: dict[str, Any]) -> int:
    """The prompts per forward a set records (1 where each prompt ran alone, 8 where it records none)."""
    first = (fingerprint.get("batch_shape") or [8])[0]
    return first if isinstance(first, int) and not isinstance(first, bool) and first > 0 else 1


def _check_declared_length(name: str, fingerprint: dict[str, Any], tokens: dict[str, Any], check: Any) -> None:
    """The fingerprint's length is what every reader pads to: it must be a positive integer, agree with the recorded
    batch shape, and hold every prompt's token count (else LatentCache fails on the clip, or pads it wrongly)."""
    length, shape = fingerprint.get("length"), fingerprint.get("batch_shape")
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        check.fail(f"text set {name}: its fingerprint's length {length!r} is not a positive integer")
        return
    if isinstance(shape, list) and len(shape) == 2 and shape[1] != length:
        check.fail(f"text set {name}: its fingerprint's length {length} differs from its batch shape {shape}")
    longer = sorted(key for key, count in tokens.items() if not isinstance(count, int) or count > length)
    for key in longer[:5]:
        check.fail(f"text set {name}: prompt {key[:12]} has {tokens[key]} tokens, more than the set's length "
                   f"{length}")


def _check_links(cache: Any, name: str, entry: dict[str, Any], key_of: dict[str, str], texts: dict[str, Any],
                 check: Any, stored_captions: dict[str, Any] | None = None) -> None:
    """What ties a set to its clips, proven from what the cache holds rather than from the recorded hashes (which a
    forger can recompute): each prompt's stored text hashes to its key, and each clip's key is the key of its own
    caption, cleaned by the recorded family's cleaning: read again from the clip's recorded metadata, or for a
    --captions set from the captions its clip table keeps (`stored_captions`), else from the captions file where it
    is still at hand with its recorded sha256 (else a note says the links were not proven)."""
    import functools

    from vaecache.errors import DatasetError
    from vaecache.models.base import CLEANINGS
    from vaecache.text.families import installed_version
    from vaecache.text.sets import prompt_key, read_captions_file, record_caption

    for key, text in sorted(texts.items()):
        if not isinstance(text, str) or prompt_key(text) != key:
            check.fail(f"text set {name}: prompt {key[:12]}'s stored text does not hash to its key (the text or "
                       "the key was changed)")
    fingerprint = entry.get("fingerprint") or {}
    cleaning, source = fingerprint.get("cleaning"), entry.get("captions") or {}
    unproven = None
    if cleaning not in CLEANINGS:
        unproven = f"its cleaning {cleaning!r} is not one this vaecache knows"
    elif cleaning == "wan" and fingerprint.get("ftfy") != installed_version("ftfy"):
        unproven = f"it was cleaned with ftfy {fingerprint.get('ftfy')}, and ftfy {installed_version('ftfy')} is " \
                   "installed"
    captions = None
    if unproven is None and source.get("kind") == "file" and stored_captions is not None:
        captions = stored_captions
    elif unproven is None and source.get("kind") == "file":
        path = Path(str(source.get("path")))
        try:
            mapping, identity = read_captions_file(path)
            if identity["sha256"] == source.get("sha256"):
                captions = mapping
            else:
                unproven = f"its captions file {path} changed since the set was made"
        except DatasetError as exc:  # gone, or a file an older vaecache read more leniently
            unproven = f"its captions file {path} is not at hand as it was recorded ({exc})"
    elif unproven is None and source.get("kind") != "clip metadata":
        unproven = f"its captions source {source.get('kind')!r} is not one this vaecache knows"
    if unproven is not None:
        check.note = (check.note + "; " if check.note else "") + f"clip-to-caption links not proven: {unproven}"
        return
    clean = CLEANINGS[cleaning]
    key_for = functools.lru_cache(maxsize=1 << 16)(lambda text: prompt_key(clean(text)))
    field = str(source.get("field") or "caption")
    wrong = 0
    # one pass over the clip table, clip by clip: only the set's clips (one an encode added since has no embedding,
    # which the table check names), a caption the captions lack or that is not text named for that clip alone
    for record in cache.clip_records():
        clip = record["id"]
        if clip not in key_of:
            continue
        if captions is not None:
            if clip not in captions:
                check.fail(f"text set {name}: clip {clip} has no caption among the captions the set was made from")
                continue
            text = captions[clip]
        else:
            text = record_caption(record, field)[0]
        if text is not None and not isinstance(text, str):
            check.fail(f"text set {name}: clip {clip}'s {field!r} is {type(text).__name__}, not text")
            continue
        key = key_for(text or "")
        if key != key_of[clip]:
            wrong += 1
            if wrong <= 5:
                check.fail(f"text set {name}: clip {clip} is linked to prompt {key_of[clip][:12]}, but its own caption "
                           f"is prompt {key[:12]}")
    if wrong > 5:
        check.fail(f"text set {name}: {wrong - 5} more clips are linked to another caption's prompt")


def check_text_reembed(cache: Any, count: int, seed: int, device: Any, tolerance: float | None,
                       tolerances: dict[str, float], check_type: type,
                       allow_pickle_weights: bool = False) -> list[Any]:
    """`verify --reencode K`: for each text set, K of its prompts (chosen by `seed`) embedded again with the
    recorded encoder and settings, compared with the stored rows; the encoder's fingerprint must be the recorded
    one (else a failure naming what differs)."""
    import random

    from vaecache.differences import describe_differences
    from vaecache.text.encoder import load_text_encoder
    from vaecache.text.sets import TextSet

    rows = []
    for name in sorted(cache.manifest.get("text") or {}):
        entry = cache.manifest["text"][name]
        fingerprint = entry.get("fingerprint") or {}
        check = check_type(f"re-embed {count} prompt(s) of text set {name}")
        rows.append(check)
        stored_dtype = canonical_dtype_name(fingerprint.get("stored_dtype") or "float32")
        compute = canonical_dtype_name(fingerprint.get("compute_dtype") or "float32")
        generic = fingerprint.get("family") == "generic"
        try:
            texts = TextSet(cache.store, cache.manifest, name)
            encoder = load_text_encoder(str(entry.get("spec")), device, compute_dtype=compute, dtype=stored_dtype,
                                        length=fingerprint.get("length") if generic else None,
                                        layer=fingerprint.get("layer") if generic else None,
                                        batch=recorded_batch(fingerprint),
                                        allow_pickle_weights=allow_pickle_weights,
                                        convention=family_named(str(fingerprint.get("family") or "")))
        except (VaecacheError, KeyError, OSError) as exc:
            check.fail(f"text set {name}: cannot load its encoder {entry.get('spec')!r} ({exc})")
            continue
        differs = describe_differences(fingerprint, encoder.fingerprint())
        if differs:
            check.fail(f"text set {name}: the encoder at {encoder.spec} is not the recorded one "
                       f"({'; '.join(differs[:3])})")
            continue
        keys = sorted(texts.prompt_keys())
        chosen = random.Random(seed).sample(keys, min(count, len(keys)))
        fresh = encoder.embed([texts.prompt_text(key) for key in chosen])
        limit = tolerance if tolerance is not None else tolerances.get(fingerprint.get("stored_dtype", ""), 0.0)
        recomputed = Recomputed(check, limit)
        for key, embedding in zip(chosen, fresh):
            recomputed.compare(f"text set {name}: prompt {key[:12]}", "re-embeds", embedding.rows, texts.key_rows(key))
            if embedding.glyph is not None:
                recomputed.compare(f"text set {name}: prompt {key[:12]}'s glyph rows", "re-embeds", embedding.glyph,
                                   texts.key_tensor(f"{key}{GLYPH_SUFFIX}", key))
        recomputed.finish()
    return rows


def check_caption_files(manifest: dict[str, Any], check_type: type) -> list[Any]:
    """`verify --dataset`: each text set embedded from a --captions file, against the file's recorded size and
    sha256 (a changed file means the set's embeddings are stale: run embed --replace)."""
    from pathlib import Path

    rows = []
    for name, entry in sorted((manifest.get("text") or {}).items()):
        source = entry.get("captions") if isinstance(entry, dict) else None
        if not isinstance(source, dict) or source.get("kind") != "file":
            continue
        check = check_type(f"captions of text set {name} unchanged")
        rows.append(check)
        path = Path(str(source.get("path")))
        try:
            data = path.read_bytes()
        except OSError as exc:
            check.fail(f"{path}: the captions file text set {name} was embedded from cannot be read "
                       f"({exc.strerror or exc})")
            continue
        if len(data) != source.get("bytes") or hashlib.sha256(data).hexdigest() != source.get("sha256"):
            check.fail(f"{path}: changed since text set {name} was embedded from it (its embeddings are stale: "
                       f"vaecache embed OUT --set {name} --captions {path} --replace)")
        else:
            check.ok()
    return rows
