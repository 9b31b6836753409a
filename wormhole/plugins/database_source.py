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
  (:meth:`DatabaseSource._snapshot_estimate`) on ``context.progress``.
- **Reconnecting.** An error of the stream is classified by the subclass: what a
  reconnect cannot fix stops the run, anything else reconnects with backoff (logged,
  cut short by the pipeline's stop) and resumes after what ``read`` returned.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from wormhole.core.backoff import Backoff
from wormhole.core.errors import SourceError, SourceStopped, first_line
from wormhole.core.update import NULL, Update
from wormhole.plugins.components import SourceBatch, SourceContext
from wormhole.plugins.events import reconnecting
from wormhole.plugins.progress import Progress, ProgressTask
from wormhole.plugins.transactions import TransactionMarker

_encode = msgspec.json.Encoder().encode
_Raw = msgspec.Raw


def close_quietly(*resources: Any) -> None:
    """Close each resource that is not None, ignoring errors (it may be broken already)."""
    for resource in resources:
        if resource is not None:
            with contextlib.suppress(Exception):
                resource.close()


@dataclass
class SnapshotTable:
    """One table of the initial snapshot, being read."""

    name: str
    """The updates' ``table`` (``schema.table``)."""
    keys: list[str]
    """The key columns."""
    cursor: Any
    """The table's rows: ``fetchmany(n)`` gives up to ``n`` of them, ``close()`` ends it."""
    rows: Callable[[list[Any]], list[Any]]
    """Rows as fetched -> rows as column -> JSON value dicts, or with ``encoded``, ->
    ``(key dict, the row's JSON object as bytes)`` pairs."""
    columns: msgspec.Raw = field(default_factory=lambda: NULL)
    """The updates' ``columns`` (:func:`wormhole.core.update.encode_columns`), if known."""
    details: str = ""
    """The table's part of the updates' ``details`` (see
    :meth:`DatabaseSource._snapshot_details`)."""
    read: int = 0
    """Rows of it made into updates so far."""
    encoded: bool = False
    """The database wrote each row's JSON (with the stream's value rules): it goes into its
    update as it came, with no dict and no encoding in Python."""


class PartsCursor:
    """A table read in parts on several connections at once, as one cursor.

    Each part is read by a thread of its own connection (``connections[i]`` reads the
    parts ``i``, ``i + n``, …): ``open_part(connection, part)`` returns a cursor of that
    part's rows, read ``batch`` rows at a time. Drivers that release the GIL while they
    wait for the server (psycopg2 does) overlap the server's work on the next rows with
    the work done on the rows already read. ``fetchmany`` hands the rows on in the order
    they arrive; at most two batches per connection wait in memory. An error of a reader is
    raised by ``fetchmany``.
    """

    def __init__(
        self,
        connections: list[Any],
        parts: list[Any],
        open_part: Callable[[Any, Any], Any],
        batch: int,
    ) -> None:
        self.open_part = open_part
        self.batch = batch
        readers = min(len(connections), len(parts))
        self.arrived: queue.Queue[Any] = queue.Queue(maxsize=2 * readers)
        self.halt = threading.Event()
        self.buffer: list[Any] = []
        self.running = readers
        self.threads = [
            threading.Thread(
                target=self._read,
                args=(connections[i], parts[i::readers]),
                name=f"snapshot-reader-{i}",
                daemon=True,
            )
            for i in range(readers)
        ]
        for thread in self.threads:
            thread.start()

    def _read(self, connection: Any, parts: list[Any]) -> None:
        try:
            for part in parts:
                cursor = self.open_part(connection, part)
                try:
                    while not self.halt.is_set():
                        rows = cursor.fetchmany(self.batch)
                        if not rows:
                            break
                        self._put(rows)
                finally:
                    cursor.close()
            self._put(None)
        except BaseException as exc:  # handed to the reading thread
            self._put(exc)

    def _put(self, item: Any) -> None:
        while not self.halt.is_set():
            try:
                self.arrived.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def fetchmany(self, size: int) -> list[Any]:
        while not self.buffer and self.running:
            item = self.arrived.get()
            if item is None:
                self.running -= 1
            elif isinstance(item, BaseException):
                self.close()
                raise item
            else:
                self.buffer = item
        rows = self.buffer
        if size >= len(rows):
            self.buffer = []
            return rows
        self.buffer = rows[size:]
        return rows[:size]

    def close(self) -> None:
        """Stop the readers (each after the batch it is reading)."""
        self.halt.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self.arrived.get_nowait()
        for thread in self.threads:
            thread.join(5.0)


class DatabaseSource(ABC):
    """A source that snapshots a database, then streams its log (see the module docstring).

    A subclass sets the class attributes, implements the abstract methods, and keeps
    ``phase`` (``"snapshot"`` or ``"stream"``), ``announce``, ``in_txn`` and the ``txn_*``
    attributes of the transaction being read (for :meth:`_update`) up to date.
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
        self.in_txn = False
        """The stream is inside a transaction (``--once`` does not end there)."""
        # The transaction being read: its changes are at <txn_position>:<txn_index>.
        self.txn_position = ""
        self.txn_index = -1
        self.txn_logical = ""
        self.txn_id: int | None = None
        self.txn_ts = 0
        self.snapshot_tables: list[Any] = []
        """What is left to read of the snapshot, for :meth:`_open_snapshot_table`."""
        self.snapshot: SnapshotTable | None = None
        self.snapshot_position = ""
        """The snapshot's native position; row ``n`` is at ``<snapshot_position>:<n>``."""
        self.snapshot_logical = ""
        self.snapshot_index = 0
        self.snapshot_progress: ProgressTask | None = None
        self.describe = False
        """Fill ``Update.columns`` and ``Update.details`` (``SourceContext.describe_updates``,
        set by :meth:`open`)."""
        self.marker: TransactionMarker | None = None
        """Numbers each transaction's updates (``SourceContext.transaction_metadata``, set
        by :meth:`open`); None: not asked."""
        self.snapshot_held: tuple[Update, SnapshotTable, bool, bool] | None = None
        """The last snapshot row read, held back until what follows it is known (its
        ``details`` say whether it is the last of its table, or of the snapshot)."""
        self.change_columns: msgspec.Raw = NULL
        """The ``columns`` of the change being read (see :meth:`_update`)."""
        self.change_details: msgspec.Raw = NULL
        """The ``details`` of the change being read (see :meth:`_update`)."""

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
                return self._read_snapshot()
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
                self._recover(exc)
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
        if self.announce or self.phase == "snapshot" or self.in_txn:
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
    def _open_snapshot_table(self, table: Any) -> SnapshotTable:
        """Start reading ``table`` (an item of ``snapshot_tables``)."""

    @abstractmethod
    def _end_snapshot(self) -> None:
        """Every table was read: end the snapshot's transaction."""

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

    def _snapshot_details(self, table: SnapshotTable, flag: str) -> msgspec.Raw:
        """The ``details`` of a snapshot row of ``table`` (see
        :attr:`wormhole.core.update.Update.details`). ``flag`` is where the row stands,
        as Debezium's ``source.snapshot`` says it: ``first`` (of the snapshot), ``last``,
        ``first_in_data_collection``, ``last_in_data_collection`` or ``true``. None by
        default."""
        return NULL

    def _snapshot_estimate(self) -> int | None:
        """About how many rows the snapshot's tables (``snapshot_tables``) hold, from the
        database's statistics, for progress; None when it cannot tell."""
        return None

    def _update(
        self,
        op: str,
        table: str,
        key: dict[str, Any],
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
    ) -> Update:
        """An update of change ``txn_index`` of the transaction being read."""
        return Update(
            op=op,
            key=key,
            before=NULL if before is None else _Raw(_encode(before)),
            after=NULL if after is None else _Raw(_encode(after)),
            table=table,
            connector=self.connector,
            position=f"{self.txn_position}:{self.txn_index}",
            logical=self.txn_logical,
            txid=self.txn_id,
            ts_ms=self.txn_ts,
            columns=self.change_columns,
            details=self.change_details,
        )

    def _query(self, sql: str, args: Any = None) -> list[tuple[Any, ...]]:
        """The rows of ``sql`` on ``conn`` (none for a statement that returns none)."""
        with self.conn.cursor() as cur:
            cur.execute(sql, args)
            return list(cur.fetchall()) if cur.description else []

    # ------------------------------------------------------------ the snapshot
    def _read_snapshot(self) -> SourceBatch | None:
        progress = self.snapshot_progress
        if progress is None:
            progress = self.snapshot_progress = self._start_progress()
        limit = self.batch_updates
        updates: list[Update] = []
        while len(updates) < limit:
            table = self.snapshot
            if table is None:
                if not self.snapshot_tables:
                    self._release_held(updates, last=True)
                    self._finish_snapshot()
                    break
                table = self.snapshot = self._open_snapshot_table(self.snapshot_tables.pop(0))
            rows = table.cursor.fetchmany(limit - len(updates))
            if not rows:
                table.cursor.close()
                self.snapshot = None
                continue
            self._snapshot_reads(table, rows, updates)
            progress.advance(len(rows), table.name)
        checkpoint: Any = {"phase": "snapshot"} if self.phase == "snapshot" else self._checkpoint()
        return SourceBatch(updates, checkpoint) if updates or self.phase == "stream" else None

    def _snapshot_reads(self, table: SnapshotTable, rows: list[Any], updates: list[Update]) -> None:
        position, logical = self.snapshot_position, self.snapshot_logical
        keys, name, connector = table.keys, table.name, self.connector
        now_ms = int(time.time() * 1000)
        index = self.snapshot_index
        columns = table.columns
        pairs: Iterable[tuple[dict[str, Any], bytes]]
        if table.encoded:  # (key, encoded row) pairs already
            pairs = table.rows(rows)
        else:
            encode = _encode
            pairs = (({k: row[k] for k in keys}, encode(row)) for row in table.rows(rows))
        raw = _Raw
        made = [
            Update(
                op="r",
                key=key,
                after=raw(document),
                table=name,
                connector=connector,
                position=f"{position}:{index + n}",
                logical=logical,
                ts_ms=now_ms,
                columns=columns,
            )
            for n, (key, document) in enumerate(pairs, 1)
        ]
        if not made:
            return
        first_overall = index == 0
        self.snapshot_index = index + len(made)
        if not self.describe:
            updates += made
            return
        # Each row goes out once the next one is read: only then is it known whether it
        # is the last of its table, or of the snapshot.
        self._release_held(updates, last=False, following=table)
        for n, update in enumerate(made):
            if n:
                self._release_held(updates, last=False, following=table)
            self.snapshot_held = (update, table, table.read == 0, first_overall and n == 0)
            table.read += 1

    def _release_held(
        self, updates: list[Update], last: bool, following: SnapshotTable | None = None
    ) -> None:
        """Append the held snapshot row with its ``details``, now that what follows it is
        known: nothing (``last``), or a row of ``following``."""
        if self.snapshot_held is None:
            return
        update, table, first_in_table, first_overall = self.snapshot_held
        self.snapshot_held = None
        if last:
            flag = "last"
        elif first_overall:
            flag = "first"
        elif first_in_table:
            flag = "first_in_data_collection"
        elif following is not table:
            flag = "last_in_data_collection"
        else:
            flag = "true"
        details = self._snapshot_details(table, flag)
        if details is not NULL:
            update.details = details
        updates.append(update)

    def _start_progress(self) -> ProgressTask:
        try:
            total = self._snapshot_estimate()
        except Exception as exc:  # statistics only: the snapshot goes on without them
            self.logger.debug("no row estimate for the snapshot: %s", exc)
            total = None
        progress = self.context.progress if self.context is not None else Progress(self.logger)
        return progress.task("initial snapshot", total, "rows")

    def _finish_snapshot(self) -> None:
        self._end_snapshot()
        if self.snapshot_progress is not None:
            self.snapshot_progress.finish()
        self.logger.info(
            "initial snapshot done (%d rows); streaming from %s",
            self.snapshot_index,
            self.snapshot_position,
        )
        self._start_stream()

    # ------------------------------------------------------------ reconnecting
    def _recover(self, exc: Exception) -> None:
        reason: str | None = self._lost(exc)
        backoff = Backoff(
            self.logger,
            first=self.first_backoff_s,
            cap=self.max_backoff_s,
            stop=self.context.stop if self.context else None,
        )
        while reason is not None:
            self._disconnect()
            reconnecting(self.logger.name)
            if not backoff.wait("lost %s (%s); reconnecting in %.1fs", self.stream_name, reason):
                # Asked to stop while the server is away: nothing is lost (the source
                # resumes from its checkpoint), so the run ends as a graceful stop does.
                raise SourceStopped(self.stopped_reconnecting) from exc
            reason = self._reconnect()
