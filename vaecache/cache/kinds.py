"""A kind of tensor set added to a finished cache is a declaration: a `SetKind` names its folder and manifest key,
its shard files, its per-item table, and says how one shard's tensors are computed (its `SetJob`), how verify
checks its sets, and what a reader and the WebDataset export add to a clip's item. Everything else (the lock,
shards split across ranks, commits, resume and repair, rows copied from the set before, the tables, the one
manifest write, the fault hook) is vaecache.cache.embedding.embed_sets, the same for every kind.

The built-in kinds are text (vaecache.text.embed), conditions (vaecache.conditions.embed) and audio
(vaecache.audio.embed). Another kind is a class that calls `register(...)` at import of its module, and code enters
from installed packages only: a package declares its kind by a `vaecache.kinds` entry point (`NAME = MODULE` or
`NAME = MODULE:CLASS`), or the user names the module on the command line (`vaecache embed --kind MODULE`, that run
only). `embed_sets` records the module in the manifest (`"kinds": {name: module}`), but a reader never imports what a
manifest names: verify, LatentCache, the exports, subprocesses and DataLoader workers find the kind among the
installed entry points (by its name, or by the module the manifest records), and a kind no installed package
declares is one line naming it and the module to install, nothing imported (the rule torch.load(weights_only=True)
keeps). docs/architecture.md walks through tests/cache/latent_mean.py, a kind declared outside the package.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from vaecache.cache.hooks import hook_problem, kind_hook
from vaecache.cache.layout import BUILTIN_SET_KINDS as BUILTIN_MODULES
from vaecache.cache.layout import KINDS_RECORD, module_name, recorded_kinds
from vaecache.errors import KindNotInstalledError, ManifestError, UsageError, first_line

COLUMN_TYPES = ("string", "int32", "int64", "float64", "bool", "list<bool>", "list<int32>", "list<float64>")


def arrow_type(name: str) -> Any:
    import pyarrow as pa

    scalar = {"string": pa.string(), "int32": pa.int32(), "int64": pa.int64(), "float64": pa.float64(),
              "bool": pa.bool_()}
    if name.startswith("list<"):
        return pa.list_(scalar[name[5:-1]])
    return scalar[name]


@dataclass(frozen=True)
class SetPlan:
    """One set an embed writes: its name (manifest[kind][name], OUT/<kind>/<name>/), what decides its bytes
    (fingerprint; the generation hashes it with every item's input), its items cut into shards (in the order of its
    item table), and that table's columns as (name, type), the item column and `shard` among them."""

    name: str
    fingerprint: dict[str, Any]
    generation: str
    shards: list[list[str]]
    columns: tuple[tuple[str, str], ...]
    summary: dict[str, Any] = field(default_factory=dict)
    """What the run's summary shows of the plan (counts); JSON-able."""

    def __post_init__(self) -> None:
        for column, kind in self.columns:
            if kind not in COLUMN_TYPES:
                raise ValueError(f"set {self.name}: column {column!r} has type {kind!r}; the types are "
                                 f"{', '.join(COLUMN_TYPES)}")

    @property
    def items(self) -> list[str]:
        return [item for shard in self.shards for item in shard]


@dataclass(frozen=True)
class ComputedItem:
    """One item as a shard holds it: its tensors (named `item` or `item/<part>`) and its item-table row (every column
    but the item and the shard)."""

    tensors: dict[str, Any]
    facts: dict[str, Any]


class SetJob(Protocol):
    """One embed's work for one kind, made on every rank by `SetKind.job` (models loaded there)."""

    def plans(self) -> list[SetPlan]:
        """The sets this embed writes, the same on every rank."""

    def follows(self, prior: dict[str, Any], plan: SetPlan) -> bool:
        """The listed set `prior` was made from the same inputs but the cache's clips (an encode added some): it is
        brought up to date without --replace."""

    def reusable(self, prior: dict[str, Any], plan: SetPlan, item: str, facts: dict[str, Any]) -> bool:
        """An item of `prior` (its table row `facts`) holds what this plan would compute for it: copied, not
        computed."""

    def compute(self, number: int, todo: dict[str, list[str]]) -> tuple[dict[str, dict[str, ComputedItem]],
                                                                        list[str]]:
        """Shard `number`'s items of each set in `todo` (set name -> items) computed: per set, per item; and what
        the run should tell (out-of-memory backoffs)."""

    def extra_tables(self, plan: SetPlan, facts: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
        """Tables written after the item table, as (name without .parquet, pyarrow table); rank 0."""

    def record(self, plan: SetPlan, facts: dict[str, dict[str, Any]],
               files: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The set's manifest record, `files` ({"shards": [...], "tables": {...}}) placed in it, and what the
        summary shows (JSON-able); rank 0."""


class SetKind:
    """A declaration of a kind of set. Subclasses set the class attributes and implement `job`; the readers,
    verify and export hooks have generic defaults a kind may override."""

    name: str = ""
    """The manifest's key and OUT's folder: manifest[name][set], OUT/<name>/<set>/<generation>/."""
    what: str = "set"
    """How messages name one set: "text set", "condition set"."""
    shard_prefix: str = "shard-"
    item_table: str = "items"
    """The per-item table's name (without .parquet): one row per item, its shard and its facts."""
    item_column: str = "id"
    metadata_key: str = "vaecache_set"
    """The shard's one safetensors metadata key; its value the set's name."""
    export_member: str = ""
    """The WebDataset member holding the kind's tensors of a clip (default <name>.safetensors)."""
    sets_key: str = ""
    """The key naming the kind's sets in verify's summary and in a WebDataset sample's json (default <name>_sets)."""
    export_description: str = ""
    """What the WebDataset member holds, for the export's export.json."""

    def member(self) -> str:
        return self.export_member or f"{self.name}.safetensors"

    def summary_key(self) -> str:
        return self.sets_key or f"{self.name}_sets"

    # --- embed
    def job(self, request: Any, store: Any, manifest: dict[str, Any], ctx: Any, device: Any, given: Any) -> SetJob:
        """The embed's work, made on every rank (`given`: what `embed_sets`' before_lock read on rank 0, None on the
        others)."""
        raise NotImplementedError

    def refusal(self, where: str, name: str) -> str:
        """The message for a listed set made from other inputs, without --replace."""
        return (f"{where}: the cache already holds {self.what} {name!r}, made from other inputs; --replace "
                "replaces it")

    # --- read
    def readers(self, store: Any, manifest: dict[str, Any], verify: str) -> list[Any]:
        """One reader per listed set; each has `name`, `item(clip) -> {tensor name: tensor}` (what LatentCache's
        item adds), `export_tensors(clip)` and `export_facts(clip)` (what the WebDataset export writes)."""
        from vaecache.cache.sets import ItemSet

        return [ItemSet(store, manifest, self, name, verify) for name in set_names(manifest, self)]

    def decode(self, stored: dict[str, Any], facts: dict[str, Any]) -> dict[str, Any]:
        """A WebDataset sample's tensors of this kind as LatentCache's item has them (`facts`: set -> export_facts)."""
        return dict(stored)

    def left_out(self, row: dict[str, Any]) -> str | None:
        """Why the clip of this item-table row holds no tensor (its item recorded but left out, e.g. a clip without
        sound under `--audio-missing skip`), or None: it holds one (default)."""
        return None

    # --- verify
    def check_item(self, cache: Any, clip: str, tensors: dict[str, Any], row: dict[str, Any]) -> str | None:
        """verify's check of one clip's tensors (named `clip`, `clip/<part>`) against its table row and the cache (a
        CacheReader: `cache.clip_records()`): what links the item to its clip; a problem, or None (default: nothing
        more than the generic checks)."""
        return None

    def verify_sets(self, cache: Any, quick: bool, check_type: type) -> list[Any]:
        from vaecache.cache.sets import verify_item_sets

        return verify_item_sets(cache, self, quick, check_type)

    def reencode_sets(self, cache: Any, options: Any, ctx: Any, check_type: type) -> list[Any]:
        """verify --reencode's checks of this kind (default: none)."""
        return []


_REGISTERED: dict[str, SetKind] = {}
MANIFEST_FIELDS = ("format", "format_version", "created_at", "producer", "vae", "fingerprint_sha256", "frame_rule",
                   "settings", "latent", "planned_clips", "oom_backoffs", "counts", "shards", "clips", "failures",
                   "buckets", KINDS_RECORD)
"""The manifest's own top-level keys: a kind's sets are listed under its name there, so no kind may take one."""


def register(kind: SetKind) -> SetKind:
    """Declare `kind` (at import of its module). A name is one kind: registering another class under a taken name is
    refused."""
    if not kind.name or "/" in kind.name or kind.name.startswith("."):
        raise UsageError(f"a set kind needs a plain folder name, got {kind.name!r}")
    from vaecache.cache.layout import OWNED_ENTRIES

    held = _REGISTERED.get(kind.name)
    if held is not None and type(held) is not type(kind):
        raise UsageError(f"set kind {kind.name!r} is declared twice ({type(held).__module__} and "
                         f"{type(kind).__module__})")
    if held is None and kind.name not in BUILTIN_MODULES and (kind.name in OWNED_ENTRIES or
                                                              kind.name in MANIFEST_FIELDS):
        raise UsageError(f"set kind {kind.name!r}: the name of an entry of the cache's own layout or manifest")
    _REGISTERED[kind.name] = kind
    return kind


ENTRY_POINT_GROUP = "vaecache.kinds"
"""The entry-point group by which an installed package declares a kind: `NAME = MODULE` (the module registers the
kind at import) or `NAME = MODULE:CLASS` (a SetKind subclass, registered when loaded)."""
def installed_kinds() -> dict[str, list[Any]]:
    """The `vaecache.kinds` entry points of the installed packages, by name (metadata only: nothing imported)."""
    from importlib.metadata import entry_points

    found: dict[str, list[Any]] = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        held = found.setdefault(point.name, [])
        if all(other.value != point.value for other in held):  # one package seen twice on sys.path
            held.append(point)
    return found


def not_installed(name: str, module: str | None) -> str | None:
    """Why a reader would not read kind `name`'s sets (no installed package declares it), or None: it is built in,
    registered, or an installed entry point declares it. Metadata only: nothing is imported."""
    if name in _REGISTERED or name in BUILTIN_MODULES:
        return None
    installed = installed_kinds()
    if name in installed or any(point.module == module for points in installed.values() for point in points):
        return None
    return (f"no installed package declares it (a `{ENTRY_POINT_GROUP}` entry point): install the package that "
            f"provides {module or name} to read these sets; nothing was imported")


def kind_named(name: str, module: str | None = None, where: str = "manifest.json") -> SetKind:
    """The kind `name` a cache holds sets of: one this process has registered, a built-in one, or the one an installed
    package declares by a `vaecache.kinds` entry point named `name` or pointing at `module` (the module the cache
    records). Nothing else is imported: a kind no installed package declares is a KindNotInstalledError naming it and
    `module`."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in BUILTIN_MODULES:
        importlib.import_module(BUILTIN_MODULES[name])
        return _REGISTERED[name]
    installed = installed_kinds()
    points = installed.get(name) or [point for points in installed.values() for point in points
                                     if module is not None and point.module == module]
    declared_by = f"module {module}" if module else "no module"
    if not points:
        raise KindNotInstalledError(f"{where}: set kind {name!r} ({declared_by}) is declared by no installed "
                                    f"package: install the package whose `{ENTRY_POINT_GROUP}` entry point declares "
                                    f"{module or name} to read its sets; nothing was imported")
    if len(points) > 1:
        raise ManifestError(f"{where}: set kind {name!r} is declared by {len(points)} installed entry points "
                            f"({', '.join(sorted(point.value for point in points))}): uninstall all but one")
    (point,) = points
    try:
        loaded = point.load()
    except Exception as exc:  # noqa: BLE001  # an installed package's own failure, named in one line
        raise ManifestError(f"{where}: set kind {name!r}: its entry point {point.value} ({ENTRY_POINT_GROUP}) does "
                            f"not load ({type(exc).__name__}: {first_line(exc)})") from None
    if isinstance(loaded, type) and issubclass(loaded, SetKind) and loaded.name not in _REGISTERED:
        register(loaded())
    elif isinstance(loaded, SetKind) and loaded.name not in _REGISTERED:
        register(loaded)
    if name not in _REGISTERED:
        raise ManifestError(f"{where}: set kind {name!r}: its entry point {point.value} ({ENTRY_POINT_GROUP}) does "
                            "not declare it (no SetKind of that name registered)")
    return _REGISTERED[name]


def cache_kinds(manifest: dict[str, Any], where: str = "manifest.json") -> list[SetKind]:
    """Every kind a cache's manifest may hold sets of: the built-in ones, then those it records, in name order."""
    recorded = recorded_kinds(manifest, where)
    names = [*BUILTIN_MODULES, *sorted(name for name in recorded if name not in BUILTIN_MODULES)]
    return [kind_named(name, recorded.get(name), where) for name in names]


def set_names(manifest: dict[str, Any], kind: SetKind) -> list[str]:
    sets = manifest.get(kind.name) or {}
    return sorted(sets) if isinstance(sets, dict) else []


def module_record(kind: SetKind) -> dict[str, str]:
    """What the manifest records of `kind`: nothing for a built-in, else its module."""
    if kind.name in BUILTIN_MODULES:
        return {}
    return {kind.name: type(kind).__module__}


@dataclass
class SetOutcome:
    """What one embed did to one set (the same on every rank)."""

    name: str
    record: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    unchanged: bool = False
    replaced: bool = False
    updated: bool = False
    computed: int = 0
    """Items the encoder ran on."""
    copied: int = 0
    """Items copied from the set before (a grown cache, the same encoder)."""
    resumed: int = 0
    """Shards an interrupted run had committed, kept."""
    repaired: list[str] = field(default_factory=list)
    """Shards of the listed set found missing or damaged and computed again."""
    events: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SetRequest:
    """`vaecache embed OUT --kind MODULE`: the sets of a kind declared outside vaecache (the module registers it)."""

    out: str
    module: str
    set_name: str = "default"
    replace: bool = False
    shard_bytes: int = 256 << 20
    device: str = "auto"
    storage_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.shard_bytes < 1:
            raise UsageError(f"--shard-size must be at least 1 byte, got {self.shard_bytes}")
        if not module_name(self.module):
            raise UsageError(f"--kind must name a Python module (dotted), got {self.module!r}")

    def kind(self) -> SetKind:
        """The one kind `module` registers (imported here)."""
        try:
            importlib.import_module(self.module)
        except ImportError as exc:
            raise UsageError(f"--kind {self.module}: the module does not import ({exc})") from None
        declared = [kind for kind in _REGISTERED.values() if type(kind).__module__ == self.module]
        if len(declared) != 1:
            raise UsageError(f"--kind {self.module}: the module must register exactly one set kind "
                             f"(vaecache.cache.kinds.register), it registers {len(declared)}")
        return declared[0]


__all__ = ["ENTRY_POINT_GROUP", "ComputedItem", "SetJob", "SetKind", "SetOutcome", "SetPlan", "SetRequest",
           "cache_kinds", "hook_problem", "installed_kinds", "kind_hook", "kind_named", "not_installed",
           "recorded_kinds", "register", "set_names"]
