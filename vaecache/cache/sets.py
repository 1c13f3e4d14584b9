"""What every named set added to a finished cache shares (text embeddings: vaecache.text.sets; image-to-video
conditions: vaecache.conditions.sets): a folder OUT/<kind dir>/<set>/<generation>/ of shards and Parquet tables,
written through OUT's store, listed by one manifest record; the generation a hash of every input, so the same
inputs write the same bytes and a rerun with other inputs never writes into the folder the manifest lists."""

from __future__ import annotations

import hashlib
import io
import json
import math
from typing import Any, Iterable


def generation_of(inputs: dict[str, Any], pairs: Iterable[tuple[str, str]]) -> str:
    """A set's folder name: a hash of its settings and its (clip, input key) pairs."""
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode())
    for clip, key in pairs:
        digest.update(f"{clip}\t{key}\n".encode())
    return digest.hexdigest()[:16]


def pack_shards(keys: list[str], sizes: list[int], batch: int, shard_bytes: int) -> list[list[str]]:
    """The keys (in the order given) cut into shards of whole batches, each up to `shard_bytes` (a single batch may
    exceed it): a function of the keys and sizes alone, so every world size writes the same files."""
    shards: list[list[str]] = []
    current: list[str] = []
    held = 0
    for start in range(0, len(keys), batch):
        size = sum(sizes[start:start + batch])
        if current and held + size > shard_bytes:
            shards.append(current)
            current, held = [], 0
        current.extend(keys[start:start + batch])
        held += size
    if current:
        shards.append(current)
    return shards


def file_entry(file: str, data: bytes, **extra: Any) -> dict[str, Any]:
    """A manifest entry for one written file."""
    return {"file": file, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), **extra}


def parquet_bytes(table: Any) -> bytes:
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd", write_page_checksum=True)
    return buffer.getvalue()


def listed_files(record: dict[str, Any]) -> set[str]:
    """Every file a set's manifest record lists (its shards and tables)."""
    return {entry.get("file") for entry in [*(record.get("shards") or []), *(record.get("tables") or {}).values()]
            if isinstance(entry, dict)}


def delete_unlisted(store: Any, folder: str, record: dict[str, Any]) -> None:
    """Every file under the set's folder that its manifest record does not list (what a crash left)."""
    listed = listed_files(record)
    store.delete([file for file in store.listing(folder) if file not in listed])


def check_set_files(store: Any, name: str, prefix: str, entry: dict[str, Any], quick: bool,
                    check: Any) -> dict[str, bytes]:
    """verify's file checks of one set: every listed file inside `prefix`<generation>/, present with the recorded
    bytes (and sha256 unless `quick`; tables always), nothing unlisted in the set's folder. Returns the contents
    read, by file."""
    folder = f"{prefix}{entry['generation']}/"
    present = store.listing(prefix.rstrip("/"))
    listed = set()
    contents: dict[str, bytes] = {}
    for item in [*(entry.get("tables") or {}).values(), *(entry.get("shards") or [])]:
        file = item.get("file") if isinstance(item, dict) else None
        if not isinstance(file, str) or not file.startswith(folder) or "/" in file[len(folder):]:
            check.fail(f"{name}: a listed file {file!r} is not in {folder}")
            continue
        listed.add(file)
        if file not in present:
            check.fail(f"{store.where(file)}: listed in the manifest, missing")
            continue
        if present[file] != item.get("bytes"):
            check.fail(f"{store.where(file)}: {present[file]} bytes, the manifest says {item.get('bytes')}")
            continue
        if not quick or file.endswith(".parquet"):
            data = store.read(file)
            if hashlib.sha256(data).hexdigest() != item.get("sha256"):
                check.fail(f"{store.where(file)}: sha256 differs from the manifest's")
                continue
            contents[file] = data
        check.ok()
    for stray in sorted(set(present) - listed):
        check.fail(f"{store.where(stray)}: in {name}'s folder, not listed in the manifest (left by an interrupted "
                   "run: the next one of this set removes it)")
    return contents


def check_opened_file(store: Any, name: str, entry: dict[str, Any], verify: str) -> None:
    """A reader's check of a set's file the first time it opens it, as LatentCache checks a latent shard: its byte
    count ("size"), also its sha256 ("sha256"), or nothing ("none"); a ShardChecksumError naming it otherwise."""
    from vaecache.errors import ShardChecksumError

    if verify == "none":
        return
    where = store.where(name)
    try:
        size = store.size(name)
    except OSError as exc:
        raise ShardChecksumError(f"{where}: unreadable ({exc.strerror or exc})") from None
    if size != entry.get("bytes"):
        raise ShardChecksumError(f"{where}: {size} bytes, manifest.json records {entry.get('bytes')}")
    if verify == "sha256" and store.sha256(name) != entry.get("sha256"):
        raise ShardChecksumError(f"{where}: sha256 differs from the one manifest.json records")


COMMITS_DIR = "commits"
"""A set shard's commit record sits in <generation>/commits/, named as the shard with .json: its manifest entry
(bytes, sha256), its items and their table rows. The manifest naming the set supersedes them (they are removed with
everything else it does not list)."""


MAX_OPEN_SET_SHARDS = 64
"""Shards a set reader keeps open at once (the oldest closed first), as LatentCache bounds latent shards."""


class SetShards:
    """The shards a set's manifest record lists, opened through the store on first use (checked as LatentCache checks
    a latent shard: `verify` size, sha256 or none) and kept open, at most MAX_OPEN_SET_SHARDS at once."""

    def __init__(self, store: Any, record: dict[str, Any], verify: str, what: str) -> None:
        self.store, self.verify, self.what = store, verify, what
        self.listed = {entry.get("file"): entry for entry in record.get("shards") or [] if isinstance(entry, dict)}
        self._handles: dict[str, Any] = {}

    def open(self, shard: str, named_by: str) -> Any:
        """The handle of `shard`, which `named_by` (a clip, a prompt) names; a ManifestError for an unlisted one."""
        from vaecache.errors import ManifestError

        handle = self._handles.get(shard)
        if handle is None:
            if shard not in self.listed:
                raise ManifestError(f"{self.store.location}: {self.what}: {named_by} names shard {shard!r}, which "
                                    "the manifest does not list")
            name = self.store.checked_name(shard, self.what)
            check_opened_file(self.store, name, self.listed[shard], self.verify)
            while len(self._handles) >= MAX_OPEN_SET_SHARDS:
                self._handles.pop(next(iter(self._handles)))
            handle = self._handles[shard] = self.store.shard(name)
        return handle


def unlisted_set_checks(cache: Any, directory: str, what: str, sets: dict[str, Any], check_type: type) -> list[Any]:
    """verify's row naming each set folder under `directory` the manifest does not list (none where all are)."""
    unlisted = unlisted_sets(cache.store, directory, sets)
    if not unlisted:
        return []
    orphan = check_type(f"{what}s")
    for name in unlisted:
        orphan.fail(f"{cache.store.where(directory + '/' + name)}: a {what} the manifest does not list (an "
                    "interrupted first embed): embed it again, or delete the folder")
    return [orphan]


def unlisted_sets(store: Any, directory: str, sets: dict[str, Any]) -> list[str]:
    """Set folders under `directory` the manifest does not list."""
    return sorted({name.split("/")[1] for name in store.listing(directory)
                   if name.count("/") >= 2 and name.split("/")[1] not in sets})


# ----------------------------------------------------------------------------- reading and verifying any kind

SHARD_COLUMN_NAME = "shard"
"""The item table's column naming the shard that holds an item."""


def read_item_table(store: Any, kind: Any, name: str, record: dict[str, Any]) -> Any:
    """A set's item table (pyarrow), its entry a file of the set's folder; a ManifestError naming it otherwise."""
    import pyarrow.parquet as pq

    from vaecache.cache.layout import MANIFEST
    from vaecache.errors import ManifestError

    entry = (record.get("tables") or {}).get(kind.item_table)
    file = entry.get("file") if isinstance(entry, dict) else None
    if not isinstance(file, str) or not file.startswith(f"{kind.name}/{name}/"):
        raise ManifestError(f"{store.where(MANIFEST)}: {kind.what} {name!r}: its {kind.item_table} table entry "
                            f"{entry!r} is not a file of {kind.name}/{name}/")
    try:
        return pq.read_table(io.BytesIO(store.read(store.checked_name(file, f"{kind.what} {name}"))))
    except FileNotFoundError as exc:
        raise ManifestError(f"{store.location}: {kind.what} {name!r}: its {kind.item_table} table is missing "
                            f"({exc})") from None


class ItemSet:
    """One set of a kind whose items are the cache's clips (the default reader of vaecache.cache.kinds.SetKind):
    `item(clip)` gives its tensors as `<kind>/<set>` (the tensor named by the clip) and `<kind>/<set>/<part>` (one
    named `<clip>/<part>`); the WebDataset export writes the same tensors and the table row as the clip's facts."""

    def __init__(self, store: Any, manifest: dict[str, Any], kind: Any, name: str, verify: str = "size") -> None:
        self.store, self.kind, self.name = store, kind, name
        self.entry = (manifest.get(kind.name) or {})[name]
        table = read_item_table(store, kind, name, self.entry)
        self._rows = {row.pop(kind.item_column): row for row in table.to_pylist()}
        self._shards = SetShards(store, self.entry, verify, f"{kind.what} {name!r}")

    def clips(self) -> list[str]:
        return list(self._rows)

    def item(self, clip: str) -> dict[str, Any]:
        row = self._rows.get(clip)
        if row is None:
            raise KeyError(f"clip {clip} has no item in {self.kind.what} {self.name!r}")
        if self.kind.left_out(row):
            return {}
        handle = self._shards.open(row[SHARD_COLUMN_NAME], f"clip {clip}")
        return {f"{self.kind.name}/{self.name}{name[len(clip):]}": handle.get_tensor(name)
                for name in handle.keys() if name == clip or name.startswith(f"{clip}/")}

    def export_tensors(self, clip: str) -> dict[str, Any]:
        return {name: tensor.contiguous() for name, tensor in self.item(clip).items()}

    def export_facts(self, clip: str) -> dict[str, Any]:
        return {key: value for key, value in self._rows[clip].items() if key != SHARD_COLUMN_NAME}


def verify_item_sets(cache: Any, kind: Any, quick: bool, check_type: type) -> list[Any]:
    """verify's checks of every set of a kind whose items are the cache's clips: the files as the manifest lists
    them, every clip of the cache in the item table once and no other, each clip's tensor in the shard the table names
    (a removed one named, whatever the recorded hashes say), finite, its statistics where the table records them, and
    the kind's own check of one item (`kind.check_item(clip, tensors, row) -> problem or None`)."""
    import pyarrow.parquet as pq
    from safetensors.torch import load as safetensors_load

    from vaecache.cache.hooks import kind_hook
    from vaecache.cache.writer import STATS_RTOL, tensor_stats
    from vaecache.errors import KindHookError, VaecacheError

    sets = cache.manifest.get(kind.name) or {}
    rows = unlisted_set_checks(cache, kind.name, kind.what, sets, check_type)
    ids = list(cache.clip_ids()) if sets else []
    for name in sorted(sets):
        check = check_type(f"{kind.what} {name}" + (" (size only, --quick)" if quick else ""))
        try:
            entry = sets[name]
            contents = check_set_files(cache.store, f"{kind.what} {name}", f"{kind.name}/{name}/", entry, quick, check)
            table_file = ((entry.get("tables") or {}).get(kind.item_table) or {}).get("file")
            if table_file not in contents:
                rows.append(check)
                continue
            table = pq.read_table(io.BytesIO(contents[table_file])).to_pylist()
            held = [row[kind.item_column] for row in table]
            held_set = set(held)
            missing = [clip for clip in ids if clip not in held_set]
            for clip in missing[:5]:
                check.fail(f"{kind.what} {name}: clip {clip} has no item")
            for clip in sorted(held_set - set(ids))[:5]:
                check.fail(f"{kind.what} {name}: holds clip {clip}, which the cache does not hold")
            if len(held) != len(held_set):
                check.fail(f"{kind.what} {name}: a clip is listed twice")
            tensors: dict[str, dict[str, Any]] = {}
            for file, data in contents.items():
                if file.endswith(".safetensors"):
                    tensors[file] = safetensors_load(data)
            for row in table if not quick else []:
                clip, shard = row[kind.item_column], row[SHARD_COLUMN_NAME]
                found = {tensor: value for tensor, value in tensors.get(shard, {}).items()
                         if tensor == clip or tensor.startswith(f"{clip}/")}
                with kind_hook(kind, "left_out", name, f"clip {clip}"):
                    left_out = kind.left_out(row)
                if left_out:
                    if found:
                        check.fail(f"{cache.store.where(shard)}: holds a tensor for clip {clip}, which its row says "
                                   f"was left out ({left_out})")
                    else:
                        check.ok()
                    continue
                if clip not in found:
                    check.fail(f"{cache.store.where(shard)}: holds no tensor for clip {clip}, which the set's "
                               f"{kind.item_table} table places there")
                    continue
                if not all(value.isfinite().all() for value in found.values()):
                    check.fail(f"{cache.store.where(shard)}: clip {clip}'s tensor holds non-finite values")
                    continue
                if all(row.get(stat) is not None for stat in ("min", "max", "mean", "std")):
                    now = tensor_stats(found[clip])
                    if any(not math.isclose(now[stat], row[stat], rel_tol=STATS_RTOL, abs_tol=1e-12)
                           for stat in now):
                        check.fail(f"{cache.store.where(shard)}: clip {clip}'s tensor does not match the statistics "
                                   "its table records (altered, or another clip's)")
                        continue
                with kind_hook(kind, "check_item", name, f"clip {clip}"):
                    problem = kind.check_item(cache, clip, found, row)
                if problem:
                    check.fail(f"{cache.store.where(shard)}: clip {clip}: {problem}")
                    continue
                check.ok()
        except KindHookError as exc:
            check.fail(str(exc))
        except (KeyError, TypeError, ValueError, OSError, VaecacheError) as exc:
            check.fail(f"{kind.what} {name}: {type(exc).__name__}: {exc}")
        rows.append(check)
    return rows


class Recomputed:
    """verify --reencode's comparison, for one set's check, of items computed again with what stored them: each item
    within `limit` of the stored max (`compare`), and the worst difference as the check's note (`finish`)."""

    def __init__(self, check: Any, limit: float) -> None:
        self.check, self.limit, self.worst = check, limit, 0.0

    def compare(self, subject: str, verb: str, fresh: Any, stored: Any) -> None:
        """`subject` ("text set NAME: prompt KEY") that `verb` ("re-embeds") to another shape, or too far from the
        stored item, fails the check; else it counts as one item that holds."""
        if fresh.shape != stored.shape:
            self.check.fail(f"{subject} {verb} to shape {tuple(fresh.shape)}, stored {tuple(stored.shape)}")
            return
        if not stored.numel():  # no rows (a prompt quoting no glyph text): the same shape is all there is
            self.check.ok()
            return
        stored = stored.float()
        relative = float((fresh.float() - stored).abs().max()) / (float(stored.abs().max()) or 1.0)
        self.worst = max(self.worst, relative)
        if relative > self.limit:
            self.check.fail(f"{subject} {verb} {relative:.3g} of the stored max away (tolerance {self.limit:g})")
        else:
            self.check.ok()

    def finish(self) -> None:
        self.check.note = f"max difference {self.worst:.3g} of the stored max (tolerance {self.limit:g})"


def unrecorded_set_folders(store: Any, known: set[str]) -> list[str]:
    """Folders at OUT's top level outside `known` (the layout's own entries and the kinds the manifest records) that
    hold what an embed of a kind leaves before its first manifest names it: a shard or a commit record under
    <folder>/<set>/<generation>/."""
    from vaecache.cache.store import LocalStore

    try:
        top = ({path.name for path in store.folder.iterdir() if path.is_dir()} if isinstance(store, LocalStore)
               else store.entries())
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in sorted(top - known):
        for name in store.listing(entry):
            parts = name.split("/")
            if len(parts) >= 4 and (parts[3] == COMMITS_DIR or parts[-1].endswith(".safetensors")):
                found.append(entry)
                break
    return found
