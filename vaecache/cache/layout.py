"""Names and version of the on-disk layout of a latent cache.

OUT/
  manifest.json        written last, once; its presence means "complete"
  clips.parquet        the clip table: one row per clip, sorted by clip id (sha256 recorded in manifest.json)
  failures.parquet     inputs that produced no clip, with the reason
  (format version 1 wrote clips.jsonl and failures.jsonl instead; those caches are still read)
  run.json             settings + VAE fingerprint of the run that owns OUT (checked on resume)
  shards/*.safetensors latent shards
  progress/rank-*.jsonl  per-rank commit log: one line per committed shard (merged into the manifest)
  probes/rank-*.jsonl  per-rank probe cache: what opening each source told (a restart opens no video twice)
  logs/rank-*.log      per-rank logs
  text/<set>/...       text-embedding sets `vaecache embed` adds (vaecache.text.sets)
  conditions/<kind>/...  image-to-video condition sets `vaecache embed --condition` adds (vaecache.conditions)
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from vaecache.cache.v1 import CLIPS_V1, FAILURES_V1
from vaecache.errors import ManifestError, UnsafePathError

VERIFY_MODES = ("size", "sha256", "none")
"""How a reader checks a shard the first time it opens it: its byte count (size), its sha256 against the manifest
(sha256), or not at all (none)."""

FORMAT_NAME = "vaecache"
FORMAT_VERSION = 2
SUPPORTED_VERSIONS = (1, 2)
"""1: clip and failure records as JSON Lines; 2: as Parquet tables (vaecache.cache.table)."""

MANIFEST = "manifest.json"
CLIPS = "clips.parquet"
FAILURES = "failures.parquet"
RUN = "run.json"
LOCK = ".lock"
SHARDS_DIR = "shards"
PROGRESS_DIR = "progress"
ROWS_SUFFIX = ".arrows"
LOGS_DIR = "logs"
PROBES_DIR = "probes"
SHARD_SUFFIX = ".safetensors"
TEXT_DIR = "text"
"""Text-embedding sets added to a finished cache (vaecache.text.sets)."""
CONDITIONS_DIR = "conditions"
"""Image-to-video condition sets added to a finished cache (vaecache.conditions.sets)."""
AUDIO_DIR = "audio"
"""Audio latent sets added to a finished cache (vaecache.audio.embed)."""
BUILTIN_SET_KINDS = {TEXT_DIR: "vaecache.text.embed", CONDITIONS_DIR: "vaecache.conditions.embed",
                     AUDIO_DIR: "vaecache.audio.embed"}
"""The kinds of set vaecache declares (vaecache.cache.kinds), by their folder, with the module that registers each."""
KINDS_RECORD = "kinds"
"""manifest.json's record of the kinds of set declared outside vaecache: {kind name: the module that registers it}."""
OWNED_ENTRIES = (MANIFEST, CLIPS, FAILURES, CLIPS_V1, FAILURES_V1, RUN, SHARDS_DIR, PROGRESS_DIR, LOGS_DIR, LOCK,
                 PROBES_DIR, TEXT_DIR, CONDITIONS_DIR, AUDIO_DIR)
"""Everything vaecache may create in OUT (anything else there means OUT is not a cache)."""


def progress_path(out: Path, rank: int) -> Path:
    return Path(out) / PROGRESS_DIR / f"rank-{rank:05d}.jsonl"


def rows_name(rank: int, attempt: int) -> str:
    """The clip-table rows a rank committed in one attempt (an Arrow IPC stream beside its progress log, see
    table.RowLog)."""
    return f"rows-rank-{rank:05d}-a{attempt:03d}{ROWS_SUFFIX}"


def probes_path(out: Path, rank: int) -> Path:
    return Path(out) / PROBES_DIR / f"rank-{rank:05d}.jsonl"


def failures_path(out: Path, rank: int) -> Path:
    return Path(out) / PROGRESS_DIR / f"failures-rank-{rank:05d}.jsonl"


def shard_name(attempt: int, rank: int, seq: int) -> str:
    return f"a{attempt:03d}-r{rank:05d}-{seq:06d}{SHARD_SUFFIX}"


_BAD_ID = re.compile(r"[/\\\x00-\x1f]")
_CLIP_WINDOW = re.compile(r"[0-9]{6,}-[0-9]{6,}")


def id_problem(name: object) -> str | None:
    """Why `name` cannot be a scene id (ids name files and tensors: no '/', '\\' or control characters, not
    empty, no leading '.', so never '..' or an absolute path); None when it can. Encode refuses such ids, and
    verify and the readers refuse a table that holds one."""
    if not isinstance(name, str) or not name:
        return "an empty name" if name == "" else f"not text ({type(name).__name__})"
    bad = _BAD_ID.search(name)
    if bad:
        what = {"/": "'/'", "\\": "'\\'"}.get(bad.group(0), f"a control character ({bad.group(0)!r})")
        return f"a name with {what} (ids name files and tensors)"
    if name.startswith("."):
        return "a name starting with '.'"
    return None


def clip_id_problem(clip_id: object, scene: object) -> str | None:
    """Why a clip record's id (and scene) is not one encode writes: `<scene>/<first>-<last>` (frame numbers of at
    least six digits) with a usable scene id equal to the record's scene."""
    if not isinstance(clip_id, str):
        return f"clip id {clip_id!r} is not text"
    head, slash, window = clip_id.rpartition("/")
    if not slash or not _CLIP_WINDOW.fullmatch(window):
        return f"clip id {clip_id!r} is not <scene>/<first>-<last>"
    why = id_problem(head)
    if why:
        return f"clip id {clip_id!r}: its scene id is {why}"
    if head != scene:
        return f"clip id {clip_id!r} does not belong to its record's scene {scene!r}"
    return None


def shard_name_problem(name: object) -> str | None:
    """Why `name` is not a shard file name as encode writes them: a plain `*.safetensors` name in shards/."""
    if not isinstance(name, str) or not name.endswith(SHARD_SUFFIX) or id_problem(name):
        return f"shard {name!r} is not a plain {SHARD_SUFFIX} file name"
    return None


def relative_inside(folder: object, relative: object, what: str) -> str:
    """`relative` as a manifest, clip table or export index names a file, refused (UnsafePathError naming `what`)
    unless the name alone stays in `folder`: text, not absolute, no '..', no drive letter. `inside` adds the
    symlink check a local folder needs; a URL's prefix has no symlinks."""
    if not isinstance(relative, str) or not relative or relative.startswith(("/", "\\")) or "\x00" in relative:
        raise UnsafePathError(f"{what}: {relative!r} is not a path inside {folder}")
    parts = relative.replace("\\", "/").split("/")
    if ".." in parts or re.match(r"[A-Za-z]:", relative):
        raise UnsafePathError(f"{what}: {relative!r} leaves {folder}")
    return relative


def inside(folder: Path, relative: object, what: str) -> Path:
    """`folder/relative`, where `relative` (as a manifest, clip table or export index names a file) stays in
    `folder`: not absolute, no '..', and not leaving it through a symlink (resolved). An UnsafePathError naming
    `what` otherwise: nothing outside a cache or an export is read."""
    path = Path(folder) / relative_inside(folder, relative, what)
    try:
        resolved, root = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    except (OSError, ValueError) as exc:
        raise UnsafePathError(f"{what}: {relative!r} cannot be resolved ({exc})") from None
    if not resolved.is_relative_to(root):
        raise UnsafePathError(f"{what}: {relative!r} leads out of {folder} through a symlink (to {resolved})")
    return path


# ----------------------------------------------------------------------------- the manifest's record of kinds

MAX_RECORDED_NAME = 200
"""The longest kind name or module name a manifest's kinds record may hold (a message quotes them)."""


def recorded_kinds(manifest: dict[str, Any], where: str = "manifest.json") -> dict[str, str]:
    """The manifest's record of kinds declared outside vaecache ({kind name: module}; {} where it has none), each
    name a plain folder name and each module a dotted Python name; a ManifestError naming `where` otherwise."""
    if KINDS_RECORD not in manifest:
        return {}
    recorded = manifest[KINDS_RECORD]
    if not isinstance(recorded, dict):
        raise ManifestError(f"{where}: \"{KINDS_RECORD}\" is not an object of kind names and modules, got "
                            f"{quoted(recorded)}")
    for name, module in recorded.items():
        if not plain_name(name):
            raise ManifestError(f"{where}: \"{KINDS_RECORD}\" names kind {quoted(name)}, not a plain folder name")
        if not isinstance(module, str) or not module_name(module):
            raise ManifestError(f"{where}: \"{KINDS_RECORD}\" gives kind {name!r} the module {quoted(module)}, not "
                                "a dotted Python module name")
    return recorded


def plain_name(name: Any) -> bool:
    """A kind's name a manifest may hold: a plain folder name, printable and not too long."""
    return (isinstance(name, str) and 0 < len(name) <= MAX_RECORDED_NAME and name.isprintable() and "/" not in name
            and "\\" not in name and not name.startswith("."))


def module_name(module: str) -> bool:
    """A dotted Python module name a manifest may record (never imported from there)."""
    return 0 < len(module) <= MAX_RECORDED_NAME and all(part.isidentifier() for part in module.split("."))


def quoted(value: Any) -> str:
    """A value a manifest holds, quoted for a one-line message (cut short, never its newlines)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
