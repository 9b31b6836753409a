"""Backfills: tables re-read in key-order chunks while the stream flows (DBLog watermarks).

``wormhole backfill PIPELINE --table T`` (or an application's ``start: {backfill: [T]}``)
queues a request in ``<state_dir>/backfills.sqlite``; the publisher's
:class:`Backfiller` runs the queue, one request and one chunk at a time, in the tailer
thread, with the watermark algorithm of DBLog (Andreakis and Papapanagiotou, 2020):

1. While the stream is not being read (the tailer thread is busy here), write a *low*
   watermark into the datastore's log, select one chunk of rows by key (after the last
   chunk's last key), and write a *high* watermark.
2. Read the stream on. Between the low and the high watermark, every change of the
   table drops the chunk's row of its key (the stream's version is the newer one); a
   truncate drops them all. Before the low watermark, so does a change of a transaction
   the chunk's read did not see (:meth:`SourceBackfill.backfill_unseen`: PostgreSQL
   makes a transaction visible a moment after its commit record is in the WAL).
3. At the high watermark the chunk's remaining rows are emitted, as op ``r`` updates at
   the high watermark's position, in their own publisher-log batch right after the
   stream's updates before it: in order with the stream, per key.

A chunk's rows reflect the table as of the high watermark, so no row overwrites a newer
change, and a row's version (its position) sorts after every change before it and
before every change after it, for replay-safe sinks. A request's progress (the last key
of the last chunk whose rows are durable in the publisher log) is stored only once those
rows are: after a crash the backfill resumes from its last completed chunk (that chunk
may be emitted twice; a later chunk never before an earlier one). Watermarks written by
a process that died are not recognised and are skipped.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from wormhole.core.backfill_queue import (
    ACTIVE,
    FILENAME,
    FINISHED,
    BackfillRequest,
    BackfillStore,
    summary,
)
from wormhole.core.errors import BackfillError, first_line
from wormhole.core.shard import canonical_key
from wormhole.core.update import Update
from wormhole.plugins.components import (
    BackfillPlan,
    SourceBackfill,
    SourceBatch,
    Watermark,
)
from wormhole.plugins.progress import Progress, ProgressTask

log = logging.getLogger("wormhole.backfill")


# ------------------------------------------------------------------ the runner
@dataclass
class _Chunk:
    """A chunk between its watermarks."""

    low: str
    high: str
    rows: dict[bytes, Update]
    """Canonical key -> row, in key order."""
    last_key: list[Any] | None
    read: int
    final: bool
    """Fewer rows than asked: the table ends here."""
    open: bool = False
    """The low watermark was passed: the stream's changes now drop rows."""


@dataclass
class _Active:
    request: BackfillRequest
    plan: BackfillPlan
    task: ProgressTask
    after: list[Any] | None
    chunk: _Chunk | None = None
    done: bool = False
    """The last chunk was emitted (finished when it is durable)."""


@dataclass
class Emission:
    """A chunk's rows to append right after the batch that ended at its high watermark,
    and what to do once they are durable."""

    updates: list[Update]
    durable: Callable[[], None]


@dataclass
class BackfillCounters:
    """What the metrics endpoint reads."""

    rows: dict[tuple[str, str], int] = field(default_factory=dict)
    """(table, application or "") -> rows emitted."""
    dropped: dict[tuple[str, str], int] = field(default_factory=dict)
    chunks: int = 0


class Backfiller:
    """Runs the queued backfills of one publisher (see the module docstring)."""

    poll_s = 0.5

    def __init__(
        self,
        source: SourceBackfill,
        store: BackfillStore,
        pipeline: str,
        progress: Progress,
        known_applications: Callable[[], set[str]],
    ) -> None:
        self.source = source
        self.store = store
        self.pipeline = pipeline
        self.progress = progress
        self.known_applications = known_applications
        self.active: _Active | None = None
        self.nonce = uuid.uuid4().hex[:12]
        self.sequence = 0
        self.next_poll = 0.0
        self.retry_at = 0.0
        """A request could not start (the database away): not before this is it tried again."""
        self.not_before = 0.0
        self.queued = False
        """The store held a request the last time it was read."""
        self.counters = BackfillCounters()
        self.lock = threading.Lock()

    # ----------------------------------------------------------- tailer side
    def idle(self) -> bool:
        """Nothing to run and nothing in flight (``run --once`` ends only then)."""
        with self.lock:
            if self.active is not None:
                return False
        self._poll(force=True)
        with self.lock:
            return self.active is None and not self.queued

    def step(self) -> Emission | None:
        """Between two reads of the stream: pick up a request, notice a cancel, and start
        the next chunk when none is between its watermarks. Returns what must go through
        the appender in order (a request whose table ended), if anything."""
        self._poll()
        active = self.active
        if active is None or active.chunk is not None or active.done:
            return None
        if time.monotonic() < self.not_before or not self.source.backfill_ready():
            return None
        return self._start_chunk(active)

    def observe(self, batch: SourceBatch) -> Emission | None:
        """Track a batch the stream returned; at a chunk's high watermark, its rows."""
        active = self.active
        chunk = active.chunk if active is not None else None
        if chunk is None or active is None:
            return None
        if chunk.rows and batch.updates:
            table, rows = active.plan.table, chunk.rows
            # Before the low watermark, only a change the chunk's read did not see.
            unseen = None if chunk.open else self.source.backfill_unseen
            for u in batch.updates:
                if u.table != table or (unseen is not None and not unseen(u)):
                    continue
                if u.op == "t":
                    chunk.rows = rows = {}
                    break
                rows.pop(canonical_key(u.key), None)
        watermark = batch.watermark
        if watermark is None:
            return None
        if watermark.token == chunk.low:
            chunk.open = True
            return None
        if watermark.token != chunk.high:
            return None  # another chunk's (an earlier process's): not ours any more
        if not chunk.open:
            # The high watermark without the low one before it: the window cannot be
            # trusted, so the chunk is read again between new watermarks.
            log.warning(
                "%s: the stream passed a chunk's high watermark without its low one; reading "
                "that chunk again",
                active.request.describe(),
            )
            active.chunk = None
            return None
        return self._emit(active, chunk, watermark)

    # -------------------------------------------------------------- the queue
    def _poll(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self.next_poll:
            return
        self.next_poll = now + self.poll_s
        active = self.active
        if active is not None:
            current = self.store.get(active.request.id)
            if current is None or current.state in ("cancelled", "failed"):
                log.info(
                    "%s was %s; it stops here (rows already delivered stay)",
                    active.request.describe(),
                    current.state if current else "removed",
                )
                active.task.finish()
                with self.lock:
                    self.active = None
            return
        pending = self.store.active()
        self.queued = bool(pending)
        if pending and (now < self.retry_at or not self.source.backfill_ready()):
            return  # asked again at a later poll
        for request in pending:
            if self._activate(request):
                return

    def _activate(self, request: BackfillRequest) -> bool:
        if request.application is not None and request.application not in (
            self.known_applications()
        ):
            self._fail(request, f"application {request.application} is not in the pipeline")
            return False
        try:
            plan = self.source.backfill_plan(self.pipeline, request.table, request.where)
        except BackfillError as exc:
            self._fail(request, str(exc))
            return False
        except Exception as exc:
            # The database is away, say: the request stays queued and is tried again.
            log.warning("%s cannot start yet (%s)", request.describe(), first_line(exc))
            self.retry_at = time.monotonic() + 2.0
            return False
        if not self.store.start(request.id, plan.estimate if request.read == 0 else None):
            return False
        remaining = None if plan.estimate is None else max(plan.estimate, request.read)
        task = self.progress.task(f"backfill {request.table}", remaining, "rows")
        if request.read:
            task.advance(request.read)
        resumed = f", resuming after key {request.after}" if request.after else ""
        log.info("%s starts%s", request.describe(), resumed)
        with self.lock:
            self.active = _Active(request, plan, task, request.after)
        return True

    def _fail(self, request: BackfillRequest, error: str) -> None:
        log.error("%s failed: %s", request.describe(), error)
        self.store.finish(request.id, "failed", error)

    # ---------------------------------------------------------------- chunks
    def _token(self, request: BackfillRequest, kind: str) -> str:
        self.sequence += 1
        return f"{request.id}.{self.nonce}.{self.sequence}.{kind}"

    def _start_chunk(self, active: _Active) -> Emission | None:
        request, plan = active.request, active.plan
        low, high = self._token(request, "low"), self._token(request, "high")
        try:
            self.source.backfill_watermark(low)
            rows = self.source.backfill_chunk(plan, active.after, request.chunk_size)
            if rows:
                self.source.backfill_watermark(high)
        except BackfillError as exc:
            active.task.finish()
            self._fail(request, str(exc))
            with self.lock:
                self.active = None
            return None
        except Exception as exc:
            # The database went away, say: the stream's own reconnect deals with that; the
            # chunk is read again (after new watermarks) a moment later.
            log.warning(
                "%s: a chunk could not be read (%s); trying again",
                request.describe(),
                first_line(exc),
            )
            self.not_before = time.monotonic() + 1.0
            return None
        if not rows:
            # The table ends here: done once the chunks before are durable, so the end
            # goes through the appender in order with them.
            active.done = True
            return Emission([], lambda: self._done(active))
        last = rows[-1].key
        active.chunk = _Chunk(
            low,
            high,
            {canonical_key(u.key): u for u in rows},
            [last[k] for k in plan.keys],
            len(rows),
            len(rows) < request.chunk_size,
        )
        return None

    def _emit(self, active: _Active, chunk: _Chunk, watermark: Watermark) -> Emission:
        request = active.request
        audience = request.application or ""
        updates = list(chunk.rows.values())
        base, logical = watermark.position, watermark.logical
        for n, u in enumerate(updates):
            u.position = f"{base}:{n}"
            u.logical = logical
            u.audience = audience
        active.chunk = None
        active.after = chunk.last_key
        if chunk.final:
            active.done = True
        if request.pause_ms:
            self.not_before = time.monotonic() + request.pause_ms / 1000.0
        dropped = chunk.read - len(updates)
        emitted, last_key, read, final = len(updates), chunk.last_key, chunk.read, chunk.final

        def durable() -> None:
            self._durable(active, last_key, emitted, read, dropped, final)

        return Emission(updates, durable)

    # ------------------------------------------------------- appender side
    def _durable(
        self,
        active: _Active,
        last_key: list[Any] | None,
        emitted: int,
        read: int,
        dropped: int,
        final: bool,
    ) -> None:
        """A chunk's rows are in the publisher log (called by the appender, in order)."""
        request = active.request
        stored = self.store.progress(request.id, last_key, emitted, read, dropped)
        key = (request.table, request.application or "")
        with self.lock:
            counters = self.counters
            counters.rows[key] = counters.rows.get(key, 0) + emitted
            counters.dropped[key] = counters.dropped.get(key, 0) + dropped
            counters.chunks += 1
        active.task.advance(read)
        if final and stored:
            self._done(active)

    def _done(self, active: _Active) -> None:
        request = active.request
        self.store.finish(request.id, "done")
        active.task.finish()
        current = self.store.get(request.id)
        if current is not None:
            log.info(
                "%s done: %d rows emitted, %d read, %d dropped as changed meanwhile, in %d chunks",
                request.describe(),
                current.rows,
                current.read,
                current.dropped,
                current.chunks,
            )
        with self.lock:
            if self.active is active:
                self.active = None
        self.next_poll = 0.0


__all__ = [
    "ACTIVE",
    "FILENAME",
    "FINISHED",
    "BackfillCounters",
    "BackfillRequest",
    "BackfillStore",
    "Backfiller",
    "Emission",
    "summary",
]
