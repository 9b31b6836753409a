"""The binlog stream of the ``mysql`` source: its loop over the reader's messages
(``events.py``), the transaction being read, and what was emitted (``position.py``).

A restart on the same server resumes at the emitted ``file:pos``; on another server (a
replica that took over) it resumes from the emitted GTID state by GTID, which MariaDB
keeps the same on every copy. Either way the part of the transaction emitted in part is
skipped, so nothing repeats and nothing is lost.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import re
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Literal, assert_never

import msgspec

from wormhole.connectors.mysql.events import (
    Begin,
    BeginQuery,
    BinlogReader,
    Commit,
    Heartbeat,
    Message,
    Rotate,
    Rows,
    Statement,
    TableMap,
)
from wormhole.connectors.mysql.position import (
    BinlogPosition,
    gtid_state_text,
    parse_gtid_state,
    seen_sequences,
)
from wormhole.connectors.mysql.server import json_text
from wormhole.core.errors import SourceError
from wormhole.core.update import NULL, Update
from wormhole.plugins.components import SourceBatch, Watermark

if TYPE_CHECKING:
    from wormhole.connectors.mysql.source import MySQLSource

log = logging.getLogger("wormhole.mysql")

_TRUNCATE = re.compile(r"^\s*TRUNCATE\s+(?:TABLE\s+)?(`?[\w$]+`?(?:\s*\.\s*`?[\w$]+`?)?)", re.I)
_DETAILS_END = b',"thread":null,"query":null}'


class _Go(enum.Enum):
    ON = 0


_GO_ON: Literal[_Go.ON] = _Go.ON
"""What a message's handler returns when the batch goes on (else: the batch, or None)."""

Handled = SourceBatch | None | Literal[_Go.ON]


class BinlogStream:
    """The binlog stream of one :class:`MySQLSource`, which keeps the ``txn_*`` attributes of
    the transaction being read (its updates are made by ``DatabaseSource._update``)."""

    def __init__(self, source: MySQLSource) -> None:
        self.source = source
        self.reader: BinlogReader | None = None
        self.messages: Iterator[Message] = iter(())
        # Emitted state (what the next checkpoint says).
        self.file = ""
        self.pos = 4
        self.gtid_state: dict[int, str] = {}
        self.pos_server = 0
        """The server whose binlog ``file:pos`` is in."""
        self.partial_gtid = ""
        self.partial_index = -1
        self.emitted: BinlogPosition | None = None
        """The position of the last checkpoint made."""
        # Resume: the part of a transaction emitted before a restart.
        self.skip_gtid = ""
        self.skip_index = -1
        self.seen_seq: dict[int, int] = {}
        self.by_gtid = False
        # The transaction being read.
        self.txn_gtid = ""
        self.txn_name = ""
        """Debezium's id of the transaction being read (with transaction metadata)."""
        self.txn_domain = -1
        self.txn_seq = 0
        self.txn_began = False
        self.skip_txn = False
        self.pending_watermark: str | None = None
        """The backfill watermark met in the transaction being read."""
        self.held: Rows | None = None
        """A rows message read when a batch was full (transaction metadata): read first next."""
        # The batch being read.
        self.updates: list[Update] = []
        self.deadline = 0.0
        self.full = False

    # ------------------------------------------------------------ positions
    def position(self) -> BinlogPosition:
        """Where the stream stands after what was read."""
        return BinlogPosition(
            self.file,
            self.pos,
            gtid_state_text(self.gtid_state),
            self.partial_gtid,
            self.partial_index,
            self.pos_server,
        )

    def checkpoint(self) -> BinlogPosition:
        """:meth:`position`, as the position emitted."""
        self.emitted = self.position()
        return self.emitted

    def restore(self, position: BinlogPosition) -> None:
        """Stand at ``position`` (emitted before, or a new start); on a server other than
        the position's, by GTID."""
        server = self.source.server
        self.file, self.pos = position.file, position.pos
        self.gtid_state = parse_gtid_state(position.gtid_state)
        self.partial_gtid, self.partial_index = position.gtid, position.index
        self.pos_server = position.server_id
        self.by_gtid = position.server_id != server.server_id
        if self.by_gtid and not server.mariadb:
            raise SourceError(
                f"source: the saved position is on server_id {position.server_id}, but this "
                f"server is {server.server_id}; moving between MySQL servers by GTID is not "
                f"supported: point the DSN back at the server the position came from"
            )
        if self.by_gtid:
            log.warning(
                "the saved position came from server_id %d; this is server_id %d: resuming by "
                "GTID after %s",
                position.server_id,
                server.server_id,
                gtid_state_text(self.gtid_state) or "(the beginning)",
            )

    def open(self) -> None:
        """(Re)start the binlog stream after the emitted state."""
        source = self.source
        self.held = None
        self.skip_gtid, self.skip_index = self.partial_gtid, self.partial_index
        self.seen_seq = seen_sequences(self.gtid_state)
        source.txn.open = False
        self.skip_txn = False
        self.pending_watermark = None
        if not self.by_gtid:
            binlogs = source.server.binlogs()
            if self.file not in binlogs:
                raise SourceError(
                    f"source: binlog file {self.file} (saved position {self.file}:{self.pos}) "
                    f"is no longer on the server (oldest retained: "
                    f"{binlogs[0] if binlogs else 'none'}); the changes since were purged. "
                    f"Keep binlogs longer (binlog_expire_logs_seconds / expire_logs_days), and "
                    f"remove the state_dir to start over with a new snapshot"
                )
        options = source.options
        self.reader = BinlogReader(
            source.server.settings,
            source.reader_id,
            options.heartbeat_s,
            self.position(),
            self.by_gtid,
        )
        self.messages = self.reader.messages()

    def close(self) -> None:
        reader, self.reader = self.reader, None
        self.messages = iter(())
        if reader is not None:
            with contextlib.suppress(Exception):  # broken already
                reader.close()

    # ------------------------------------------------------------ the loop
    def read(self, deadline: float) -> SourceBatch | None:
        """The next batch (see ``DatabaseSource._read_stream``)."""
        self.updates = []
        self.deadline = deadline
        # With transaction metadata, a batch that is full inside a transaction ends before
        # the next rows message of it (held for the next call), not right after the last one
        # read: the last change of a transaction must be known as such (its END).
        self.full = False
        messages: Iterable[Message] = self.messages
        held, self.held = self.held, None
        if held is not None:
            messages = itertools.chain((held,), messages)
        for message in messages:
            match message:
                case Rows():
                    handled = self._rows(message)
                case TableMap():
                    self.source.tables.table_map(message.event)
                    continue
                case Commit():
                    handled = self._commit_read(message)
                case Begin():
                    self._begin(message)
                    continue
                case BeginQuery():
                    self.txn_began = True
                    continue
                case Statement():
                    handled = self._statement(message)
                case Heartbeat():
                    handled = self._heartbeat(message)
                case Rotate():
                    if self.source.txn.open:
                        # The reader reconnected by itself in the middle of a transaction (it
                        # resends from where it started): resume properly from what was emitted.
                        raise EOFError("the binlog stream restarted inside a transaction")
                    continue
                case _:
                    assert_never(message)
            if handled is not _GO_ON:
                return handled
        raise EOFError("the server closed the binlog stream")

    def _batch(self) -> SourceBatch | None:
        """The batch read so far, if anything was."""
        return SourceBatch(self.updates, self.source._checkpoint()) if self.updates else None

    def _due(self) -> Handled:
        """Between transactions: the batch, if it is full or the deadline passed."""
        if len(self.updates) >= self.source.batch_updates or time.monotonic() >= self.deadline:
            return self._batch()
        return _GO_ON

    # ------------------------------------------------------------ rows
    def _rows(self, message: Rows) -> Handled:
        source = self.source
        updates = self.updates
        if self.full:
            self.held = message
            return SourceBatch(updates, source._checkpoint())
        if self.skip_txn or not source.included.wanted(message.schema, message.table):
            signal = source.backfills.signal
            if (
                message.table == signal[1]
                and message.schema == signal[0]
                and not self.skip_txn
                and message.op != "d"
            ):
                token = source.backfills.signal_rows(message.event, message.op == "c")
                if token is not None:
                    self.pending_watermark = token
            return _GO_ON
        first_update = len(updates)
        self._changes(message)
        marker = source.marker
        if marker is not None:
            for update in updates[first_update:]:
                marker.mark(update, self.txn_name)
        if len(updates) >= source.batch_updates:
            # A large transaction goes out in chunks: memory stays bounded.
            if marker is None:
                return SourceBatch(updates, source._checkpoint())
            self.full = True
        return _GO_ON

    def _changes(self, message: Rows) -> None:
        """The updates of a rows message's rows, but those emitted before a restart."""
        source = self.source
        tables = source.tables
        event = message.event
        table = f"{message.schema}.{message.table}"
        layout = tables.decoder(event, table)
        op = message.op
        details = self._rows_details(message) if source.describe else None
        first_index = source.txn.index + 1
        append = self.updates.append
        update = source._update
        for row in tables.rows(event, layout, table, op == "u"):
            source.txn.index += 1
            if details is not None:
                source.txn.details = msgspec.Raw(
                    b"%s%d%s" % (details, source.txn.index - first_index, _DETAILS_END)
                )
            if self.txn_gtid == self.skip_gtid and source.txn.index <= self.skip_index:
                continue
            if op == "u":
                before, after = row
                old_key = {k: before[k] for k in layout.key}
                new_key = {k: after[k] for k in layout.key}
                if old_key != new_key:
                    # The old key may live in another shard: it gets a delete, the
                    # new key an insert, so both flows see the change.
                    append(update("d", table, old_key, before, None))
                    append(update("c", table, new_key, None, after))
                else:
                    append(update("u", table, new_key, before, after))
            else:
                values = row
                key = {k: values[k] for k in layout.key}
                if op == "c":
                    append(update("c", table, key, None, values))
                else:
                    append(update("d", table, key, values, None))
            self.partial_gtid, self.partial_index = self.txn_gtid, source.txn.index

    def _rows_details(self, message: Rows) -> bytes:
        """The start of ``Update.details`` of a rows message's rows (up to ``"row":``), as
        Debezium's MySQL connector writes its ``source`` block; sets ``txn.columns``."""
        source = self.source
        event = message.event
        columns, db, table = source.tables.described[event.table_id]
        source.txn.columns = columns
        packet = event.packet
        seconds = int(event.timestamp)
        gtid = "null" if source.server.mariadb or not self.txn_gtid else json_text(self.txn_gtid)
        return (
            f'{{"connector":"mysql","snapshot":"false","db":{db},"sequence":null,'
            f'"ts_us":{seconds * 1_000_000},"ts_ns":{seconds * 1_000_000_000},"table":{table},'
            f'"server_id":{packet.server_id},"gtid":{gtid},'
            f'"file":{json_text(message.file)},'
            f'"pos":{packet.log_pos - packet.event_size},"row":'
        ).encode()

    # ------------------------------------------------------------ statements
    def _commit_read(self, message: Commit) -> Handled:
        self._commit(message.file, message.pos)
        if self.pending_watermark is not None:
            return self._at_watermark()
        if not self.updates:
            self._nothing_pending(message.file, message.pos)  # a transaction with nothing of ours
        return self._due()

    def _statement(self, message: Statement) -> Handled:
        source = self.source
        if source.txn.open and self.txn_began:
            # Inside a transaction (SAVEPOINT, ROLLBACK TO, RELEASE SAVEPOINT): not its end.
            return _GO_ON
        # DDL, in a GTID group of its own: a transaction of its own.
        truncate = self._truncate(message)
        if truncate is not None:
            self.updates.append(truncate)
            if source.marker is not None:
                source.marker.mark(truncate, self.txn_name)
        if source.txn.open:
            self._commit(message.file, message.pos)
        if not self.updates and not source.txn.open:
            self._nothing_pending(message.file, message.pos)
        return self._due()

    def _truncate(self, message: Statement) -> Update | None:
        source = self.source
        match = _TRUNCATE.match(message.query)
        if match is None or self.skip_txn:
            return None
        name = match.group(1).replace("`", "").replace(" ", "")
        schema, _, table = name.rpartition(".")
        default = message.schema
        schema = schema or str(default.decode() if isinstance(default, bytes) else default)
        if not source.included.wanted(schema, table):
            return None
        source.txn.index += 1
        if self.txn_gtid == self.skip_gtid and source.txn.index <= self.skip_index:
            return None
        self.partial_gtid, self.partial_index = self.txn_gtid, source.txn.index
        source.txn.columns = source.txn.details = NULL
        return source.txn.update("t", f"{schema}.{table}", {}, None, None)

    def _heartbeat(self, message: Heartbeat) -> Handled:
        if self.source.txn.open:
            return _GO_ON
        if not self.updates:
            self._nothing_pending(message.file, message.pos)
        if time.monotonic() >= self.deadline:
            return self._batch()
        return _GO_ON

    def _nothing_pending(self, file: str, pos: int) -> None:
        """Between transactions, with nothing read since the emitted checkpoint: the binlog
        up to ``file:pos`` holds nothing more for the publisher log (for lag())."""
        self.source.lags.nothing_pending(self.emitted, file, pos)

    def _at_watermark(self) -> SourceBatch:
        """The batch that ends at the commit of a watermark's transaction."""
        source = self.source
        token, self.pending_watermark = self.pending_watermark, None
        assert token is not None
        return SourceBatch(
            self.updates,
            source._checkpoint(),
            Watermark(token, source.txn.position, source.txn.logical),
        )

    # ------------------------------------------------------------ transactions
    def _begin(self, message: Begin) -> None:
        source = self.source
        self.txn_gtid = message.gtid
        self.txn_domain = message.domain
        self.txn_seq = message.seq
        self.txn_began = message.began
        source.txn.begin(
            f"{message.file}:{message.offset}", message.gtid, message.seq or None, message.ts_ms
        )
        self.pending_watermark = None
        if source.marker is not None:
            # Debezium's transaction id: the GTID (MariaDB's as Debezium's MariaDB connector
            # writes it), or where the transaction starts.
            self.txn_name = message.gtid or f"file={message.file},pos={message.offset}"
            source.marker.begin(self.txn_name, message.ts_ms)
        # After a reconnect by GTID the server may send transactions already emitted.
        self.skip_txn = (
            self.by_gtid
            and source.server.mariadb
            and self.txn_seq <= self.seen_seq.get(self.txn_domain, -1)
            and self.txn_gtid != self.skip_gtid
        )

    def _commit(self, file: str, pos: int) -> None:
        source = self.source
        source.txn.open = False
        source.lags.read_ts_ms = source.txn.ts_ms
        self.file, self.pos = file, pos
        self.pos_server = source.server.server_id
        if self.skip_txn:
            self.skip_txn = False
            self.pending_watermark = None
            return
        if source.marker is not None:
            source.marker.commit(self.txn_name)
        if self.txn_gtid:
            if source.server.mariadb:
                self.gtid_state[self.txn_domain] = self.txn_gtid
                self.seen_seq[self.txn_domain] = self.txn_seq
            else:
                self.gtid_state[0] = self.txn_gtid
        self.partial_gtid, self.partial_index = "", -1
        if self.txn_gtid == self.skip_gtid:
            self.skip_gtid, self.skip_index = "", -1
