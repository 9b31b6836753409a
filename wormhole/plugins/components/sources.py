"""Sources: the readers of a datastore log, and their optional parts (backfills, lag)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from wormhole.plugins.progress import Progress
from wormhole.core.update import Update


@dataclass
class SourceContext:
    """What the publisher tells a source when it opens it."""

    pipeline: str
    state_dir: Path
    shards: int
    stop: threading.Event
    log: logging.Logger
    progress: Progress = field(default_factory=Progress)
    """Where long work (an initial snapshot) reports how far it is: ``progress.task(name,
    total, unit)``, then ``advance(n)`` and ``finish()`` on the task. The publisher shows it
    as a progress bar on a terminal and as log lines otherwise."""
    describe_updates: bool = False
    """Fill ``Update.columns`` and ``Update.details`` where the source can: some consumer
    of this run asked for them (see ``Options.describes_updates``). Off, a source skips
    that work and the publisher log stays smaller."""
    transaction_metadata: bool = False
    """Mark each update with its transaction (``Update.transaction``) where the source can,
    with :class:`wormhole.plugins.transactions.TransactionMarker`: some consumer of this
    run asked for it (see ``Options.marks_transactions``). Off, a source skips that work."""


@dataclass
class SourceBatch:
    """Updates read from the datastore log, transaction-aligned.

    ``checkpoint`` is where the source would resume after these updates: any
    value msgspec can encode (JSON types). It is stored with the batch in the
    publisher log, and handed back to :meth:`Source.open` after a restart.
    """

    updates: list[Update]
    checkpoint: Any
    watermark: Watermark | None = None
    """Set when the stream passed a backfill watermark (:class:`SourceBackfill`) right after
    these updates: the batch ends there, and nothing after the watermark is in it."""


@dataclass(frozen=True)
class Watermark:
    """A backfill watermark, as the stream met it: the ``token`` written by
    :meth:`SourceBackfill.backfill_watermark`, and where it is in the datastore's log.

    Backfilled rows emitted at it get the native position ``<position>:<n>`` and the
    logical position ``logical``; the source's position mapper must give an op ``r`` there
    a version above every change before the watermark and below every change after it."""

    token: str
    position: str
    logical: str


@dataclass(frozen=True)
class BackfillPlan:
    """A table a source can backfill, checked: what :meth:`SourceBackfill.backfill_plan`
    returns and :meth:`SourceBackfill.backfill_chunk` is given back."""

    table: str
    """``schema.table``, as the stream's updates name it."""
    keys: list[str]
    """The key columns, in the order chunks are read (the stream's key of the table)."""
    where: str | None = None
    """The SQL condition rows must meet (``--where``), checked by the source."""
    estimate: int | None = None
    """About how many rows the backfill reads (statistics), for progress; None: unknown."""
    detail: Any = None
    """Whatever the source keeps for reading chunks (columns, types)."""


@runtime_checkable
class SourceBackfill(Protocol):
    """Optional: a database source that can backfill tables while it streams
    (``wormhole backfill``; docs/backfill.md). The engine runs the DBLog watermark
    algorithm with these three methods, in the thread that calls ``read``:
    a low watermark, one chunk, a high watermark; then it reads the stream on, drops
    the chunk's rows whose keys change between the two watermarks, and emits the rest at
    the high one. The stream's ``read`` reports each watermark it passes as
    :attr:`SourceBatch.watermark` (watermarks it did not write are its own to skip).
    """

    def backfill_ready(self) -> bool:
        """Whether a backfill can run now (not while an initial snapshot is read, say); the
        engine asks again a moment later."""

    def backfill_plan(self, pipeline: str, table: str, where: str | None) -> BackfillPlan:
        """Check that ``table`` can be backfilled with ``where``; raise
        :class:`wormhole.core.errors.BackfillError` saying why not (no primary key, not
        captured, a condition that does not parse). Also called by ``wormhole backfill``
        on a source that was never opened: connect for it, and let ``close`` release it."""

    def backfill_watermark(self, token: str) -> None:
        """Write a watermark carrying ``token`` into the datastore's log, durably (the
        stream meets it later, in commit order with the changes)."""

    def backfill_chunk(
        self, plan: BackfillPlan, after: list[Any] | None, limit: int
    ) -> list[Update]:
        """Up to ``limit`` rows of the table meeting ``plan.where`` whose key comes after
        ``after`` (key values in ``plan.keys`` order; None: from the first), in key order,
        as op ``r`` updates with ``key``, ``after``, ``table``, ``connector`` and ``ts_ms``
        (positions are set when they are emitted). Read as of now, not in a snapshot.

        Raise :class:`wormhole.core.errors.BackfillError` for what reading again cannot fix
        (the backfill fails with the message); any other error is taken as passing (the
        chunk is read again a moment later). The read must see every transaction that is
        in the log before the low watermark (PostgreSQL: one whose commit record is written
        is not visible until a moment later; the source waits for it), or name those it
        did not see through :meth:`backfill_unseen`."""

    def backfill_unseen(self, update: Update) -> bool:
        """Whether a change the stream returns after the last :meth:`backfill_chunk` and
        before that chunk's low watermark belongs to a transaction the chunk's read did
        not see. The engine then drops the chunk's row of that key, as for a change
        between the watermarks (the stream's version is the newer one). A source whose
        chunk reads see every transaction before the low watermark returns False
        (:class:`wormhole.plugins.database_source.DatabaseSource` does).

        PostgreSQL needs it: a transaction's commit record is in the WAL (so before the
        low watermark) a moment before the transaction is marked committed and becomes
        visible, and a chunk's snapshot taken in that moment does not see it."""


@runtime_checkable
class Source(Protocol):
    """A tailer: the one reader of a datastore log.

    Optionally, a source also reports how far behind its datastore it is (see
    :class:`SourceLag`): ``lag()``, which metrics read at scrape time.
    """

    def open(self, context: SourceContext, checkpoint: Any) -> None:
        """Prepare to read after ``checkpoint`` (None: from the source's beginning)."""

    def read(self, timeout: float) -> SourceBatch | None:
        """The next batch, or None if nothing arrived within ``timeout`` seconds.

        Updates need op, key, table, before/after and positions; the publisher
        sets ``shard``. Raise :class:`wormhole.core.errors.SourceError` for input
        that cannot be read (it stops the pipeline with the message).
        """

    def capture_end(self) -> Any:
        """The source's current end position (for ``wormhole run --once``): it covers every
        change committed before the call (even one the datastore acknowledged before writing
        it where ``read`` looks), and ``read`` reaches it even if nothing is written after."""

    def reached(self, end: Any) -> bool:
        """Whether everything up to ``end`` (from capture_end) has been returned by read."""

    def confirm(self, checkpoint: Any) -> None:
        """Everything up to ``checkpoint`` is durable in the publisher log.

        A database source tells the database it may discard its log up to here
        (PostgreSQL ``confirmed_flush_lsn``).
        """

    def close(self) -> None:
        """Release connections and files."""


@runtime_checkable
class SourceLag(Protocol):
    """The optional ``lag()`` of a source, read by the metrics endpoint at scrape time."""

    def lag(self) -> dict[str, float]:
        """Named gauges of how far the source is behind its datastore, measured against what
        the publisher log holds (the positions given to :meth:`Source.confirm`).

        Each name becomes the gauge ``wormhole_source_<name>{source="<type>"}`` and must
        match ``[a-z][a-z0-9_]*_(bytes|seconds|updates)`` (a unit last): ``lag_bytes``,
        ``lag_seconds``, ``retained_bytes``. Return ``{}`` when there is nothing to tell
        yet. It is called from another thread than ``read``: use a connection of its own
        (not the reading one) and keep it short; an exception leaves the gauges out of that
        scrape.
        """
