"""vaecache: precompute video VAE latents at cluster scale, into verified safetensors shards.

Public API (imported lazily: `import vaecache` stays light, torch loads on first use):
`LatentCache`, `LatentDataset`, `LatentItem`, `ShapeBatchSampler`, `collate_latents` (vaecache.format.reader).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.5.0"

_LAZY = {name: "vaecache.format.reader"
         for name in ("LatentCache", "LatentDataset", "LatentItem", "ShapeBatchSampler", "collate_latents")}

if TYPE_CHECKING:
    from vaecache.format.reader import LatentCache, LatentDataset, LatentItem, ShapeBatchSampler, collate_latents


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vaecache' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = ["LatentCache", "LatentDataset", "LatentItem", "ShapeBatchSampler", "__version__", "collate_latents"]
