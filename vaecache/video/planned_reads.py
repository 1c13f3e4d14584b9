"""The planned reads of an object at a URL whose reader knows which bytes it will read (a video with a timeline:
its container's header and index, then each clip's GOPs), as the fsspec read cache its file reads through
(`storage.open_url(url, read_cache=planned_reads(head))`)."""

from __future__ import annotations

from typing import Any, Callable, Collection

from vaecache import storage

PLANNED_READ_AHEAD = 16 << 10
"""The least a PlannedReads fetches past a read outside its plan (the decoder's look-ahead past a clip's GOPs); more
where the object's frames are larger (PlannedReads.read_ahead)."""


class PlannedReads:
    """The read cache (fsspec's interface: `_fetch`) of an object whose reader knows which bytes it will read: the
    container's header and index (`planned` at open), then each clip's GOPs (`plan`, before the clip is decoded).

    A read inside a planned range fetches the rest of that range, up to `blocksize` bytes per GET; a read outside
    every planned range fetches `read_ahead` bytes past it. Fetched bytes are kept, at most storage.BLOCKS_KEPT
    blocks' worth, the oldest dropped first, so a clip decoded again, or the container reopened, reads no byte twice
    while they last. `fetches` counts the GETs and `fetched_bytes` their bytes."""

    name = "vaecache-planned"

    def __init__(self, blocksize: int, fetcher: Any, size: int, planned: Collection[tuple[int, int]] = ()) -> None:
        self.blocksize, self.fetcher, self.size = blocksize, fetcher, size
        self.hit_count = self.miss_count = self.fetches = self.fetched_bytes = 0
        self.read_ahead = PLANNED_READ_AHEAD
        """Bytes fetched past a read outside the plan (at least)."""
        self._planned: list[tuple[int, int]] = []
        self._pieces: list[tuple[int, bytes]] = []  # (start, bytes), sorted by start, never overlapping
        self._order: list[int] = []  # piece starts, oldest first
        self._kept = 0
        for start, end in planned:
            self.plan(start, end)

    def plan(self, start: int, end: int) -> None:
        """Bytes [start, end) will be read."""
        from vaecache.video.timeline import merged

        self._planned = merged([*self._planned, (max(0, start), min(self.size, end))])

    def fetch_planned(self) -> None:
        """GET every planned range not kept yet (up to a block of each) side by side: one round trip, not one per
        range (a container's header at its start and its index at its end)."""
        from concurrent.futures import ThreadPoolExecutor

        wanted = [(start, min(end, start + self.blocksize, self._next_kept(start))) for start, end in self._planned
                  if not self._piece_at(start)[1]]
        if len(wanted) < 2:
            return
        with ThreadPoolExecutor(max_workers=len(wanted), thread_name_prefix="vaecache-ranges") as pool:
            found = list(pool.map(lambda part: self.fetcher(*part), wanted))
        for (start, _), data in zip(wanted, found):
            if data:
                self.fetches += 1
                self.fetched_bytes += len(data)
                self._keep(start, data)

    def _piece_at(self, position: int) -> tuple[int, bool]:
        """(index of the last kept piece starting at or before `position`, -1 for none; whether it holds it)."""
        import bisect

        index = bisect.bisect_right(self._pieces, position, key=lambda piece: piece[0]) - 1
        return index, index >= 0 and position < self._pieces[index][0] + len(self._pieces[index][1])

    def _next_kept(self, position: int) -> int:
        """Where the first kept piece after `position` starts (the object's size: none)."""
        index = self._piece_at(position)[0] + 1
        return self._pieces[index][0] if index < len(self._pieces) else self.size

    def _fetch(self, start: int | None, stop: int | None) -> bytes:
        start = 0 if start is None else start
        stop = self.size if stop is None else min(stop, self.size)
        if start >= stop:
            return b""
        out = bytearray()
        position = start
        missed = False
        while position < stop:
            index, kept = self._piece_at(position)
            if kept:
                piece_start, data = self._pieces[index]
                take = data[position - piece_start: stop - piece_start]
                out += take
                position += len(take)
                continue
            missed = True
            following = self._pieces[index + 1][0] if index + 1 < len(self._pieces) else self.size
            end = self._fetch_end(position, stop, following)
            data = self.fetcher(position, end)
            if not data:
                break
            self.fetches += 1
            self.fetched_bytes += len(data)
            self._keep(position, data)
        self.miss_count += missed
        self.hit_count += not missed
        return bytes(out)

    def _fetch_end(self, position: int, stop: int, following: int) -> int:
        """Where a GET from `position` ends: the planned range's end (a block at most), or a read-ahead past `stop`
        (up to the next planned range); never past the next kept piece."""
        import bisect

        index = bisect.bisect_right(self._planned, position, key=lambda part: part[0]) - 1
        if index >= 0 and position < self._planned[index][1]:
            end = max(stop, min(self._planned[index][1], position + self.blocksize))
        else:  # up to the next planned range at most: that one is fetched whole by its own GET
            planned = self._planned[index + 1][0] if index + 1 < len(self._planned) else self.size
            end = max(stop, min(position + self.read_ahead, planned))
        return min(end, following, self.size)

    def _keep(self, start: int, data: bytes) -> None:
        import bisect

        bisect.insort(self._pieces, (start, data), key=lambda piece: piece[0])
        self._order.append(start)
        self._kept += len(data)
        while self._kept > storage.BLOCKS_KEPT * self.blocksize and len(self._order) > 1:
            oldest = self._order.pop(0)
            index = bisect.bisect_left(self._pieces, oldest, key=lambda piece: piece[0])
            self._kept -= len(self._pieces.pop(index)[1])

    def _log_stats(self) -> str:
        return f" , {self.name}: {self.fetches} GETs, {self.fetched_bytes} bytes"


def planned_reads(planned: Collection[tuple[int, int]]) -> Callable[[int, Any, int], PlannedReads]:
    """The read cache `storage.open_url` is to give an object whose `planned` ranges will be read first."""
    return lambda blocksize, fetcher, size: PlannedReads(blocksize, fetcher, size, planned)
