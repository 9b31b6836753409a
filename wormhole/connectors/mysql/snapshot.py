"""The initial snapshot of the ``mysql`` source: the plan of tables and their columns, each
table read in one consistent-snapshot transaction with DECIMAL, temporal and YEAR values as
the server's text (as backfill chunks read them), text of other character sets decoded as
the stream decodes it, and the snapshot rows' ``details``."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from wormhole.connectors.mysql.chunks import chunk_layout, select_list
from wormhole.connectors.mysql.position import gtid_state_text
from wormhole.connectors.mysql.server import json_text, quote_name
from wormhole.connectors.mysql.values import Layout
from wormhole.core.update import NULL
from wormhole.plugins.database_source import SnapshotTable

if TYPE_CHECKING:
    from wormhole.connectors.mysql.source import MySQLSource

log = logging.getLogger("wormhole.mysql")

TEXT_TYPES = frozenset({"char", "varchar", "tinytext", "text", "mediumtext", "longtext"})
UTF8 = frozenset({None, "utf8mb3", "utf8mb4", "utf8", "binary"})


class MySQLSnapshot:
    """The initial snapshot of one :class:`MySQLSource` (which starts its transaction and
    takes the binlog position it stands at)."""

    def __init__(self, source: MySQLSource) -> None:
        self.source = source
        self.conn: Any = None
        """The connection whose transaction is the snapshot."""
        self.ts_us = 0
        """When the snapshot started (whole seconds, as Debezium's ``source.ts_*``)."""

    def begin(self) -> None:
        """Start the snapshot's transaction; the stream starts where it stands."""
        source = self.source
        self.conn, position = source.server.start_snapshot()
        source.binlog.restore(position)
        self.ts_us = int(time.time()) * 1_000_000
        source.snapshot_position = f"{position.file}:{position.pos}"
        source.snapshot_logical = gtid_state_text(source.binlog.gtid_state)
        source.snapshot_tables = self.plan()
        source.phase = "snapshot"
        log.info(
            "initial snapshot of %d tables at %s:%d",
            len(source.snapshot_tables),
            position.file,
            position.pos,
        )

    def estimate(self) -> int | None:
        """``information_schema.TABLES.TABLE_ROWS`` of the snapshot's tables (an estimate
        for InnoDB)."""
        source = self.source
        total = 0
        for schema, name, _layout, _select in source.snapshot_tables:
            rows = source._query(
                "SELECT TABLE_ROWS FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s "
                "AND TABLE_NAME = %s",
                (schema, name),
            )
            if not rows or rows[0][0] is None:
                return None
            total += int(rows[0][0])
        return total

    def plan(self) -> list[tuple[str, str, Layout, str]]:
        source = self.source
        rows = source._query(
            "SELECT TABLE_SCHEMA, TABLE_NAME FROM information_schema.TABLES "
            "WHERE TABLE_TYPE = 'BASE TABLE' ORDER BY 1, 2"
        )
        plan = []
        for schema, table in rows:
            if not source.included.wanted(schema, table):
                continue
            columns = source._query(
                "SELECT COLUMN_NAME, DATA_TYPE, DATETIME_PRECISION, NUMERIC_PRECISION, "
                "CHARACTER_SET_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = %s "
                "AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
                (schema, table),
            )
            key = [
                r[0]
                for r in source._query(
                    "SELECT COLUMN_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = %s "
                    "AND TABLE_NAME = %s AND COLUMN_KEY = 'PRI' ORDER BY ORDINAL_POSITION",
                    (schema, table),
                )
            ]
            layout = chunk_layout(columns, key)
            as_bytes = self._text_as_bytes(schema, table, columns, layout)
            plan.append((schema, table, layout, select_list(columns, as_bytes)))
        return plan

    def _text_as_bytes(
        self, schema: str, table: str, columns: list[tuple[Any, ...]], layout: Layout
    ) -> set[str]:
        """Text columns the snapshot reads as their bytes and decodes as the stream does: those
        of a character set other than UTF-8, which the server's conversion to the connection's
        utf8mb4 would turn into ``?`` where it cannot map a byte."""
        source = self.source
        assert source.server.charsets is not None
        as_bytes: set[str] = set()
        for name, data_type, _dt, _num, charset in columns:
            if str(data_type).lower() not in TEXT_TYPES or charset in UTF8:
                continue
            decode = source.server.charsets.decoders.get(str(charset))
            if decode is None:
                continue
            as_bytes.add(name)
            layout.special.append((name, self._text(f"{schema}.{table}", name, decode)))
        return as_bytes

    def _text(self, table: str, column: str, decode: Any) -> Any:
        source = self.source

        def convert(value: Any) -> Any:
            if not isinstance(value, (bytes, bytearray)):
                return value
            try:
                return decode(bytes(value))
            except ValueError as exc:
                at = f"the snapshot at {source.snapshot_position}"
                return source.tables.undecodable(table, column, bytes(value), str(exc), at, "table")

        return convert

    def open_table(self, table: tuple[str, str, Layout, str]) -> SnapshotTable:
        source = self.source
        schema, name, layout, select = table
        cursor = self.conn.cursor()
        cursor.execute(f"SELECT {select} FROM {quote_name(schema)}.{quote_name(name)}")
        names, convert = layout.columns, layout.convert

        def as_dicts(fetched: list[Any]) -> list[dict[str, Any]]:
            return [convert(dict(zip(names, values, strict=True))) for values in fetched]

        if not source.describe:
            return SnapshotTable(f"{schema}.{name}", layout.key, cursor, as_dicts)
        columns, db, table_name = source.tables.describe_table(schema, name)
        return SnapshotTable(
            f"{schema}.{name}",
            layout.key,
            cursor,
            as_dicts,
            columns,
            f'"db":{db},"sequence":null,"ts_us":{self.ts_us},'
            f'"ts_ns":{self.ts_us * 1000},"table":{table_name},',
        )

    def details(self, table: SnapshotTable, flag: str) -> msgspec.Raw:
        source = self.source
        if not source.describe:
            return NULL
        return msgspec.Raw(
            f'{{"connector":"mysql","snapshot":"{flag}",{table.details}"server_id":0,'
            f'"gtid":null,"file":{json_text(source.binlog.file)},"pos":{source.binlog.pos},"row":0,'
            f'"thread":null,"query":null}}'.encode()
        )

    def end(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.commit()
            self.conn.close()
