"""The torch side of reading a cache in training: LatentDataset (a map-style Dataset safe in DataLoader workers),
ShapeBatchSampler (one latent shape per batch, split across DDP ranks) and collate_latents."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.utils.data

from vaecache.cache.layout import VERIFY_MODES
from vaecache.cache.store import store_location
from vaecache.training.cache import LatentCache


def collate_latents(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A DataLoader collate_fn for LatentDataset items: tensors stacked (one shape per batch, which
    ShapeBatchSampler guarantees), everything else (ids, records) kept as lists."""
    batch: dict[str, Any] = {}
    for key in items[0]:
        values = [item[key] for item in items]
        batch[key] = torch.stack(values) if isinstance(values[0], torch.Tensor) else values
    return batch


class LatentDataset(torch.utils.data.Dataset):
    """A map-style Dataset over a finished cache: `ds[i]` -> {"id", "record", and each stored tensor by key}.

    Safe in DataLoader workers: it holds only (out, verify, keys, storage_options) and opens the cache lazily in each
    process (a forked worker that inherits an open cache reopens it), so nothing unpicklable crosses processes. `out`
    may be an fsspec URL (``s3://bucket/cache``): see vaecache.cache.store."""

    def __init__(self, out: str | Path, verify: str = "size", keys: Sequence[str] | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        self.out, self.verify = store_location(out), verify
        self.storage_options = dict(storage_options or {})
        self.keys = tuple(keys) if keys is not None else None
        self._cache: LatentCache | None = None
        self._pid = 0
        self._length = len(self.cache)

    @property
    def cache(self) -> LatentCache:
        import os

        if self._cache is None or self._pid != os.getpid():
            # A cache (and, for a URL, a filesystem) of this process's own: neither crosses a fork.
            self._cache, self._pid = LatentCache(self.out, self.verify, self.storage_options), os.getpid()
        return self._cache

    def __getstate__(self) -> dict[str, Any]:
        return {"out": self.out, "verify": self.verify, "keys": self.keys, "_cache": None, "_pid": 0,
                "_length": self._length, "storage_options": self.storage_options}

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = self.cache[int(index)]
        tensors = item.tensors if self.keys is None else {key: item.tensors[key] for key in self.keys}
        return {"id": item.id, **tensors, "record": item.record}

    def batch_sampler(self, batch_size: int, *, seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                      rank: int | None = None, world_size: int | None = None) -> ShapeBatchSampler:
        """A ShapeBatchSampler over this dataset's clips (rank/world from torch.distributed when initialized)."""
        return ShapeBatchSampler(self.cache.shapes(), batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last,
                                 rank=rank, world_size=world_size)


class ShapeBatchSampler(torch.utils.data.Sampler):
    """Batches of positions that share one latent shape, shuffled by (seed, epoch), split across DDP ranks.

    Per epoch: the positions of each shape are shuffled and cut into batches (a shape's last, short batch is
    kept unless drop_last); the batches of every shape are shuffled together; the list is padded by repeating
    its first batches to a multiple of world_size, and rank r takes batches r, r + world, ... So every rank
    yields the same number of batches (len(sampler)), which DDP needs, and the union over ranks covers every
    clip. Call set_epoch(e) before each epoch for a new order."""

    def __init__(self, shapes: Sequence[Any], batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, rank: int | None = None, world_size: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if rank is None or world_size is None:
            dist = torch.distributed
            ready = dist.is_available() and dist.is_initialized()
            rank = (dist.get_rank() if ready else 0) if rank is None else rank
            world_size = (dist.get_world_size() if ready else 1) if world_size is None else world_size
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        groups: dict[Any, list[int]] = {}
        for position, shape in enumerate(shapes):
            groups.setdefault(shape, []).append(position)
        self.groups = [groups[key] for key in sorted(groups, key=repr)]
        self.batch_size, self.seed, self.shuffle, self.drop_last = batch_size, seed, shuffle, drop_last
        self.rank, self.world_size = rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _all_batches(self) -> list[list[int]]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        batches: list[list[int]] = []
        for group in self.groups:
            order = ([group[i] for i in torch.randperm(len(group), generator=generator).tolist()] if self.shuffle
                     else group)
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                if len(batch) == self.batch_size or not self.drop_last:
                    batches.append(batch)
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
        if batches and len(batches) % self.world_size:
            pad = self.world_size - len(batches) % self.world_size
            batches += [batches[i % len(batches)] for i in range(pad)]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        yield from self._all_batches()[self.rank::self.world_size]

    def __len__(self) -> int:
        total = sum((len(g) // self.batch_size) if self.drop_last else -(-len(g) // self.batch_size)
                    for g in self.groups)
        return -(-total // self.world_size)
