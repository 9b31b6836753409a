"""A base for database sources: an initial snapshot, then the stream of the database's log.

The built-in ``postgres`` and ``mysql`` sources build on :class:`DatabaseSource`, and
a source for another database can too. It holds what such sources share, so that a
subclass writes only what is particular to its database:

- **Phases.** ``open`` starts over on a first run (no checkpoint) and after an
  interrupted snapshot (a checkpoint ``{"phase": "snapshot"}``), and resumes the
  stream from any other checkpoint. ``read`` returns the start position when it must
  be recorded at once (``announce``), then the snapshot, then the stream.
- **The snapshot.** One table at a time through a cursor, ``batch_updates`` rows per
  batch, each row an op ``r`` update at ``<snapshot position>:<n>``. Its batches carry
  the checkpoint ``{"phase": "snapshot"}``, so an interrupted snapshot is taken again.
  A table can be read in parts on several connections at once (:class:`PartsCursor`),
  where the database lets them share one snapshot.
- **Progress.** The snapshot reports rows done of the subclass's estimate
  (``snapshots.estimate()``, see :class:`~wormhole.plugins.database_snapshot.SnapshotPart`)
  on ``context.progress``.
- **Reconnecting.** An error of the stream is classified by the subclass: what a
  reconnect cannot fix stops the run, anything else reconnects with backoff (logged,
  cut short by the pipeline's stop) and resumes after what ``read`` returned.
"""

from __future__ import annotations

import contextlib
import logging
import time
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import msgspec

from wormhole.core.backoff import Backoff
from wormhole.core.errors import SourceError, SourceStopped, first_line
from wormhole.core.update import NULL, Update
from wormhole.plugins.components import SourceBatch, SourceContext
from wormhole.plugins.database_snapshot import (
    PartsCursor,
    SnapshotPart,
    SnapshotReader,
    SnapshotTable,
    SourceHooks,
)
from wormhole.plugins.events import reconnecting
from wormhole.plugins.transactions import TransactionMarker

__all__ = [
    "DatabaseSource",
    "PartsCursor",
    "SnapshotPart",
    "SnapshotReader",
    "SnapshotTable",
    "StreamTransaction",
    "close_quietly",
]

_encode = msgspec.json.Encoder().encode
_Raw = msgspec.Raw


def close_quietly(*resources: Any) -> None:
    """Close each resource that is not None, ignoring errors (it may be broken already)."""
    for resource in resources:
        if resource is not None:
            with contextlib.suppress(Exception):
                resource.close()


class StreamTransaction:
    """The transaction the stream is reading: its changes are at ``<position>:<index>``.

    The stream decoder owns it: ``begin`` at a transaction's start, ``index += 1`` for each
    change, ``columns``/``details`` for the change being read, ``end`` at its commit;
    :meth:`update` builds the change's update from it.
    """

    __slots__ = (
        "columns",
        "connector",
        "details",
        "id",
        "index",
        "logical",
        "open",
        "position",
        "ts_ms",
    )

    def __init__(self, connector: str) -> None:
        self.connector = connector
        self.open = False
        """Inside a transaction (``--once`` does not end there)."""
        self.position = ""
        self.index = -1
        self.logical = ""
        self.id: int | None = None
        self.ts_ms = 0
        self.columns: msgspec.Raw = NULL
        """The ``columns`` of the change being read (``SourceContext.describe_updates``)."""
        self.details: msgspec.Raw = NULL
        """The ``details`` of the change being read."""

    def begin(self, position: str, logical: str, txid: int | None, ts_ms: int) -> None:
        self.position, self.logical, self.id, self.ts_ms = position, logical, txid, ts_ms
        self.index = -1
        self.open = True

    def end(self) -> None:
        self.open = False

    def update(
        self,
        op: str,
        table: str,
        key: dict[str, Any],
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
    ) -> Update:
        """The update of change ``index``."""
        return Update(
            op=op,
            key=key,
            before=NULL if before is None else _Raw(_encode(before)),
            after=NULL if after is None else _Raw(_encode(after)),
            table=table,
            connector=self.connector,
            position=f"{self.position}:{self.index}",
            logical=self.logical,
            txid=self.id,
            ts_ms=self.ts_ms,
            columns=self.columns,
            details=self.details,
        )


class _TransactionNames:
    """The names a :class:`DatabaseSource` subclass used before :class:`StreamTransaction`
    (``txn_position``, ``txn_index``, ``txn_logical``, ``txn_id``, ``txn_ts``, ``in_txn``,
    ``change_columns``, ``change_details``, ``_update``): deprecated, each is the same
    field of ``self.txn``."""

    txn: StreamTransaction

    def _update(self, *change: Any) -> Update:
        """Deprecated: ``self.txn.update(op, table, key, before, after)``."""
        return self.txn.update(*change)


def _alias(field: str) -> property:
    def get(self: _TransactionNames) -> Any:
        return getattr(self.txn, field)

    def put(self: _TransactionNames, value: Any) -> None:
        setattr(self.txn, field, value)

    return property(get, put, doc=f"Deprecated: ``self.txn.{field}``.")


for _old, _field in (
    ("txn_position", "position"),
    ("txn_index", "index"),
    ("txn_logical", "logical"),
    ("txn_id", "id"),
    ("txn_ts", "ts_ms"),
    ("in_txn", "open"),
    ("change_columns", "columns"),
    ("change_details", "details"),
):
    setattr(_TransactionNames, _old, _alias(_field))


class DatabaseSource(_TransactionNames, ABC):
    """A source that snapshots a database, then streams its log (see the module docstring).

    A subclass sets the class attributes, implements the abstract methods, and keeps
    ``phase`` (``"snapshot"`` or ``"stream"``) and ``announce`` up to date; its stream
    decoder keeps ``txn`` (the :class:`StreamTransaction` being read).
    """

    connector: ClassVar[str]
    """The updates' ``connector``."""
    logger: ClassVar[logging.Logger] = logging.getLogger("wormhole.source")
    stream_name: ClassVar[str] = "the stream"
    """What is lost and reconnected, for the log (``lost the binlog stream (…)``)."""
    stopped_reconnecting: ClassVar[str] = "source: stopped while reconnecting"
    """The error when the pipeline stops while the source waits to reconnect."""
    first_backoff_s: ClassVar[float] = 0.5
    max_backoff_s: ClassVar[float] = 30.0

    def __init__(self, batch_updates: int) -> None:
        self.batch_updates = batch_updates
        self.context: SourceContext | None = None
        self.conn: Any = None
        """A DB-API connection for :meth:`_query` (catalog reads and the like)."""
        self.phase = "stream"
        self.announce = False
        """The next ``read`` returns no updates, only the checkpoint (a new start position)."""
        self.txn = StreamTransaction(self.connector)
        """The transaction the stream is reading (kept by the subclass's stream decoder)."""
        self.snapshot_tables: list[Any] = []
        """What is left to read of the snapshot, for ``snapshots.open_table``."""
        self.snapshot: SnapshotTable | None = None
        self.snapshot_position = ""
        """The snapshot's native position; row ``n`` is at ``<snapshot_position>:<n>``."""
        self.snapshot_logical = ""
        self.snapshots: SnapshotPart = SourceHooks(self)
        """What the snapshot's tables are read with: a subclass sets its own part."""
        self.snapshot_reader = SnapshotReader(self)
        """Reads the snapshot (``snapshot_tables``), then starts the stream."""
        self.describe = False
        """Fill ``Update.columns`` and ``Update.details`` (``SourceContext.describe_updates``,
        set by :meth:`open`)."""
        self.marker: TransactionMarker | None = None
        """Numbers each transaction's updates (``SourceContext.transaction_metadata``, set
        by :meth:`open`); None: not asked."""

    # ----------------------------------------------------------- the protocol
    def open(self, context: SourceContext, checkpoint: Any) -> None:
        self.context = context
        self.describe = context.describe_updates
        self.marker = TransactionMarker() if context.transaction_metadata else None
        self._connect_and_check(context)
        if checkpoint is None or checkpoint.get("phase") == "snapshot":
            self._start(interrupted=checkpoint is not None)
        else:
            self._resume(checkpoint)

    def read(self, timeout: float) -> SourceBatch | None:
        if self.announce:
            self.announce = False
            return SourceBatch([], self._checkpoint())
        if self.phase == "snapshot":
            try:
                return self.snapshot_reader.read()
            except SourceError:
                raise
            except Exception as exc:  # not retried: the snapshot is taken again instead
                raise SourceError(
                    f"source: the initial snapshot failed ({first_line(exc)}); the next run "
                    f"takes it again from the start (rows already delivered are delivered again)"
                ) from exc
        deadline = time.monotonic() + timeout
        while True:
            try:
                batch = self._read_stream(deadline)
            except SourceError:
                raise
            except Exception as exc:
                recover(self, exc)
                if time.monotonic() >= deadline:
                    return None
                continue
            if batch is not None or time.monotonic() >= deadline:
                return batch

    def backfill_ready(self) -> bool:
        """For sources that offer backfills (:class:`SourceBackfill`): not while the initial
        snapshot is read, nor before the stream's start position was recorded."""
        return self.phase == "stream" and not self.announce

    def backfill_unseen(self, update: Update) -> bool:
        """For sources that offer backfills (:class:`SourceBackfill`): a chunk's read sees
        every transaction before its low watermark, unless a subclass says otherwise."""
        return False

    def reached(self, end: Any) -> bool:
        if self.announce or self.phase == "snapshot" or self.txn.open:
            return False
        return self._stream_reached(end)

    # --------------------------------------------------------- what differs
    @abstractmethod
    def _connect_and_check(self, context: SourceContext) -> None:
        """Connect, and check that the server is set up for change capture."""

    @abstractmethod
    def _start(self, interrupted: bool) -> None:
        """Begin a first run: the snapshot (``phase = "snapshot"``), or the stream at its
        current end (``announce = True``). ``interrupted``: an earlier snapshot was."""

    @abstractmethod
    def _resume(self, checkpoint: Any) -> None:
        """Resume the stream after ``checkpoint`` (one of phase ``stream``)."""

    @abstractmethod
    def _checkpoint(self) -> Any:
        """The stream checkpoint after what was returned (``{"phase": "stream", ...}``)."""

    @abstractmethod
    def _start_stream(self) -> None:
        """Stream from the snapshot's position (``phase = "stream"``)."""

    @abstractmethod
    def _read_stream(self, deadline: float) -> SourceBatch | None:
        """The next batch of the stream, or None at ``deadline`` (``time.monotonic()``).

        Raise :class:`SourceError` for what cannot be read; any other error goes to
        :meth:`_lost`, and a reconnect resumes after what was returned.
        """

    @abstractmethod
    def _lost(self, exc: Exception) -> str:
        """Why the stream failed (for the log), when a reconnect may help; raise (a
        :class:`SourceError`, or ``exc``) when it cannot."""

    @abstractmethod
    def _disconnect(self) -> None:
        """Drop the connections, before each wait to reconnect."""

    @abstractmethod
    def _reconnect(self) -> str | None:
        """One attempt to reconnect and resume after what was returned: None when it
        worked, else why not (it is tried again after a longer wait). Raise what
        another attempt cannot fix."""

    @abstractmethod
    def _stream_reached(self, end: Any) -> bool:
        """Whether the stream, between transactions, has returned everything up to ``end``."""

    def _query(self, sql: str, args: Any = None) -> list[tuple[Any, ...]]:
        """The rows of ``sql`` on ``conn`` (none for a statement that returns none)."""
        with self.conn.cursor() as cur:
            cur.execute(sql, args)
            return list(cur.fetchall()) if cur.description else []


def recover(source: DatabaseSource, exc: Exception) -> None:
    """Reconnect ``source`` after its stream failed with ``exc``, with backoff, until its
    ``_reconnect`` works; raise what a reconnect cannot fix (``_lost`` says), or
    :class:`SourceStopped` when the pipeline stops meanwhile."""
    reason: str | None = source._lost(exc)
    backoff = Backoff(
        source.logger,
        first=source.first_backoff_s,
        cap=source.max_backoff_s,
        stop=source.context.stop if source.context else None,
    )
    while reason is not None:
        source._disconnect()
        reconnecting(source.logger.name)
        if not backoff.wait("lost %s (%s); reconnecting in %.1fs", source.stream_name, reason):
            # Asked to stop while the server is away: nothing is lost (the source
            # resumes from its checkpoint), so the run ends as a graceful stop does.
            raise SourceStopped(source.stopped_reconnecting) from exc
        reason = source._reconnect()
