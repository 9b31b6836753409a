"""The ``mysql`` source: the row-based binlog of MariaDB (and MySQL), with an initial snapshot.

:class:`MySQLSource` puts together what ``DatabaseSource`` asks of a database source:

- the server (``server.py``): connections, the checks that it is set up for change capture,
  binlog positions, and which errors a reconnect fixes;
- the binlog stream (``stream.py``): the loop over the reader's messages (``events.py``),
  transactions, and the position emitted (``position.py``, which describes the checkpoint);
- the tables it reads and their table maps (``tables.py``), the initial snapshot
  (``snapshot.py``), backfills (``backfill.py``) and the lag metrics (``lag.py``).

Nothing is confirmed to the server: the binlog is the server's to keep and purge
(``expire_logs_days`` / ``binlog_expire_logs_seconds``). A position that was purged is a
fatal error.
"""

from __future__ import annotations

import logging
from typing import Any

from wormhole.connectors.mysql.backfill import MySQLBackfill
from wormhole.connectors.mysql.events import HAVE_REPLICATION
from wormhole.connectors.mysql.lag import BinlogLag
from wormhole.connectors.mysql.options import MySQLOptions
from wormhole.connectors.mysql.position import BinlogPosition
from wormhole.connectors.mysql.server import NO_DRIVER, MySQLServer, reader_id
from wormhole.connectors.mysql.snapshot import MySQLSnapshot
from wormhole.connectors.mysql.stream import BinlogStream
from wormhole.connectors.mysql.tables import IncludedTables, TableMaps
from wormhole.core.errors import SourceError
from wormhole.core.update import Update
from wormhole.plugins.components import BackfillPlan, SourceBatch, SourceContext
from wormhole.plugins.database_source import DatabaseSource, close_quietly

log = logging.getLogger("wormhole.mysql")


class MySQLSource(DatabaseSource):
    connector = "mysql"
    logger = log
    stream_name = "the binlog stream"
    stopped_reconnecting = "source: stopped while reconnecting to the server"
    max_backoff_s = 10.0

    def __init__(self, options: MySQLOptions) -> None:
        super().__init__(options.batch_updates)
        self.options = options
        self.server = MySQLServer(options.connection(), self._query)
        self.reader_id = 0
        """The server id this source's binlog reader registers as."""
        self.backfills = MySQLBackfill(self)
        self.included = IncludedTables(options, self.backfills.signal)
        self.tables = TableMaps(self)
        """Table maps: each table's row decoder and description, by table id."""
        self.snapshots: MySQLSnapshot = MySQLSnapshot(self)
        self.binlog = BinlogStream(self)
        self.lags = BinlogLag(self.server.settings)

    # ------------------------------------------------------------ open
    def _connect_and_check(self, context: SourceContext) -> None:
        if not HAVE_REPLICATION:
            raise SourceError(NO_DRIVER)
        self.reader_id = reader_id(self.options, context.pipeline)
        self.backfills.signal_id = self.backfills.signal_row(context.pipeline)
        self.conn = self.server.connect()
        self.server.check()

    def _start(self, interrupted: bool) -> None:
        if interrupted:
            log.warning(
                "the initial snapshot was interrupted; taking it again (rows already "
                "delivered are delivered again)"
            )
        if self.options.snapshot == "initial":
            self.snapshots.begin()
        else:
            self.binlog.restore(self.server.position(*self.server.binlog_end()))
            self.announce = True  # the start position goes into the log at once
            self._start_stream()

    def _resume(self, checkpoint: Any) -> None:
        self.binlog.restore(BinlogPosition.from_checkpoint(checkpoint, self.server.server_id))
        self._start_stream()

    def _checkpoint(self) -> dict[str, Any]:
        return self.binlog.checkpoint().checkpoint()

    # ------------------------------------------------------------ snapshot
    def snapshot_pending(self) -> list[str]:
        """Tables whose every row this open's initial snapshot is about to read (a new
        application starting at the log end gets them all: its start backfill is not needed)."""
        if self.phase != "snapshot":
            return []
        return [f"{schema}.{name}" for schema, name, _layout, _select in self.snapshot_tables]

    # DatabaseSource's hooks, answered by the source's BinlogStream (stream.py).
    def _start_stream(self) -> None:
        self.binlog.open()
        self.phase = "stream"
        self._checkpoint()

    # SourceBackfill, answered by the source's MySQLBackfill (backfill.py).
    def backfill_plan(self, pipeline: str, table: str, where: str | None) -> BackfillPlan:
        return self.backfills.plan(pipeline, table, where)

    def backfill_watermark(self, token: str) -> None:
        self.backfills.watermark(token)

    def backfill_chunk(
        self, plan: BackfillPlan, after: list[Any] | None, limit: int
    ) -> list[Update]:
        return self.backfills.chunk(plan, after, limit)

    # ------------------------------------------------------------ stream
    def _read_stream(self, deadline: float) -> SourceBatch | None:
        return self.binlog.read(deadline)

    def _lost(self, exc: Exception) -> str:
        return self.server.lost(exc, self.binlog.position())

    def _disconnect(self) -> None:
        self.binlog.close()
        close_quietly(self.conn)

    def _reconnect(self) -> str | None:
        try:
            self.conn = self.server.connect()
            self.server.check()
        except SourceError as again:
            return str(again)
        # Resume after what was emitted: changes read since then were not returned.
        assert self.binlog.emitted is not None
        self.binlog.restore(self.binlog.emitted)
        self.binlog.open()
        self.phase = "stream"
        log.info("binlog stream resumed at %s:%d", self.binlog.file, self.binlog.pos)
        return None

    # --------------------------------------------------------------- --once
    def capture_end(self) -> Any:
        file, pos = self.server.binlog_end()
        return [file, pos]

    def _stream_reached(self, end: Any) -> bool:
        reader = self.binlog.reader
        return reader is not None and reader.reached(*end)

    # --------------------------------------------------------------- metrics
    def confirm(self, checkpoint: Any) -> None:
        """Nothing to tell the server, which keeps the binlog by its own retention settings;
        the position is kept for :meth:`lag`."""
        if checkpoint.get("phase") == "stream":
            self.lags.confirm(BinlogPosition.from_checkpoint(checkpoint, self.server.server_id))

    def lag(self) -> dict[str, float]:
        """For metrics (called at scrape time, from another thread): ``lag_bytes``, binlog
        between what the publisher log holds and the server's binlog end; ``lag_seconds``,
        how long ago the last transaction read was written, while behind (else 0)."""
        return self.lags.measure()

    def close(self) -> None:
        self.binlog.close()
        snapshot_cursor = self.snapshot.cursor if self.snapshot is not None else None
        close_quietly(snapshot_cursor, self.snapshots.conn, self.conn)
        self.backfills.close()
        self.lags.close()
