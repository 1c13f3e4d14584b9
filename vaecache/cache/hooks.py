"""A kind's own code run by the set machinery, the readers and verify (vaecache.cache.kinds): what it raises beyond
its contract named in one line with the kind, the hook, the set and the item. `kind` is a SetKind (its `name` and
`what` are read), typed loosely so that this module sits below the declarations."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from vaecache.errors import first_line


@contextmanager
def kind_hook(kind: Any, hook: str, set_name: str | None = None, item: str | None = None,
              passing: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Run a kind's own code (`hook`: its readers, an item, its verify checks): a VaecacheError (or one of `passing`,
    what the hook's contract raises: a reader's KeyError for a clip its set lacks) passes as it is, any other exception
    becomes a KindHookError naming the kind (and its module), the set and the item."""
    from vaecache.errors import KindHookError, VaecacheError

    try:
        yield
    except (VaecacheError, *passing):
        raise
    except Exception as exc:  # noqa: BLE001  # a kind's own failure, named in one line
        raise KindHookError(hook_problem(kind, hook, exc, set_name, item)) from exc


def hook_problem(kind: Any, hook: str, exc: BaseException, set_name: str | None = None,
                 item: str | None = None) -> str:
    """What a failing hook of `kind` says: the kind and its module, the hook, the set and the item, the error."""
    where = "".join([f", {kind.what} {set_name!r}" if set_name is not None else "",
                     f", {item}" if item is not None else ""])
    return (f"set kind {kind.name!r} ({type(kind).__module__}): its {hook}{where} raised "
            f"{type(exc).__name__}: {first_line(exc)}")


__all__ = ["hook_problem", "kind_hook"]
