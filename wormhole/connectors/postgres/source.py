"""The ``postgres`` source: pgoutput over the replication protocol, with an initial snapshot.

Positions. A change's native position is ``<commit LSN>:<index in its
transaction>``; its logical position is the commit LSN on the origin server
when the transaction was replicated from elsewhere (an Origin message), else
the commit LSN. The checkpoint stored with every batch is::

    {"phase": "stream", "lsn": <commit LSN of the last transaction emitted>,
     "index": <last change index emitted in it>, "complete": <whole transaction?>,
     "flush": <end LSN of the last complete transaction>}

so a restart resumes exactly, even in the middle of a large transaction that
was emitted in chunks (bounded memory). The slot's ``confirmed_flush_lsn`` moves
only to ``flush`` of batches the publisher log has made durable.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import select
import threading
import time
from typing import Any

import msgspec

from wormhole.connectors.postgres import pgoutput as pg
from wormhole.connectors.postgres import schema_trigger
from wormhole.connectors.postgres.backfill import PostgresBackfill
from wormhole.connectors.postgres.catalog import Catalog, signature
from wormhole.connectors.postgres.decode_errors import DecodeErrors
from wormhole.connectors.postgres.options import PostgresOptions
from wormhole.connectors.postgres.schema_history import SchemaHistory
from wormhole.connectors.postgres.snapshot import PostgresSnapshot
from wormhole.connectors.postgres.sql import (
    identifier,
    qualified,
    quote,
)
from wormhole.core.errors import SourceError, first_line
from wormhole.core.update import NULL, Update
from wormhole.plugins.components import (
    BackfillPlan,
    SourceBatch,
    SourceContext,
    Watermark,
)
from wormhole.plugins.database_source import (
    DatabaseSource,
    SnapshotTable,
    close_quietly,
)

log = logging.getLogger("wormhole.postgres")


try:  # optional dependency: the `postgres` extra
    import psycopg2
    import psycopg2.extensions
    import psycopg2.extras

    HAVE_PSYCOPG2 = True
except ImportError:  # pragma: no cover - reported at open()
    HAVE_PSYCOPG2 = False

_encode = msgspec.json.Encoder().encode
_Raw = msgspec.Raw


class PostgresSource(DatabaseSource):
    connector = "postgres"
    logger = log
    stream_name = "the replication connection"
    stopped_reconnecting = "stopped while reconnecting to PostgreSQL"

    def __init__(self, options: PostgresOptions) -> None:
        super().__init__(options.batch_updates)
        self.options = options
        self.slot = ""
        self.publication = ""
        self.repl: Any = None  # replication connection
        self.cursor: Any = None
        self.relations: dict[int, pg.Relation] = {}
        self.held_message: Any = None
        """A change read when a batch was full (transaction metadata): read first next."""
        self.catalog = Catalog(self)
        self.history: SchemaHistory | None = None
        self.server_version = 0
        self.snapshot_lsn = 0
        # Where emitted data ends (what the next checkpoint says).
        self.lsn = 0
        self.index = -1
        self.complete = True
        self.flush = 0
        # Resume point: skip what the publisher log already holds.
        self.resume_lsn = 0
        self.resume_index = -1
        self.resume_complete = True
        # The current transaction.
        self.txn_lsn = 0
        self.txn_origin: int | None = None
        self.skip_txn = False
        self.resuming = False
        self.confirmed = 0
        self.seen_lsn = 0
        self.last_heartbeat = 0.0
        self.heartbeat_conn: Any = None
        self.lag_conn: Any = None
        self.lag_lock = threading.Lock()
        # Backfills: the watermarks of this slot's pipeline, and their queries.
        self.watermark_prefix = ""
        self.pending_watermark: str | None = None
        self.streamed_txids: collections.deque[int] = collections.deque(maxlen=4096)
        """The last transactions the stream read (their commit records are written)."""
        self.backfills = PostgresBackfill(self)
        self.decode_errors = DecodeErrors(options.on_decode_error == "stop")
        self.raw_text = False
        """A SQL_ASCII database: the snapshot reads text as bytes and decodes it here."""
        # What typed envelopes need (Update.columns and Update.details) per transaction;
        # per relation, the catalog keeps its part.
        self.database_json = '""'
        self.txn_details_head = ""
        self.last_commit_lsn = "null"
        """The end LSN of the last transaction read (JSON-in-JSON), for ``sequence``."""
        self.txn_details_mid = ""
        self.txn_details_tail = ""
        self.snapshots = PostgresSnapshot(self)
        """The initial snapshot's readers, parts and details."""

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
        self.conn = self._connect()
        self._check_server()
        (database,) = self._query("SELECT current_database()")[0]
        self.database_json = json.dumps(database)
        self.history = SchemaHistory(context.state_dir / "postgres-schema.json")

    def _start(self, interrupted: bool) -> None:
        if interrupted:
            log.warning(
                "the initial snapshot of slot %s was interrupted; dropping the slot and "
                "taking the snapshot again (rows already delivered are delivered again)",
                self.slot,
            )
            self._drop_slot()
        self._ensure_publication(first_run=True)
        self.catalog.warn_about_out_of_line_keys()
        self._ensure_schema_trigger()
        self._create_slot_and_snapshot()

    def _resume(self, checkpoint: Any) -> None:
        self._ensure_publication(first_run=False)
        self.catalog.warn_about_out_of_line_keys()
        self._ensure_schema_trigger()
        self._require_slot()
        self.resume_lsn = pg.parse_lsn(checkpoint["lsn"])
        self.resume_index = int(checkpoint.get("index", -1))
        self.resume_complete = bool(checkpoint.get("complete", True))
        self.lsn, self.index = self.resume_lsn, self.resume_index
        self.complete = self.resume_complete
        self.flush = pg.parse_lsn(checkpoint.get("flush", checkpoint["lsn"]))
        self.last_commit_lsn = f'\\"{self.flush}\\"'
        self.confirmed = self.flush
        self.seen_lsn = self.flush
        self._start_replication()

    def _connect(self, replication: bool = False) -> Any:
        try:
            if replication:
                return psycopg2.connect(
                    self.options.dsn,
                    connection_factory=psycopg2.extras.LogicalReplicationConnection,
                )
            conn = psycopg2.connect(self.options.dsn)
            conn.autocommit = True
            return conn
        except psycopg2.OperationalError as exc:
            raise SourceError(
                f"source.dsn: cannot connect to PostgreSQL ({first_line(exc)}); check the "
                f"DSN, that the server is up, and that pg_hba.conf lets this user connect to the "
                f"database (logical replication uses the database's own entry)"
            ) from exc

    def _check_server(self) -> None:
        (level,) = self._query("SHOW wal_level")[0]
        if level != "logical":
            raise SourceError(
                f"source: the server's wal_level is {level!r}; logical decoding needs "
                f"wal_level = logical (set it in postgresql.conf and restart the server)"
            )
        (encoding,) = self._query("SHOW server_encoding")[0]
        if encoding not in ("UTF8", "SQL_ASCII"):
            raise SourceError(
                f"source: the database encoding is {encoding}; this source reads UTF8 databases"
            )
        self.raw_text = encoding == "SQL_ASCII"
        (version,) = self._query("SHOW server_version_num")[0]
        self.server_version = int(version)
        rows = self._query(
            "SELECT rolreplication OR rolsuper, quote_ident(current_user) FROM pg_roles "
            "WHERE rolname = current_user"
        )
        if not rows or not rows[0][0]:
            user = rows[0][1] if rows else "<user>"
            raise SourceError(
                f"source.dsn: the user {user} needs the REPLICATION privilege; as a superuser, "
                f"run: ALTER ROLE {user} WITH REPLICATION"
            )

    def _ensure_publication(self, first_run: bool) -> None:
        exists = self._query("SELECT 1 FROM pg_publication WHERE pubname = %s", (self.publication,))
        if exists:
            return
        if not first_run:
            raise SourceError(
                f"source.publication: publication {self.publication!r} does not exist (was it "
                f"dropped?); the stream cannot continue without it. Recreate it with the same "
                f"tables, or remove the state_dir to start over with a new snapshot"
            )
        tables = self.options.tables
        if tables:
            target = "FOR TABLE " + ", ".join(qualified(t) for t in tables)
        else:
            target = "FOR ALL TABLES"
        try:
            self._query(f"CREATE PUBLICATION {quote(self.publication)} {target}")
        except psycopg2.Error as exc:
            raise SourceError(
                f"source.tables: cannot create publication {self.publication!r} "
                f"({str(exc).strip()}); check the table names and that the user owns them "
                f"(FOR ALL TABLES needs a superuser)"
            ) from exc
        log.info("created publication %s %s", self.publication, target)

    def _ensure_schema_trigger(self) -> None:
        """With ``schema_trigger``: install the trigger unless it is there (see
        :mod:`schema_trigger`). ``schema_events`` needs it."""
        if not self.options.schema_trigger:
            if self.options.schema_events and not (
                self.server_version >= schema_trigger.MINIMUM_VERSION
                and schema_trigger.installed(self._query)
            ):
                raise SourceError(
                    "source.schema_events: schema-change events come from the schema "
                    "trigger, which is not installed in this database; set "
                    "schema_trigger: true (needs a superuser) or have a superuser run "
                    "`wormhole postgres-schema-trigger PIPELINE`"
                    + (
                        f" (it needs PostgreSQL 14 or later; this server is {self.server_version})"
                        if self.server_version < schema_trigger.MINIMUM_VERSION
                        else ""
                    )
                )
            return
        if self.server_version < schema_trigger.MINIMUM_VERSION:
            raise SourceError(
                f"source.schema_trigger: the schema trigger needs PostgreSQL 14 or later "
                f"(pgoutput sends logical decoding messages from 14 on); this server is "
                f"{self.server_version}. Set schema_trigger: false"
            )
        if schema_trigger.installed(self._query):
            return
        try:
            self._query(schema_trigger.INSTALL)
        except psycopg2.Error as exc:
            raise SourceError(
                f"source.schema_trigger: cannot install the schema trigger ({first_line(exc)}); "
                f"{schema_trigger.PRIVILEGE_HINT}, or set schema_trigger: false"
            ) from exc
        log.info("installed the schema trigger (event triggers %s)", schema_trigger.TRIGGERS)

    def _slot_exists(self) -> bool:
        return bool(
            self._query(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND database = "
                "current_database()",
                (self.slot,),
            )
        )

    def _require_slot(self) -> None:
        if not self._slot_exists():
            raise SourceError(
                f"source.slot: replication slot {self.slot!r} does not exist (was it dropped?). "
                f"Changes since the last confirmed position may be gone, so it is not recreated "
                f"silently: remove the state_dir to start over with a new initial snapshot"
            )

    def _drop_slot(self) -> None:
        if self._slot_exists():
            self._query("SELECT pg_drop_replication_slot(%s)", (self.slot,))

    def _create_slot_and_snapshot(self) -> None:
        if self._slot_exists():
            raise SourceError(
                f"source.slot: replication slot {self.slot!r} already exists, but this state_dir "
                f"has no record of reading it. Drop it (SELECT pg_drop_replication_slot("
                f"'{self.slot}')) or name another slot"
            )
        self.repl = self._connect(replication=True)
        self.cursor = self.repl.cursor()
        # The exported snapshot shows the catalog exactly as it is at the slot's start,
        # for the schema history, even when no rows are read from it.
        self.cursor.execute(
            f"CREATE_REPLICATION_SLOT {quote(self.slot)} LOGICAL pgoutput EXPORT_SNAPSHOT"
        )
        _slot, consistent_point, snapshot_name, _plugin = self.cursor.fetchone()
        log.info("created replication slot %s at %s", self.slot, consistent_point)
        self.snapshot_lsn = pg.parse_lsn(consistent_point)
        self.snapshot_position = self.snapshot_logical = pg.lsn_text(self.snapshot_lsn)
        self.lsn, self.index, self.complete = self.snapshot_lsn, -1, True
        self.flush = self.confirmed = self.seen_lsn = self.snapshot_lsn
        self.last_commit_lsn = f'\\"{self.snapshot_lsn}\\"'
        self.resume_lsn, self.resume_index = self.snapshot_lsn, -1
        self.conn.autocommit = False
        with self.conn.cursor() as cur:
            cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            cur.execute("SET TRANSACTION SNAPSHOT %s", (snapshot_name,))
            snapshot_txid: Any = "null"
            if self.describe:  # Debezium's snapshot events name the snapshot's transaction
                cur.execute("SELECT txid_current()")
                (snapshot_txid,) = cur.fetchone()
        snapshot_us = int(time.time() * 1_000_000)
        lsn = self.snapshot_lsn
        snapshots = self.snapshots
        snapshots.details_head = '{"connector":"postgresql",'
        snapshots.details_mid = (
            f'"db":{self.database_json},"sequence":"[null,\\"{lsn}\\"]",'
            f'"ts_us":{snapshot_us},"ts_ns":{snapshot_us}000,'
        )
        snapshots.details_tail = (
            f'"txId":{snapshot_txid},"lsn":{lsn},"xmin":null,"origin":null,"origin_lsn":null}}'
        )
        if self.options.snapshot == "initial":
            snapshots.open_readers(snapshot_name, self.options.snapshot_readers)
        self.catalog.record_published_tables()
        if self.options.snapshot == "initial":
            self.phase = "snapshot"
            self.snapshot_tables = self._published_tables()
        else:
            self.conn.commit()
            self.conn.autocommit = True
            self._start_replication()
            # The new slot's position goes into the publisher log at once, so that a
            # restart knows the slot is ours even if no change arrived yet.
            self.announce = True

    def snapshot_pending(self) -> list[str]:
        """Tables whose every row this open's initial snapshot is about to read (a new
        application starting at the log end gets them all: its start backfill is not needed)."""
        return list(self.snapshot_tables) if self.phase == "snapshot" else []

    def _published_tables(self) -> list[str]:
        rows = self._query(
            "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s "
            "ORDER BY 1, 2",
            (self.publication,),
        )
        heartbeat = self.options.heartbeat_tables
        return [f"{s}.{n}" for s, n in rows if f"{s}.{n}" not in heartbeat]

    def _start_replication(self) -> None:
        if self.repl is None:
            self.repl = self._connect(replication=True)
            self.cursor = self.repl.cursor()
        try:
            self.cursor.start_replication(
                slot_name=self.slot,
                decode=False,
                start_lsn=pg.lsn_text(self.confirmed) if self.confirmed else 0,
                options=self._replication_options(),
                status_interval=self.options.status_interval_s,
            )
        except psycopg2.Error as exc:
            text = str(exc).strip()
            if "does not exist" in text:
                self._require_slot()
            raise SourceError(
                f"source: cannot start replication from slot {self.slot}: {text}"
            ) from exc
        self.phase = "stream"

    def _replication_options(self) -> dict[str, str]:
        options = {"proto_version": "1", "publication_names": self.publication}
        if self.server_version >= 140000:
            # Logical decoding messages: the watermarks of backfills.
            options["messages"] = "true"
        return options

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

    # ------------------------------------------------------------ catalog

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
            self.conn = self._connect()
            self._require_slot()
            # Resume after what was emitted; the server resends from the slot.
            self.resume_lsn, self.resume_index = self.lsn, self.index
            self.resume_complete = self.complete
            self.in_txn = False
            self.skip_txn = self.resuming = False
            self.pending_watermark = None
            self.held_message = None
            # Only what was returned counts as seen (for --once).
            self.seen_lsn = self.flush
            self.relations.clear()
            self._start_replication()
        except SourceError as again:
            if "does not exist" in str(again):
                raise
            return str(again)
        except psycopg2.Error as again:
            return str(again).strip()
        log.info("reconnected to PostgreSQL; streaming from %s", pg.lsn_text(self.confirmed))
        return None

    def _checkpoint(self) -> dict[str, Any]:
        if self.history is not None:
            # Durable no later than the batch keyed by what it learnt.
            self.history.prune(self.confirmed)
            self.history.save()
        return {
            "phase": "stream",
            "lsn": pg.lsn_text(self.lsn),
            "index": self.index,
            "complete": self.complete,
            "flush": pg.lsn_text(self.flush),
        }

    def _read_stream(self, deadline: float) -> SourceBatch | None:
        """Read until a batch is full or ``deadline``.

        What the next checkpoint says (``lsn``, ``index``, ``complete``, ``flush``)
        is kept in locals and stored only with the batch that is returned: if the
        connection fails half-way, the changes read so far are dropped, and the
        reconnect resumes after what was returned, not after what was dropped.
        """
        cursor = self.cursor
        updates: list[Update] = []
        append = updates.append
        limit = self.options.batch_updates
        relations = self.relations
        heartbeat_tables = self.options.heartbeat_tables
        parse_change = pg.parse_change
        bad: list[tuple[str, bytes]] = []
        make_insert = self._insert
        make_change = self._change
        lsn, index, complete, flush = self.lsn, self.index, self.complete, self.flush
        # Whether the transaction being read was emitted before (a resend after a restart
        # or reconnect): kept across calls, since a transaction can span several.
        skip_txn, resuming = self.skip_txn, self.resuming
        read_message = cursor.read_message
        describe = self.describe
        # With transaction metadata, a batch that is full inside a transaction ends before
        # the next change of it (held for the next call), not right after the last one
        # read: the last change of a transaction must be known as such (its END).
        marker = self.marker
        full = False
        held, self.held_message = self.held_message, None

        def batch() -> SourceBatch:
            self.lsn, self.index, self.complete, self.flush = lsn, index, complete, flush
            self.skip_txn, self.resuming = skip_txn, resuming
            return SourceBatch(updates, self._checkpoint())

        if self.confirmed:
            # Recorded here; psycopg2 reports it every status_interval.
            cursor.send_feedback(flush_lsn=self.confirmed)
        self._heartbeat()
        while True:
            if held is None:
                message = read_message()
            else:
                message, held = held, None
            if message is None:
                if self.confirmed:
                    cursor.send_feedback(flush_lsn=self.confirmed)
                self._heartbeat()
                if updates and not self.in_txn:
                    return batch()
                if not self.in_txn and cursor.wal_end:
                    # Nothing of ours up to the server's WAL end.
                    self.seen_lsn = max(self.seen_lsn, cursor.wal_end)
                    if self.confirmed >= self.flush:
                        # Idle, and all that was emitted is durable: the slot may move
                        # past WAL that held nothing for this publication (once what the
                        # schema history learnt from it is durable too).
                        if self.history is not None and self.history.dirty:
                            self.history.save()
                        self.confirmed = max(self.confirmed, cursor.wal_end)
                remaining = deadline - time.monotonic()
                if remaining <= 0 and (marker is None or not self.in_txn):
                    # (With transaction metadata, not inside a transaction: see ``full``.
                    # The server sends a decoded transaction's messages without a pause.)
                    if updates:
                        return batch()
                    # Transactions that held nothing for us still move the position.
                    self.lsn, self.index, self.complete, self.flush = lsn, index, complete, flush
                    self.skip_txn, self.resuming = skip_txn, resuming
                    return None
                select.select([cursor], [], [], min(remaining, 0.1) if remaining > 0 else 0.1)
                continue
            data = message.payload
            tag = data[0]
            if full and (tag == 73 or tag == 85 or tag == 68 or tag == 84 or tag == 77):
                self.held_message = message
                return batch()
            if tag == 73 or tag == 85 or tag == 68:  # I U D
                self.txn_index += 1
                if skip_txn or (resuming and self.txn_index <= self.resume_index):
                    continue
                op, relation, before, after, unchanged, whole = parse_change(data, relations, bad)
                if bad:
                    self._undecodable(relation, bad)
                if heartbeat_tables and relation.table in heartbeat_tables:
                    continue
                if describe:
                    self._describe_change(relation, message.data_start)
                if op == "c":
                    append(make_insert(relation, after))
                    if marker is not None:
                        marker.mark(updates[-1], f"{self.txn_id}:{message.data_start}")
                else:
                    made = make_change(op, relation, before, after, unchanged, whole)
                    updates.extend(made)
                    if marker is not None:
                        for update in made:
                            marker.mark(update, f"{self.txn_id}:{message.data_start}")
                lsn, index, complete = self.txn_lsn, self.txn_index, False
                if len(updates) >= limit:
                    # A large transaction goes out in chunks: memory stays bounded.
                    if marker is None:
                        return batch()
                    full = True
            elif tag == 66:  # B
                self.txn_lsn, self.txn_ts, self.txn_id = pg.parse_begin(data)
                self.streamed_txids.append(self.txn_id)
                if describe:
                    self._describe_transaction(data)
                self.txn_position = self.txn_logical = pg.lsn_text(self.txn_lsn)
                self.txn_index = -1
                self.txn_origin = None
                self.pending_watermark = None
                self.in_txn = True
                if marker is not None:
                    marker.begin(f"{self.txn_id}:{message.data_start}", self.txn_ts)
                resuming = self.txn_lsn == self.resume_lsn
                skip_txn = self.txn_lsn < self.resume_lsn or (resuming and self.resume_complete)
            elif tag == 67:  # C
                _commit_lsn, end_lsn, _ts = pg.parse_commit(data)
                self.last_commit_lsn = f'\\"{end_lsn}\\"'
                self.in_txn = False
                self.seen_lsn = max(self.seen_lsn, end_lsn)
                if skip_txn:
                    skip_txn = False
                    continue
                lsn, index, complete = self.txn_lsn, self.txn_index, True
                flush = end_lsn
                if marker is not None:
                    marker.commit(f"{self.txn_id}:{message.data_start}")
                if self.pending_watermark is not None:
                    # A backfill watermark: the batch ends here (see SourceBatch.watermark).
                    token, self.pending_watermark = self.pending_watermark, None
                    out = batch()
                    out.watermark = Watermark(token, self.txn_position, self.txn_logical)
                    return out
                if len(updates) >= limit:
                    return batch()
            elif tag == 82:  # R
                relation = pg.parse_relation(data)
                self.catalog.describe(relation)
                relations[relation.oid] = relation
            elif tag == 79:  # O
                self.txn_origin, _name = pg.parse_origin(data)
                self.txn_logical = pg.lsn_text(self.txn_origin)
            elif tag == 84:  # T
                self.txn_index += 1
                if skip_txn or (resuming and self.txn_index <= self.resume_index):
                    continue
                for oid in pg.parse_truncate(data):
                    relation = relations[oid]
                    if relation.table not in heartbeat_tables:
                        if describe:
                            self._describe_change(relation, message.data_start)
                        append(self._truncate(relation))
                        if marker is not None:
                            marker.mark(updates[-1], f"{self.txn_id}:{message.data_start}")
                lsn, index, complete = self.txn_lsn, self.txn_index, False
            elif tag == 77:  # M
                transactional, prefix, content = pg.parse_message(data)
                if transactional and prefix == self.watermark_prefix and not skip_txn:
                    try:
                        self.pending_watermark = content.decode()
                    except UnicodeDecodeError:
                        at = f"{self.txn_position}:{self.txn_index}"
                        self.decode_errors.message(prefix, content, at)
                elif transactional and prefix == schema_trigger.PREFIX:
                    # Counted as a change (its event's position), and recorded even in a
                    # transaction emitted before: the history is rebuilt from the WAL.
                    self.txn_index += 1
                    emit = not skip_txn and not (resuming and self.txn_index <= self.resume_index)
                    event = self._schema_change(content, emit)
                    if event is not None:
                        append(event)
                        lsn, index, complete = self.txn_lsn, self.txn_index, False
            # 'Y' (type) carries nothing the envelope needs.

    def _describe_change(self, relation: pg.Relation, lsn: int) -> None:
        """``columns`` and ``details`` of the change at ``lsn`` (the message's own WAL
        position), for :meth:`_update` and :meth:`_insert`."""
        self.change_columns = self.catalog.relation_columns.get(relation.oid, NULL)
        self.change_details = _Raw(
            f"{self.txn_details_head}{lsn}{self.txn_details_mid}"
            f"{self.catalog.relation_details.get(relation.oid, '')}{self.txn_details_tail}"
            f'{lsn},"xmin":null,"origin":null,"origin_lsn":null}}'.encode()
        )

    def _describe_transaction(self, begin: bytes) -> None:
        """The parts of ``details`` that a transaction's changes share."""
        commit_us = pg.parse_begin_us(begin)
        self.txn_details_head = (
            f'{{"connector":"postgresql","snapshot":"false","db":{self.database_json},'
            f'"sequence":"[{self.last_commit_lsn},\\"'
        )
        self.txn_details_mid = f'\\"]","ts_us":{commit_us},"ts_ns":{commit_us}000,'
        self.txn_details_tail = f'"txId":{self.txn_id},"lsn":'

    def _schema_change(self, content: bytes, emit: bool) -> Update | None:
        """A message of the schema trigger: the table's version after a DDL, exact at
        this point of the WAL; with ``schema_events`` (and ``emit``), its event."""
        history = self.history
        assert history is not None
        try:
            message = schema_trigger.parse(content)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning(
                "ignoring a message with prefix %s at %s:%s that the schema trigger did not "
                "write (%s)",
                schema_trigger.PREFIX,
                self.txn_position,
                self.txn_index,
                exc,
            )
            return None
        if message.dropped:
            published = history.published(message.oid)
        else:
            published = self.publication in message.publications
        entry = message.entry(self.txn_lsn, self.txn_index, published)
        history.record_in_band(message.oid, entry)
        relation = self.relations.get(message.oid)
        if (
            relation is not None
            and relation.replica_identity in ("f", "n")
            and entry.identity == relation.replica_identity
            and entry.columns == signature(relation)
        ):
            # Its primary key changed and nothing the Relation message says did: the next
            # change is keyed by the new one whether or not a Relation message comes first.
            relation.key_columns = self.catalog.stream_key(relation)
        if not (emit and published and self.options.schema_events):
            return None
        if message.table in self.options.heartbeat_tables:
            return None
        # Not a row of a described table: no columns or details of the last change.
        self.change_columns = self.change_details = NULL
        return self._update(
            "c", schema_trigger.EVENTS_TABLE, {"table": message.table}, None, message.event()
        )

    def _undecodable(self, relation: pg.Relation, bad: list[tuple[str, bytes]]) -> None:
        """Text values of a change that are not UTF-8 (already rendered as undecoded by
        the parser): a warning and the metric for each, or a stop."""
        at = f"{self.txn_position}:{self.txn_index}"
        try:
            for column, raw in bad:
                self.decode_errors.value(relation.table, column, raw, at)
        finally:
            bad.clear()

    def _insert(self, relation: pg.Relation, after: Any) -> Update:
        # The common case, kept short: an insert holds every value (never a TOAST
        # placeholder), and its key is in it.
        return Update(
            op="c",
            key={k: after[k] for k in relation.key_columns},
            after=_Raw(_encode(after)),
            table=relation.table,
            connector="postgres",
            position=f"{self.txn_position}:{self.txn_index}",
            logical=self.txn_logical,
            txid=self.txn_id,
            ts_ms=self.txn_ts,
            columns=self.change_columns,
            details=self.change_details,
        )

    def _change(
        self,
        op: str,
        relation: pg.Relation,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        unchanged: list[str],
        full: bool,
    ) -> list[Update]:
        """An update or a delete; an update that changed the key becomes a delete + insert.

        ``before`` is the old row (``full``, REPLICA IDENTITY FULL) or the old key
        columns, or None when the update left the key alone. ``unchanged`` names the
        TOASTed columns the update left alone, which are not in ``after``.
        """
        keys = relation.key_columns
        if op == "d":
            assert before is not None
            old_key = {k: before[k] for k in keys}
            return [self._update("d", relation.table, old_key, before if full else old_key, None)]
        assert after is not None
        if unchanged and before is not None:
            # The old image holds what the update left alone: the whole old row (FULL),
            # or the key columns, which PostgreSQL logs when they are stored out of line.
            for name in unchanged:
                if full or name in keys:
                    after[name] = before[name]
        key = {k: after[k] for k in keys}
        if before is None:
            if unchanged and any(key[k] == pg.UNCHANGED_TOAST for k in keys):
                raise self._unknown_key(relation, [k for k in keys if k in unchanged])
            return [self._update("u", relation.table, key, key, after)]
        old_key = {k: before[k] for k in keys}
        if old_key == key:
            return [self._update("u", relation.table, key, before if full else old_key, after)]
        # The old key may live in another shard: it gets a delete, the new key an
        # insert, so both flows see the change (as for any key-value store).
        return [
            self._update("d", relation.table, old_key, before if full else old_key, None),
            self._update("c", relation.table, key, None, after),
        ]

    def _unknown_key(self, relation: pg.Relation, columns: list[str]) -> SourceError:
        return SourceError(
            f"source: the update of {relation.table} at {self.txn_position}:{self.txn_index} "
            f"left its key column(s) {', '.join(columns)} unchanged and stored out of line "
            f"(TOAST), and this server did not write their value to the WAL, so the key of "
            f"the change is unknown and it cannot be delivered. Set REPLICA IDENTITY FULL on "
            f"the table (ALTER TABLE {qualified(relation.table)} REPLICA IDENTITY FULL) or "
            f"upgrade PostgreSQL to a minor release that writes the value (10.21, 11.16, "
            f"12.11, 13.7, 14.3 or later), then remove the state_dir to start over with a new "
            f"initial snapshot: this change stays in the slot's WAL"
        )

    def _truncate(self, relation: pg.Relation) -> Update:
        return self._update("t", relation.table, {}, None, None)

    # -------------------------------------------------------------- snapshot
    # DatabaseSource's hooks, answered by the source's PostgresSnapshot (snapshot.py).
    def _snapshot_estimate(self) -> int | None:
        return self.snapshots.estimate()

    def _open_snapshot_table(self, table: str) -> SnapshotTable:
        return self.snapshots.open_table(table)

    def _snapshot_details(self, table: SnapshotTable, flag: str) -> msgspec.Raw:
        return self.snapshots.details(table, flag)

    def _end_snapshot(self) -> None:
        self.conn.commit()
        self.conn.autocommit = True
        self.snapshots.close_readers()

    def _start_stream(self) -> None:
        self._start_replication()

    # --------------------------------------------------------------- --once
    def capture_end(self) -> Any:
        """The end of a marker written now (see :meth:`_end_marker`), after the slot exists:
        during a snapshot, everything committed after it is in the WAL the stream reads."""
        return pg.lsn_text(self._end_marker())

    def _end_marker(self) -> int:
        """Write the end marker; its LSN.

        The server's WAL positions alone do not do: with ``synchronous_commit`` off, a
        COMMIT returns once its record is in the WAL buffers, before it is written, so
        ``pg_current_wal_lsn()`` (the write position) can be short of a transaction the
        client saw committed; ``pg_current_wal_insert_lsn()`` includes it, but the stream
        sees only flushed WAL, and at a page boundary that position lies past the page
        header, where no record ends until something more is written.

        The marker is an empty transactional logical decoding message under the source's
        end prefix, in a savepoint that is rolled back, in a transaction committed with
        ``synchronous_commit`` on. Its LSN (the end of its record) comes after the commit of
        every transaction committed before it; the commit (the transaction has an xid from
        the message) flushes the WAL past it, so the stream decodes all of them, and then
        the commit, whether or not anything is written after it. Rolled back, the message
        reaches no reader of the WAL (this source, another pipeline, Debezium), and the
        transaction has no change: pgoutput sends it as an empty transaction, or from
        PostgreSQL 15 on skips it and moves the position it reports past it.
        """
        conn = None
        try:
            # Its own connection: during a snapshot, the source's holds the snapshot.
            conn = self._connect()
            with conn.cursor() as cur:
                cur.execute("SET synchronous_commit TO on")
                cur.execute("BEGIN")
                cur.execute("SAVEPOINT wormhole_end")
                cur.execute(
                    "SELECT pg_logical_emit_message(true, %s, '')::text", (self._end_prefix(),)
                )
                (lsn,) = cur.fetchone()
                cur.execute("ROLLBACK TO SAVEPOINT wormhole_end")
                cur.execute("COMMIT")
        except psycopg2.Error as exc:
            hint = (
                "grant EXECUTE on the function pg_logical_emit_message to the DSN's user "
                "(PUBLIC has it unless it was revoked)"
                if exc.pgcode == "42501"
                else "check that the DSN names the primary server (a standby cannot write WAL)"
            )
            raise SourceError(
                f"source: run --once marks the end it reads to with a logical decoding "
                f"message, and writing it failed ({first_line(exc)}); {hint}"
            ) from exc
        finally:
            close_quietly(conn)
        return pg.parse_lsn(lsn)

    def _end_prefix(self) -> str:
        """The prefix of the end marker: this slot's own (never decoded: rolled back)."""
        return f"wormhole.end.{self.slot}"

    def _stream_reached(self, end: Any) -> bool:
        # Past the marker's record: every transaction that committed before it was read
        # (the marker's empty transaction, or the server's position after it).
        return self.seen_lsn >= pg.parse_lsn(end)

    # ------------------------------------------------------------- confirm
    def confirm(self, checkpoint: Any) -> None:
        """The publisher log holds everything up to ``checkpoint``: the slot may move on."""
        if checkpoint.get("phase") == "stream":
            # Read by the tailer thread, which owns the replication connection.
            self.confirmed = max(self.confirmed, pg.parse_lsn(checkpoint["flush"]))

    # ------------------------------------------------------------------ lag
    def lag(self) -> dict[str, float]:
        """For metrics (called at scrape time, from another thread): ``lag_bytes``, WAL
        between the server's current position and what the publisher log holds (confirmed);
        ``retained_bytes``, WAL the slot keeps on the server (from its ``restart_lsn``)."""
        with self.lag_lock:
            try:
                if self.lag_conn is None:
                    self.lag_conn = psycopg2.connect(
                        self.options.dsn, connect_timeout=5, options="-c statement_timeout=5000"
                    )
                    self.lag_conn.autocommit = True
                with self.lag_conn.cursor() as cur:
                    cur.execute(
                        "SELECT pg_current_wal_lsn()::text, confirmed_flush_lsn::text, "
                        "restart_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                        (self.slot,),
                    )
                    row = cur.fetchone()
            except psycopg2.Error:
                close_quietly(self.lag_conn)
                self.lag_conn = None
                raise
        if row is None:
            return {}
        current = pg.parse_lsn(row[0])
        confirmed = max(self.confirmed, pg.parse_lsn(row[1]) if row[1] else 0)
        restart = pg.parse_lsn(row[2]) if row[2] else current
        return {
            "lag_bytes": float(max(0, current - confirmed)),
            "retained_bytes": float(max(0, current - restart)),
        }

    # ------------------------------------------------------------ heartbeat
    def _heartbeat(self) -> None:
        heartbeat = self.options.heartbeat
        if heartbeat is None:
            return
        now = time.monotonic()
        if now - self.last_heartbeat < heartbeat.interval_s:
            return
        self.last_heartbeat = now
        try:
            if self.heartbeat_conn is None:
                self.heartbeat_conn = psycopg2.connect(self.options.dsn)
                self.heartbeat_conn.autocommit = True
            with self.heartbeat_conn.cursor() as cur:
                cur.execute(
                    f"CREATE TABLE IF NOT EXISTS {qualified(heartbeat.table)} "
                    f"(id int PRIMARY KEY, ts timestamptz NOT NULL)"
                )
                cur.execute(
                    f"INSERT INTO {qualified(heartbeat.table)} VALUES (1, now()) "
                    f"ON CONFLICT (id) DO UPDATE SET ts = excluded.ts"
                )
        except psycopg2.Error as exc:
            log.warning("heartbeat write to %s failed: %s", heartbeat.table, str(exc).strip())
            self.heartbeat_conn = None

    def close(self) -> None:
        if self.history is not None:
            with contextlib.suppress(OSError):
                self.history.save()
        if self.cursor is not None and self.phase == "stream" and self.confirmed:
            # Status updates go out every status_interval; the last one must not wait.
            with contextlib.suppress(Exception):
                self.cursor.send_feedback(flush_lsn=self.confirmed, force=True)
        self.snapshots.close_readers()
        with self.lag_lock:
            close_quietly(self.repl, self.conn, self.heartbeat_conn, self.lag_conn)
            self.lag_conn = None
            self.backfills.close()
