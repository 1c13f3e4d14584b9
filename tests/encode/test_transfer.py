from __future__ import annotations

import pytest
import torch

from vaecache.encode.transfer import views_on_device_ahead


def _batches(count: int) -> list[dict]:
    return [{"index": i, "views": torch.full((2, 3, 1, 4, 4), float(i)), "errors": {}} for i in range(count)]


def test_off_cuda_the_batches_pass_through_untouched() -> None:
    batches = _batches(3)
    assert [b is a for a, b in zip(batches, views_on_device_ahead(iter(batches), torch.device("cpu")))] == [True] * 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_every_batch_arrives_in_order_with_its_views_on_the_device() -> None:
    device = torch.device("cuda")
    batches = [{**b, "views": b["views"].pin_memory()} for b in _batches(4)]
    seen = list(views_on_device_ahead(iter(batches), device))
    assert [b["index"] for b in seen] == [0, 1, 2, 3]
    for host, moved in zip(batches, seen):
        assert moved["views"].device.type == "cuda" and torch.equal(moved["views"].cpu(), host["views"])
        assert moved["errors"] is host["errors"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_last_batch_comes_without_asking_the_loader_for_one_more() -> None:
    """A DataLoader ends its workers before it says it has no more: the last batch (its shard's write) must not wait
    for that."""
    pulled: list[object] = []

    def loader():
        for batch in _batches(3):
            pulled.append(batch["index"])
            yield {**batch, "views": batch["views"].pin_memory()}
        pulled.append("no more")

    moved = views_on_device_ahead(loader(), torch.device("cuda"), 3)
    assert [next(moved)["index"] for _ in range(3)] == [0, 1, 2] and pulled == [0, 1, 2]
