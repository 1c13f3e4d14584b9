"""One embed of any kind of set (vaecache.cache.kinds): OUT's lock on rank 0, shard s of every set computed by rank
s % world, each shard committed by a record holding its sha256 and rows, a rerun keeping what is committed and
intact (a killed embed resumes, a listed set is repaired), items the set before held copied into a grown cache, the
tables, and the manifest written once (vaecache.cache.manifest.write_manifest)."""

from __future__ import annotations

import hashlib
import io
import json
from typing import Any, Callable, TypeVar

from vaecache.cache.kinds import (
    ComputedItem,
    SetKind,
    SetOutcome,
    SetRequest,
    arrow_type,
    module_record,
    recorded_kinds,
)
from vaecache.cache.layout import KINDS_RECORD, MANIFEST
from vaecache.cache.sets import (
    COMMITS_DIR,
    MAX_OPEN_SET_SHARDS,
    SHARD_COLUMN_NAME,
    delete_unlisted,
    file_entry,
    parquet_bytes,
)

T = TypeVar("T")


def embed_sets(kind: SetKind, request: Any, ctx: Any = None,
               before_lock: Callable[[], Any] | None = None) -> list[SetOutcome]:
    """Add, update or repair the sets `kind.job` plans in the finished cache at `request.out` (`request` has out,
    storage_options, replace and device), under OUT's lock held by rank 0; latents and other sets untouched.

    Shard s of every set is computed by rank s % world, so the files do not depend on the world size. Each shard is
    committed by a record holding its sha256 and rows; a rerun keeps every committed shard still intact and computes
    only the missing or damaged ones (a killed embed resumes; a listed set with a deleted shard is repaired), and an
    item the set before already held (the same encoder: a grown cache) is copied from it, not computed: the files are
    those a run from scratch writes. Rank 0 writes the tables and then the manifest, once. Every rank returns the same
    outcomes (vaecache.cache.kinds.SetOutcome), in plan order. `before_lock` runs on rank 0 before the lock is taken
    (reading an input the user named); its result is handed to `kind.job` as `given`."""
    from contextlib import ExitStack

    from vaecache.cache.lock import held_lock
    from vaecache.cache.reader import CacheReader
    from vaecache.cache.store import open_store
    from vaecache.distributed.context import resolve_device

    rank, world = (ctx.info.rank, ctx.info.world_size) if ctx is not None else (0, 1)
    store = open_store(request.out, dict(request.storage_options))
    with ExitStack() as stack:
        def prepare() -> tuple[dict[str, Any], Any]:
            store.check_present()
            given = before_lock() if before_lock is not None else None
            stack.enter_context(held_lock(store, ctx.info.job_id if ctx is not None else None))
            return CacheReader(store).manifest, given

        manifest, given = _on_rank0(ctx, prepare)
        device = ctx.device if ctx is not None else resolve_device(request.device)
        job = kind.job(request, store, manifest, ctx, device, given)
        plans = job.plans()
        survey = _on_rank0(ctx, lambda: _survey(store, kind, job, plans, manifest, request.replace))
        outcomes = {plan.name: SetOutcome(plan.name, **survey[plan.name]["status"]) for plan in plans}
        own = _compute_own_shards(store, kind, job, plans, survey, rank, world)
        gathered = ctx.all_gather_object(own) if ctx is not None else [own]
        done = _on_rank0(ctx, lambda: _finish(store, kind, job, plans, manifest, survey,
                                              [part for parts in gathered for part in parts]))
    for plan in plans:
        outcome, result = outcomes[plan.name], done[plan.name]
        outcome.record = result["record"]
        outcome.extra = {"out": str(store.location), **plan.summary, **result["extra"]}
        outcome.unchanged = result["unchanged"]
        outcome.computed, outcome.copied = result["computed"], result["copied"]
        outcome.resumed, outcome.repaired = result["resumed"], result["repaired"]
        outcome.events = [event for parts in gathered for part in parts for event in part["events"]]
    return [outcomes[plan.name] for plan in plans]


def _on_rank0(ctx: Any, fn: Callable[[], T]) -> T:
    return ctx.on_rank0(fn) if ctx is not None else fn()


def set_folder(kind: Any, plan: Any) -> str:
    return f"{kind.name}/{plan.name}/{plan.generation}"


def shard_file(kind: Any, plan: Any, number: int) -> str:
    return f"{set_folder(kind, plan)}/{kind.shard_prefix}{number:05d}.safetensors"


def commit_file(kind: Any, plan: Any, number: int) -> str:
    return f"{set_folder(kind, plan)}/{COMMITS_DIR}/{kind.shard_prefix}{number:05d}.json"


def _survey(store: Any, kind: Any, job: Any, plans: list[Any], manifest: dict[str, Any],
            replace: bool) -> dict[str, Any]:
    """Rank 0, per plan: how it stands to the listed set (new, unchanged generation, follows, replaced; refused when
    made from other inputs without --replace), the shards already committed (the listed set's, when its generation is
    this one; an interrupted run's records), and the items the listed set holds that need no computing."""
    listed = manifest.get(kind.name) or {}
    surveyed: dict[str, Any] = {}
    for plan in plans:
        prior = listed.get(plan.name) if isinstance(listed, dict) else None
        status = {"replaced": False, "updated": False}
        committed: dict[int, dict[str, Any]] = {}
        reuse: dict[str, list[Any]] = {}
        prior_shards: dict[str, dict[str, Any]] = {}
        if isinstance(prior, dict):
            same = prior.get("generation") == plan.generation
            if not same:
                follows = job.follows(prior, plan)
                if not replace and not follows:
                    from vaecache.errors import UsageError

                    raise UsageError(kind.refusal(str(store.where(MANIFEST)), plan.name))
                status = {"replaced": replace, "updated": not replace}
            rows = _prior_rows(store, kind, prior)
            needed = {name for name, _ in plan.columns} - {kind.item_column, SHARD_COLUMN_NAME}
            if same:
                listed_commits = _listed_commits(kind, prior, rows)
                legacy = any(not needed <= row.keys() for _, row in rows.values())
                # a set written before a column of its table existed is up to date while every shard is intact;
                # else it is computed whole, so that its table can be written with every column
                if legacy and all(_intact(store, commit["entry"]) for commit in listed_commits.values()):
                    for commit in listed_commits.values():
                        commit["checked"] = True  # hashed here: its owner need not read it again
                if not legacy or all(commit.get("checked") for commit in listed_commits.values()):
                    committed.update(listed_commits)
            elif prior.get("fingerprint") == plan.fingerprint:
                wanted = set(plan.items)
                reuse = {item: [row[0], row[1]] for item, row in rows.items()
                         if item in wanted and needed <= row[1].keys() and job.reusable(prior, plan, item, row[1])}
                prior_shards = {entry["file"]: entry for entry in prior.get("shards") or []
                                if isinstance(entry, dict) and isinstance(entry.get("file"), str)}
        committed.update(_recorded_commits(store, kind, plan))
        surveyed[plan.name] = {"status": status, "committed": committed, "reuse": reuse, "prior_shards": prior_shards,
                               "listed": isinstance(prior, dict) and prior.get("generation") == plan.generation}
    return surveyed


def _prior_rows(store: Any, kind: Any, prior: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """The listed set's item table as {item: (its shard, its row but the item and the shard)}; empty when it does
    not read (nothing is then copied from it)."""
    import pyarrow.parquet as pq

    entry = (prior.get("tables") or {}).get(kind.item_table)
    file = entry.get("file") if isinstance(entry, dict) else None
    try:
        data = store.read(store.checked_name(file, f"{kind.what}"))
        if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            return {}
        rows = pq.read_table(io.BytesIO(data)).to_pylist()
    except Exception:  # noqa: BLE001  # a table that does not read vouches for nothing: everything is computed
        return {}
    found = {}
    for row in rows:
        item, shard = row.pop(kind.item_column, None), row.pop(SHARD_COLUMN_NAME, None)
        if isinstance(item, str) and isinstance(shard, str):
            found[item] = (shard, row)
    return found


def _listed_commits(kind: Any, prior: dict[str, Any], rows: dict[str, tuple[str, dict[str, Any]]]) -> dict[int, Any]:
    """The listed set's shards as commits: each shard's manifest entry, items and rows (from its item table)."""
    by_shard: dict[str, list[str]] = {}
    for item, (shard, _) in rows.items():
        by_shard.setdefault(shard, []).append(item)
    commits = {}
    for entry in prior.get("shards") or []:
        file = entry.get("file") if isinstance(entry, dict) else None
        number = _shard_number(kind, file)
        if number is None or file not in by_shard:
            continue
        items = by_shard[file]
        commits[number] = {"entry": entry, "items": items, "facts": [rows[item][1] for item in items],
                           "from": "listed"}
    return commits


def _shard_number(kind: Any, file: Any) -> int | None:
    name = str(file).rsplit("/", 1)[-1]
    if not name.startswith(kind.shard_prefix) or not name.endswith(".safetensors"):
        return None
    digits = name[len(kind.shard_prefix):-len(".safetensors")]
    return int(digits) if digits.isdigit() else None


def _recorded_commits(store: Any, kind: Any, plan: Any) -> dict[int, Any]:
    """The commit records an interrupted run of this generation left (a record that does not parse, or lacks a row or
    a column the plan's table needs, is ignored: its shard is computed again)."""
    folder = f"{set_folder(kind, plan)}/{COMMITS_DIR}"
    needed = {name for name, _ in plan.columns} - {kind.item_column, SHARD_COLUMN_NAME}
    commits = {}
    for name in sorted(store.listing(folder)):
        number = _shard_number(kind, name.removesuffix(".json") + ".safetensors")
        if number is None or number >= len(plan.shards):
            continue
        try:
            record = json.loads(store.read(name))
            items, facts = record.get("items"), record.get("facts")
            if record.get("entry", {}).get("file") != shard_file(kind, plan, number) or \
                    not isinstance(items, list) or not isinstance(facts, list) or len(items) != len(facts) or \
                    not all(isinstance(row, dict) and needed <= row.keys() for row in facts):
                continue
        except (OSError, ValueError, AttributeError):
            continue
        record["from"] = "record"
        commits[number] = record
    return commits


def _intact(store: Any, entry: dict[str, Any]) -> bool:
    try:
        return store.size(entry["file"]) == entry.get("bytes") and store.sha256(entry["file"]) == entry.get("sha256")
    except (OSError, KeyError):
        return False


def _compute_own_shards(store: Any, kind: Any, job: Any, plans: list[Any], survey: dict[str, Any], rank: int,
                        world: int) -> list[dict[str, Any]]:
    """This rank's shards (s % world == rank) of every plan that have no intact commit: each computed (or copied
    from the set before), written, committed; the fault hook after each."""
    from safetensors.torch import save

    from vaecache import faults

    by_name = {plan.name: plan for plan in plans}
    copier = _Copier(store, {file: entry for plan in plans
                             for file, entry in survey[plan.name]["prior_shards"].items()})
    written: list[dict[str, Any]] = []
    count = 0
    for number in range(max((len(plan.shards) for plan in plans), default=0)):
        if number % world != rank:
            continue
        todo: dict[str, list[str]] = {}
        for plan in plans:
            if number >= len(plan.shards):
                continue
            commit = survey[plan.name]["committed"].get(number)
            if commit is not None and commit["items"] == plan.shards[number] and \
                    (commit.get("checked") or _intact(store, commit["entry"])):
                continue
            todo[plan.name] = plan.shards[number]
        if not todo:
            continue
        items: dict[str, dict[str, Any]] = {name: {} for name in todo}
        fresh: dict[str, list[str]] = {}
        for name, wanted in todo.items():
            reuse = survey[name]["reuse"]
            for item in wanted:
                copied = copier.copy(item, *reuse[item]) if item in reuse else None
                if copied is None:
                    fresh.setdefault(name, []).append(item)
                else:
                    items[name][item] = copied
        computed, events = job.compute(number, fresh) if fresh else ({}, [])
        for name, found in computed.items():
            items[name].update(found)
        for name, wanted in todo.items():
            plan = by_name[name]
            tensors = {tensor: value for item in wanted for tensor, value in items[name][item].tensors.items()}
            # one metadata key: safetensors writes a header's metadata in hash-map order, so two keys are two byte
            # orders and the same set would not be the same bytes
            data = save(tensors, metadata={kind.metadata_key: plan.name})
            file = shard_file(kind, plan, number)
            store.write(file, data)
            commit = {"entry": file_entry(file, data, tensors=len(wanted)), "items": wanted,
                      "facts": [items[name][item].facts for item in wanted]}
            store.write(commit_file(kind, plan, number), json.dumps(commit).encode())
            written.append({**commit, "set": name, "number": number,
                            "computed": len(fresh.get(name, [])), "copied": len(wanted) - len(fresh.get(name, [])),
                            "events": events if name == next(iter(todo)) else []})
        count += 1
        if faults.should_fail_set(kind.name, count, rank):
            faults.crash()
    return written


class _Copier:
    """Items copied out of the listed set's shards: each shard's sha256 checked against its manifest entry the first
    time (a damaged one copies nothing: its items are computed)."""

    def __init__(self, store: Any, listed: dict[str, dict[str, Any]]) -> None:
        self.store, self.listed = store, listed
        self._handles: dict[str, Any] = {}

    def copy(self, item: str, shard: str, facts: dict[str, Any]) -> Any:
        handle = self._handles.get(shard, False)
        if handle is False:
            try:
                entry = self.listed.get(shard)
                handle = (self.store.shard(self.store.checked_name(shard, "a set's shard"))
                          if entry is not None and _intact(self.store, entry) else None)
            except Exception:  # noqa: BLE001  # what does not open is computed instead
                handle = None
            while len(self._handles) >= MAX_OPEN_SET_SHARDS:
                self._handles.pop(next(iter(self._handles)))
            self._handles[shard] = handle
        if handle is None:
            return None
        names = [name for name in handle.keys() if name == item or name.startswith(f"{item}/")]
        if item not in names:
            return None
        return ComputedItem({name: handle.get_tensor(name) for name in names}, dict(facts))


def _finish(store: Any, kind: Any, job: Any, plans: list[Any], manifest: dict[str, Any], survey: dict[str, Any],
            written: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0: each plan's shards (committed, or written now) made into its tables and record, the manifest written
    once with every changed set, and what the sets' folders hold but the manifest does not list removed."""
    from vaecache.cache.manifest import write_manifest

    results: dict[str, Any] = {}
    records: dict[str, dict[str, Any]] = {}
    for plan in plans:
        mine = {part["number"]: part for part in written if part["set"] == plan.name}
        committed = survey[plan.name]["committed"]
        listed = survey[plan.name]["listed"]
        repaired = sorted(part["entry"]["file"] for part in mine.values()) if listed else []
        resumed = sum(1 for number, commit in committed.items()
                      if commit["from"] == "record" and number not in mine)
        result = {"unchanged": listed and not mine, "computed": sum(p["computed"] for p in mine.values()),
                  "copied": sum(p["copied"] for p in mine.values()), "resumed": resumed, "repaired": repaired,
                  "record": None, "extra": {}}
        results[plan.name] = result
        if result["unchanged"]:
            prior = manifest[kind.name][plan.name]
            delete_unlisted(store, f"{kind.name}/{plan.name}", prior)
            result["record"] = prior
            continue
        shards = [mine.get(number) or committed[number] for number in range(len(plan.shards))]
        facts = {item: row for shard in shards for item, row in zip(shard["items"], shard["facts"])}
        folder = set_folder(kind, plan)
        tables = {}
        for table_name, table in [(kind.item_table, item_table(kind, plan, shards)),
                                  *job.extra_tables(plan, facts)]:
            data = parquet_bytes(table)
            file = f"{folder}/{table_name}.parquet"
            store.write(file, data)
            tables[table_name] = file_entry(file, data, rows=table.num_rows)
        record, extra = job.record(plan, facts, {"shards": [shard["entry"] for shard in shards], "tables": tables})
        records[plan.name] = record
        result["record"], result["extra"] = record, extra
    if records:
        kinds = {**recorded_kinds(manifest, store.where(MANIFEST)), **module_record(kind)}
        updated = {**manifest, kind.name: {**(manifest.get(kind.name) or {}), **records}}
        if kinds:
            updated[KINDS_RECORD] = kinds
        write_manifest(store, updated)
        for name, record in records.items():
            delete_unlisted(store, f"{kind.name}/{name}", record)
    return results


def item_table(kind: Any, plan: Any, shards: list[dict[str, Any]]) -> Any:
    """The per-item table: one row per item in shard order, its columns as the plan declares them."""
    import pyarrow as pa

    values: dict[str, list[Any]] = {name: [] for name, _ in plan.columns}
    for shard in shards:
        for item, facts in zip(shard["items"], shard["facts"]):
            for name, _ in plan.columns:
                values[name].append(item if name == kind.item_column else shard["entry"]["file"]
                                    if name == SHARD_COLUMN_NAME else facts[name])
    return pa.table({name: pa.array(values[name], arrow_type(kind_type)) for name, kind_type in plan.columns})




def embed_kind(request: SetRequest, ctx: Any = None) -> list[SetOutcome]:
    """The sets of the kind `request.module` declares, embedded by the one set machinery."""
    return embed_sets(request.kind(), request, ctx)
