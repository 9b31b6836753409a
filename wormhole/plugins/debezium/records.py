"""Messages as lines, and change events read back into updates."""

from __future__ import annotations

import msgspec

from wormhole.core.update import Update
from wormhole.plugins.debezium.options import Message
from wormhole.plugins.debezium.schemas import _encode

_decode_any = msgspec.json.Decoder()


def decode_message(key: bytes | None, value: bytes, shard: int = 0) -> Update:
    """A Debezium change event (with or without schemas) back into an update: what a
    subscriber of a topic in Debezium's format hands its sink. Values stay as Debezium
    typed them; ``position`` is the LSN (where the source block has one)."""
    record = _decode_any.decode(value)
    payload = record["payload"] if "schema" in record and "payload" in record else record
    key_row = _decode_any.decode(key) if key else {}
    if isinstance(key_row, dict) and "schema" in key_row and "payload" in key_row:
        key_row = key_row["payload"]
    source = payload.get("source") or {}
    namespace = source.get("schema") or source.get("db")
    table = f"{namespace}.{source.get('table')}" if namespace else str(source.get("table", ""))
    lsn = source.get("lsn")
    return Update.create(
        op=payload["op"],
        key=key_row or {},
        table=table,
        before=payload.get("before"),
        after=payload.get("after"),
        connector=str(source.get("connector", "")),
        position="" if lsn is None else str(lsn),
        txid=source.get("txId"),
        ts_ms=source.get("ts_ms"),
        shard=shard,
    )


def encode_lines(messages: list[Message], values_only: bool) -> bytes:
    """Messages as JSON lines: each value (tombstones left out), or with ``values_only``
    false each record as ``{"topic": ..., "key": ..., "value": ...}``."""
    if values_only:
        lines = [m.value for m in messages if m.value is not None]
    else:
        lines = [
            b'{"topic":%s,"key":%s,"value":%s}'
            % (_encode(m.topic), m.key or b"null", m.value or b"null")
            for m in messages
        ]
    return b"\n".join(lines) + b"\n" if lines else b""
