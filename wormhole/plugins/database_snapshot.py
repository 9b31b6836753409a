"""The initial snapshot of a database source: tables read through cursors, rows as op ``r``
updates, progress, and each row's place in the snapshot (``details``) where asked for.

:class:`SnapshotTable` and :class:`PartsCursor` are what a source's ``_open_snapshot_table``
returns; :class:`SnapshotReader` reads them for :class:`~wormhole.plugins.database_source.
DatabaseSource`, one batch at a time.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from wormhole.core.update import NULL, Update
from wormhole.plugins.components import SourceBatch
from wormhole.plugins.progress import Progress, ProgressTask

if TYPE_CHECKING:
    from wormhole.plugins.database_source import DatabaseSource

_encode = msgspec.json.Encoder().encode
_Raw = msgspec.Raw


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
    :meth:`SnapshotPart.details`)."""
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


class SnapshotPart(Protocol):
    """What a database source's snapshot is read with, set as ``DatabaseSource.snapshots``
    (the built-ins' ``PostgresSnapshot`` and ``MySQLSnapshot``)."""

    def estimate(self) -> int | None:
        """About how many rows the snapshot's tables (``snapshot_tables``) hold, from the
        database's statistics, for progress; None when it cannot tell."""
        ...

    def open_table(self, table: Any) -> SnapshotTable:
        """Start reading ``table`` (an item of the source's ``snapshot_tables``)."""
        ...

    def details(self, table: SnapshotTable, flag: str) -> msgspec.Raw:
        """The ``details`` of a snapshot row of ``table`` (see
        :attr:`wormhole.core.update.Update.details`); ``flag`` is where the row stands, as
        Debezium's ``source.snapshot`` says it: ``first`` (of the snapshot), ``last``,
        ``first_in_data_collection``, ``last_in_data_collection`` or ``true``. ``NULL``: none."""
        ...

    def end(self) -> None:
        """Every table was read: end the snapshot's transaction."""
        ...


class SourceHooks:
    """The snapshot part of a source written before :class:`SnapshotPart`: its methods
    ``_open_snapshot_table`` and ``_end_snapshot``, and the optional ``_snapshot_estimate`` and
    ``_snapshot_details`` (deprecated; what ``DatabaseSource.snapshots`` is by default)."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def estimate(self) -> int | None:
        hook = getattr(self.source, "_snapshot_estimate", None)
        return hook() if hook is not None else None

    def open_table(self, table: Any) -> SnapshotTable:
        hook = getattr(self.source, "_open_snapshot_table", None)
        if hook is None:
            raise NotImplementedError(
                f"{type(self.source).__name__}: a DatabaseSource sets its snapshots part "
                f"(see SnapshotPart) to take an initial snapshot"
            )
        table_read: SnapshotTable = hook(table)
        return table_read

    def details(self, table: SnapshotTable, flag: str) -> msgspec.Raw:
        hook = getattr(self.source, "_snapshot_details", None)
        return hook(table, flag) if hook is not None else NULL

    def end(self) -> None:
        hook = getattr(self.source, "_end_snapshot", None)
        if hook is not None:
            hook()


class SnapshotReader:
    """Reads the snapshot's tables (``source.snapshot_tables``, opened by the source's
    ``snapshots`` part) a batch at a time, then hands over to the stream."""

    def __init__(self, source: DatabaseSource) -> None:
        self.source = source
        self.index = 0
        """Rows read so far; row ``n`` is at ``<snapshot_position>:<n>``."""
        self.progress: ProgressTask | None = None
        self.held: tuple[Update, SnapshotTable, bool, bool] | None = None
        """The last snapshot row read, held back until what follows it is known (its
        ``details`` say whether it is the last of its table, or of the snapshot)."""

    def read(self) -> SourceBatch | None:
        source = self.source
        progress = self.progress
        if progress is None:
            progress = self.progress = self._start_progress()
        limit = source.batch_updates
        updates: list[Update] = []
        while len(updates) < limit:
            table = source.snapshot
            if table is None:
                if not source.snapshot_tables:
                    self._release_held(updates, last=True)
                    self._finish()
                    break
                table = source.snapshot = source.snapshots.open_table(source.snapshot_tables.pop(0))
            rows = table.cursor.fetchmany(limit - len(updates))
            if not rows:
                table.cursor.close()
                source.snapshot = None
                continue
            self._reads(table, rows, updates)
            progress.advance(len(rows), table.name)
        checkpoint: Any = (
            {"phase": "snapshot"} if source.phase == "snapshot" else source._checkpoint()
        )
        return SourceBatch(updates, checkpoint) if updates or source.phase == "stream" else None

    def _reads(self, table: SnapshotTable, rows: list[Any], updates: list[Update]) -> None:
        source = self.source
        position, logical = source.snapshot_position, source.snapshot_logical
        keys, name, connector = table.keys, table.name, source.connector
        now_ms = int(time.time() * 1000)
        index = self.index
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
        self.index = index + len(made)
        if not source.describe:
            updates += made
            return
        # Each row goes out once the next one is read: only then is it known whether it
        # is the last of its table, or of the snapshot.
        self._release_held(updates, last=False, following=table)
        for n, update in enumerate(made):
            if n:
                self._release_held(updates, last=False, following=table)
            self.held = (update, table, table.read == 0, first_overall and n == 0)
            table.read += 1

    def _release_held(
        self, updates: list[Update], last: bool, following: SnapshotTable | None = None
    ) -> None:
        """Append the held snapshot row with its ``details``, now that what follows it is
        known: nothing (``last``), or a row of ``following``."""
        source = self.source
        if self.held is None:
            return
        update, table, first_in_table, first_overall = self.held
        self.held = None
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
        details = source.snapshots.details(table, flag)
        if details is not NULL:
            update.details = details
        updates.append(update)

    def _start_progress(self) -> ProgressTask:
        source = self.source
        try:
            total = source.snapshots.estimate()
        except Exception as exc:  # statistics only: the snapshot goes on without them
            source.logger.debug("no row estimate for the snapshot: %s", exc)
            total = None
        progress = (
            source.context.progress if source.context is not None else Progress(source.logger)
        )
        return progress.task("initial snapshot", total, "rows")

    def _finish(self) -> None:
        source = self.source
        source.snapshots.end()
        if self.progress is not None:
            self.progress.finish()
        source.logger.info(
            "initial snapshot done (%d rows); streaming from %s",
            self.index,
            source.snapshot_position,
        )
        source._start_stream()
