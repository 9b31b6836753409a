"""The stream's lag while something else runs: a thread tailing a ``jsonl`` sink's file.

Shared by the backfill benchmarks (``bench/backfill.py``, ``bench/backfill_mysql.py``).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec


class LagSampler(threading.Thread):
    """Tails a jsonl file: (arrival time, lag in ms) for every line, the lag being now less
    the line's commit time in ms (``commit_ms`` of the decoded envelope)."""

    def __init__(self, path: Path, commit_ms: Callable[[Any], float]) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.commit_ms = commit_ms
        self.halt = threading.Event()
        self.samples: list[tuple[float, float]] = []

    def run(self) -> None:
        decode = msgspec.json.decode
        offset = 0
        pending = b""
        while not self.halt.wait(0.005):
            if not self.path.exists():
                continue
            with open(self.path, "rb") as f:
                f.seek(offset)
                data = f.read()
            offset += len(data)
            pending += data
            *lines, pending = pending.split(b"\n")
            now = time.time()
            for line in lines:
                self.samples.append((now, now * 1000 - self.commit_ms(decode(line))))

    def between(self, start: float, end: float) -> list[float]:
        return [lag for at, lag in self.samples if start <= at < end]


def figures(lags: list[float]) -> str:
    """p50, p99 and max of lags in ms, and how many."""
    if not lags:
        return "no samples"
    ordered = sorted(lags)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (
        f"p50 {statistics.median(ordered):6.0f} ms  p99 {p99:6.0f} ms  max {ordered[-1]:6.0f} ms"
        f"  ({len(ordered)} ticks)"
    )


def time_backfills(
    store: Any, table: str, rows: int, chunk_size: int, repeat: int
) -> tuple[list[float], list[tuple[float, float]]]:
    """Queue ``repeat`` backfills of ``table`` one after the other in a running publisher's
    queue (``store``, a BackfillStore) and time each from ``running`` to ``done``: their
    rates in rows/s, and their (start, end) wall-clock windows for :meth:`LagSampler.between`."""
    rates, windows = [], []
    for _ in range(repeat):
        request = store.add(table, None, None, chunk_size, 0)
        running = running_wall = 0.0
        while True:
            state = store.get(request.id)
            assert state is not None
            if state.state == "running" and not running:
                running, running_wall = time.perf_counter(), time.time()
            if state.state == "done":
                done, done_wall = time.perf_counter(), time.time()
                break
            assert state.state in ("queued", "running"), state
            time.sleep(0.002)
        assert state.read == rows, state
        rates.append(rows / (done - running))
        windows.append((running_wall, done_wall))
    return rates, windows
