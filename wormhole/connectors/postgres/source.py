"""The ``postgres`` source: pgoutput over the replication protocol, with an initial snapshot.

:class:`PostgresSource` composes the parts, each in a module of its own:

- :mod:`admin` (:class:`PostgresAdmin`): the server's settings, the publication, the schema
  trigger, the replication slot, the end marker of ``--once``, the heartbeat, the lag;
- :mod:`snapshot` (:class:`PostgresSnapshot`): the initial snapshot;
- :mod:`stream` (:class:`PostgresStream`): the replication connection's messages, typed by
  :mod:`stream_reader`, as batches of updates (:mod:`changes`), and the stream's position
  (:mod:`position`, which describes the checkpoint);
- :mod:`catalog` (:class:`Catalog`): domain types, a table's key at a point of the WAL,
  column descriptions;
- :mod:`backfill` (:class:`PostgresBackfill`): backfills while the stream runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

from wormhole.connectors.postgres import pgoutput as pg
from wormhole.connectors.postgres.admin import PostgresAdmin
from wormhole.connectors.postgres.backfill import PostgresBackfill
from wormhole.connectors.postgres.catalog import Catalog
from wormhole.connectors.postgres.decode_errors import DecodeErrors
from wormhole.connectors.postgres.driver import HAVE_PSYCOPG2, psycopg2
from wormhole.connectors.postgres.options import PostgresOptions
from wormhole.connectors.postgres.position import StreamPosition
from wormhole.connectors.postgres.schema_history import SchemaHistory
from wormhole.connectors.postgres.snapshot import PostgresSnapshot
from wormhole.connectors.postgres.sql import identifier
from wormhole.connectors.postgres.stream import PostgresStream
from wormhole.core.errors import SourceError
from wormhole.core.update import Update
from wormhole.plugins.components import BackfillPlan, SourceBatch, SourceContext
from wormhole.plugins.database_source import DatabaseSource, close_quietly

log = logging.getLogger("wormhole.postgres")


class PostgresSource(DatabaseSource):
    connector = "postgres"
    logger = log
    stream_name = "the replication connection"
    stopped_reconnecting = "stopped while reconnecting to PostgreSQL"

    def __init__(self, options: PostgresOptions) -> None:
        super().__init__(options.batch_updates)
        self.options = options
        # What the parts share: the server, the slot, and where it started.
        self.slot = ""
        self.publication = ""
        self.watermark_prefix = ""
        """The prefix of this slot's backfill watermarks (logical decoding messages)."""
        self.server_version = 0
        self.raw_text = False
        """A SQL_ASCII database: the snapshot reads text as bytes and decodes it here."""
        self.database_json = '""'
        self.snapshot_lsn = 0
        self.repl: Any = None  # replication connection
        self.cursor: Any = None
        self.txn_lsn = 0
        """The commit LSN of the transaction being read."""
        self.history: SchemaHistory | None = None
        self.decode_errors = DecodeErrors(options.on_decode_error == "stop")
        self.admin = PostgresAdmin(self)
        self.catalog = Catalog(self)
        self.stream = PostgresStream(self)
        self.snapshots: PostgresSnapshot = PostgresSnapshot(self)
        """The initial snapshot's readers, parts and details (the base class reads the
        snapshot with it)."""
        self.backfills = PostgresBackfill(self)

    # ------------------------------------------------------------------ open
    def _connect_and_check(self, context: SourceContext) -> None:
        if not HAVE_PSYCOPG2:
            raise SourceError(
                "source.type: postgres needs psycopg2; install the extra: pip install "
                "'wormhole-cdc[postgres]'"
            )
        options = self.options
        self.slot = options.slot or f"wormhole_{identifier(context.pipeline)}"
        self.publication = options.publication or f"wormhole_{identifier(context.pipeline)}"
        self.watermark_prefix = f"wormhole.watermark.{self.slot}"
        self.conn = self.admin.connect()
        self.admin.check_server()
        (database,) = self._query("SELECT current_database()")[0]
        self.database_json = json.dumps(database)
        self.history = SchemaHistory(context.state_dir / "postgres-schema.json")

    def _start(self, interrupted: bool) -> None:
        admin = self.admin
        if interrupted:
            log.warning(
                "the initial snapshot of slot %s was interrupted; dropping the slot and "
                "taking the snapshot again (rows already delivered are delivered again)",
                self.slot,
            )
            admin.drop_slot()
        admin.prepare(first_run=True)
        self.snapshot_lsn, snapshot_name = admin.create_slot()
        self.snapshot_position = self.snapshot_logical = pg.lsn_text(self.snapshot_lsn)
        self.stream.start_at(self.snapshot_lsn)
        self.snapshots.begin(snapshot_name)
        self.catalog.record_published_tables()
        if self.options.snapshot == "initial":
            self.phase = "snapshot"
            self.snapshot_tables = admin.published_tables()
        else:
            self.snapshots.end()
            self._start_stream()
            # The new slot's position goes into the publisher log at once, so that a
            # restart knows the slot is ours even if no change arrived yet.
            self.announce = True

    def _resume(self, checkpoint: Any) -> None:
        self.admin.prepare(first_run=False)
        self.admin.require_slot()
        self.stream.resume_from(StreamPosition.from_checkpoint(checkpoint))
        self._start_stream()

    def snapshot_pending(self) -> list[str]:
        """Tables whose every row this open's initial snapshot is about to read (a new
        application starting at the log end gets them all: its start backfill is not needed)."""
        return list(self.snapshot_tables) if self.phase == "snapshot" else []

    # ---------------------------------------------------------------- stream
    # DatabaseSource's hooks, answered by the source's PostgresStream (stream.py).
    def _start_stream(self) -> None:
        self.stream.attach(self.admin.start_replication(self.stream.confirmed))
        self.phase = "stream"

    def _read_stream(self, deadline: float) -> SourceBatch | None:
        return self.stream.read(deadline)

    def _checkpoint(self) -> dict[str, Any]:
        return self.stream.checkpoint()

    def confirm(self, checkpoint: Any) -> None:
        """The publisher log holds everything up to ``checkpoint``: the slot may move on."""
        if checkpoint.get("phase") == "stream":
            # Read by the tailer thread, which owns the replication connection.
            stream = self.stream
            stream.confirmed = max(stream.confirmed, pg.parse_lsn(checkpoint["flush"]))

    def lag(self) -> dict[str, float]:
        """For metrics, from another thread: see :meth:`PostgresAdmin.lag`."""
        return self.admin.lag()

    # --------------------------------------------------------------- --once
    def capture_end(self) -> Any:
        """The end of a marker written now (see :meth:`PostgresAdmin.end_marker`), after the
        slot exists: during a snapshot, everything committed after it is in the WAL the
        stream reads."""
        return pg.lsn_text(self.admin.end_marker())

    def _stream_reached(self, end: Any) -> bool:
        # Past the marker's record: every transaction that committed before it was read
        # (the marker's empty transaction, or the server's position after it).
        return self.stream.seen_lsn >= pg.parse_lsn(end)

    # ------------------------------------------------------------ backfills
    # SourceBackfill, answered by the source's PostgresBackfill (backfill.py).
    def backfill_plan(self, pipeline: str, table: str, where: str | None) -> BackfillPlan:
        return self.backfills.plan(pipeline, table, where)

    def backfill_watermark(self, token: str) -> None:
        self.backfills.watermark(token)

    def backfill_chunk(
        self, plan: BackfillPlan, after: list[Any] | None, limit: int
    ) -> list[Update]:
        return self.backfills.chunk(plan, after, limit)

    def backfill_unseen(self, update: Update) -> bool:
        return self.backfills.unseen(update)

    # ------------------------------------------------------------- reconnect
    def _lost(self, exc: Exception) -> str:
        if not isinstance(exc, psycopg2.Error):
            raise exc
        text = str(exc).strip()
        if "does not exist" in text and "slot" in text:
            raise SourceError(f"source.slot: {text}") from exc
        return text

    def _disconnect(self) -> None:
        close_quietly(self.repl, self.conn)
        self.repl = self.cursor = None

    def _reconnect(self) -> str | None:
        try:
            self.conn = self.admin.connect()
            self.admin.require_slot()
            # Resume after what was emitted; the server resends from the slot.
            self.stream.rewind()
            self._start_stream()
        except SourceError as again:
            if "does not exist" in str(again):
                raise
            return str(again)
        except psycopg2.Error as again:
            return str(again).strip()
        log.info("reconnected to PostgreSQL; streaming from %s", pg.lsn_text(self.stream.confirmed))
        return None

    def close(self) -> None:
        if self.history is not None:
            with contextlib.suppress(OSError):
                self.history.save()
        if self.cursor is not None and self.phase == "stream" and self.stream.confirmed:
            # Status updates go out every status_interval; the last one must not wait.
            with contextlib.suppress(Exception):
                self.cursor.send_feedback(flush_lsn=self.stream.confirmed, force=True)
        self.snapshots.close_readers()
        self.admin.close(self.repl, self.conn)
        self.backfills.close()
