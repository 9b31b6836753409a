"""Backfills of the ``postgres`` source (:class:`~wormhole.plugins.components.SourceBackfill`):
a plan from the catalog, watermarks as transactional logical decoding messages, and chunks
read in key order in a snapshot that sees every transaction before the low watermark, each
row's JSON written by PostgreSQL with the stream's value rules."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import msgspec

from wormhole.connectors.postgres import pgoutput as pg
from wormhole.connectors.postgres.driver import psycopg2
from wormhole.connectors.postgres.sql import (
    ROW_ESTIMATE,
    identifier,
    json_row_select,
    key_value,
    native_key,
    qualified,
    quote,
    statement_separators,
    unused_name,
)
from wormhole.core.errors import BackfillError, first_line
from wormhole.core.update import Update
from wormhole.plugins.components import BackfillPlan
from wormhole.plugins.database_source import close_quietly

if TYPE_CHECKING:
    from wormhole.connectors.postgres.source import PostgresSource

_Raw = msgspec.Raw


@dataclass(frozen=True)
class _ChunkSql:
    """What a backfill plan keeps for reading chunks."""

    columns: list[tuple[str, int, int]]
    """(name, value kind, base type oid) of the published columns."""
    only: str
    """``ONLY `` for a plain table (not its inheritance children), empty for a partitioned
    table published through its root."""
    row_filter: str | None
    described: tuple[msgspec.Raw, str] | None = None
    """With ``describe``: the chunks' ``columns`` and their table's part of ``details``."""


class Invisible:
    """The transactions a snapshot does not see, as the stream names them (pgoutput's
    32-bit transaction ids): those it lists as running, and every one from its ``xmax``
    on (a transaction running when the snapshot was taken, but with an id at or above
    the newest completed one, is not listed). Transactions below ``xmin`` that the stream
    returns committed, so the snapshot sees them."""

    __slots__ = ("running", "xmax")

    def __init__(self, xmax: int, running: Iterable[int]) -> None:
        self.xmax = xmax & 0xFFFFFFFF
        self.running = frozenset(x & 0xFFFFFFFF for x in running)

    def __contains__(self, xid: int) -> bool:
        # At or after xmax in the 32-bit circle of transaction ids.
        return xid in self.running or ((xid - self.xmax) & 0xFFFFFFFF) < 0x80000000


class PostgresBackfill:
    """The backfill queries of one :class:`PostgresSource`, which they share the catalog,
    the connection for watermarks and the stream's transaction ids with; chunks are read
    on a read-only connection of their own."""

    def __init__(self, source: PostgresSource) -> None:
        self.source = source
        self.conn: Any = None
        """The read-only connection chunks and conditions are read on."""
        self.chunk_unseen: Invisible | None = None
        """The transactions the last chunk's snapshot did not see."""

    def close(self) -> None:
        self._drop_connection()

    def plan(self, pipeline: str, table: str, where: str | None) -> BackfillPlan:
        """Check ``table`` and ``where`` against the catalog (see SourceBackfill)."""
        source = self.source
        self._connect(pipeline, table)
        schema, _, name = table.rpartition(".")
        schema = schema or "public"
        full_name = f"{schema}.{name}"
        oid, reltuples, relkind = self._find(table, schema, name)
        via_root, published_columns, row_filter = self._published(table, schema, name)
        if relkind == "p" and not via_root:
            raise BackfillError(
                f"--table {table}: {full_name} is partitioned, and publication "
                f"{source.publication} streams its changes under its partitions' names; "
                f"backfill each partition (--table <partition>), or set publish_via_partition_root "
                f"= true on the publication"
            )
        catalog = source.catalog.tables([oid])[oid]
        keys = self._keys(table, full_name, oid, catalog)
        relation = pg.Relation(
            oid,
            schema,
            name,
            catalog.identity,
            [pg.Column(n, t, False, 0, mod) for n, t, mod in catalog.columns],
        )
        source.catalog.resolve_types(relation)
        columns = [
            (c.name, c.kind, source.catalog.base_types.get(c.type_oid, c.type_oid))
            for c in relation.columns
            if published_columns is None or c.name in published_columns
        ]
        described = None
        if source.describe:
            names = {n for n, _, _ in columns}
            chunk_columns = [c for c in relation.columns if c.name in names]
            described = source.catalog.column_description(
                pg.Relation(oid, schema, name, catalog.identity, chunk_columns)
            )
        estimate: int | None = int(reltuples) if reltuples is not None and reltuples >= 0 else None
        if where is not None:
            estimate = self._check_condition(full_name, where)
        detail = _ChunkSql(
            columns,
            "" if relkind == "p" else "ONLY ",
            # The publication's row filter: the stream sends only the rows that pass it.
            None if row_filter is None else str(row_filter),
            described,
        )
        return BackfillPlan(full_name, keys, where, estimate, detail)

    def _connect(self, pipeline: str, table: str) -> None:
        """Connect when no run is going on (``wormhole backfill``), with the slot and the
        publication the pipeline's run uses; a server too old for backfills is an error."""
        source = self.source
        if source.conn is None:
            source.conn = source.admin.connect()
            (version,) = source._query("SHOW server_version_num")[0]
            source.server_version = int(version)
        if not source.slot:
            source.slot = source.options.slot or f"wormhole_{identifier(pipeline)}"
            source.publication = source.options.publication or f"wormhole_{identifier(pipeline)}"
        if source.server_version < 140000:
            raise BackfillError(
                f"--table {table}: backfills need PostgreSQL 14 or later (their watermarks "
                f"are logical decoding messages, which pgoutput sends from 14 on); this server "
                f"is {source.server_version}"
            )

    def _find(self, table: str, schema: str, name: str) -> tuple[int, Any, str]:
        """The table's oid, row estimate and kind (``r`` or ``p``); an error if none."""
        found = self.source._query(
            f"SELECT c.oid::int8, {ROW_ESTIMATE}, c.relkind::text FROM pg_class c JOIN "
            "pg_namespace n ON n.oid = c.relnamespace LEFT JOIN pg_stat_user_tables s ON "
            "s.relid = c.oid WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')",
            (schema, name),
        )
        if not found:
            raise BackfillError(
                f"--table {table}: there is no table {schema}.{name} in the database (name it as "
                f"schema.table)"
            )
        oid, reltuples, relkind = found[0]
        return oid, reltuples, relkind

    def _published(self, table: str, schema: str, name: str) -> tuple[bool, Any, Any]:
        """How the publication publishes the table: via its root, which columns (None: all,
        or a server before 15), its row filter (None: none); an error if it does not."""
        source = self.source
        full_name = f"{schema}.{name}"
        extra = ", attnames::text[], rowfilter" if source.server_version >= 150000 else ""
        published = source._query(
            f"SELECT p.pubviaroot{extra} FROM pg_publication_tables t JOIN pg_publication p ON "
            f"p.pubname = t.pubname WHERE t.pubname = %s AND t.schemaname = %s AND "
            f"t.tablename = %s",
            (source.publication, schema, name),
        )
        if not published or full_name in source.options.heartbeat_tables:
            raise BackfillError(
                f"--table {table}: {full_name} is not in publication {source.publication}, so "
                f"the stream does not capture it and a backfill could not be kept in order "
                f"with its changes; add it (ALTER PUBLICATION {quote(source.publication)} ADD "
                f"TABLE {qualified(full_name)}), then backfill it"
            )
        row = published[0]
        return bool(row[0]), row[1] if len(row) > 1 else None, row[2] if len(row) > 2 else None

    def _keys(self, table: str, full_name: str, oid: int, catalog: Any) -> list[str]:
        """The key columns in the index's order, so that each chunk is one index range scan;
        an error for a table without a key."""
        key_set = set(catalog.identity_index if catalog.identity == "i" else catalog.primary_key)
        if not key_set:
            raise BackfillError(
                f"--table {table}: {full_name} has no primary key (nor a replica identity "
                f"index); a backfill reads a table in key order, chunk by chunk, and matches "
                f"rows to the stream's changes by key. Add a primary key (ALTER TABLE "
                f"{qualified(full_name)} ADD PRIMARY KEY (...))"
            )
        index = "indisreplident" if catalog.identity == "i" else "indisprimary"
        ordered = [
            row[0]
            for row in self.source._query(
                f"SELECT a.attname::text FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey) "
                f"WITH ORDINALITY AS k(attnum, n) JOIN pg_attribute a ON a.attrelid = "
                f"i.indrelid AND a.attnum = k.attnum WHERE i.indrelid = %s AND i.{index} "
                f"ORDER BY k.n",
                (oid,),
            )
        ]
        return [k for k in ordered if k in key_set] or sorted(key_set)

    def _check_condition(self, table: str, where: str) -> int | None:
        """Parse ``where`` on ``table`` (EXPLAIN, on the read-only connection, rolled back):
        BackfillError if PostgreSQL cannot use it; the planner's row estimate if it can."""
        if not where.strip():
            raise BackfillError("--where: the condition is empty; leave --where out for every row")
        statements = statement_separators(where)
        if statements:
            raise BackfillError(
                f"--where {where!r}: a condition cannot end a statement (';' at character "
                f"{statements[0] + 1}); give one SQL condition on the table's columns"
            )
        conn = self._connection()
        try:
            with conn.cursor() as cur:
                cur.execute("BEGIN READ ONLY")
                try:
                    cur.execute(
                        f"EXPLAIN (FORMAT JSON) SELECT 1 FROM {qualified(table)} WHERE ({where}\n)"
                    )
                    plan = cur.fetchone()[0]
                finally:
                    cur.execute("ROLLBACK")
        except psycopg2.Error as exc:
            if isinstance(exc, psycopg2.OperationalError | psycopg2.InterfaceError):
                self._drop_connection()
                raise
            raise BackfillError(
                f"--where {where!r}: PostgreSQL cannot use it as a condition on {table}: "
                f"{first_line(exc)}"
            ) from exc
        try:
            return int(plan[0]["Plan"]["Plan Rows"])
        except (KeyError, IndexError, TypeError, ValueError):
            return None

    def _connection(self) -> Any:
        """The chunks' connection: read-only, so that a condition cannot write; text as
        bytes, so that each row's JSON goes into its update as it came."""
        source = self.source
        if self.conn is None:
            conn = psycopg2.connect(source.options.dsn)
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute("SET default_transaction_read_only = on")
            psycopg2.extensions.register_type(psycopg2.extensions.BYTES, conn)
            self.conn = conn
        return self.conn

    def _drop_connection(self) -> None:
        close_quietly(self.conn)
        self.conn = None

    def watermark(self, token: str) -> None:
        """A transactional logical decoding message: it reaches the stream at its commit."""
        source = self.source
        if source.conn is None:
            source.conn = source.admin.connect()
        # Flushed at its commit even where synchronous_commit is off: the stream only sees
        # flushed WAL, and the backfill waits for the watermark to come round.
        statement = "SET synchronous_commit TO on; SELECT pg_logical_emit_message(true, %s, %s)"
        try:
            source._query(statement, (source.watermark_prefix, token))
        except (psycopg2.OperationalError, psycopg2.InterfaceError):
            # This connection alone may have gone (the stream's has its own): once more.
            close_quietly(source.conn)
            source.conn = source.admin.connect()
            source._query(statement, (source.watermark_prefix, token))

    def chunk(self, plan: BackfillPlan, after: list[Any] | None, limit: int) -> list[Update]:
        """One chunk in key order, PostgreSQL writing each row's JSON with the stream's
        value rules, read in a snapshot that sees every transaction committed before it
        (see :meth:`_visible_snapshot`)."""
        source = self.source
        sql_parts: _ChunkSql = plan.detail
        columns = sql_parts.columns
        kinds = {n: (kind, base) for n, kind, base in columns}
        keys = plan.keys
        alias = unused_name("wormhole_row", {n for n, _, _ in columns})
        order = ", ".join(f"t.{quote(k)}" for k in keys)
        conditions = []
        if plan.where is not None:
            # On lines of its own: a trailing -- comment ends with its line.
            conditions.append(f"(\n{plan.where.replace('%', '%%')}\n)")
        if sql_parts.row_filter is not None:
            conditions.append(f"({sql_parts.row_filter.replace('%', '%%')})")
        if after is not None:
            # Key values as text: the server reads each as its column's type (a real key
            # compared with a double would find itself greater than itself).
            conditions.append(f"({order}) > ({', '.join(['%s'] * len(keys))})")
        where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
        sql = (
            f"SELECT {json_row_select(columns, keys, alias)} FROM {sql_parts.only}"
            f"{qualified(plan.table)} t{where} ORDER BY {order} LIMIT {int(limit)}"
        )
        params = None if after is None else [v if isinstance(v, str) else str(v) for v in after]
        conn = self._connection()
        try:
            with conn.cursor() as cur:
                self._visible_snapshot(cur)
                try:
                    cur.execute(sql, params)
                    fetched = cur.fetchall()
                finally:
                    cur.execute("COMMIT")
        except psycopg2.Error as exc:
            if isinstance(exc, psycopg2.OperationalError | psycopg2.InterfaceError):
                self._drop_connection()
                raise  # the server or the link: tried again
            raise BackfillError(
                f"backfill of {plan.table}: a chunk cannot be read ({first_line(exc)}); if the "
                f"table changed, backfill it again"
            ) from exc
        if source.raw_text:
            at = "a backfill chunk"
            fetched = [
                source.decode_errors.chunk_row(plan.table, row, len(keys), at) for row in fetched
            ]
        return self._chunk_updates(plan, kinds, fetched)

    def unseen(self, update: Update) -> bool:
        """A change of a transaction the last chunk's snapshot did not see: if the
        stream returns it before that chunk's low watermark, its commit record was written
        before the watermark but the transaction was not visible yet when the chunk was
        read (see :meth:`_visible_snapshot`)."""
        unseen = self.chunk_unseen
        return unseen is not None and update.txid is not None and update.txid in unseen

    def _visible_snapshot(self, cur: Any) -> None:
        """Begin a read-only REPEATABLE READ transaction whose snapshot sees every
        transaction committed so far. A transaction writes its commit record (and so comes
        before the low watermark in the stream) a moment before it becomes visible, longer
        under synchronous replication, where it waits for a standby: a snapshot that does
        not see a transaction already marked committed, or one the stream already read, is
        dropped and taken again. One still in the moment between its commit record and that
        mark cannot be told from a running one here: the snapshot's invisible transactions
        are kept, and the stream names their changes before the low watermark
        (:meth:`backfill_unseen`)."""
        source = self.source
        deadline = time.monotonic() + 30.0
        pause = 0.001
        while True:
            cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            cur.execute(
                "SELECT pg_snapshot_xmax(s)::text::bigint, "
                "array(SELECT x::text::bigint FROM pg_snapshot_xip(s) x), "
                "EXISTS(SELECT FROM pg_snapshot_xip(s) x WHERE pg_xact_status(x) = 'committed') "
                "FROM pg_current_snapshot() s"
            )
            xmax, running, committed = cur.fetchone()
            unseen = Invisible(xmax, running)
            if not committed and not any(t in unseen for t in source.stream.streamed_txids):
                self.chunk_unseen = unseen
                return
            cur.execute("ROLLBACK")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    "transactions committed before the low watermark did not become visible "
                    "within 30 s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def _chunk_updates(
        self, plan: BackfillPlan, kinds: dict[str, tuple[int, int]], fetched: list[Any]
    ) -> list[Update]:
        table = plan.table
        keys = plan.keys
        now_ms = int(time.time() * 1000)
        raw = _Raw
        described: tuple[msgspec.Raw, str] | None = plan.detail.described
        if described is not None:
            return [
                self._incremental(update, *described, now_ms)
                for update in self._chunk_updates(
                    replace(plan, detail=replace(plan.detail, described=None)), kinds, fetched
                )
            ]
        if len(keys) == 1 and native_key(*kinds[keys[0]]):
            (name,) = keys
            return [
                Update(
                    op="r",
                    key={name: key},
                    after=raw(row),
                    table=table,
                    connector="postgres",
                    ts_ms=now_ms,
                )
                for key, row in fetched
            ]
        key_kinds = [(k, *kinds[k]) for k in keys]
        n_keys = len(keys)
        return [
            Update(
                op="r",
                key={
                    k: key_value(kind, base, v)
                    for (k, kind, base), v in zip(key_kinds, row, strict=False)
                },
                after=raw(row[n_keys]),
                table=table,
                connector="postgres",
                ts_ms=now_ms,
            )
            for row in fetched
        ]

    def _incremental(
        self, update: Update, columns: msgspec.Raw, table_part: str, now_ms: int
    ) -> Update:
        """A backfill row described as Debezium describes an incremental snapshot's."""
        source = self.source
        update.columns = columns
        update.details = _Raw(
            f'{{"connector":"postgresql","snapshot":"incremental","db":{source.database_json},'
            f'"sequence":null,"ts_us":{now_ms * 1000},"ts_ns":{now_ms * 1_000_000},{table_part}'
            f'"txId":null,"lsn":null,"xmin":null,"origin":null,"origin_lsn":null}}'.encode()
        )
        return update
