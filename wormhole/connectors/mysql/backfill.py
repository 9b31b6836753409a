"""Backfills of the ``mysql`` source (:class:`~wormhole.plugins.components.SourceBackfill`):
a plan from ``information_schema``, watermarks written into the signal table (the stream
meets them at their transaction's commit), and chunks read in key order on a read-only
connection, converted as the snapshot converts rows (SQL in ``chunks.py``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec

from wormhole.connectors.mysql.chunks import Chunks, chunk_layout, chunks, qualified
from wormhole.connectors.mysql.server import (
    CHUNK_FATAL,
    DESCRIBE_COLUMNS,
    NO_DRIVER,
    SIGNAL_FATAL,
    SYSTEM_SCHEMAS,
    TRANSIENT,
    json_text,
    quote_name,
    reader_id,
    server_error,
    text_conversions,
)
from wormhole.core.errors import BackfillError, SourceError
from wormhole.core.update import Update, snapshot_read
from wormhole.plugins.components import BackfillPlan
from wormhole.plugins.database_source import close_quietly

if TYPE_CHECKING:
    from wormhole.connectors.mysql.source import MySQLSource

try:  # optional dependency: the `mysql` extra
    import pymysql

    HAVE_DRIVER = True
except ImportError:  # pragma: no cover - reported at open()
    HAVE_DRIVER = False


class MySQLBackfill:
    """The backfills of one :class:`MySQLSource`: the signal table and this pipeline's row
    in it (the stream reports the watermarks it meets there), written on a connection of
    its own, and the backfill queries, read on another."""

    def __init__(self, source: MySQLSource) -> None:
        self.source = source
        schema, _, table = source.options.signal_table.partition(".")
        self.signal = (schema, table)
        """The signal table, where watermarks are written."""
        self.signal_id = ""
        """This pipeline's row in it (:meth:`signal_row`)."""
        self.conn: Any = None
        """The read-only connection of catalogs and chunks."""
        self.signal_conn: Any = None
        """The connection that writes watermarks."""
        self.signal_ready = False
        """The signal table exists (made on the first watermark's connection)."""

    def close(self) -> None:
        close_quietly(self.conn, self.signal_conn)
        self.conn = self.signal_conn = None

    def signal_row(self, pipeline: str) -> str:
        """The signal table's row of ``pipeline``: its reader's server id, which is unique
        among the server's replicas, and its name, for people."""
        return f"{reader_id(self.source.options, pipeline)}:{pipeline}"[:191]

    def signal_rows(self, event: Any, written: bool) -> str | None:
        """The watermark in a rows event of the signal table (rows ``written``, else
        updated), if this pipeline's row carries one; other pipelines' rows are theirs."""
        values_of = "values" if written else "after_values"
        token: str | None = None
        for row in event.rows:
            values = row[values_of]
            row_id, value = values.get("id"), values.get("token")
            if isinstance(row_id, bytes):
                row_id = row_id.decode("utf-8", "replace")
            if row_id == self.signal_id:
                if isinstance(value, bytes):
                    value = value.decode("utf-8", "replace")
                token = str(value)
        return token

    def _reader(self, check: bool = False) -> Any:
        """The read-only connection of catalogs and chunks, in UTC as the snapshot's is.
        ``check``: ping it first, and replace it if it is broken (a chunk that fails drops
        it instead, and is read again a moment later)."""
        source = self.source
        conn = self.conn
        if conn is not None and not check:
            return conn
        if conn is not None:
            try:
                conn.ping(reconnect=False)
                return conn
            except Exception:
                close_quietly(conn)
                self.conn = None
        # DECIMAL, temporal and YEAR values stay the server's text (see chunk_layout).
        conn = source.server.connect(conv=text_conversions())
        try:
            with conn.cursor() as cur:
                cur.execute("SET SESSION time_zone = '+00:00'")
                # Every statement of the session is a read-only transaction of its own: a
                # --where condition cannot write, whatever it calls, and each chunk reads
                # the table as of now.
                cur.execute("SET SESSION TRANSACTION READ ONLY")
        except BaseException:
            close_quietly(conn)
            raise
        self.conn = conn
        return conn

    def _signal_table(self) -> str:
        return qualified(*self.signal)

    def _signal_writer(self) -> Any:
        """The connection that writes watermarks; the signal table exists once it is made."""
        source = self.source
        conn = self.signal_conn
        if conn is None:
            conn = source.server.connect()
            self.signal_conn = conn
        if not self.signal_ready:
            self._ensure_signal_table(conn)
        return conn

    def _ensure_signal_table(self, conn: Any) -> None:
        source = self.source
        schema, table = self.signal
        try:
            with conn.cursor() as cur:
                cur.execute(
                    "SELECT 1 FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s AND "
                    "TABLE_NAME = %s",
                    (schema, table),
                )
                if not cur.fetchall():
                    cur.execute(f"CREATE DATABASE IF NOT EXISTS {quote_name(schema)}")
                    cur.execute(
                        f"CREATE TABLE IF NOT EXISTS {self._signal_table()} ("
                        "id VARCHAR(191) NOT NULL PRIMARY KEY, token VARCHAR(191) NOT NULL, "
                        "at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)"
                        ") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
                    )
        except pymysql.err.Error as exc:
            code, message = server_error(exc)
            if code in TRANSIENT or not code:
                raise
            raise BackfillError(
                f"source.signal_table {source.options.signal_table}: the table where backfills "
                f"write their watermarks cannot be created ({message}); create it (CREATE "
                f"TABLE {self._signal_table()} (id VARCHAR(191) PRIMARY KEY, token "
                f"VARCHAR(191) NOT NULL, at TIMESTAMP(6) NOT NULL DEFAULT "
                f"CURRENT_TIMESTAMP(6))) and grant the source's user INSERT and UPDATE on it, "
                f"or set signal_table to one it may create"
            ) from exc
        self.signal_ready = True

    def plan(self, pipeline: str, table: str, where: str | None) -> BackfillPlan:
        """Check ``table`` and ``where`` against the catalog (see SourceBackfill), in the order
        a user meets their errors: the server, the table, its key, the condition."""
        if not HAVE_DRIVER:
            raise SourceError(NO_DRIVER)
        if not self.signal_id:
            self.signal_id = self.signal_row(pipeline)
        schema, dot, name = table.partition(".")
        if not dot or not schema or not name:
            raise BackfillError(
                f"--table {table}: name the table with its database, as database.table "
                f"(shop.orders)"
            )
        conn = self._reader(check=True)
        self._check_commit_order(conn, table)
        schema, name, table_rows = self._find_table(conn, table, schema, name)
        columns = _rows(
            conn,
            "SELECT COLUMN_NAME, DATA_TYPE, DATETIME_PRECISION, NUMERIC_PRECISION, "
            "NUMERIC_SCALE, COLUMN_TYPE FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = "
            "%s AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
            (schema, name),
        )
        keys = self._primary_key(conn, table, schema, name)
        estimate: int | None = int(table_rows) if table_rows is not None else None
        if where is not None:
            estimate = self._where_estimate(conn, table, schema, name, where)
        # Created now, so that a problem with it shows when the backfill is asked for.
        self._signal_writer()
        detail = chunks(schema, name, columns, keys, where, chunk_layout(columns, keys))
        return BackfillPlan(f"{schema}.{name}", keys, where, estimate, detail)

    def _check_commit_order(self, conn: Any, table: str) -> None:
        ordered = _rows(conn, "SHOW GLOBAL VARIABLES LIKE 'binlog_order_commits'")
        if ordered and str(ordered[0][1]).upper() in ("OFF", "0"):
            # A chunk read after its low watermark committed must see every transaction
            # before the watermark in the binlog: the server commits in binlog order only
            # with binlog_order_commits on.
            raise BackfillError(
                f"--table {table}: the server at {self.source.server.address} has "
                f"binlog_order_commits = OFF, so a transaction before a backfill's watermark in "
                f"the binlog may still be invisible to the chunk read after it; set "
                f"binlog_order_commits = ON (the default)"
            )

    def _find_table(self, conn: Any, table: str, schema: str, name: str) -> tuple[str, str, Any]:
        """The table's schema, name and estimated rows, if the source captures it."""
        source = self.source
        found = _rows(
            conn,
            "SELECT TABLE_SCHEMA, TABLE_NAME, TABLE_ROWS FROM information_schema.TABLES WHERE "
            "TABLE_SCHEMA = %s AND TABLE_NAME = %s AND TABLE_TYPE = 'BASE TABLE'",
            (schema, name),
        )
        if not found:
            raise BackfillError(
                f"--table {table}: there is no table {name} in database {schema} on the "
                f"server at {source.server.address} (name it as database.table)"
            )
        schema, name, table_rows = str(found[0][0]), str(found[0][1]), found[0][2]
        if (schema, name) == self.signal:
            raise BackfillError(
                f"--table {table}: that is the source's signal table (signal_table), which "
                f"holds backfill watermarks and is never emitted"
            )
        if not source.included.wanted(schema, name):
            why = (
                f"{schema} is a system schema, which the source never reads"
                if schema in SYSTEM_SCHEMAS
                else "its tables and exclude_tables options leave it out"
            )
            raise BackfillError(
                f"--table {table}: the source does not capture {schema}.{name} ({why}), so the "
                f"stream has none of its changes and a backfill could not be kept in order "
                f"with them; add it to the source's tables (and keep it out of "
                f"exclude_tables), then backfill it"
            )
        return schema, name, table_rows

    @staticmethod
    def _primary_key(conn: Any, table: str, schema: str, name: str) -> list[str]:
        """The primary key, in its index's order (the order chunks are read in). The stream
        keys the table's rows by the same columns (the table map's primary key)."""
        keys = [
            str(r[0])
            for r in _rows(
                conn,
                "SELECT COLUMN_NAME FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = %s "
                "AND TABLE_NAME = %s AND INDEX_NAME = 'PRIMARY' ORDER BY SEQ_IN_INDEX",
                (schema, name),
            )
        ]
        if not keys:
            raise BackfillError(
                f"--table {table}: {schema}.{name} has no primary key; a backfill reads a table "
                f"in key order, chunk by chunk, and matches rows to the stream's changes by key. "
                f"Add a primary key (ALTER TABLE {qualified(schema, name)} ADD PRIMARY KEY "
                f"(...))"
            )
        return keys

    @staticmethod
    def _where_estimate(conn: Any, table: str, schema: str, name: str, where: str) -> int | None:
        """The server's estimate of the rows ``where`` selects (it must be a condition)."""
        if not where.strip():
            raise BackfillError("--where: the condition is empty; leave --where out for every row")
        try:
            with conn.cursor() as cur:
                cur.execute(f"EXPLAIN SELECT 1 FROM {qualified(schema, name)} WHERE ({where})")
                names = [d[0].lower() for d in cur.description]
                explained = cur.fetchall()
        except pymysql.err.Error as exc:
            code, message = server_error(exc)
            if code in TRANSIENT or not code:
                raise
            raise BackfillError(
                f"--where {where!r}: the server cannot use it as a condition on "
                f"{schema}.{name}: "
                f"{message.strip().splitlines()[0] if message.strip() else exc!r}"
            ) from exc
        if explained and "rows" in names:
            rows = explained[0][names.index("rows")]
            return int(rows) if rows is not None else 0
        return None

    def watermark(self, token: str) -> None:
        """One autocommit transaction that writes ``token`` into this pipeline's row of the
        signal table; the stream reports it at that transaction's commit."""
        source = self.source
        if not self.signal_id:
            raise BackfillError("backfill_watermark: backfill_plan was never called")
        try:
            conn = self._signal_writer()
            with conn.cursor() as cur:
                cur.execute(
                    f"INSERT INTO {self._signal_table()} (id, token, at) VALUES (%s, %s, "
                    f"NOW(6)) ON DUPLICATE KEY UPDATE token = VALUES(token), at = VALUES(at)",
                    (self.signal_id, token),
                )
        except pymysql.err.Error as exc:
            close_quietly(self.signal_conn)
            self.signal_conn = None
            code, message = server_error(exc)
            if code == 1146:  # dropped meanwhile: made again on the next try
                self.signal_ready = False
            if code in SIGNAL_FATAL:
                raise BackfillError(
                    f"source.signal_table {source.options.signal_table}: a backfill watermark "
                    f"cannot be written ({message}); the server must accept writes to it "
                    f"(not read_only) from the source's user, with INSERT and UPDATE on it"
                ) from exc
            raise

    def chunk(self, plan: BackfillPlan, after: list[Any] | None, limit: int) -> list[Update]:
        """Up to ``limit`` rows after ``after`` in key order, read as the snapshot reads
        them (the same columns, the same conversions)."""
        source = self.source
        detail: Chunks = plan.detail
        if after is None:
            sql, args = detail.first, None
        else:
            sql, args = detail.following, detail.arguments(after)
        try:
            conn = self._reader()
            with conn.cursor() as cur:
                cur.execute(f"{sql} LIMIT {int(limit)}", args)
                fetched = cur.fetchall()
        except pymysql.err.Error as exc:
            close_quietly(self.conn)
            self.conn = None
            code, message = server_error(exc)
            if code in CHUNK_FATAL:
                raise BackfillError(
                    f"--table {plan.table}: a chunk cannot be read ({message}); was the table "
                    f"changed? Backfill it again"
                ) from exc
            raise
        layout = detail.layout
        names, keys, table = layout.columns, plan.keys, plan.table
        rows = [dict(zip(names, values)) for values in fetched]  # noqa: B905 - one per column
        if layout.special:
            convert = layout.convert
            rows = [convert(row) for row in rows]
        now_ms = int(time.time() * 1000)
        read = snapshot_read
        updates = [
            read(row, keys, table=table, connector="mysql", position="", logical="", ts_ms=now_ms)
            for row in rows
        ]
        if source.describe and updates:
            self._describe_chunk(conn, table, updates, now_ms)
        return updates

    def _describe_chunk(self, conn: Any, table: str, updates: list[Update], now_ms: int) -> None:
        """A backfill chunk's rows described as Debezium describes an incremental
        snapshot's (read on the backfill's own connection)."""
        source = self.source
        schema, _, name = table.partition(".")
        with conn.cursor() as cur:
            cur.execute(DESCRIBE_COLUMNS, (schema, name))
            columns, db, table_name = source.tables.described_rows(
                list(cur.fetchall()), schema, name
            )
        details = msgspec.Raw(
            f'{{"connector":"mysql","snapshot":"incremental","db":{db},"sequence":null,'
            f'"ts_us":{now_ms * 1000},"ts_ns":{now_ms * 1_000_000},"table":{table_name},'
            f'"server_id":0,"gtid":null,"file":{json_text(source.binlog.file)},"pos":{source.binlog.pos},'
            f'"row":0,"thread":null,"query":null}}'.encode()
        )
        for update in updates:
            update.columns = columns
            update.details = details


def _rows(conn: Any, sql: str, args: Any = None) -> list[tuple[Any, ...]]:
    with conn.cursor() as cur:
        cur.execute(sql, args)
        return list(cur.fetchall())
