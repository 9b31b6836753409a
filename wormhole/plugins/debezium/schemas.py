"""The schemas Debezium writes around the rows: ``source`` blocks by connector, the
transaction block and transaction events, and field schemas in JsonConverter's order."""

from __future__ import annotations

from typing import Any

import msgspec

_SOURCE_COMMON: list[tuple[str, str, bool]] = [
    ("version", "string", False),
    ("connector", "string", False),
    ("name", "string", False),
    ("ts_ms", "int64", False),
    ("snapshot", "enum", True),
    ("db", "string", False),
    ("sequence", "string", True),
    ("ts_us", "int64", True),
    ("ts_ns", "int64", True),
]
"""The fields every Debezium source block starts with, in its order."""
_SOURCE_SCHEMAS: dict[str, list[tuple[str, str, bool]]] = {
    # Debezium's source block schema per connector: (field, Connect type, optional).
    "postgresql": [
        *_SOURCE_COMMON,
        ("schema", "string", False),
        ("table", "string", False),
        ("txId", "int64", True),
        ("lsn", "int64", True),
        ("xmin", "int64", True),
        ("origin", "string", True),
        ("origin_lsn", "int64", True),
    ],
    "mysql": [
        *_SOURCE_COMMON,
        ("table", "string", True),
        ("server_id", "int64", False),
        ("gtid", "string", True),
        ("file", "string", False),
        ("pos", "int64", False),
        ("row", "int32", False),
        ("thread", "int64", True),
        ("query", "string", True),
    ],
}
_SOURCE_NAMES = {
    "postgresql": "io.debezium.connector.postgresql.Source",
    "mysql": "io.debezium.connector.mysql.Source",
}
_SNAPSHOT_ENUM = {
    "type": "string",
    "optional": True,
    "name": "io.debezium.data.Enum",
    "version": 1,
    "parameters": {
        "allowed": "true,first,first_in_data_collection,last_in_data_collection,last,false,"
        "incremental"
    },
    "default": "false",
}


_decode_details = msgspec.json.Decoder(dict[str, Any])
_encode = msgspec.json.Encoder().encode


_REQUIRED = frozenset({"version", "connector", "name", "ts_ms"})

_TRANSACTION_SCHEMA = {
    "type": "struct",
    "fields": [
        {"type": "string", "optional": False, "field": "id"},
        {"type": "int64", "optional": False, "field": "total_order"},
        {"type": "int64", "optional": False, "field": "data_collection_order"},
    ],
    "optional": True,
    "name": "event.block",
    "version": 1,
    "field": "transaction",
}


class _TransactionId(msgspec.Struct):
    id: str


_decode_transaction_id = msgspec.json.Decoder(_TransactionId)
_decode_marks_raw = msgspec.json.Decoder(tuple[msgspec.Raw, msgspec.Raw, msgspec.Raw])


def _decode_marks(raw: msgspec.Raw) -> tuple[bytes, bytes, bytes]:
    """:attr:`Update.transaction` as (block, begin, end), each raw JSON."""
    block, begin, end = _decode_marks_raw.decode(raw)
    return bytes(block), bytes(begin), bytes(end)


_TRANSACTION_KEY_SCHEMA = _encode(
    {
        "type": "struct",
        "fields": [{"type": "string", "optional": False, "field": "id"}],
        "optional": False,
        "name": "io.debezium.connector.common.TransactionMetadataKey",
        "version": 1,
    }
)
_TRANSACTION_VALUE_SCHEMA = _encode(
    {
        "type": "struct",
        "fields": [
            {"type": "string", "optional": False, "field": "status"},
            {"type": "string", "optional": False, "field": "id"},
            {"type": "int64", "optional": True, "field": "event_count"},
            {
                "type": "array",
                "items": {
                    "type": "struct",
                    "fields": [
                        {"type": "string", "optional": False, "field": "data_collection"},
                        {"type": "int64", "optional": False, "field": "event_count"},
                    ],
                    "optional": True,
                    "name": "event.collection",
                    "version": 1,
                },
                "optional": True,
                "field": "data_collections",
            },
            {"type": "int64", "optional": False, "field": "ts_ms"},
        ],
        "optional": False,
        "name": "io.debezium.connector.common.TransactionMetadataValue",
        "version": 1,
    }
)

_FIELD_ORDER = (
    "type",
    "items",
    "fields",
    "optional",
    "name",
    "version",
    "doc",
    "parameters",
    "default",
)


def _ordered(field: dict[str, Any]) -> dict[str, Any]:
    """A field schema with its keys in JsonConverter's order (``field`` last)."""
    out = {k: field[k] for k in _FIELD_ORDER if k in field}
    out.update({k: v for k, v in field.items() if k not in out and k != "field"})
    out["field"] = field["field"]
    return out
