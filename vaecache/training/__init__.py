"""Reading a finished cache in training: LatentCache (random access by position or clip id), LatentDataset (a
map-style torch Dataset safe in DataLoader workers), ShapeBatchSampler (one latent shape per batch, split across DDP
ranks) and collate_latents. What a trainer imports; the files in storage are read by vaecache.cache.reader."""

from vaecache.training.cache import MAX_OPEN_SHARDS, LatentCache, LatentItem
from vaecache.training.dataset import LatentDataset, ShapeBatchSampler, collate_latents

__all__ = ["MAX_OPEN_SHARDS", "LatentCache", "LatentDataset", "LatentItem", "ShapeBatchSampler", "collate_latents"]
