"""Work every rank does alike, agreed on before anything is written: a model loaded on every rank (one rank's failure
told to all at once), and the same model on every rank (each loads its own copy, perhaps from another node's disk).
Collectives through the run's DistContext; imports no torch itself."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

T = TypeVar("T")


def loaded_on_every_rank(ctx: Any, load: Callable[[], T], what: str) -> T:
    """`load()` run on every rank, and every rank told at once when one of them failed: each rank's outcome is
    gathered, so a rank whose model does not load (a damaged file on its node's disk) makes the whole job exit with
    that rank's one line, instead of leaving the others in the next collective until its timeout."""
    if ctx is None or ctx.info.world_size == 1:
        return load()
    from vaecache.errors import UsageError, VaecacheError, first_line

    failure: tuple[int, str] | None = None
    own: BaseException | None = None
    loaded: Any = None
    try:
        loaded = load()
    except VaecacheError as exc:
        own, failure = exc, (exc.exit_code, str(exc))
    except Exception as exc:  # noqa: BLE001  # the others must hear of it too
        own, failure = exc, (1, f"{type(exc).__name__}: {first_line(exc)}")
    outcomes = ctx.all_gather_object(failure)
    if own is not None:
        raise own
    for rank, outcome in enumerate(outcomes):
        if outcome is not None:
            code, message = outcome
            raise (UsageError if code == UsageError.exit_code else VaecacheError)(
                f"rank {rank} could not load its {what}: {message}")
    return loaded


def same_on_every_rank(ctx: Any, fingerprint: dict[str, Any], what: str) -> None:
    """Under torchrun, every rank's encoder must be the same (each loads its own copy, perhaps from another node's
    disk): a UsageError on every rank naming the first rank that differs and how, before anything is written."""
    if ctx is None or ctx.info.world_size == 1:
        return
    from vaecache.differences import describe_differences
    from vaecache.errors import UsageError

    prints = ctx.all_gather_object(fingerprint)
    for rank, other in enumerate(prints):
        if other != prints[0]:
            differs = describe_differences(prints[0], other)
            raise UsageError(f"rank {rank} loaded another {what} than rank 0 ({'; '.join(differs[:3])}): every rank "
                             "must read the same files")
