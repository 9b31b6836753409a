"""Change events assembled: :class:`DebeziumEncoder` turns updates into Kafka-style
messages whose key and value are what Debezium's JsonConverter writes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from wormhole.core.update import NULL, TRUNCATE, ColumnType, Update, decode_columns
from wormhole.plugins.debezium.columns import (
    DebeziumTypes,
    _Converter,
)
from wormhole.plugins.debezium.options import (
    _UNCHANGED_TOAST,
    UNAVAILABLE,
    VERSION,
    DebeziumFields,
    Message,
)
from wormhole.plugins.debezium.schemas import (
    _REQUIRED,
    _SNAPSHOT_ENUM,
    _SOURCE_NAMES,
    _SOURCE_SCHEMAS,
    _TRANSACTION_KEY_SCHEMA,
    _TRANSACTION_SCHEMA,
    _TRANSACTION_VALUE_SCHEMA,
    _decode_details,
    _decode_marks,
    _decode_transaction_id,
    _encode,
    _ordered,
)
from wormhole.plugins.debezium.values import (
    _bool_of,
    _float_of,
    _int_of,
)

_UNCHANGED_MARK = b'"__unchanged_toast__"'


@dataclass
class _Table:
    """What the encoder keeps per (table, columns): converters and schemas."""

    topic: str
    names: list[str]
    converters: list[_Converter]
    defaults: list[Any]
    """Each column's default as Debezium writes it (None: no constant default). A null
    becomes it, as JsonConverter's replace.null.with.default does."""
    key_schema: dict[str, Any] | None
    value_schema: dict[str, Any] | None
    passthrough: bool = False
    """Every column's value is already as Debezium writes it (numbers, booleans, text) and
    none has a default: a whole row's raw JSON is copied, not rebuilt."""
    envelope_schemas: dict[str, bytes] = field(default_factory=dict)
    """Per connector: the value's schema as JSON (``schemas``)."""


_IDENTITY = (_int_of, _bool_of, _float_of)
"""Conversions that leave a describing source's values as they are."""


class DebeziumEncoder:
    """Updates -> Debezium messages, under the options of :class:`DebeziumFields`."""

    def __init__(self, options: DebeziumFields, topic_prefix: str) -> None:
        self.options = options
        self.prefix = options.topic_prefix or topic_prefix
        self.types = DebeziumTypes(options)
        self.tables: dict[tuple[str, bytes, tuple[str, ...]], _Table] = {}
        self.source_schemas: dict[str, dict[str, Any]] = {}
        self.prefix_json = _encode(self.prefix)
        self.transactions = options.transaction_metadata
        self.transaction_topic = f"{self.prefix}.transaction"

    def topic(self, table: str) -> str:
        """``<prefix>.<schema>.<table>``."""
        return f"{self.prefix}.{table}"

    def messages(self, updates: list[Update]) -> list[Message]:
        """The messages of ``updates``, in order (a delete is followed by its tombstone)."""
        out: list[Message] = []
        now_ns = time.time_ns()
        transactions = self.transactions
        for update in updates:
            block = end = b"null"
            if transactions and update.transaction != NULL:
                block, begin, end = _decode_marks(update.transaction)
                if begin != b"null" and (update.op != TRUNCATE or update.shard == 0):
                    out.append(self._transaction_message(begin))
            if update.op == TRUNCATE:
                # Off by default, as Debezium's skipped.operations=t. The publisher gives
                # every shard a copy: the one of shard 0 is written.
                if update.shard == 0:
                    if self.options.truncates:
                        table = self._table(update)
                        value = self._value(table, update, now_ns, block)
                        out.append(Message(table.topic, None, value))
                    if end != b"null":
                        out.append(self._transaction_message(end))
                continue
            table = self._table(update)
            key = self._key(table, update)
            out.append(Message(table.topic, key, self._value(table, update, now_ns, block)))
            if update.op == "d" and self.options.tombstones:
                out.append(Message(table.topic, key, None))
            if end != b"null":
                out.append(self._transaction_message(end))
        return out

    def _transaction_message(self, value: bytes) -> Message:
        """A BEGIN or END event (``value`` as :attr:`Update.transaction` holds it)."""
        key = b'{"id":%s}' % _encode(_decode_transaction_id.decode(value).id)
        if self.options.schemas:
            key = b'{"schema":%s,"payload":%s}' % (_TRANSACTION_KEY_SCHEMA, key)
            value = b'{"schema":%s,"payload":%s}' % (_TRANSACTION_VALUE_SCHEMA, value)
        return Message(self.transaction_topic, key, value)

    # ------------------------------------------------------------- pieces
    def _table(self, update: Update) -> _Table:
        raw = bytes(update.columns) if update.columns != NULL else b""
        cache_key = (update.table, raw, tuple(update.key))
        found = self.tables.get(cache_key)
        if found is None:
            found = self.tables[cache_key] = self._describe(update)
        return found

    def _describe(self, update: Update) -> _Table:
        columns = decode_columns(update.columns)
        if columns is None:
            # A source that does not describe its columns: untyped, from the row itself.
            row = update.after_row() or update.before_row() or {}
            columns = [ColumnType(name, "unknown", name not in update.key) for name in row]
        names = [c.name for c in columns]
        converters = [self.types.converter(c.type).for_column(c.optional) for c in columns]
        defaults = [
            None if c.default is None else self._convert(converter, c.default)
            for c, converter in zip(columns, converters, strict=True)
        ]
        topic = self.topic(update.table)
        key_schema = value_schema = None
        if self.options.schemas:
            fields = []
            key_fields = []
            for column, converter, default in zip(columns, converters, defaults, strict=True):
                field = {**converter.schema, "optional": column.optional, "field": column.name}
                if default is not None:
                    field["default"] = default
                fields.append(_ordered(field))
                if column.name in update.key:
                    key_field = {**field, "optional": False}
                    key_field.pop("default", None)
                    key_fields.append(_ordered(key_field))
            key_schema = {
                "type": "struct",
                "fields": key_fields,
                "optional": False,
                "name": f"{topic}.Key",
            }
            value_schema = {
                "type": "struct",
                "fields": fields,
                "optional": True,
                "name": f"{topic}.Value",
            }
        passthrough = bool(columns) and all(
            c.convert is None or c.convert in _IDENTITY for c in converters
        )
        passthrough = passthrough and all(d is None for d in defaults)
        return _Table(topic, names, converters, defaults, key_schema, value_schema, passthrough)

    def _key(self, table: _Table, update: Update) -> bytes:
        payload = {
            name: self._convert(converter, update.key[name])
            for name, converter in zip(table.names, table.converters, strict=True)
            if name in update.key
        }
        if table.key_schema is None:
            return _encode(payload)
        return _encode({"schema": table.key_schema, "payload": payload})

    @staticmethod
    def _convert(converter: _Converter, value: Any) -> Any:
        if value is None:
            return None
        if value == _UNCHANGED_TOAST:
            return UNAVAILABLE
        if converter.convert is None:
            return value
        try:
            return converter.convert(value)
        except (ValueError, IndexError, ArithmeticError):
            # Text this mapping does not read (``infinity``, a DateStyle other than ISO):
            # the database's own text, rather than a stop.
            return value

    def _row(self, table: _Table, row: dict[str, Any] | None) -> dict[str, Any] | None:
        if row is None:
            return None
        convert = self._convert
        out = {
            name: convert(converter, row.get(name))
            for name, converter in zip(table.names, table.converters, strict=True)
        }
        for name, default in zip(table.names, table.defaults, strict=True):
            if default is not None and out[name] is None:
                out[name] = default
        return out

    def _after(self, table: _Table, update: Update) -> bytes:
        raw = update.after
        if raw == NULL:
            return b"null"
        if table.passthrough and _UNCHANGED_MARK not in bytes(raw):
            # A describing source's rows hold every column, in the table's order.
            return bytes(raw)
        return _encode(self._row(table, update.after_row()))

    def _fast_source(self, update: Update) -> tuple[bytes, str] | None:
        """The ``source`` block spliced from ``details`` without parsing it, and the
        connector; None when ``details`` does not start as sources write it."""
        details = bytes(update.details)
        if not details.startswith(b'{"connector":"'):
            return None
        end = details.find(b'"', 14) + 1
        if end <= 0 or not details.startswith(b',"snapshot":', end):
            return None
        at = details.find(b'"ts_us":', end)
        if at < 0:
            return None
        stop = details.find(b",", at)
        source_ts = int(details[at + 8 : stop]) // 1000
        block = b'{"version":"%s","connector":%s,"name":%s,"ts_ms":%d%s' % (
            VERSION.encode(),
            details[13:end],
            self.prefix_json,
            source_ts,
            details[end:],
        )
        return block, details[14 : end - 1].decode()

    def _value(self, table: _Table, update: Update, now_ns: int, block: bytes = b"null") -> bytes:
        if update.details != NULL and update.before == NULL:
            fast = self._fast_value(table, update, now_ns, block)
            if fast is not None:
                return fast
        before = update.before_row()
        if update.op == "u" and before is not None and len(before) < len(table.names):
            before = None  # only the key: Debezium has no old image then
        details = _decode_details.decode(update.details) if update.details != NULL else {}
        connector = details.pop("connector", update.connector)
        if "ts_us" in details:
            source_ts = details["ts_us"] // 1000
        else:
            source_ts = update.ts_ms if update.ts_ms is not None else now_ns // 1_000_000
        source = {
            "version": VERSION,
            "connector": connector,
            "name": self.prefix,
            "ts_ms": source_ts,
            "snapshot": details.pop("snapshot", "true" if update.op == "r" else "false"),
            **details,
        }
        payload = _encode(
            {
                "before": self._row(table, before),
                "after": self._row(table, update.after_row()),
                "source": source,
                "transaction": msgspec.Raw(block),
                "op": update.op,
                "ts_ms": now_ns // 1_000_000,
                "ts_us": now_ns // 1000,
                "ts_ns": now_ns,
            }
        )
        if table.value_schema is None:
            return payload
        schema = self._schema_json(table, connector, source)
        return b'{"schema":%s,"payload":%s}' % (schema, payload)

    def _fast_value(self, table: _Table, update: Update, now_ns: int, block: bytes) -> bytes | None:
        """The value of an update without a ``before`` whose ``details`` a source wrote,
        put together from raw JSON (no row or block is parsed); None when it cannot be."""
        spliced = self._fast_source(update)
        if spliced is None:
            return None
        source, connector = spliced
        payload = b'{"before":null,"after":%s,"source":%s,%s}' % (
            self._after(table, update),
            source,
            b'"transaction":%s,"op":"%s","ts_ms":%d,"ts_us":%d,"ts_ns":%d'
            % (block, update.op.encode(), now_ns // 1_000_000, now_ns // 1000, now_ns),
        )
        if table.value_schema is None:
            return payload
        schema = table.envelope_schemas.get(connector)
        if schema is None:
            schema = self._schema_json(table, connector, _decode_details.decode(source))
        return b'{"schema":%s,"payload":%s}' % (schema, payload)

    def _schema_json(self, table: _Table, connector: str, source: dict[str, Any]) -> bytes:
        """The value's schema as JSON, made once per table and connector."""
        schema = table.envelope_schemas.get(connector)
        if schema is None:
            schema = table.envelope_schemas[connector] = _encode(
                self._envelope_schema(table, connector, source)
            )
        return schema

    def _envelope_schema(
        self, table: _Table, connector: str, source: dict[str, Any]
    ) -> dict[str, Any]:
        assert table.value_schema is not None
        return {
            "type": "struct",
            "fields": [
                {**table.value_schema, "field": "before"},
                {**table.value_schema, "field": "after"},
                self._source_schema(connector, source),
                _TRANSACTION_SCHEMA,
                {"type": "string", "optional": False, "field": "op"},
                {"type": "int64", "optional": True, "field": "ts_ms"},
                {"type": "int64", "optional": True, "field": "ts_us"},
                {"type": "int64", "optional": True, "field": "ts_ns"},
            ],
            "optional": False,
            "name": f"{table.topic}.Envelope",
            "version": 2,
        }

    def _source_schema(self, connector: str, source: dict[str, Any]) -> dict[str, Any]:
        found = self.source_schemas.get(connector)
        if found is not None:
            return found
        known = _SOURCE_SCHEMAS.get(connector)
        if known is None:
            known = [
                (name, "int64" if isinstance(v, int) else "string", name not in _REQUIRED)
                for name, v in source.items()
            ]
        fields = []
        for name, kind, optional in known:
            if kind == "enum":
                fields.append({**_SNAPSHOT_ENUM, "field": name})
            else:
                fields.append({"type": kind, "optional": optional, "field": name})
        found = self.source_schemas[connector] = {
            "type": "struct",
            "fields": fields,
            "optional": False,
            "name": _SOURCE_NAMES.get(connector, f"io.debezium.connector.{connector}.Source"),
            "version": 1,
            "field": "source",
        }
        return found
