"""verify's checks of the sets a cache holds, every kind alike (vaecache.cache.kinds): each kind's own checks of its
sets, a kind no installed package declares or whose own code raises named in one row while the rest of the report
is kept, and the set folders no manifest records."""

from __future__ import annotations

from typing import Any

from vaecache.cache.reader import CacheReader
from vaecache.verify.report import Check


def check_sets(cache: CacheReader, quick: bool, summary: dict[str, Any]) -> list[Check]:
    """Every kind's checks of its sets (vaecache.cache.kinds), each kind's set names added to `summary`."""
    from vaecache.cache.kinds import cache_kinds
    from vaecache.errors import VaecacheError

    try:
        kinds = cache_kinds(cache.manifest)
    except VaecacheError as exc:
        check = Check("set kinds")
        check.fail(str(exc))
        return [check]
    checks = []
    for kind in kinds:
        sets = cache.manifest.get(kind.name) or {}
        if not isinstance(sets, dict):
            bad = Check(f"{kind.what}s")
            bad.fail(f"{cache.store.where('manifest.json')}: \"{kind.name}\" is not an object")
            checks.append(bad)
            sets = {}
        else:
            checks.extend(_kind_checks(kind, sets, cache, quick))
        summary[kind.summary_key()] = sorted(sets)
    from vaecache.cache.layout import OWNED_ENTRIES
    from vaecache.cache.sets import unrecorded_set_folders

    unrecorded = unrecorded_set_folders(cache.store, {*OWNED_ENTRIES, *(kind.name for kind in kinds)})
    if unrecorded:
        check = Check("unrecorded sets")
        for folder in unrecorded:
            check.fail(f"{cache.store.where(folder)}: the shards of a kind of set the manifest does not record (an "
                       "interrupted first embed of it): run that embed again, or delete the folder")
        checks.append(check)
    return checks


def _kind_checks(kind: Any, sets: dict[str, Any], cache: CacheReader, quick: bool) -> list[Check]:
    """A kind's own checks of its sets; where its verify_sets raises, one failed check naming the kind, the hook and
    the sets it left unchecked (the rest of the report is kept)."""
    from vaecache.cache.kinds import hook_problem

    try:
        return kind.verify_sets(cache, quick, Check)
    except Exception as exc:  # noqa: BLE001  # a kind's own code: named, the other checks kept
        check = Check(f"{kind.what}s")
        check.fail(f"{hook_problem(kind, 'verify_sets', exc)}: {', '.join(map(repr, sorted(sets)))} not checked")
        return [check]
