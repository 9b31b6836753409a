"""The cache the log readers of one publisher share: publisher-log batches split by shard."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

CACHE_UPDATES = 1 << 18
"""Updates the cache of ``rows`` reads holds at most (about 128 MiB of rows of 500 bytes)."""
CACHE_SECONDS = 60.0
"""A cached batch is dropped this long after it was made, if its flows have not all taken
their part by then."""
BUILD_WAIT_S = 5.0
"""How long a reader waits for another that is making the entry it needs, before making its
own."""

_Entry = tuple[int, dict[int, Any]]
"""``(end seq, parts by shard)``: what a reader at the entry's position needs of a batch."""


class _Making:
    """An entry a reader is making: the others wait for it and take what it made."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: _Entry | None = None
        """What was made, for the waiters (None: failed, or only for the reader's own use)."""


class RangeCache:
    """Publisher-log batches split by shard, shared by the log readers of one publisher.

    Readers of one micro-batch each read one flow of the same range, a few side by side: the
    first to reach a batch decodes and splits it, the others wait for it and take their
    shard's part. An entry is dropped once every shard with a part in it has taken it (the
    flows of a micro-batch read each batch once), or ``seconds`` after it was made. Entries
    weigh what the reader says (updates, or bytes); a new entry that does not fit is not kept
    (a range larger than the cache is then partly cached for every flow, rather than evicted
    ahead of each).
    """

    def __init__(self, capacity: int = CACHE_UPDATES, seconds: float = CACHE_SECONDS) -> None:
        self.capacity = capacity
        self.seconds = seconds
        self.lock = threading.Lock()
        self.entries: dict[int, tuple[float, int, _Entry, set[int]]] = {}
        """By position, oldest first: (made at, weight, entry, shards yet to take theirs)."""
        self.weight = 0
        self.making: dict[int, _Making] = {}
        self._sweeper: threading.Timer | None = None

    def get(self, first: int, shard: int | None = None) -> _Entry | None:
        with self.lock:
            entry = self.entries.get(first)
            if entry is None:
                return None
            if shard is not None:
                self._taken(first, entry, shard)
        return entry[2]

    def get_or_make(
        self,
        first: int,
        shard: int,
        make: Callable[[], tuple[_Entry, int | None]],
    ) -> _Entry:
        """The entry at ``first`` for ``shard``'s reader, made by ``make`` (``(entry, weight,
        or None when it is only for this reader)``) unless another reader is making it: then
        what that one made."""
        while True:
            with self.lock:
                entry = self.entries.get(first)
                if entry is not None:
                    self._taken(first, entry, shard)
                    return entry[2]
                making = self.making.get(first)
                if making is None:
                    making = self.making[first] = _Making()
                    break
            if not making.done.wait(BUILD_WAIT_S):
                break  # it takes too long: make it here too
            with self.lock:
                entry = self.entries.get(first)
                if entry is not None:
                    self._taken(first, entry, shard)
                    return entry[2]
            if making.value is not None:
                return making.value  # made, not kept (no room): shared all the same
            # It failed, or made it for its own application only: make it here.
        try:
            value, weight = make()
            if weight is not None:
                making.value = value
                self.put(first, value, weight, exclude=shard)
            return value
        finally:
            with self.lock:
                if self.making.get(first) is making:
                    del self.making[first]
            making.done.set()

    def put(self, first: int, value: _Entry, weight: int, exclude: int | None = None) -> None:
        """Keep ``value`` if it fits; ``exclude``: a shard whose reader already has its part."""
        waiting = set(value[1]) - {exclude}
        now = time.monotonic()
        with self.lock:
            self._expire(now)
            if first in self.entries or not waiting or self.weight + weight > self.capacity:
                return
            self.entries[first] = (now, weight, value, waiting)
            self.weight += weight
            if self._sweeper is None:
                self._sweeper = threading.Timer(self.seconds, self._sweep)
                self._sweeper.daemon = True
                self._sweeper.start()

    def expire(self) -> None:
        """Drop the entries made more than ``seconds`` ago."""
        with self.lock:
            self._expire(time.monotonic())

    def _sweep(self) -> None:
        # Readers that went quiet send no request: a timer drops what they left.
        with self.lock:
            self._sweeper = None
            self._expire(time.monotonic())
            if self.entries:
                self._sweeper = threading.Timer(self.seconds, self._sweep)
                self._sweeper.daemon = True
                self._sweeper.start()

    def _expire(self, now: float) -> None:
        # Entries are kept in the order they were made: the oldest come first.
        while self.entries:
            first, (made, weight, _, _) = next(iter(self.entries.items()))
            if now - made <= self.seconds:
                return
            del self.entries[first]
            self.weight -= weight

    def _taken(self, first: int, entry: tuple[float, int, _Entry, set[int]], shard: int) -> None:
        waiting = entry[3]
        waiting.discard(shard)
        if not waiting:
            del self.entries[first]
            self.weight -= entry[1]


__all__ = ["CACHE_UPDATES", "RangeCache"]
