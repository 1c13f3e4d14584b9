"""Ownership of an output folder: the run fingerprint guard, taking the lock (vaecache.cache.lock), cleaning up
after crashes, and DiskOut: OUT on disk as a run and verify use it (objects.ObjectOut is the same for a URL)."""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from vaecache.cache.io import AppendLog, atomic_write_bytes, atomic_write_json, read_json
from vaecache.cache.layout import (
    BUILTIN_SET_KINDS,
    KINDS_RECORD,
    LOCK,
    LOGS_DIR,
    MANIFEST,
    OWNED_ENTRIES,
    PROBES_DIR,
    PROGRESS_DIR,
    RUN,
    SHARD_SUFFIX,
    SHARDS_DIR,
    failures_path,
    probes_path,
    progress_path,
    recorded_kinds,
)
from vaecache.cache.lock import acquire_lock, release_lock
from vaecache.cache.manifest import read_manifest
from vaecache.cache.progress import CommittedIds, committed_ids, committed_shards, progress_counts
from vaecache.cache.provenance import identity_change
from vaecache.cache.reader import CacheReader
from vaecache.cache.repair import damaged_shards, forget_hashed_shards, repair_progress, repair_strays
from vaecache.cache.store import LocalStore
from vaecache.differences import describe_differences
from vaecache.errors import ManifestError, OutputError, UsageError
from vaecache.models import unrecorded_vae_part

log = logging.getLogger("vaecache")

ShardProblems = Callable[[list[dict[str, Any]]], dict[str, str]]
"""Committed shard records -> {file: problem} for the damaged ones (repair.damaged_shards for files on disk)."""


@dataclass(frozen=True)
class StrayFindings:
    """What a commit protocol's own stray check found: the problems (one line each), how many objects were fine, and
    what a user should do about them (None when nothing is wrong)."""

    problems: list[str]
    passed: int
    note: str | None = None


@dataclass(frozen=True)
class PreparedOut:
    """What rank 0 found in OUT and tells every rank before encoding starts."""

    attempt: int
    committed_clips: int
    """Clips committed by earlier attempts and kept (their ids went to prepare_out's `committed`)."""
    discarded_files: int
    complete: bool = False
    """OUT already holds a finished cache made with these settings; it was left untouched (see begin_changes)."""
    damaged: tuple[str, ...] = ()
    """Committed shards found damaged and dropped ("file: problem"): their clips are encoded again."""
    rewritten: tuple[str, ...] = ()
    """Objects of OUT's commit protocol written again from the commit records ("object: why"): a compacted object
    that disagreed with them or did not read."""

    def __post_init__(self) -> None:
        if min(self.attempt, self.committed_clips, self.discarded_files) < 0:
            raise ValueError(f"attempt, committed_clips and discarded_files must be >= 0, got {self.attempt}, "
                             f"{self.committed_clips}, {self.discarded_files}")


def _is_complete(out: Path) -> bool:
    try:
        read_manifest(out)
    except ManifestError:
        return False
    return True


def begin_changes(out: Path, attempt: int, fingerprint: dict[str, Any] | None = None,
                  sources: dict[str, dict[str, Any]] | None = None,
                  committed: CommittedIds | None = None, extra_numerics: Sequence[dict[str, Any]] = (),
                  shard_problems: ShardProblems | None = None) -> PreparedOut:
    """Rank 0 only, before anything is committed: record the attempt, drop the manifest (OUT is not complete
    until finalize rewrites it) and repair what a crash left behind. Without `fingerprint`, the one in run.json
    is kept (prepare_out has already checked it); `sources` are added to the ones recorded there. The ids of
the committed clips go to `committed` (repair_progress). `extra_numerics` (other ranks' numerics, allowed by
--allow-other-numerics) join the numerics history run.json keeps once more than one computed latents.
`shard_problems` checks committed shards that do not lie in `out` (objects.ObjectOut); default: the files there."""
    out = Path(out)
    recorded = read_json(out / RUN, "run record") if (out / RUN).exists() else {}
    fingerprint = recorded["fingerprint"] if fingerprint is None else fingerprint
    sources = {**recorded.get("sources", {}), **(sources or {})}
    history = numerics_history(recorded, fingerprint, extra_numerics)
    carried = carried_sets(out, recorded)
    atomic_write_json(out / RUN, {"fingerprint": fingerprint, "attempt": attempt, "sources": sources,
                                  **({"numerics_history": history} if len(history) > 1 else {}),
                                  **({CARRIED_SETS: carried} if carried else {})})
    if carried and (out / MANIFEST).exists():
        log.warning("%s: %s stay listed, made for the clips before this run: run vaecache embed again to add the "
                    "new clips (until then verify names each clip without one)", out,
                    ", ".join(f"{kind} set {name}" for kind, sets in sorted(carried.items()) if kind != "kinds"
                              for name in sorted(sets)))
    (out / MANIFEST).unlink(missing_ok=True)
    kept, discarded, damaged = repair_progress(out, committed, shard_problems)
    for file, problem in sorted(damaged.items()):
        log.warning("%s: committed shard is damaged (%s); its clips are encoded again", out / file, problem)
    return PreparedOut(attempt, kept, discarded, damaged=tuple(f"{f}: {p}" for f, p in sorted(damaged.items())))


CARRIED_SETS = "carried_sets"
"""run.json's record of the finished manifest's text and condition sets while a run that adds clips is under way
(the manifest is gone until finalize), so that finalize lists them again, a crash and resume included."""


def carried_sets(out: Path, recorded: dict[str, Any]) -> dict[str, Any]:
    """The sets of every kind (vaecache.cache.kinds) the next manifest lists again, with the record of the kinds
    declared outside vaecache: the finished manifest's, or, once it is gone (a resumed run), what run.json recorded
    of them."""
    if (out / MANIFEST).exists():
        manifest = read_json(out / MANIFEST, "manifest")
        declared = recorded_kinds(manifest, str(out / MANIFEST))
        carried = {kind: manifest[kind] for kind in [*BUILTIN_SET_KINDS, *declared]
                   if isinstance(manifest.get(kind), dict) and manifest[kind]}
        if carried and declared:
            carried[KINDS_RECORD] = declared
        return carried
    found = recorded.get(CARRIED_SETS)
    return dict(found) if isinstance(found, dict) else {}


def declared_kinds(out: Path) -> list[str]:
    """The folders of the kinds of set declared outside vaecache that OUT's manifest (or, while a run that adds clips
    is under way, run.json) records: --overwrite removes them with the rest of the cache."""
    names: set[str] = set()
    for name, where in ((MANIFEST, ()), (RUN, (CARRIED_SETS,))):
        try:
            found: Any = read_json(out / name, name)
            for key in where:
                found = found.get(key) or {}
            names.update(recorded_kinds(found if isinstance(found, dict) else {}))
        except (OSError, ValueError, AttributeError, ManifestError):  # a record that does not read names no folder
            continue
    return sorted(name for name in names if "/" not in name and not name.startswith("."))


def changed_sources(recorded: dict[str, dict[str, Any]], current: dict[str, dict[str, Any]]) -> list[str]:
    """Sources both runs saw whose identity differs (the rule of provenance.identity_change). Sources that are
    new (a grown dataset) or gone are not changes here."""
    changed = []
    for path in sorted(set(recorded) & set(current)):
        change = identity_change(recorded[path], current[path])
        if change is not None:
            changed.append(f"{path}: {change}")
    return changed


def numerics_history(recorded: dict[str, Any], fingerprint: dict[str, Any],
                     extra: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Every distinct numerics that computed latents in OUT, oldest first: the recorded history (or the
    recorded fingerprint's numerics), then this run's, then `extra` (other ranks of this run)."""
    history = list(recorded.get("numerics_history") or [])
    if not history and (recorded.get("fingerprint") or {}).get("numerics"):
        history.append(recorded["fingerprint"]["numerics"])
    for numerics in (fingerprint.get("numerics"), *extra):
        if numerics and numerics not in history:
            history.append(numerics)
    return history


def recorded_numerics_history(out: Path) -> list[dict[str, Any]]:
    """run.json's numerics history (empty when one numerics computed every latent, or OUT has no run.json)."""
    try:
        return list(read_json(Path(out) / RUN, "run record").get("numerics_history") or [])
    except (ManifestError, AttributeError):
        return []


def upgraded_fingerprint(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """A run fingerprint written by an older vaecache in today's terms: 0.3's "max_views_per_forward" 1 (one view
    per forward) is "views_per_forward" 1 (a larger value batched views across clips, which no setting does now);
    a VAE part written before 0.7 recorded the model family gets its class's family and the encode that ran then
    (vaecache.models.unrecorded_vae_part: HunyuanVideo's were tiled in time above 16 frames)."""
    parts = {}
    for name, part in fingerprint.items():
        if isinstance(part, dict) and part.get("max_views_per_forward") == 1 and "views_per_forward" not in part:
            part = {("views_per_forward" if key == "max_views_per_forward" else key): value
                    for key, value in part.items()}
        if name == "vae" and isinstance(part, dict):
            part = unrecorded_vae_part(part)
        parts[name] = part
    return parts


def _recorded_fingerprint_part(out: Path, part: str) -> dict[str, Any] | None:
    """One part of the fingerprint run.json in `out` records (None: no readable record, or no such object)."""
    try:
        found = read_json(Path(out) / RUN, "run record").get("fingerprint", {}).get(part, {})
    except (ManifestError, AttributeError):
        return None
    return found if isinstance(found, dict) else None


def recorded_cpu_threads(out: Path) -> int | None:
    """The torch threads per rank a CPU encode into `out` recorded (None: no such record). Read by every rank at
    start-up, before rank 0 checks the whole record, so that a resume computes with the same count."""
    numerics = _recorded_fingerprint_part(out, "numerics") or {}
    threads = numerics.get("threads") if numerics.get("device") == "cpu" else None
    return threads if isinstance(threads, int) and threads > 0 else None


def recorded_encoder_impl(out: Path) -> str | None:
    """The encoder implementation a run into `out` recorded ("fast" or "reference"; None: no run record). A
    resumed run with --encoder-impl auto takes it, so that a newer auto never mixes implementations in one cache."""
    vae = _recorded_fingerprint_part(out, "vae")
    impl = vae.get("encoder_impl", "reference") if vae is not None else None
    return impl if impl in ("fast", "reference") else None


def prepare_out(out: Path, fingerprint: dict[str, Any], overwrite: bool, job_id: str | None,
                sources: dict[str, dict[str, Any]] | None = None,
                committed: CommittedIds | None = None, allow_other_numerics: bool = False,
                extra_numerics: Sequence[dict[str, Any]] = (), shard_problems: ShardProblems | None = None,
                lock: bool = True) -> PreparedOut:
    """Rank 0 only: take the lock, check or start the run record, repair what a crash left behind, and tell
    `committed` the ids of the committed clips it keeps (repair_progress).

    `sources` maps each source video to its identity (size, mtime_ns, sha256 with --hash-sources); a resume
    whose sources changed under the cache is refused. A resume that differs in numerics alone (device kind,
    torch, CPU threads) is refused unless `allow_other_numerics`; then run.json keeps every numerics used.
    `out` may be the work folder of an OUT in object storage (objects.ObjectOut, which holds the lock there: `lock`
    False), with its `shard_problems`."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: --out exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{out}: cannot create output folder ({exc.strerror or exc})") from None
    run_file = out / RUN
    read_only = _read_only(out)
    if read_only and (overwrite or not run_file.exists() or not _is_complete(out)):
        raise OutputError(f"{out}: on a read-only filesystem; encode can only confirm a complete cache there, and "
                          f"{'--overwrite asks to rewrite it' if overwrite else 'it is not complete'}")
    if not read_only and lock:  # nothing can change a read-only OUT through this mount: no lock to take
        acquire_lock(out, job_id)
    try:
        if overwrite:
            for name in (*OWNED_ENTRIES, *declared_kinds(out)):
                if name == LOCK:
                    continue
                target = out / name
                if target.is_dir():
                    shutil.rmtree(target)
                else:
                    target.unlink(missing_ok=True)
        elif not run_file.exists():
            foreign = sorted(p.name for p in out.iterdir() if p.name not in OWNED_ENTRIES)
            if foreign:
                raise UsageError(f"{out}: not empty and not a vaecache output (holds {', '.join(foreign[:3])}); "
                                 "choose another --out")
        attempt = 0
        numerics_changed: list[str] = []
        if run_file.exists():
            try:
                recorded = read_json(run_file, "run record")
                if not isinstance(recorded, dict):
                    raise ManifestError(f"{run_file}: the run record is not a JSON object")
            except ManifestError as exc:
                raise OutputError(f"{exc}; rerun with --overwrite to start over") from None
            before = upgraded_fingerprint(recorded.get("fingerprint", {}))
            if "numerics" not in before:  # written before 0.5: what it computed with is not known
                before["numerics"] = fingerprint.get("numerics")
            diffs = describe_differences(before, fingerprint)
            if diffs and allow_other_numerics and all(diff.startswith("numerics.") for diff in diffs):
                numerics_changed, diffs = diffs, []
            if diffs and all(diff.startswith("numerics.") for diff in diffs):
                raise UsageError(f"{out} was encoded with other numerics ({'; '.join(diffs[:4])}): latents added now "
                                 "would differ from the committed ones in the last bits; resume on the same kind of "
                                 "device and torch (on CPU, OMP_NUM_THREADS as recorded), or --overwrite to start over")
            if diffs:
                raise UsageError(f"{out} was made with other settings ({'; '.join(diffs[:4])}); "
                                 "use the same settings to resume, or --overwrite to start over")
            changed = changed_sources(recorded.get("sources", {}), sources or {})
            if changed:
                raise UsageError(f"{out} was made from other data: {len(changed)} source(s) changed since "
                                 f"({'; '.join(changed[:3])}); resume on the same data, or --overwrite to start over")
            attempt = int(recorded.get("attempt", 0)) + 1
        if not read_only:
            for folder in (SHARDS_DIR, PROGRESS_DIR, LOGS_DIR):
                (out / folder).mkdir(exist_ok=True)
        if attempt > 0 and _is_complete(out):
            # A finished cache stays byte for byte as it is unless new work is about to be committed, or one of
            # its shards is damaged (then this run repairs it: the damaged shards' clips are encoded again).
            damaged = (shard_problems or (lambda shards: damaged_shards(out, shards)))(committed_shards(out))
            if not damaged:
                return PreparedOut(attempt, committed_ids(out, committed), 0, complete=True)
            if read_only:
                raise OutputError(f"{out}: {len(damaged)} committed shard(s) are damaged "
                                  f"({'; '.join(f'{f}: {p}' for f, p in sorted(damaged.items())[:2])}) and the "
                                  "filesystem is read-only: repair needs a writable OUT")
            forget_hashed_shards(out)  # it may vouch for the damaged shard (same size and mtime)
        if numerics_changed:  # said only where latents are about to be added
            log.warning("%s was encoded with other numerics (%s); resuming as --allow-other-numerics asks: "
                        "latents added now may differ from the committed ones in the last bits (recorded)",
                        out, "; ".join(numerics_changed[:4]))
        return begin_changes(out, attempt, fingerprint, sources, committed, extra_numerics, shard_problems)
    except BaseException:
        release_lock(out)
        raise


class FolderOut:
    """What both commit protocols do alike in the folder the disk code runs in (OUT itself, or the work folder of an
    OUT at a URL): the run's own records, logs and finalize. A run asks these of `run.out` and does not know which
    protocol it holds."""

    folder: Path

    def where(self, name: str = "") -> Any:
        """OUT (or OUT/name) as the user named it, for messages."""
        return self.store.where(name)  # type: ignore[attr-defined]

    def recorded_cpu_threads(self) -> int | None:
        return recorded_cpu_threads(self.folder)

    def recorded_encoder_impl(self) -> str | None:
        return recorded_encoder_impl(self.folder)

    def probes_folder(self) -> Path:
        return self.folder / PROBES_DIR

    def probes_file(self, rank: int) -> Path:
        return probes_path(self.folder, rank)

    def log_file(self, rank: int) -> Path:
        """This rank's log (logs/rank-N.log; its folder made, OSError where OUT is read-only)."""
        (self.folder / LOGS_DIR).mkdir(parents=True, exist_ok=True)
        return self.folder / LOGS_DIR / f"rank-{rank:05d}.log"

    def failure_log_file(self, rank: int) -> Path:
        return failures_path(self.folder, rank)

    def progress_log(self, rank: int) -> AppendLog:
        """This rank's fsynced append-only progress log."""
        return AppendLog(progress_path(self.folder, rank))

    def finished(self) -> CacheReader:
        """Rank 0: the finished cache as prepare found it (its manifest and failure table)."""
        return CacheReader(self.folder)

    def numerics_history(self) -> list[dict[str, Any]]:
        return recorded_numerics_history(self.folder)

    def finalize(self, header: dict[str, Any],
                 only_writer: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Rank 0, after every rank finished: the progress logs merged into the tables and the manifest (last), then
        published. `only_writer`: this process wrote every commit of the run since it prepared OUT (one rank), so
        its own records are all there is. Returns the manifest and the failure records."""
        from vaecache.cache.finalize import finalize

        self.before_finalize(only_writer)
        recorded = read_json(self.folder / RUN, "run record") if (self.folder / RUN).exists() else {}
        carried = recorded.get(CARRIED_SETS)
        manifest = finalize(self.folder, {**header, **(carried if isinstance(carried, dict) else {})})
        self.publish()
        return manifest, CacheReader(self.folder).failure_records()

    def before_finalize(self, only_writer: bool) -> None:
        raise NotImplementedError

    def publish(self) -> None:
        raise NotImplementedError


class DiskOut(FolderOut):
    """OUT as a folder, as an encode writes it and verify repairs it: the disk code runs in OUT itself; a shard is
    written by temp file, fsync and rename, and committed by its line in the rank's fsynced append-only progress log
    (vaecache.cache.progress). The same interface as objects.ObjectOut, which hides the other protocol."""

    def __init__(self, store: LocalStore) -> None:
        self.store = store
        self.folder = store.folder
        """Where the disk code runs: OUT itself."""

    # --- a run ---------------------------------------------------------------------------------------------------
    def pull_start(self) -> None:
        """Before start-up, what can be told about OUT without the run fingerprint (prepare_out checks the rest):
        nothing to fetch, OUT is here."""
        if self.folder.exists() and not self.folder.is_dir():
            raise UsageError(f"{self.folder}: --out exists and is not a folder")

    def looked_empty(self) -> bool:
        """OUT holds no run record, manifest or progress log now (a guess prepare confirms or refutes)."""
        return not any((self.folder / name).exists() for name in (RUN, MANIFEST, PROGRESS_DIR))

    def prepare(self, fingerprint: dict[str, Any], overwrite: bool, job_id: str | None,
                sources: dict[str, dict[str, Any]] | None, committed: CommittedIds | None,
                allow_other_numerics: bool = False, extra_numerics: Sequence[dict[str, Any]] = ()) -> PreparedOut:
        """Rank 0: prepare_out, under OUT's lock (held until `release_lock`)."""
        return prepare_out(self.folder, fingerprint, overwrite, job_id, sources, committed, allow_other_numerics,
                           extra_numerics)

    def begin_again(self, attempt: int, fingerprint: dict[str, Any], sources: dict[str, dict[str, Any]] | None,
                    committed: CommittedIds | None, extra_numerics: Sequence[dict[str, Any]] = ()) -> PreparedOut:
        """Rank 0: a finished cache is about to change (the dataset grew)."""
        return begin_changes(self.folder, attempt, fingerprint, sources, committed, extra_numerics)

    def write_shard(self, file: str, data: bytes) -> None:
        atomic_write_bytes(self.folder / file, data)

    def commit(self, file: str, line: str) -> None:
        """On disk the shard's commit is its progress line, which the writer appends next."""

    def settle(self) -> None:
        """Every commit is there once the writer appended its line."""

    def leave_torn_shard(self, file: str, data: bytes) -> None:
        """A crash mid-write (fault injection): a cut temp file, as an interrupted write leaves one."""
        path = self.folder / file
        with open(path.parent / f".{path.name}.crash.tmp", "wb") as handle:
            handle.write(data[: len(data) // 2])

    def mirror(self, path: Path) -> Callable[[], None] | None:
        """A function that publishes the local file `path` to OUT: none is needed, it is in OUT."""
        return None

    def before_finalize(self, only_writer: bool) -> None:
        """Rank 0: the progress logs finalize merges are OUT's own."""

    def publish(self) -> None:
        """Finalize wrote the tables and the manifest (last) into OUT."""

    def end_run(self, rank: int, attempt: int, log_file: Path, holds_lock: bool) -> None:
        """The end of a rank's run: the log is in OUT already; rank 0 releases the lock."""
        if holds_lock:
            self.release_lock()

    def release_lock(self) -> None:
        release_lock(self.folder)

    def close(self) -> None:
        """Nothing to remove."""

    # --- verify --------------------------------------------------------------------------------------------------
    check_name = "progress lines"
    """A shard file the manifest does not list is verify's orphan check; this protocol's own is that each shard the
    manifest lists is still committed by a line of a progress log (as an object store's commit record)."""

    def counts(self) -> tuple[int, int]:
        """(committed clips, committed shards) of a run without a manifest."""
        return progress_counts(self.folder) if self.folder.is_dir() else (0, 0)

    def repair(self, listed: set[str] | None) -> list[str]:
        """verify --repair: the stray shard files and temp files, deleted under OUT's lock."""
        return repair_strays(self.folder)

    def problems(self, listed: set[str] | None) -> StrayFindings | None:
        """Each shard the finished manifest lists (`listed`) whose progress line is gone (the next encode would take it
        for a stray, delete it and encode its clips again); None without a manifest (nothing to hold them to). A
        cache written to an object store and copied here commits by its commit records (progress/commits/)."""
        if listed is None:
            return None
        prefix = f"{SHARDS_DIR}/"
        listed = {name for name in listed if name.startswith(prefix) and name.endswith(SHARD_SUFFIX)
                  and "/" not in name[len(prefix):] and not name[len(prefix):].startswith(".")}  # the rest: named
        claimed = {str(shard.get("file")) for shard in committed_shards(self.folder)}  # by the manifest check
        commits = self.folder / PROGRESS_DIR / "commits"
        if commits.is_dir():
            claimed.update(f"{SHARDS_DIR}/{path.stem}{SHARD_SUFFIX}" for path in commits.glob("*.json"))
        lost = sorted(listed - claimed)
        problems = [f"{shard}: listed in the manifest, no progress line commits it any more (the next encode would "
                    "take it for a stray, delete it and encode its clips again)" for shard in lost]
        note = ("listed shard(s) lost their progress line: rerun the same encode command to encode their clips again"
                if lost else None)
        return StrayFindings(problems, len(listed) - len(lost), note)


def _read_only(out: Path) -> bool:
    """Whether OUT lies on a filesystem mounted read-only (writes there fail with EROFS, for root too)."""
    try:
        return bool(os.statvfs(out).f_flag & os.ST_RDONLY)
    except OSError:
        return False


__all__ = ["DiskOut", "FolderOut", "PreparedOut", "ShardProblems", "StrayFindings", "begin_changes",
           "numerics_history", "prepare_out", "recorded_cpu_threads",
           "recorded_numerics_history"]
