"""A kind declared outside vaecache whose own code raises where a test says (`BrokenMeanKind.broken`: the hooks that
raise): vaecache names the kind, the hook and the set, and keeps the rest of what it was doing (verify's report)."""

from __future__ import annotations

from typing import Any, ClassVar

from tests.cache.latent_mean import LatentMeanKind
from vaecache.cache.kinds import register


class BrokenMeanKind(LatentMeanKind):
    name = "broken-mean"
    what = "broken-mean set"
    metadata_key = "vaecache_broken_mean"
    broken: ClassVar[set[str]] = set()

    def _maybe_raise(self, hook: str) -> None:
        if hook in self.broken:
            raise RuntimeError(f"the kind's own {hook} failed")

    def check_item(self, cache: Any, clip: str, tensors: dict[str, Any], row: dict[str, Any]) -> str | None:
        self._maybe_raise("check_item")
        return super().check_item(cache, clip, tensors, row)

    def verify_sets(self, cache: Any, quick: bool, check_type: type) -> list[Any]:
        self._maybe_raise("verify_sets")
        return super().verify_sets(cache, quick, check_type)

    def readers(self, store: Any, manifest: dict[str, Any], verify: str) -> list[Any]:
        self._maybe_raise("readers")
        return super().readers(store, manifest, verify)


BROKEN_MEAN = register(BrokenMeanKind())
