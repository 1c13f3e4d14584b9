"""What a kind of set declares at vaecache's edges, importable without torch or the set machinery (the CLI builds
`vaecache embed`'s flags from it before anything runs): the flags that ask for its sets and shape them, the request
they make, what `vaecache encode` checks at start-up and asks once the cache is finished, and the lines a run prints
of each set it wrote. A kind's work, reading and verify are its SetKind's (vaecache.cache.kinds)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vaecache.errors import UsageError

if TYPE_CHECKING:
    from vaecache.cache.kinds import SetKind, SetOutcome, SetRequest


@dataclass(frozen=True)
class KindOption:
    """One flag of `vaecache embed` a kind declares: the command's parameter `name`, its flag, value type and one line
    of help (docs/commands.md says it in full); None when not given unless `default`."""

    name: str
    flag: str
    kind: type
    help: str
    default: Any = None
    metavar: str | None = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or not self.flag.startswith("--"):
            raise ValueError(f"a kind's option needs a parameter name and a --flag, got {self.name!r}, {self.flag!r}")


@dataclass(frozen=True)
class EmbedShared:
    """What `vaecache embed` takes for every kind: OUT, the set's name, --replace, --shard-size (bytes), --device,
    --allow-pickle-weights and the fsspec options."""

    out: str
    set_name: str | None
    replace: bool
    shard_bytes: int
    device: str
    allow_pickle_weights: bool
    storage_options: tuple[tuple[str, Any], ...]


class KindEdges:
    """What a kind declares at vaecache's edges, importable without torch: the `vaecache embed` flags that ask for its
    sets (`asked_by`, the flag naming the encoder) and shape them (`options`), the request built from them, what
    `vaecache encode` checks at start-up and asks once the cache is finished, and the lines a run prints of each set it
    wrote (from the one outcome every kind's embed returns, `SetOutcome`)."""

    kind: str = ""
    """The SetKind's name (manifest key); "" where the request names it (--kind MODULE)."""
    panel: str = ""
    """The embed --help panel of its options."""
    asked_by: str = ""
    """The name of the option whose value asks for this kind's sets."""
    options: tuple[KindOption, ...] = ()
    takes_set_name: bool = False
    """Whether --set names its set (else its sets are named by the kind: a condition set by its condition)."""
    items: str = "item(s)"
    """What the work line counts."""

    def option(self, name: str) -> KindOption:
        return next(option for option in self.options if option.name == name)

    def asked(self, given: dict[str, Any]) -> bool:
        return given.get(self.asked_by) is not None

    def check_given(self, given: dict[str, Any], shared: EmbedShared) -> None:
        """Refuse an option of this kind given where it does not apply (default: any, without `asked_by`)."""
        if self.asked(given):
            return
        misplaced = [option.flag for option in self.options if option.name != self.asked_by
                     and given.get(option.name) is not None and given.get(option.name) != option.default]
        if misplaced:
            raise UsageError(f"{', '.join(misplaced)} appl{'y' if len(misplaced) > 1 else 'ies'} to "
                             f"{self.option(self.asked_by).flag}")

    def request(self, given: dict[str, Any], shared: EmbedShared) -> Any:
        """The embed's request of this kind, validated (its own dataclass), from the flags `given`."""
        raise NotImplementedError

    def set_kind(self, request: Any) -> SetKind:
        from vaecache.cache.kinds import kind_named

        return kind_named(self.kind)

    def embed(self, request: Any, ctx: Any) -> list[SetOutcome]:
        """The request's sets embedded by the one set machinery (every rank returns the same outcomes)."""
        from vaecache.cache.embedding import embed_sets

        return embed_sets(self.set_kind(request), request, ctx)

    # --- encode
    def encode_request(self, cfg: Any) -> Any | None:
        """What `vaecache encode` asks of this kind once the cache is finished (`cfg`: its EncodeConfig), or None."""
        return None

    def check_at_start(self, request: Any) -> None:
        """encode's start-up check of this kind's settings before any video is probed (`request`: a StartRequest)."""

    def check_scenes(self, request: Any, scenes: Any) -> None:
        """encode's start-up check of this kind's settings against the scenes found, before any is probed."""

    def check_vae(self, request: Any, fingerprint: dict[str, Any]) -> None:
        """encode's start-up check, once the VAE is loaded (`fingerprint`: its model's), that it serves this kind."""

    # --- what a run prints
    def counts(self, outcome: SetOutcome) -> str:
        """What a set holds, in a few words ("3 clips, 6 views")."""
        record = outcome.record or {}
        return f"{len(record.get('shards') or [])} shard(s)"

    def notes(self, outcome: SetOutcome) -> list[str]:
        """What else a run says of a set it wrote (clips without a caption, out-of-memory backoffs)."""
        return []


class DeclaredKindEdges(KindEdges):
    """`vaecache embed OUT --kind MODULE`: the kind a module outside vaecache registers (imported for that run)."""

    panel = "Kinds declared outside vaecache"
    asked_by = "kind"
    options = (KindOption("kind", "--kind", str, "MODULE that registers a set kind.", metavar="MODULE"),)
    takes_set_name = True

    def request(self, given: dict[str, Any], shared: EmbedShared) -> SetRequest:
        from vaecache.cache.kinds import SetRequest

        return SetRequest(out=shared.out, module=given["kind"], set_name=shared.set_name or "default",
                          replace=shared.replace, shard_bytes=shared.shard_bytes, device=shared.device,
                          storage_options=shared.storage_options)

    def set_kind(self, request: SetRequest) -> SetKind:
        return request.kind()


BUILTIN_EDGES = ("vaecache.text.edges", "vaecache.conditions.edges", "vaecache.audio.edges")
"""The modules declaring the built-in kinds' edges (torch-free), in the order a run embeds and prints them."""


def kind_edges() -> tuple[KindEdges, ...]:
    """Every kind's edges `vaecache embed` and `vaecache encode` loop over: the built-in kinds', then --kind's."""
    return (*(importlib.import_module(module).EDGES for module in BUILTIN_EDGES), DeclaredKindEdges())


__all__ = ["BUILTIN_EDGES", "DeclaredKindEdges", "EmbedShared", "KindEdges", "KindOption", "kind_edges"]
