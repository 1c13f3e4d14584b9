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
"""

from __future__ import annotations

from pathlib import Path

FORMAT_NAME = "vaecache"
FORMAT_VERSION = 2
SUPPORTED_VERSIONS = (1, 2)
"""1: clip and failure records as JSON Lines; 2: as Parquet tables (vaecache.format.table)."""

MANIFEST = "manifest.json"
CLIPS = "clips.parquet"
FAILURES = "failures.parquet"
CLIPS_V1 = "clips.jsonl"
FAILURES_V1 = "failures.jsonl"
RUN = "run.json"
LOCK = ".lock"
SHARDS_DIR = "shards"
PROGRESS_DIR = "progress"
ROWS_SUFFIX = ".arrows"
LOGS_DIR = "logs"
PROBES_DIR = "probes"
SHARD_SUFFIX = ".safetensors"
OWNED_ENTRIES = (MANIFEST, CLIPS, FAILURES, CLIPS_V1, FAILURES_V1, RUN, SHARDS_DIR, PROGRESS_DIR, LOGS_DIR, LOCK, PROBES_DIR)
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
