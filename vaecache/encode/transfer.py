"""Host to device: each decoded batch's views copied to the GPU one batch ahead, on a side stream.

The DataLoader pins its batches (``pin_memory=True`` on CUDA), so a ``non_blocking`` copy from them is an
asynchronous DMA. Issued on a stream of its own right after the loader hands the batch over, the copy of
batch i+1 runs while the default stream is still encoding batch i; the encode of batch i+1 waits for its
copy's event before it reads the views. Nothing changes what is computed: the same bytes reach the same
device, so latents are identical with and without the side stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

Batch = dict[str, Any]
"""A ViewBatchDataset item: "views" (V, C, T, H, W) on the host, and its index, errors and timings."""


def views_on_device_ahead(batches: Iterable[Batch], device: torch.device, count: int | None = None) -> Iterator[Batch]:
    """The batches in order, each with "views" on `device`, copied one batch ahead on a side stream (CUDA).

    On any other device the batches pass through unchanged (the VAE runner moves the views itself). `count`: how many
    batches there are; the last is handed over as soon as it is taken, without asking `batches` for one more (a
    DataLoader ends its workers before it says it has no more, which would then come before the last batch)."""
    if device.type != "cuda":
        yield from batches
        return
    side = torch.cuda.Stream(device)
    ahead: tuple[Batch, torch.Tensor, torch.cuda.Event] | None = None
    for taken, batch in enumerate(batches, start=1):
        with torch.cuda.stream(side):
            views = batch["views"].to(device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        if ahead is not None:
            yield _ready(*ahead)
        ahead = (batch, views, copied)
        if taken == count:
            break
    if ahead is not None:
        yield _ready(*ahead)


def _ready(batch: Batch, views: torch.Tensor, copied: torch.cuda.Event) -> Batch:
    """The batch with its device views, once the stream that will encode them has waited for their copy."""
    consumer = torch.cuda.current_stream(views.device)
    consumer.wait_event(copied)
    views.record_stream(consumer)  # the side stream allocated it: keep it alive until the encode is done
    return {**batch, "views": views}


__all__ = ["views_on_device_ahead"]
