"""vaecache: precompute video VAE latents at cluster scale, into verified safetensors shards.

The public API, imported lazily (`import vaecache` stays light; torch loads on first use):

- reading a cache in training (vaecache.training): `LatentCache`, `LatentDataset`, `LatentItem`,
  `ShapeBatchSampler`, `collate_latents`;
- pixel-space losses on latents (vaecache.vae.pixel_decoder): `PixelDecoder`, a differentiable decoder in bounded
  memory (chunked, with gradient checkpointing);
- encoding in your own training code (vaecache.parallel): `sp_encode` (views split over a sequence-parallel
  group: padded to a multiple of the group, encoded locally, all-gathered and trimmed) and `spatial_encode`
  (one view's rows split into bands with halo exchange).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.7.0"

_LAZY = {
    **{name: "vaecache.training"
       for name in ("LatentCache", "LatentDataset", "LatentItem", "ShapeBatchSampler", "collate_latents")},
    "PixelDecoder": "vaecache.vae.pixel_decoder",
    "sp_encode": "vaecache.parallel.views",
    "spatial_encode": "vaecache.parallel.spatial",
}

if TYPE_CHECKING:
    from vaecache.parallel.spatial import spatial_encode
    from vaecache.parallel.views import sp_encode
    from vaecache.training import LatentCache, LatentDataset, LatentItem, ShapeBatchSampler, collate_latents
    from vaecache.vae.pixel_decoder import PixelDecoder


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


__all__ = ["LatentCache", "LatentDataset", "LatentItem", "PixelDecoder", "ShapeBatchSampler", "__version__",
           "collate_latents", "sp_encode", "spatial_encode"]
