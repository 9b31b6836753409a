"""The tailer: the one reader of the datastore log, writing into the publisher log.

Two threads: the tailer reads a batch from the source, shards it and encodes it;
the appender writes it to the publisher log, fsyncs it (per policy) and only then
confirms the source position to the datastore. Writing and fsync release the GIL,
so the next batch is parsed while this one reaches the disk.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
from collections import _count_elements  # type: ignore[attr-defined]
from collections.abc import Callable
from operator import attrgetter
from typing import Any

from wormhole.core.backfill import Backfiller
from wormhole.core.backoff import Backoff
from wormhole.core.errors import SourceStopped, file_problem
from wormhole.core.publisher_log import PreparedBatch, PublisherLog
from wormhole.core.shard import assign_shards
from wormhole.core.update import Update
from wormhole.plugins.components import Source, SourceBatch

log = logging.getLogger("wormhole.publisher")

_table_op = attrgetter("table", "op")
_table = attrgetter("table")
_op = attrgetter("op")


def count_tables(counts: dict[tuple[str, str], int], updates: list[Update]) -> None:
    """Add a batch's updates to ``counts`` by (table, op), in C: a batch of one table and
    one op (most are) costs two set-building passes, others one counting pass more."""
    if not updates:
        return
    if len(set(map(_table, updates))) == 1 and len(set(map(_op, updates))) == 1:
        first = updates[0]
        key = (first.table, first.op)
        counts[key] = counts.get(key, 0) + len(updates)
    else:
        _count_elements(counts, map(_table_op, updates))


_Item = tuple[PreparedBatch | None, Callable[[], None] | None]

TRANSIENT_WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EAGAIN)


class Tailer:
    """Reads ``source`` into ``publisher_log`` until ``stop`` is set, or, with ``end`` (``--once``),
    until the source has returned everything up to it. ``done`` is set when both threads
    have finished; ``failure`` holds what stopped them, if anything did."""

    def __init__(
        self,
        source: Source,
        publisher_log: PublisherLog,
        shards: int,
        stop: threading.Event,
        end: Any = None,
        once: bool = False,
        on_failure: Any = None,
        count_tables: bool = False,
        backfiller: Backfiller | None = None,
    ) -> None:
        self.source = source
        self.publisher_log = publisher_log
        self.shards = shards
        self.stop = stop
        self.end = end
        self.once = once
        self.on_failure = on_failure
        """Called with no arguments when either thread fails (the publisher stops)."""
        self.done = threading.Event()
        self.finished = False
        """With ``once``: the source returned everything up to ``end`` (not stopped first)."""
        self.failure: BaseException | None = None
        self.updates = 0
        """Updates appended to the publisher log (and confirmed to the source)."""
        self.count_tables = count_tables
        self.read_counts: dict[tuple[str, str], int] = {}
        """With ``count_tables`` (metrics on): updates read from the source, by (table, op)."""
        self.backfiller = backfiller
        """Runs queued backfills between reads (a source with backfills), or None."""
        self._appender_alive = True
        # (batch to append or None, what to call once it is durable or None); None: the end.
        self._prepared: queue.Queue[_Item | None] = queue.Queue(maxsize=2)
        self.thread = threading.Thread(target=self._run, name="tailer", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def _failed(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
        if self.on_failure is not None:
            self.on_failure()

    def _run(self) -> None:
        appender = threading.Thread(target=self._append_loop, name="appender", daemon=True)
        appender.start()
        try:
            self._read_loop()
        except SourceStopped:
            log.info("the source stopped while it waited, as asked")
        except BaseException as exc:
            self._failed(exc)
        finally:
            self._put(None, force=True)
            appender.join()
            self.done.set()

    def _put(self, item: _Item | None, force: bool = False) -> bool:
        while True:
            try:
                self._prepared.put(item, timeout=0.1)
                return True
            except queue.Full:
                if self.stop.is_set() and not force:
                    return False
                if force and not self._appender_alive:
                    return False

    def _finished(self) -> bool:
        if not self.once or not self.source.reached(self.end):
            return False
        # Backfills queued or running are part of the work of `run --once`.
        self.finished = self.backfiller is None or self.backfiller.idle()
        return self.finished

    def _read_loop(self) -> None:
        source, publisher_log, shards = self.source, self.publisher_log, self.shards
        counts = self.read_counts if self.count_tables else None
        if self._finished():
            return
        backfiller = self.backfiller
        while not self.stop.is_set() and self._appender_alive:
            if backfiller is not None:
                # The stream waits while a chunk is read between its watermarks (DBLog).
                ended = backfiller.step()
                if ended is not None and not self._put((None, ended.durable)):
                    return
            batch: SourceBatch | None = source.read(0.2)
            if batch is None:
                if self._finished():
                    return
                continue
            emission = backfiller.observe(batch) if backfiller is not None else None
            batch.updates = assign_shards(batch.updates, shards)
            if counts is not None:
                # While the batch is hot in the cache (assign_shards just went through it).
                count_tables(counts, batch.updates)
            if not self._put((publisher_log.prepare(batch.updates, batch.checkpoint), None)):
                return
            if emission is not None:
                # A backfill chunk's rows, in a batch of their own right after the stream's
                # updates before its high watermark, with the same checkpoint.
                rows = assign_shards(emission.updates, shards)
                if counts is not None:
                    count_tables(counts, rows)
                prepared = publisher_log.prepare(rows, batch.checkpoint)
                if not self._put((prepared, emission.durable)):
                    return
            if self._finished():
                return

    def _append_loop(self) -> None:
        try:
            while (item := self._prepared.get()) is not None:
                prepared, durable = item
                if prepared is not None:
                    if not self._commit(prepared):
                        break
                    self.updates += len(prepared.updates)
                    self.source.confirm(prepared.checkpoint)
                if durable is not None:
                    durable()
        except BaseException as exc:
            self._failed(exc)
        finally:
            self._appender_alive = False
            self.publisher_log.discard_prepared()
            # Unblock a tailer waiting to hand over a batch.
            while True:
                try:
                    self._prepared.get_nowait()
                except queue.Empty:
                    break

    def _commit(self, prepared: PreparedBatch) -> bool:
        """Append, retrying with backoff while the disk is full (nothing is lost meanwhile:
        the source is confirmed only after the append); False if stopped meanwhile."""
        publisher_log = self.publisher_log
        backoff = Backoff(log, first=0.1, cap=30.0, stop=self.stop, level=logging.ERROR)
        while True:
            try:
                publisher_log.commit(prepared)
                return True
            except OSError as exc:
                if exc.errno not in TRANSIENT_WRITE_ERRORS:
                    where = exc.filename or publisher_log.directory
                    raise file_problem(where, exc, "write the publisher log") from exc
                if not backoff.wait(
                    "cannot append to the publisher log in %s (%s); nothing was lost, "
                    "retrying in %.1fs: free space on that disk",
                    publisher_log.directory,
                    exc.strerror,
                ):
                    return False
