"""The ``postgres`` source's stream: the typed pgoutput messages of the replication
connection (:mod:`stream_reader`) as batches of updates, each with the checkpoint of the
position after it (:mod:`position`).

A change's logical position is the commit LSN on the origin server when the transaction
was replicated from elsewhere (an Origin message), else the commit LSN. The slot's
``confirmed_flush_lsn`` moves only to ``flush`` of batches the publisher log has made
durable (:meth:`PostgresSource.confirm`).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from wormhole.connectors.postgres import pgoutput as pg
from wormhole.connectors.postgres import schema_trigger
from wormhole.connectors.postgres.changes import ChangeUpdates
from wormhole.connectors.postgres.position import StreamPosition
from wormhole.connectors.postgres.stream_reader import (
    Begin,
    Change,
    Commit,
    LogicalMessage,
    Message,
    Origin,
    RelationMessage,
    StreamReader,
    Truncate,
)
from wormhole.core.update import Update
from wormhole.plugins.components import SourceBatch, Watermark
from wormhole.plugins.transactions import TransactionMarker

if TYPE_CHECKING:
    from wormhole.connectors.postgres.source import PostgresSource


class PostgresStream:
    """The stream of one :class:`PostgresSource`: the transaction being read (in the
    source's ``txn_*``), where what was returned ends, and where a restart resumes."""

    def __init__(self, source: PostgresSource) -> None:
        self.source = source
        self.reader: StreamReader | None = None
        self.relations: dict[int, pg.Relation] = {}
        self.changes = ChangeUpdates(source, self.relations)
        self.position = StreamPosition(0)
        """Where what was returned ends (what the checkpoint says)."""
        self.pending = self.position
        """Where what was read so far ends, but for ``emitted``: ``position`` once returned."""
        self.emitted: int | None = None
        """The last change of the transaction being read emitted after ``pending``."""
        self.resume = StreamPosition(0)
        """The resume point: what the publisher log already holds is skipped."""
        # Whether the transaction being read was emitted before (a resend after a restart
        # or reconnect): kept across reads, since a transaction can span several.
        self.skip_txn = False
        self.resuming = False
        self.confirmed = 0
        """The slot may be confirmed up to here: the publisher log holds what is before."""
        self.seen_lsn = 0
        """Everything before it was read (for --once)."""
        self.pending_watermark: str | None = None
        self.streamed_txids: collections.deque[int] = collections.deque(maxlen=4096)
        """The last transactions the stream read (their commit records are written)."""
        self.bad: list[tuple[str, bytes]] = []
        """The text values of the change being decoded that are not UTF-8."""
        self.messages: Iterator[Message | None] = iter(())
        """The reader's messages (None: none has arrived)."""
        # Read for each change: kept here (the options are fixed; attach sets the others).
        self.heartbeat_tables = source.options.heartbeat_tables
        self.describe = False
        self.marker: TransactionMarker | None = None

    # ------------------------------------------------------------ positions
    def start_at(self, lsn: int) -> None:
        """Stream a slot created at ``lsn`` from its start."""
        self.position = self.resume = StreamPosition.start(lsn)
        self.confirmed = self.seen_lsn = lsn
        self.changes.last_commit_lsn = f'\\"{lsn}\\"'

    def resume_from(self, position: StreamPosition) -> None:
        """Stream on after ``position``, which the publisher log holds."""
        self.position = self.resume = position
        self.confirmed = self.seen_lsn = position.flush
        self.changes.last_commit_lsn = f'\\"{position.flush}\\"'

    def attach(self, cursor: Any) -> None:
        """Read the messages of ``cursor``, which has just started replication (after
        ``open`` set the source's ``describe`` and ``marker``)."""
        self.reader = StreamReader(cursor)
        self.messages = self.reader.messages()
        self.describe = self.source.describe
        self.marker = self.source.marker

    def rewind(self) -> None:
        """After a reconnect: the server resends from the slot; resume after what was
        returned."""
        self.resume = self.position
        self.source.txn.open = False
        self.skip_txn = self.resuming = False
        self.pending_watermark = None
        # Only what was returned counts as seen (for --once).
        self.seen_lsn = self.position.flush
        self.relations.clear()

    def checkpoint(self) -> dict[str, Any]:
        """The checkpoint after what was returned."""
        history = self.source.history
        if history is not None:
            # Durable no later than the batch keyed by what it learnt.
            history.prune(self.confirmed)
            history.save()
        return self.position.checkpoint()

    # ----------------------------------------------------------------- read
    def read(self, deadline: float) -> SourceBatch | None:
        """Read until a batch is full or ``deadline``.

        What the next checkpoint says is kept in ``pending`` and ``emitted``, and stored
        in ``position`` only with the batch that is returned: if the connection fails
        half-way, the changes read so far are dropped, and the reconnect resumes after
        what was returned, not after what was dropped.
        """
        source = self.source
        reader = self.reader
        assert reader is not None
        next_message = self.messages.__next__
        marker = self.marker
        limit = source.options.batch_updates
        updates: list[Update] = []
        self.pending, self.emitted = self.position, None
        # With transaction metadata, a batch that is full inside a transaction ends before
        # the next change of it (held for the next read), not right after the last one
        # read: the last change of a transaction must be known as such (its END).
        full = False
        self._keep_alive()
        while True:
            message = next_message()
            match message:
                case Change() if not full:  # the most frequent, first
                    self._change(message, updates)
                    if len(updates) >= limit:
                        # A large transaction goes out in chunks: memory stays bounded.
                        if marker is None:
                            return self._batch(updates)
                        full = True
                case None:
                    if self._idle(updates, deadline):
                        return self._end(updates)
                case Change() | Truncate() | LogicalMessage() if full:
                    reader.hold(message)
                    return self._batch(updates)
                case Begin():
                    self._begin(message)
                case Commit():
                    batch = self._commit(message, updates, limit)
                    if batch is not None:
                        return batch
                case RelationMessage(relation=relation):
                    source.catalog.describe(relation)
                    self.relations[relation.oid] = relation
                case Origin(lsn=origin_lsn):
                    source.txn.logical = pg.lsn_text(origin_lsn)
                case Truncate():
                    self._truncate(message, updates)
                case LogicalMessage():
                    self._logical_message(message, updates)

    def _keep_alive(self) -> None:
        if self.confirmed:
            # Recorded here; psycopg2 reports it every status_interval.
            assert self.reader is not None
            self.reader.feedback(self.confirmed)
        self.source.admin.heartbeat()

    def _idle(self, updates: list[Update], deadline: float) -> bool:
        """No message has arrived: whether the read ends here, else a wait for one."""
        source = self.source
        reader = self.reader
        assert reader is not None
        self._keep_alive()
        in_txn = source.txn.open
        if updates and not in_txn:
            return True
        if not in_txn and reader.wal_end:
            # Nothing of ours up to the server's WAL end.
            self.seen_lsn = max(self.seen_lsn, reader.wal_end)
            if self.confirmed >= self.position.flush:
                # Idle, and all that was emitted is durable: the slot may move past WAL
                # that held nothing for this publication (once what the schema history
                # learnt from it is durable too).
                history = source.history
                if history is not None and history.dirty:
                    history.save()
                self.confirmed = max(self.confirmed, reader.wal_end)
        remaining = deadline - time.monotonic()
        if remaining <= 0 and (self.marker is None or not in_txn):
            # (With transaction metadata, not inside a transaction: see ``full`` in read.
            # The server sends a decoded transaction's messages without a pause.)
            return True
        reader.wait(min(remaining, 0.1) if remaining > 0 else 0.1)
        return False

    def _begin(self, message: Begin) -> None:
        source = self.source
        lsn = message.final_lsn
        source.txn_lsn = lsn
        at = pg.lsn_text(lsn)
        source.txn.begin(at, at, message.xid, message.ts_ms)
        self.streamed_txids.append(message.xid)
        if self.describe:
            self.changes.describe_transaction(message.commit_us)
        self.pending_watermark = None
        if self.marker is not None:
            self.marker.begin(f"{message.xid}:{message.wal}", message.ts_ms)
        self.resuming = lsn == self.resume.lsn
        self.skip_txn = self.resume.skips(lsn)

    def _counted(self) -> bool:
        """Count a change of the transaction: whether it is to be emitted (not one the
        publisher log holds already)."""
        source = self.source
        source.txn.index += 1
        return not (self.skip_txn or (self.resuming and source.txn.index <= self.resume.index))

    def _change(self, message: Change, updates: list[Update]) -> None:
        # The hot path: one call per change, what it reads hoisted (see _counted).
        source = self.source
        index = source.txn.index = source.txn.index + 1
        if self.skip_txn or (self.resuming and index <= self.resume.index):
            return
        changes = self.changes
        bad = self.bad
        op, relation, before, after, unchanged, whole = pg.parse_change(
            message.data, self.relations, bad
        )
        if bad:
            changes.undecodable(relation, bad)
        heartbeat_tables = self.heartbeat_tables
        if heartbeat_tables and relation.table in heartbeat_tables:
            return
        if self.describe:
            changes.describe_change(relation, message.wal)
        marker = self.marker
        if op == "c":
            update = changes.insert(relation, after)
            updates.append(update)
            if marker is not None:
                marker.mark(update, f"{source.txn.id}:{message.wal}")
        else:
            made = changes.change(op, relation, before, after, unchanged, whole)
            updates.extend(made)
            if marker is not None:
                for update in made:
                    marker.mark(update, f"{source.txn.id}:{message.wal}")
        self.emitted = index

    def _truncate(self, message: Truncate, updates: list[Update]) -> None:
        if not self._counted():
            return
        source = self.source
        for oid in message.oids:
            relation = self.relations[oid]
            if relation.table not in self.heartbeat_tables:
                if self.describe:
                    self.changes.describe_change(relation, message.wal)
                update = self.changes.truncate(relation)
                updates.append(update)
                if self.marker is not None:
                    self.marker.mark(update, f"{source.txn.id}:{message.wal}")
        self.emitted = source.txn.index

    def _logical_message(self, message: LogicalMessage, updates: list[Update]) -> None:
        source = self.source
        transactional, prefix, content = message.transactional, message.prefix, message.content
        if transactional and prefix == source.watermark_prefix and not self.skip_txn:
            try:
                self.pending_watermark = content.decode()
            except UnicodeDecodeError:
                at = f"{source.txn.position}:{source.txn.index}"
                source.decode_errors.message(prefix, content, at)
        elif transactional and prefix == schema_trigger.PREFIX:
            # Counted as a change (its event's position), and recorded even in a
            # transaction emitted before: the history is rebuilt from the WAL.
            event = self.changes.schema_change(content, self._counted())
            if event is not None:
                updates.append(event)
                self.emitted = source.txn.index

    def _commit(self, message: Commit, updates: list[Update], limit: int) -> SourceBatch | None:
        """The transaction ends; the batch when the read ends with it."""
        source = self.source
        end_lsn = message.end_lsn
        self.changes.last_commit_lsn = f'\\"{end_lsn}\\"'
        source.txn.open = False
        self.seen_lsn = max(self.seen_lsn, end_lsn)
        if self.skip_txn:
            self.skip_txn = False
            return None
        self.pending = StreamPosition(source.txn_lsn, source.txn.index, True, end_lsn)
        self.emitted = None
        if self.marker is not None:
            self.marker.commit(f"{source.txn.id}:{message.wal}")
        if self.pending_watermark is not None:
            # A backfill watermark: the batch ends here (see SourceBatch.watermark).
            token, self.pending_watermark = self.pending_watermark, None
            batch = self._batch(updates)
            batch.watermark = Watermark(token, source.txn.position, source.txn.logical)
            return batch
        if len(updates) >= limit:
            return self._batch(updates)
        return None

    def _save(self) -> None:
        """What was read becomes what was returned."""
        if self.emitted is not None:
            source = self.source
            self.pending = StreamPosition(source.txn_lsn, self.emitted, False, self.pending.flush)
            self.emitted = None
        self.position = self.pending

    def _batch(self, updates: list[Update]) -> SourceBatch:
        self._save()
        return SourceBatch(updates, self.checkpoint())

    def _end(self, updates: list[Update]) -> SourceBatch | None:
        if updates:
            return self._batch(updates)
        # Transactions that held nothing for us still move the position.
        self._save()
        return None
