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

import contextlib
import logging
import re
import select
import time
from typing import Any

import msgspec

from wormhole.connectors.postgres import pgoutput as pg
from wormhole.connectors.postgres.options import PostgresOptions
from wormhole.core.errors import SourceError
from wormhole.core.update import NULL, Update, snapshot_read
from wormhole.plugins.components import SourceBatch, SourceContext

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


def _identifier(name: str) -> str:
    return re.sub(r"[^a-z0-9_]", "_", name.lower())[:60]


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _qualified(table: str) -> str:
    schema, _, name = table.rpartition(".")
    return f"{_quote(schema or 'public')}.{_quote(name)}"


class PostgresSource:
    def __init__(self, options: PostgresOptions) -> None:
        self.options = options
        self.context: SourceContext | None = None
        self.slot = ""
        self.publication = ""
        self.conn: Any = None  # catalog / snapshot connection
        self.repl: Any = None  # replication connection
        self.cursor: Any = None
        self.relations: dict[int, pg.Relation] = {}
        self.base_types: dict[int, int] = {}
        self.phase = "stream"
        self.snapshot_tables: list[str] = []
        self.snapshot_cursor: Any = None
        self.snapshot_columns: list[pg.Column] = []
        self.snapshot_keys: list[str] = []
        self.snapshot_table = ""
        self.snapshot_lsn = 0
        self.snapshot_index = 0
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
        self.txn_index = -1
        self.txn_ts = 0
        self.txn_xid = 0
        self.txn_origin: int | None = None
        self.txn_commit = ""
        self.txn_logical = ""
        self.skip_txn = False
        self.resuming = False
        self.in_txn = False
        self.confirmed = 0
        self.seen_lsn = 0
        self.last_heartbeat = 0.0
        self.heartbeat_conn: Any = None
        self.announce = False

    # ------------------------------------------------------------------ open
    def open(self, context: SourceContext, checkpoint: Any) -> None:
        if not HAVE_PSYCOPG2:
            raise SourceError(
                "source.type: postgres needs psycopg2; install the extra: pip install "
                "'wormhole[postgres]'"
            )
        self.context = context
        options = self.options
        self.slot = options.slot or f"wormhole_{_identifier(context.pipeline)}"
        self.publication = options.publication or f"wormhole_{_identifier(context.pipeline)}"
        self.conn = self._connect()
        self._check_server()
        if checkpoint is None or checkpoint.get("phase") == "snapshot":
            if checkpoint is not None:
                log.warning(
                    "the initial snapshot of slot %s was interrupted; dropping the slot and "
                    "taking the snapshot again (rows already delivered are delivered again)",
                    self.slot,
                )
                self._drop_slot()
            self._ensure_publication(first_run=True)
            self._create_slot_and_snapshot()
        else:
            self._ensure_publication(first_run=False)
            self._require_slot()
            self.resume_lsn = pg.parse_lsn(checkpoint["lsn"])
            self.resume_index = int(checkpoint.get("index", -1))
            self.resume_complete = bool(checkpoint.get("complete", True))
            self.lsn, self.index = self.resume_lsn, self.resume_index
            self.complete = self.resume_complete
            self.flush = pg.parse_lsn(checkpoint.get("flush", checkpoint["lsn"]))
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
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise SourceError(
                f"source.dsn: cannot connect to PostgreSQL ({message}); check the DSN, that "
                f"the server is up, and that pg_hba.conf lets this user connect to the "
                f"database (logical replication uses the database's own entry)"
            ) from exc

    def _query(self, sql: str, args: Any = None) -> list[tuple[Any, ...]]:
        with self.conn.cursor() as cur:
            cur.execute(sql, args)
            return cur.fetchall() if cur.description else []

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
        rows = self._query(
            "SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user"
        )
        if not rows or not rows[0][0]:
            raise SourceError(
                "source.dsn: the user needs the REPLICATION privilege "
                "(ALTER ROLE <user> WITH REPLICATION)"
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
            target = "FOR TABLE " + ", ".join(_qualified(t) for t in tables)
        else:
            target = "FOR ALL TABLES"
        try:
            self._query(f"CREATE PUBLICATION {_quote(self.publication)} {target}")
        except psycopg2.Error as exc:
            raise SourceError(
                f"source.tables: cannot create publication {self.publication!r} "
                f"({str(exc).strip()}); check the table names and that the user owns them "
                f"(FOR ALL TABLES needs a superuser)"
            ) from exc
        log.info("created publication %s %s", self.publication, target)

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
        export = "EXPORT_SNAPSHOT" if self.options.snapshot == "initial" else "NOEXPORT_SNAPSHOT"
        self.cursor.execute(
            f"CREATE_REPLICATION_SLOT {_quote(self.slot)} LOGICAL pgoutput {export}"
        )
        _slot, consistent_point, snapshot_name, _plugin = self.cursor.fetchone()
        log.info("created replication slot %s at %s", self.slot, consistent_point)
        self.snapshot_lsn = pg.parse_lsn(consistent_point)
        self.lsn, self.index, self.complete = self.snapshot_lsn, -1, True
        self.flush = self.confirmed = self.seen_lsn = self.snapshot_lsn
        self.resume_lsn, self.resume_index = self.snapshot_lsn, -1
        if self.options.snapshot == "initial":
            self.phase = "snapshot"
            self.conn.autocommit = False
            with self.conn.cursor() as cur:
                cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                cur.execute("SET TRANSACTION SNAPSHOT %s", (snapshot_name,))
            self.snapshot_tables = self._published_tables()
        else:
            self._start_replication()
            # The new slot's position goes into the publisher log at once, so that a
            # restart knows the slot is ours even if no change arrived yet.
            self.announce = True

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
                options={"proto_version": "1", "publication_names": self.publication},
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

    # ------------------------------------------------------------ catalog
    def _describe(self, relation: pg.Relation) -> None:
        """Resolve domain types to their base types, and the key columns."""
        unknown = [c.type_oid for c in relation.columns if c.type_oid not in self.base_types]
        if unknown:
            rows = self._catalog(
                "WITH RECURSIVE t(oid, base) AS (SELECT oid, CASE WHEN typtype = 'd' THEN "
                "typbasetype ELSE oid END FROM pg_type WHERE oid = ANY(%s) UNION ALL "
                "SELECT t.oid, p.typbasetype FROM t JOIN pg_type p ON p.oid = t.base "
                "WHERE p.typtype = 'd') SELECT oid, base FROM t",
                (unknown,),
            )
            for oid, base in rows:
                self.base_types[oid] = base
        for column in relation.columns:
            column.kind = pg.value_kind(self.base_types.get(column.type_oid, column.type_oid))
        # One rule for snapshot and stream, so a row always lands in the same shard:
        # the replica identity index (REPLICA IDENTITY USING INDEX), else the primary
        # key, else every column.
        keys = [
            r[0]
            for r in self._catalog(
                "SELECT a.attname FROM pg_class c JOIN pg_index i ON i.indrelid = c.oid "
                "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
                "WHERE c.oid = %s AND CASE WHEN c.relreplident = 'i' THEN i.indisreplident "
                "ELSE i.indisprimary END ORDER BY array_position(i.indkey, a.attnum)",
                (relation.oid,),
            )
        ]
        relation.key_columns = keys or [c.name for c in relation.columns]
        relation.refresh()

    def _catalog(self, sql: str, args: Any) -> list[tuple[Any, ...]]:
        # The snapshot transaction (if any) is read-only and fine for catalog reads.
        return self._query(sql, args)

    # ------------------------------------------------------------------ read
    def read(self, timeout: float) -> SourceBatch | None:
        if self.announce:
            self.announce = False
            return SourceBatch([], self._checkpoint())
        if self.phase == "snapshot":
            return self._read_snapshot()
        deadline = time.monotonic() + timeout
        while True:
            try:
                batch = self._read_stream(deadline)
            except psycopg2.Error as exc:
                self._reconnect(exc)
                continue
            if batch is not None or time.monotonic() >= deadline:
                return batch

    def _reconnect(self, exc: Exception) -> None:
        text = str(exc).strip()
        if "does not exist" in text and "slot" in text:
            raise SourceError(f"source.slot: {text}") from exc
        delay = 0.5
        stop = self.context.stop if self.context else None
        while True:
            log.warning("lost the replication connection (%s); reconnecting in %.1fs", text, delay)
            for conn in (self.repl, self.conn):
                try:
                    if conn is not None:
                        conn.close()
                except psycopg2.Error:
                    pass
            self.repl = self.cursor = None
            if stop is not None and stop.wait(delay):
                raise SourceError("stopped while reconnecting to PostgreSQL") from exc
            try:
                self.conn = self._connect()
                self._require_slot()
                # Resume after what was emitted; the server resends from the slot.
                self.resume_lsn, self.resume_index = self.lsn, self.index
                self.resume_complete = self.complete
                self.in_txn = False
                self.skip_txn = self.resuming = False
                # Only what was returned counts as seen (for --once).
                self.seen_lsn = self.flush
                self.relations.clear()
                self._start_replication()
                log.info(
                    "reconnected to PostgreSQL; streaming from %s", pg.lsn_text(self.confirmed)
                )
                return
            except SourceError as again:
                if "does not exist" in str(again):
                    raise
                text = str(again)
            except psycopg2.Error as again:
                text = str(again).strip()
            delay = min(delay * 2, 30.0)

    def _checkpoint(self) -> dict[str, Any]:
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
        make_update = self._update
        lsn, index, complete, flush = self.lsn, self.index, self.complete, self.flush
        # Whether the transaction being read was emitted before (a resend after a restart
        # or reconnect): kept across calls, since a transaction can span several.
        skip_txn, resuming = self.skip_txn, self.resuming
        read_message = cursor.read_message

        def batch() -> SourceBatch:
            self.lsn, self.index, self.complete, self.flush = lsn, index, complete, flush
            self.skip_txn, self.resuming = skip_txn, resuming
            return SourceBatch(updates, self._checkpoint())

        if self.confirmed:
            # Recorded here; psycopg2 reports it every status_interval.
            cursor.send_feedback(flush_lsn=self.confirmed)
        self._heartbeat()
        while True:
            message = read_message()
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
                        # past WAL that held nothing for this publication.
                        self.confirmed = max(self.confirmed, cursor.wal_end)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if updates:
                        return batch()
                    # Transactions that held nothing for us still move the position.
                    self.lsn, self.index, self.complete, self.flush = lsn, index, complete, flush
                    self.skip_txn, self.resuming = skip_txn, resuming
                    return None
                select.select([cursor], [], [], min(remaining, 0.1))
                continue
            data = message.payload
            tag = data[0]
            if tag == 73 or tag == 85 or tag == 68:  # I U D
                self.txn_index += 1
                if skip_txn or (resuming and self.txn_index <= self.resume_index):
                    continue
                op, relation, before, after, _unchanged, full = parse_change(data, relations)
                if heartbeat_tables and relation.table in heartbeat_tables:
                    continue
                update = make_update(op, relation, before, after, full)
                if op == "u" and before is not None and self._key_changed(update, before):
                    updates.extend(self._split_key_change(update, before, full))
                else:
                    append(update)
                lsn, index, complete = self.txn_lsn, self.txn_index, False
                if len(updates) >= limit:
                    # A large transaction goes out in chunks: memory stays bounded.
                    return batch()
            elif tag == 66:  # B
                self.txn_lsn, self.txn_ts, self.txn_xid = pg.parse_begin(data)
                self.txn_commit = self.txn_logical = pg.lsn_text(self.txn_lsn)
                self.txn_index = -1
                self.txn_origin = None
                self.in_txn = True
                resuming = self.txn_lsn == self.resume_lsn
                skip_txn = self.txn_lsn < self.resume_lsn or (resuming and self.resume_complete)
            elif tag == 67:  # C
                _commit_lsn, end_lsn, _ts = pg.parse_commit(data)
                self.in_txn = False
                self.seen_lsn = max(self.seen_lsn, end_lsn)
                if skip_txn:
                    skip_txn = False
                    continue
                lsn, index, complete = self.txn_lsn, self.txn_index, True
                flush = end_lsn
                if len(updates) >= limit:
                    return batch()
            elif tag == 82:  # R
                relation = pg.parse_relation(data)
                self._describe(relation)
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
                        append(self._truncate(relation))
                lsn, index, complete = self.txn_lsn, self.txn_index, False
            # 'Y' (type) and 'M' (message) carry nothing the envelope needs.

    def _update(
        self,
        op: str,
        relation: pg.Relation,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        full: bool,
    ) -> Update:
        keys = relation.key_columns
        if before is None and op == "c":  # an insert: the common case, kept short
            assert after is not None
            return Update(
                op="c",
                key={k: after.get(k) for k in keys},
                after=_Raw(_encode(after)),
                table=relation.table,
                connector="postgres",
                position=f"{self.txn_commit}:{self.txn_index}",
                logical=self.txn_logical,
                txid=self.txn_xid,
                ts_ms=self.txn_ts,
            )
        row = after if after is not None else before
        assert row is not None
        key = {k: row.get(k) for k in keys}
        if before is not None and not full:
            before = {k: before[k] for k in keys if k in before}
            key = {k: before.get(k, key[k]) for k in keys} if op == "d" else key
        if before is None and op == "u":
            before = {k: row.get(k) for k in keys}
        if after is not None and before is not None and full:
            for name, value in after.items():
                if value == pg.UNCHANGED_TOAST and name in before:
                    after[name] = before[name]  # carried from the old image
        commit = self.txn_commit
        return Update(
            op=op,
            key=key,
            before=NULL if before is None else _Raw(_encode(before)),
            after=NULL if after is None else _Raw(_encode(after)),
            table=relation.table,
            connector="postgres",
            position=f"{commit}:{self.txn_index}",
            logical=self.txn_logical,
            txid=self.txn_xid,
            ts_ms=self.txn_ts,
        )

    @staticmethod
    def _key_changed(update: Update, before: dict[str, Any]) -> bool:
        # Columns missing from the old image (NULL in a key-only image) say nothing.
        return any(before.get(k) is not None and before[k] != v for k, v in update.key.items())

    def _split_key_change(self, update: Update, before: dict[str, Any], full: bool) -> list[Update]:
        # The old key may live in another shard: it gets a delete, the new key an
        # insert, so both flows see the change (as for any key-value store).
        old_key = {k: before.get(k) for k in update.key}
        delete = Update(
            op="d",
            key=old_key,
            before=update.before if full else _Raw(_encode(old_key)),
            table=update.table,
            connector=update.connector,
            position=update.position,
            logical=update.logical,
            txid=update.txid,
            ts_ms=update.ts_ms,
        )
        update.op = "c"
        update.before = NULL
        return [delete, update]

    def _truncate(self, relation: pg.Relation) -> Update:
        commit = pg.lsn_text(self.txn_lsn)
        return Update(
            op="t",
            key={},
            table=relation.table,
            connector="postgres",
            position=f"{commit}:{self.txn_index}",
            logical=pg.lsn_text(self.txn_origin) if self.txn_origin else commit,
            txid=self.txn_xid,
            ts_ms=self.txn_ts,
        )

    # -------------------------------------------------------------- snapshot
    def _read_snapshot(self) -> SourceBatch | None:
        limit = self.options.batch_updates
        updates: list[Update] = []
        while len(updates) < limit:
            if self.snapshot_cursor is None:
                if not self.snapshot_tables:
                    self._finish_snapshot()
                    break
                self._open_snapshot_table(self.snapshot_tables.pop(0))
            rows = self.snapshot_cursor.fetchmany(limit - len(updates))
            if not rows:
                self.snapshot_cursor.close()
                self.snapshot_cursor = None
                continue
            columns = self.snapshot_columns
            keys = self.snapshot_keys
            position = pg.lsn_text(self.snapshot_lsn)
            table = self.snapshot_table
            now_ms = int(time.time() * 1000)
            for values in rows:
                row = {
                    c.name: (v if v is None or c.kind == 0 else pg.convert(c.kind, v))
                    for c, v in zip(columns, values, strict=True)
                }
                self.snapshot_index += 1
                updates.append(
                    snapshot_read(
                        row,
                        keys,
                        table=table,
                        connector="postgres",
                        position=f"{position}:{self.snapshot_index}",
                        logical=position,
                        ts_ms=now_ms,
                    )
                )
        checkpoint: dict[str, Any] = (
            {"phase": "snapshot"} if self.phase == "snapshot" else self._checkpoint()
        )
        return SourceBatch(updates, checkpoint) if updates or self.phase == "stream" else None

    def _open_snapshot_table(self, table: str) -> None:
        schema, _, name = table.partition(".")
        rows = self._query(
            "SELECT a.attname, a.atttypid FROM pg_attribute a JOIN pg_class c ON c.oid = "
            "a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s "
            "AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            (schema, name),
        )
        (oid,) = self._query(
            "SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = %s",
            (schema, name),
        )[0]
        relation = pg.Relation(oid, schema, name, "d", [pg.Column(n, t, False) for n, t in rows])
        self._describe(relation)
        self.snapshot_columns = relation.columns
        self.snapshot_keys = relation.key_columns
        self.snapshot_table = table
        select_list = ", ".join(f"{_quote(c.name)}::text" for c in relation.columns)
        cursor = self.conn.cursor(name=f"wormhole_snapshot_{oid}")
        cursor.itersize = self.options.batch_updates
        cursor.execute(f"SELECT {select_list} FROM {_qualified(table)}")
        self.snapshot_cursor = cursor

    def _finish_snapshot(self) -> None:
        self.conn.commit()
        self.conn.autocommit = True
        log.info(
            "initial snapshot done (%d rows); streaming from %s",
            self.snapshot_index,
            pg.lsn_text(self.snapshot_lsn),
        )
        self._start_replication()

    # --------------------------------------------------------------- --once
    def capture_end(self) -> Any:
        if self.phase == "snapshot":
            # The snapshot is consistent with the slot's start: everything after is WAL.
            pass
        (lsn,) = self._query("SELECT pg_current_wal_lsn()::text")[0]
        return lsn

    def reached(self, end: Any) -> bool:
        if self.announce or self.phase == "snapshot" or self.in_txn:
            return False
        return self.seen_lsn >= pg.parse_lsn(end)

    # ------------------------------------------------------------- confirm
    def confirm(self, checkpoint: Any) -> None:
        """The publisher log holds everything up to ``checkpoint``: the slot may move on."""
        if checkpoint.get("phase") == "stream":
            # Read by the tailer thread, which owns the replication connection.
            self.confirmed = max(self.confirmed, pg.parse_lsn(checkpoint["flush"]))

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
                    f"CREATE TABLE IF NOT EXISTS {_qualified(heartbeat.table)} "
                    f"(id int PRIMARY KEY, ts timestamptz NOT NULL)"
                )
                cur.execute(
                    f"INSERT INTO {_qualified(heartbeat.table)} VALUES (1, now()) "
                    f"ON CONFLICT (id) DO UPDATE SET ts = excluded.ts"
                )
        except psycopg2.Error as exc:
            log.warning("heartbeat write to %s failed: %s", heartbeat.table, str(exc).strip())
            self.heartbeat_conn = None

    def close(self) -> None:
        if self.cursor is not None and self.phase == "stream" and self.confirmed:
            # Status updates go out every status_interval; the last one must not wait.
            with contextlib.suppress(Exception):
                self.cursor.send_feedback(flush_lsn=self.confirmed, force=True)
        for conn in (self.repl, self.conn, self.heartbeat_conn):
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
