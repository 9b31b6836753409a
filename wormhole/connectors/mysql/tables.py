"""The tables of the ``mysql`` source: which it reads (:class:`IncludedTables`), and their
table maps: each rows event's table, its row decoder (built from the table map's layout,
cached by everything decoding depends on), its description for typed envelopes (from
``information_schema``), and what happens to a value that cannot be decoded."""

from __future__ import annotations

import fnmatch
import logging
import re
from typing import TYPE_CHECKING, Any

import msgspec

from wormhole.connectors.mysql.rowimage import (
    OLD_TEMPORALS,
    RowDecoder,
    Unframed,
    collations,
    present_columns,
    signature,
    undecoded,
)
from wormhole.connectors.mysql.server import (
    DESCRIBE_COLUMNS,
    SYSTEM_SCHEMAS,
    json_text,
    quote_name,
)
from wormhole.core.errors import SourceError
from wormhole.core.update import ColumnType, encode_columns
from wormhole.plugins import events

if TYPE_CHECKING:
    from wormhole.connectors.mysql.options import MySQLOptions
    from wormhole.connectors.mysql.source import MySQLSource

log = logging.getLogger("wormhole.mysql")

_INT_WIDTH = re.compile(r"^(tinyint|smallint|mediumint|int|bigint)\(\d+\)")
_FSP_TYPES = frozenset({"time", "datetime", "timestamp"})
_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


def _column_type(column_type: str, data_type: str, fsp: Any) -> str:
    """A column's type for :attr:`Update.columns`: MySQL's ``COLUMN_TYPE`` in lower case,
    without integer display widths (``int unsigned``, ``bigint``), with the fractional
    precision always given for temporal types (``datetime(0)``), ``year`` for ``year(4)``."""
    text = column_type.lower()
    data_type = data_type.lower()
    if data_type in _FSP_TYPES:
        return f"{data_type}({int(fsp or 0)})"
    if data_type == "year":
        return "year"
    return _INT_WIDTH.sub(r"\1", text).replace(" zerofill", "")


def _default_text(default: Any) -> str | None:
    """A constant default of ``information_schema.COLUMNS.COLUMN_DEFAULT`` (MariaDB writes
    an expression: ``7``, ``'none'``, ``NULL``, ``current_timestamp()``), else None."""
    if default is None:
        return None
    text = str(default)
    if len(text) >= 2 and text[0] == "'" and text[-1] == "'":
        return text[1:-1].replace("''", "'").replace("\\\\", "\\")
    if _NUMBER.match(text):
        return text
    return None


class IncludedTables:
    """Which tables the source reads: those its ``tables`` option names (every table without
    it) less those of ``exclude_tables``, never the system schemas' nor the signal table."""

    def __init__(self, options: MySQLOptions, signal: tuple[str, str]) -> None:
        self.include = options.tables
        self.exclude = options.exclude_tables
        self.signal = signal
        self.known: dict[tuple[str, str], bool] = {}

    def wanted(self, schema: str, table: str) -> bool:
        found = self.known.get((schema, table))
        if found is None:
            name = f"{schema}.{table}"
            include = self.include
            found = (
                schema not in SYSTEM_SCHEMAS
                and (schema, table) != self.signal
                and (include is None or any(fnmatch.fnmatchcase(name, p) for p in include))
                and not any(fnmatch.fnmatchcase(name, p) for p in self.exclude)
            )
            self.known[(schema, table)] = found
        return found


class TableMaps:
    """The tables one :class:`MySQLSource` meets in the binlog, by table id."""

    def __init__(self, source: MySQLSource) -> None:
        self.source = source
        # Row decoders: by table id (set by each table map), and by everything of a table
        # map that decoding depends on (types, their metadata, character sets, members).
        self.decoders: dict[int, RowDecoder] = {}
        self.decoder_cache: dict[tuple[Any, ...], RowDecoder] = {}
        # What typed envelopes need (SourceContext.describe_updates): per table id the
        # table's Update.columns and its "db" / "table" part of Update.details.
        self.described: dict[int, tuple[msgspec.Raw, str, str]] = {}
        self.described_tables: dict[tuple[Any, ...], tuple[msgspec.Raw, str, str]] = {}
        self.present: dict[tuple[bytes, int], list[int]] = {}
        self.undecoded_logged: dict[tuple[str, str], int] = {}
        # Primary keys that the table map describes as PRIMARY_KEY_WITH_PREFIX, by table id.
        self.prefix_keys: dict[int, tuple[str, ...]] = {}

    def table_map(self, event: Any) -> None:
        source = self.source
        # The key is the primary key the table map carries (binlog_row_metadata=FULL), as
        # it was when the row was written, never the live catalog's. The binlog reader
        # reads it only from SIMPLE_PRIMARY_KEY; a primary key with a prefix part
        # (PRIMARY KEY (name(10))) comes as PRIMARY_KEY_WITH_PREFIX instead, and would
        # otherwise leave the table keyed by every column.
        metadata = getattr(event, "optional_metadata", None)
        prefixed = getattr(metadata, "primary_keys_with_prefix", None)
        if prefixed:
            columns = event.columns
            self.prefix_keys[event.table_id] = tuple(columns[i].name for i in sorted(prefixed))
        else:
            self.prefix_keys.pop(event.table_id, None)
        if source.included.wanted(event.schema, event.table):
            self._new_decoder(event)

    def decoder(self, event: Any, table: str) -> RowDecoder:
        source = self.source
        decoder = self.decoders.get(event.table_id)
        if decoder is None:  # pragma: no cover - the server writes a table map first
            reader = source.binlog.reader
            raise SourceError(
                f"source: a rows event of {table} came without its table map at "
                f"{reader.at() if reader is not None else '?'}"
            )
        return decoder

    def _new_decoder(self, event: Any) -> None:
        """The row decoder of a table map's layout (cached by everything decoding uses)."""
        source = self.source
        table_obj = event.get_table()
        columns = table_obj.columns
        primary_key = table_obj.primary_key or self.prefix_keys.get(event.table_id, "")
        ids = collations(columns, event.optional_metadata, event.dbms == "mariadb")
        key = (event.schema, event.table, primary_key, signature(columns, ids))
        decoder = self.decoder_cache.get(key)
        if decoder is None:
            if isinstance(primary_key, str):
                keys = [primary_key] if primary_key else []
            else:
                keys = list(primary_key or ())
            assert source.server.charsets is not None
            if any(c.type in OLD_TEMPORALS for c in columns):
                self._check_old_temporals(event.schema, event.table, columns)
            try:
                decoder = RowDecoder(columns, ids, source.server.charsets, keys)
            except ValueError as exc:
                raise SourceError(
                    f"source: cannot read the rows of {event.schema}.{event.table}: {exc}; "
                    f"leave the table out (exclude_tables)"
                ) from exc
            self.decoder_cache[key] = decoder
        self.decoders[event.table_id] = decoder
        if source.describe:
            described = self.described_tables.get(key)
            if described is None:
                described = self.described_tables[key] = self.describe_table(
                    str(event.schema), str(event.table)
                )
            self.described[event.table_id] = described

    def describe_table(self, schema: str, table: str) -> tuple[msgspec.Raw, str, str]:
        """A table's ``Update.columns`` (from the catalog: types, nullability, constant
        defaults) and the JSON of its database and table name for ``Update.details``."""
        source = self.source
        return self.described_rows(source._query(DESCRIBE_COLUMNS, (schema, table)), schema, table)

    @staticmethod
    def described_rows(
        rows: list[tuple[Any, ...]], schema: str, table: str
    ) -> tuple[msgspec.Raw, str, str]:
        columns = [
            ColumnType(
                str(name),
                _column_type(str(column_type), str(data_type), fsp),
                nullable == "YES",
                _default_text(default),
            )
            for name, column_type, data_type, fsp, nullable, default in rows
        ]
        return encode_columns(columns), json_text(schema), json_text(table)

    def rows(self, event: Any, decoder: RowDecoder, table: str, update: bool) -> list[Any]:
        """The rows of a rows event, decoded from its bytes: dicts, or (before, after)."""
        source = self.source
        packet = event.packet
        body = packet.read(event.event_size - packet.read_bytes)
        count = event.number_of_columns
        present = self._present(event.columns_present_bitmap, count)
        present_after = self._present(event.columns_present_bitmap2, count) if update else None
        held = min(len(present), len(present_after) if present_after is not None else count)
        if held < count:
            # Not the row: the missing columns would arrive as NULL (or the key as changed).
            raise SourceError(
                f"source: the rows of {table} at {source.txn.position} (GTID "
                f"{source.txn.logical or '-'}) hold {held} of the table's {count} columns: the "
                f"session that wrote them had binlog_row_image MINIMAL or NOBLOB, and a partial "
                f"image is not the row. Set binlog_row_image=FULL for every session (globally, "
                f"and do not let clients SET SESSION binlog_row_image), then start the source "
                f"after this change and backfill {table}"
            )
        first = source.txn.index + 1

        def on_error(column: str, raw: bytes, reason: str, row: int) -> Any:
            at = f"{source.txn.position}:{first + row} (GTID {source.txn.logical or '-'})"
            return self.undecodable(table, column, raw, reason, at)

        try:
            return decoder.rows(body, present, present_after, on_error)
        except Unframed as exc:
            raise SourceError(
                f"source: the rows of {table} at {source.txn.position} (GTID "
                f"{source.txn.logical or '-'}) do not match their table map: {exc}; leave the "
                f"table out (exclude_tables) and report it with the table's SHOW CREATE TABLE"
            ) from exc

    def _check_old_temporals(self, schema: str, table: str, columns: list[Any]) -> None:
        """TIME, DATETIME and TIMESTAMP in the pre-10.1 format carry no length in the binlog:
        readable only without fractional seconds (the catalog says which they have)."""
        source = self.source
        names = [str(c.name) for c in columns if c.type in OLD_TEMPORALS]
        marks = ", ".join(["%s"] * len(names))
        fractional = [
            str(r[0])
            for r in source._query(
                "SELECT COLUMN_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = %s AND "
                f"TABLE_NAME = %s AND COLUMN_NAME IN ({marks}) AND DATETIME_PRECISION > 0",
                (schema, table, *names),
            )
        ]
        if fractional:
            raise SourceError(
                f"source: {schema}.{table} has columns in the temporal format of MariaDB before "
                f"10.1 with fractional seconds ({', '.join(fractional)}), whose values carry no "
                f"length in the binlog: neither the source nor mariadb-binlog can read its rows. "
                f"Rebuild the table in the current format (mysql56_temporal_format=ON, the "
                f"default, then ALTER TABLE {quote_name(schema)}.{quote_name(table)} FORCE), or "
                f"leave it out (exclude_tables)"
            )

    def _present(self, bitmap: bytes, count: int) -> list[int]:
        found = self.present.get((bitmap, count))
        if found is None:
            found = self.present[(bitmap, count)] = present_columns(bitmap, count)
        return found

    def undecodable(
        self, table: str, column: str, raw: bytes, reason: str, at: str, kept: str = "binlog"
    ) -> Any:
        """A value that cannot be decoded: stop, or deliver its bytes with a warning. ``at``:
        where it is (the change's position); ``kept``: what keeps it (binlog, table)."""
        source = self.source
        shown = raw[:64].hex() + ("..." if len(raw) > 64 else "")
        where = f"column {column} of {table} at {at}"
        if source.options.on_decode_error == "stop":
            raise SourceError(
                f"source: cannot decode {where}: {reason}; bytes {shown}. The {kept} keeps "
                f"the value: set source.on_decode_error: fallback to deliver it as "
                f'{{"undecoded": "<hex>"}}, and give the column a character set that holds '
                f"it (ALTER TABLE ... CONVERT TO CHARACTER SET utf8mb4) for the rows to come"
            )
        events.undecoded_value(table, column)
        logged = self.undecoded_logged.get((table, column), 0)
        if logged < 10:
            self.undecoded_logged[(table, column)] = logged + 1
            log.warning(
                'cannot decode %s: %s; delivered as {"undecoded": "%s"}. Give the column a '
                "character set that holds the value (ALTER TABLE ... CONVERT TO CHARACTER SET "
                "utf8mb4), or set source.on_decode_error: stop to stop at such a value%s",
                where,
                reason,
                shown,
                " (further ones of this column are only counted)" if logged == 9 else "",
            )
        return undecoded(raw)
