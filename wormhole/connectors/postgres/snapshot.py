"""The initial snapshot of the ``postgres`` source: connections that import the slot's
exported snapshot, each table read in parts (CTID ranges, one per reader) with PostgreSQL
writing each row's JSON by the stream's value rules, and the snapshot rows' ``details``."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from wormhole.connectors.postgres import pgoutput as pg
from wormhole.connectors.postgres.driver import psycopg2
from wormhole.connectors.postgres.sql import (
    ROW_ESTIMATE,
    json_row_select,
    key_value,
    native_key,
    qualified,
    unused_name,
)
from wormhole.core.update import NULL
from wormhole.plugins.database_source import PartsCursor, SnapshotTable, close_quietly

if TYPE_CHECKING:
    from wormhole.connectors.postgres.source import PostgresSource

_Raw = msgspec.Raw

PAGES_PER_PART = 128
"""A table is read in parts (one per snapshot reader) only when each part holds at least
this many pages (1 MiB of 8 kB pages): a small table is read whole, by one reader."""


class PostgresSnapshot:
    """The initial snapshot of one :class:`PostgresSource`: its reader connections, the
    tables' parts, and the ``details`` its rows carry (the snapshot's transaction is the
    source's own connection's, which reads the catalog as of the slot's start)."""

    def __init__(self, source: PostgresSource) -> None:
        self.source = source
        self.conns: list[Any] = []
        """The readers: connections in the exported snapshot."""
        self.cursors = itertools.count()
        """Numbers the readers' named cursors."""
        # The snapshot rows' details (Debezium's source block), around each table's part.
        self.details_head = ""
        self.details_mid = ""
        self.details_tail = ""

    def begin(self, snapshot_name: str) -> None:
        """Enter the slot's exported snapshot ``snapshot_name`` on the source's connection
        (the catalog as of the slot's start, for the schema history, even when no rows are
        read), and set the rows' ``details``; with ``snapshot: initial``, the readers import
        it too."""
        source = self.source
        source.conn.autocommit = False
        with source.conn.cursor() as cur:
            cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            cur.execute("SET TRANSACTION SNAPSHOT %s", (snapshot_name,))
            snapshot_txid: Any = "null"
            if source.describe:  # Debezium's snapshot events name the snapshot's transaction
                cur.execute("SELECT txid_current()")
                (snapshot_txid,) = cur.fetchone()
        snapshot_us = int(time.time() * 1_000_000)
        lsn = source.snapshot_lsn
        self.details_head = '{"connector":"postgresql",'
        self.details_mid = (
            f'"db":{source.database_json},"sequence":"[null,\\"{lsn}\\"]",'
            f'"ts_us":{snapshot_us},"ts_ns":{snapshot_us}000,'
        )
        self.details_tail = (
            f'"txId":{snapshot_txid},"lsn":{lsn},"xmin":null,"origin":null,"origin_lsn":null}}'
        )
        if source.options.snapshot == "initial":
            self.open_readers(snapshot_name, source.options.snapshot_readers)

    def end(self) -> None:
        """End the snapshot's transaction (every table was read, or none is to be)."""
        source = self.source
        source.conn.commit()
        source.conn.autocommit = True
        self.close_readers()

    def open_readers(self, snapshot_name: str, readers: int) -> None:
        """Every reader imports the snapshot now: it can be imported only until the
        replication connection runs its next command."""
        self.conns = [self.reader(snapshot_name) for _ in range(readers)]

    def reader(self, snapshot_name: str) -> Any:
        """A connection in the exported snapshot ``snapshot_name``, read-only, with text as
        bytes (each row's JSON goes into its update as it came)."""
        source = self.source
        conn = source.admin.connect()
        try:
            conn.autocommit = False
            conn.set_session(isolation_level="REPEATABLE READ", readonly=True)
            psycopg2.extensions.register_type(psycopg2.extensions.BYTES, conn)
            with conn.cursor() as cur:
                cur.execute("SET TRANSACTION SNAPSHOT %s", (snapshot_name,))
        except BaseException:
            close_quietly(conn)
            raise
        return conn

    def estimate(self) -> int | None:
        """The snapshot's tables' row counts, estimated (see ROW_ESTIMATE); None if unknown."""
        source = self.source
        total = 0
        for table in source.snapshot_tables:
            schema, _, name = table.partition(".")
            rows = source._query(
                f"SELECT {ROW_ESTIMATE} FROM pg_class c JOIN pg_namespace n ON n.oid = "
                "c.relnamespace LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid "
                "WHERE n.nspname = %s AND c.relname = %s",
                (schema, name),
            )
            if not rows or rows[0][0] is None or rows[0][0] < 0:
                return None
            total += int(rows[0][0])
        return total

    def open_table(self, table: str) -> SnapshotTable:
        source = self.source
        oid, relation, keys = self._relation(table)
        # Read as backfill chunks are: PostgreSQL writes each row's JSON.
        columns = [
            (c.name, c.kind, source.catalog.base_types.get(c.type_oid, c.type_oid))
            for c in relation.columns
        ]
        alias = unused_name("wormhole_row", {c.name for c in relation.columns})
        select = f"SELECT {json_row_select(columns, keys, alias)} FROM {qualified(table)} t"
        parts = self._parts(oid)
        batch = source.options.batch_updates
        cursors = self.cursors

        def open_part(conn: Any, where: str) -> Any:
            cursor = conn.cursor(name=f"wormhole_snapshot_{oid}_{next(cursors)}")
            cursor.itersize = batch
            cursor.execute(select + where)
            return cursor

        cursor = PartsCursor(self.conns, parts, open_part, batch)
        return SnapshotTable(
            table,
            keys,
            cursor,
            self._keyed(table, keys, columns),
            source.catalog.relation_columns.pop(oid, NULL),
            source.catalog.relation_details.pop(oid, ""),
            encoded=True,
        )

    def _relation(self, table: str) -> tuple[int, pg.Relation, list[str]]:
        """The table's oid, its relation as the snapshot sees it (columns, types, key) and
        its key columns."""
        source = self.source
        schema, _, name = table.partition(".")
        rows = source._query(
            "SELECT a.attname, a.atttypid, a.atttypmod FROM pg_attribute a JOIN pg_class c ON "
            "c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s "
            "AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            (schema, name),
        )
        (oid,) = source._query(
            "SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = %s",
            (schema, name),
        )[0]
        table_now = source.catalog.tables([oid])[oid]
        relation = pg.Relation(
            oid,
            schema,
            name,
            table_now.identity,
            [pg.Column(n, t, False, 0, mod) for n, t, mod in rows],
        )
        source.catalog.resolve_types(relation)
        # The rule of Catalog.stream_key, from the catalog in the snapshot (the slot's start).
        key = table_now.identity_index if table_now.identity == "i" else table_now.primary_key
        relation.key_columns = keys = key or [c.name for c in relation.columns]
        source.catalog.describe_columns(relation)
        return oid, relation, keys

    def _keyed(
        self, table: str, keys: list[str], columns: list[tuple[str, Any, Any]]
    ) -> Callable[[list[Any]], list[Any]]:
        """What turns fetched rows (key values, then the row's JSON) into (key, JSON) pairs."""
        source = self.source
        kinds = {n: (kind, base) for n, kind, base in columns}
        n_keys = len(keys)
        at = f"the snapshot at {pg.lsn_text(source.snapshot_lsn)}"
        utf8_row = source.decode_errors.chunk_row
        raw_text = source.raw_text

        if n_keys == 1 and native_key(*kinds[keys[0]]) and not raw_text:
            (name,) = keys

            def keyed(fetched: list[Any]) -> list[Any]:
                return [({name: k}, document) for k, document in fetched]

            return keyed
        key_kinds = [(k, *kinds[k]) for k in keys]

        def keyed_values(fetched: list[Any]) -> list[Any]:
            if raw_text:
                fetched = [utf8_row(table, row, n_keys, at) for row in fetched]
            return [
                (
                    {
                        k: key_value(kind, base, v)
                        for (k, kind, base), v in zip(key_kinds, row, strict=False)
                    },
                    row[n_keys],
                )
                for row in fetched
            ]

        return keyed_values

    def details(self, table: SnapshotTable, flag: str) -> msgspec.Raw:
        source = self.source
        if not source.describe:
            return NULL
        return _Raw(
            f'{self.details_head}"snapshot":"{flag}",{self.details_mid}'
            f"{table.details}{self.details_tail}".encode()
        )

    def _parts(self, oid: int) -> list[str]:
        """The conditions that split a table into one range of pages (CTID) per snapshot
        reader: a TID range scan each (PostgreSQL 14 or later). The last range is open, so
        the parts hold every row however large the table has grown since it was measured."""
        source = self.source
        readers = len(self.conns)
        if readers < 2 or source.server_version < 140000:
            return [""]
        (pages,) = source._query(
            "SELECT pg_relation_size(%s::oid) / current_setting('block_size')::int8", (oid,)
        )[0]
        parts = min(readers, int(pages) // PAGES_PER_PART)
        if parts < 2:
            return [""]
        bounds = [int(pages) * i // parts for i in range(1, parts)]
        conditions = [f" WHERE t.ctid < '({bounds[0]},0)'::tid"]
        conditions += [
            f" WHERE t.ctid >= '({low},0)'::tid AND t.ctid < '({high},0)'::tid"
            for low, high in itertools.pairwise(bounds)
        ]
        conditions.append(f" WHERE t.ctid >= '({bounds[-1]},0)'::tid")
        return conditions

    def close_readers(self) -> None:
        source = self.source
        if source.snapshot is not None:
            source.snapshot.cursor.close()
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.rollback()  # read only: nothing to commit
        close_quietly(*self.conns)
        self.conns = []
