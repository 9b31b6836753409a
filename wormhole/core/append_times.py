"""When positions were appended to the publisher log (for lag in seconds)."""

from __future__ import annotations

import bisect
import time


class AppendTimes:
    """When positions were appended to the publisher log, for lag in seconds.

    Exact for the batches kept in memory; beyond them, one mark per ``interval_ns``
    (at most ``limit`` marks: when full, every other one goes and the interval doubles).
    A position appended before this process opened the log is given the open time: its
    age is then a lower bound.
    """

    def __init__(self, interval_ns: int = 1_000_000_000, limit: int = 4096) -> None:
        self.interval_ns = interval_ns
        self.limit = limit
        self.opened_ns = time.monotonic_ns()
        self.seqs: list[int] = []
        self.times: list[int] = []

    def mark(self, first_seq: int, now_ns: int) -> None:
        """Batch ``first_seq`` was appended at ``now_ns`` (caller holds the log's lock)."""
        times = self.times
        if times and now_ns - times[-1] < self.interval_ns:
            return
        self.seqs.append(first_seq)
        times.append(now_ns)
        if len(times) > self.limit:
            del self.seqs[1::2]
            del times[1::2]
            self.interval_ns *= 2

    def forget_before(self, seq: int) -> None:
        """Positions before ``seq`` are gone (garbage-collected)."""
        i = bisect.bisect_right(self.seqs, seq) - 1
        if i > 0:
            del self.seqs[:i]
            del self.times[:i]

    def at(self, position: int) -> int:
        i = bisect.bisect_right(self.seqs, position) - 1
        return self.times[i] if i >= 0 else self.opened_ns
