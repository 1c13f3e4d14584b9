"""The planned reads of an object (PlannedReads): a planned range is fetched whole by one GET (a block at
most), a read outside the plan fetches a small read-ahead past it, bytes are served from what was fetched, and the
container's header, index and first clip go out side by side."""

from __future__ import annotations

import threading
import time

from vaecache.storage import BLOCKS_KEPT
from vaecache.video.planned_reads import PLANNED_READ_AHEAD, PlannedReads

OBJECT = bytes(range(256)) * 4096  # 1 MiB


class Store:
    """The object behind a fetcher that logs each GET (start, end) and, with `delay`, holds it that long."""

    def __init__(self, delay: float = 0.0) -> None:
        self.gets: list[tuple[int, int]] = []
        self.delay = delay
        self.in_flight = self.most_in_flight = 0
        self._lock = threading.Lock()

    def fetch(self, start: int, end: int) -> bytes:
        with self._lock:
            self.gets.append((start, end))
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        time.sleep(self.delay)
        with self._lock:
            self.in_flight -= 1
        return OBJECT[start:end]


def _read_through(reads: PlannedReads, start: int, end: int) -> bytes:
    """What FFmpeg does: 4 KiB at a time."""
    return b"".join(reads._fetch(at, min(end, at + 4096)) for at in range(start, end, 4096))


def test_a_planned_range_is_one_get_and_its_bytes_are_then_served_without_another() -> None:
    store = Store()
    reads = PlannedReads(256 << 10, store.fetch, len(OBJECT), [(0, 4096)])
    reads.plan(100_000, 180_000)
    assert reads._fetch(100_000, 104_096) == OBJECT[100_000:104_096]
    assert store.gets == [(100_000, 180_000)]  # the rest of the range, not 4 KiB at a time
    assert reads._fetch(150_000, 160_000) == OBJECT[150_000:160_000] and len(store.gets) == 1
    assert reads._fetch(0, 10) == OBJECT[:10] and store.gets[-1] == (0, 4096)
    assert (reads.fetches, reads.fetched_bytes) == (2, 84_096)


def test_a_read_outside_the_plan_fetches_the_read_ahead_past_it_and_never_refetches_kept_bytes() -> None:
    store = Store()
    reads = PlannedReads(256 << 10, store.fetch, len(OBJECT))
    reads.plan(60_000, 70_000)
    assert reads._fetch(50_000, 54_096) == OBJECT[50_000:54_096]
    assert store.gets == [(50_000, 60_000)]  # the read-ahead stops where planned bytes begin
    assert _read_through(reads, 55_000, 75_000) == OBJECT[55_000:75_000]
    assert store.gets[1:] == [(60_000, 70_000), (70_000, 70_000 + PLANNED_READ_AHEAD)]
    assert reads._fetch(len(OBJECT) - 10, len(OBJECT) + 100) == OBJECT[-10:]  # clipped to the object
    assert store.gets[-1] == (len(OBJECT) - 10, len(OBJECT))


def test_a_planned_range_larger_than_a_block_is_fetched_a_block_at_a_time() -> None:
    store = Store()
    reads = PlannedReads(64 << 10, store.fetch, len(OBJECT), [(0, 200_000)])
    assert _read_through(reads, 0, 200_000) == OBJECT[:200_000]
    assert store.gets == [(0, 65_536), (65_536, 131_072), (131_072, 196_608), (196_608, 200_000)]


def test_kept_bytes_are_bounded_the_oldest_dropped_first() -> None:
    store = Store()
    block = 16 << 10
    reads = PlannedReads(block, store.fetch, len(OBJECT), [(0, len(OBJECT))])
    assert _read_through(reads, 0, len(OBJECT)) == OBJECT
    assert reads._kept <= BLOCKS_KEPT * block and len(store.gets) == len(OBJECT) // block
    assert reads._fetch(len(OBJECT) - 10, len(OBJECT)) == OBJECT[-10:]
    assert len(store.gets) == len(OBJECT) // block  # the last blocks are kept
    assert reads._fetch(0, 10) == OBJECT[:10] and store.gets[-1] == (0, block)  # the first were dropped: again


def test_the_header_index_and_first_clip_are_fetched_side_by_side() -> None:
    store = Store(delay=0.2)
    reads = PlannedReads(256 << 10, store.fetch, len(OBJECT), [(0, 4096), (1_000_000, len(OBJECT))])
    reads.plan(300_000, 340_000)
    started = time.perf_counter()
    reads.fetch_planned()
    assert time.perf_counter() - started < 0.5  # one round trip, not three
    assert store.most_in_flight == 3 and sorted(store.gets) == [(0, 4096), (300_000, 340_000),
                                                               (1_000_000, len(OBJECT))]
    assert reads._fetch(1_000_000, len(OBJECT)) == OBJECT[1_000_000:] and len(store.gets) == 3
    reads.fetch_planned()
    assert len(store.gets) == 3  # nothing planned is left to fetch


def test_planned_ranges_fetched_side_by_side_stop_at_bytes_already_kept() -> None:
    store = Store()
    reads = PlannedReads(256 << 10, store.fetch, len(OBJECT), [(0, 4096)])
    assert reads._fetch(60_000, 60_010) == OBJECT[60_000:60_010]  # read outside the plan: kept from 60,000
    reads.plan(50_000, 90_000)
    reads.fetch_planned()
    assert (50_000, 60_000) in store.gets  # not over the kept piece
    assert _read_through(reads, 50_000, 90_000) == OBJECT[50_000:90_000]
