"""Every error vaecache reports and every exit code it returns, in one place (docs/commands.md, "Exit codes").

| code | meaning |
|---|---|
| 0 (EXIT_OK) | done: everything asked for holds |
| 1 (EXIT_FAILED) | failed: a VaecacheError that is not a usage error (bad output, a damaged cache, a broken VAE) |
| 2 (EXIT_USAGE) | the command line, a config file or an input path is wrong (UsageError and its kinds) |
| 3 (EXIT_PARTIAL) | done, but some inputs were skipped (recorded in failures.parquet, or the index's rejected file) |
| 75 (EXIT_STOPPED) | stopped by SIGTERM, SIGUSR1 or a first Ctrl-C after committing its work: rerun to resume |
| 130 (EXIT_INTERRUPTED) | Ctrl-C outside the encode loop's graceful stop (128 + SIGINT) |

The CLI maps each error to a one-line message naming the file and the problem, and its class's exit_code.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PARTIAL = 3
EXIT_STOPPED = 75
"""Stopped by SIGTERM/SIGUSR1/Ctrl-C after committing its work (EX_TEMPFAIL): rerun to resume."""
EXIT_INTERRUPTED = 130
"""Ctrl-C outside the encode loop's graceful stop (128 + SIGINT)."""


class VaecacheError(Exception):
    """Base class for every error vaecache reports without a traceback."""

    exit_code = EXIT_FAILED


class UsageError(VaecacheError):
    """The command line, a config file or an input path is wrong."""

    exit_code = EXIT_USAGE


class DatasetError(UsageError):
    """The dataset cannot be discovered or planned (missing path, empty folder, bad index)."""


class CaptionError(DatasetError):
    """A caption or metadata file (a folder's sidecar `.txt`, a tar's `key.txt`/`key.json`) that cannot be used:
    not UTF-8, too large, unreadable. Its scene is a recorded skip naming the file."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class TarShardError(DatasetError):
    """A WebDataset shard whose members do not account for its bytes (a header's size field wrong, a shard cut
    short, bytes after the end-of-archive marker). Raised after the shard's good samples were listed; discovery
    records it as a skipped input naming the shard and the byte where its listing stops."""

    def __init__(self, shard: str, offset: int, reason: str) -> None:
        super().__init__(f"{shard}: {reason}")
        self.shard = shard
        self.offset = offset
        self.reason = reason


class VideoDecodeError(VaecacheError):
    """One video could not be read; recorded as a failure and the run goes on."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class FrameBudgetError(VideoDecodeError):
    """A video's frames are larger than the run's --max-frame-pixels: a fact about this run's budget, not about
    the file, so it is never cached (another run may allow them)."""


class AudioMissingError(VaecacheError):
    """A clip's audio cannot be cut: its video has no audio track, or the track does not cover the clip's window."""


class SourceChangedError(VaecacheError):
    """A clip's source file changed since its clip was encoded (size, mtime or sha256): its latents are stale."""


class InputError(VaecacheError):
    """An input could not be turned into latents (bad video, out of memory) and --on-error fail is set."""


class MissingExtraError(UsageError):
    """A command needs an optional extra that is not installed (the message names it: pip install 'vaecache[...]')."""


class VaeSpecError(UsageError):
    """The --vae spec cannot be resolved into a model."""


class FrameRuleError(UsageError):
    """--num-frames or --size violates the VAE's compression rules."""


class OutputError(VaecacheError):
    """OUT cannot be written (disk full, permission denied) or is in an unusable state."""


class ManifestError(VaecacheError):
    """A manifest is missing, unparsable or of an unsupported format version."""


class UnsafePathError(ManifestError):
    """A manifest, clip table or export index names a file outside its own folder (an absolute path, '..', a
    symlink out) or an id that encode would refuse: nothing outside the cache is ever read."""


class KindNotInstalledError(ManifestError):
    """A cache's manifest records a kind of set that no installed package declares (a `vaecache.kinds` entry point):
    the message names the kind and the module to install; nothing the manifest names is ever imported."""


class KindHookError(VaecacheError):
    """A set kind's own code (a hook of its declaration: its readers, an item, its verify checks) raised: the
    message names the kind, the set and the hook, and verify keeps the rest of its report."""


class EmptyCacheError(VaecacheError):
    """An encode committed no clip at all; an empty cache is refused, no manifest is written."""


class DistributedError(VaecacheError):
    """Distributed state could not be set up, or a collective failed or timed out."""


class ShardHeaderError(ManifestError):
    """A shard's safetensors header cannot be read (truncated, overwritten, not a safetensors file)."""


class ShardChecksumError(ManifestError):
    """A shard differs from what the manifest records (size or sha256), or is missing or unlisted."""


class IncompleteCacheError(ManifestError):
    """OUT has a manifest but its clip table is missing or disagrees with it (a copy in progress, a crash)."""


class NormalizationError(ManifestError):
    """The cache records no normalization constants for its VAE (or not the ones its formula needs)."""


class ClipTableError(ManifestError):
    """A clip or failure table cannot be read (truncated, overwritten, not Parquet, missing columns)."""


class ExportError(UsageError):
    """The cache cannot be exported as asked (DIR exists, a trainer convention the cache cannot meet)."""


def first_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message cut to its first line and `limit` characters (library errors can run to pages), or
    its type's name."""
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:limit]
