"""Decoding of PostgreSQL's pgoutput logical replication messages (protocol version 1).

Message layouts follow the PostgreSQL documentation, "Logical Replication Message
Formats". Column values arrive in PostgreSQL's text output format; this module
turns them into the envelope's JSON values: integers, booleans and finite floats
become JSON numbers and booleans, text types stay strings, and every other type
keeps PostgreSQL's own text representation as a string. SQL NULL is ``None``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

# Epoch of PostgreSQL timestamps (2000-01-01) in Unix milliseconds.
PG_EPOCH_MS = 946_684_800_000

INT_TYPES = frozenset({20, 21, 23, 26, 28, 29, 5069})  # int8 int2 int4 oid xid cid xid8
BOOL_TYPE = 16
FLOAT_TYPES = frozenset({700, 701})  # float4 float8
TEXT_TYPES = frozenset({25, 1043, 1042, 19, 18})  # text varchar bpchar name char

UNCHANGED_TOAST = "__unchanged_toast__"
"""The value of a TOASTed column an update left unchanged, when no image of it is known.

PostgreSQL does not send such values (pgoutput marks them 'u'); Wormhole never
invents one. A sink that merges rows should keep the column's current value.
"""

_U8 = struct.Struct("!B")
_U16 = struct.Struct("!H")
_I32 = struct.Struct("!i")
_U32 = struct.Struct("!I")
_U64 = struct.Struct("!Q")
_I64 = struct.Struct("!q")
_BEGIN = struct.Struct("!QqI")
_COMMIT = struct.Struct("!BQQq")
_RELATION_COLUMN = struct.Struct("!Ii")


def lsn_text(lsn: int) -> str:
    """An LSN as PostgreSQL writes it: ``16B3748`` -> ``0/16B3748``."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


def pg_time_ms(microseconds: int) -> int:
    return PG_EPOCH_MS + microseconds // 1000


@dataclass
class Column:
    name: str
    type_oid: int
    key: bool
    """Part of the replica identity (flag bit 1 of the Relation message)."""
    kind: int = 0  # 0 text, 1 int, 2 bool, 3 float
    typmod: int = -1


@dataclass
class Relation:
    oid: int
    schema: str
    name: str
    replica_identity: str  # d default, n nothing, f full, i index
    columns: list[Column]
    key_columns: list[str] = field(default_factory=list)
    table: str = ""
    fields: list[tuple[str, int]] = field(default_factory=list)
    """(name, kind) of each column, for the tuple parser; see :meth:`refresh`."""

    def __post_init__(self) -> None:
        self.table = f"{self.schema}.{self.name}"
        self.refresh()

    def refresh(self) -> None:
        """Recompute ``fields`` after the columns' kinds changed."""
        self.fields = [(c.name, c.kind) for c in self.columns]


def value_kind(type_oid: int) -> int:
    if type_oid in INT_TYPES:
        return 1
    if type_oid == BOOL_TYPE:
        return 2
    if type_oid in FLOAT_TYPES:
        return 3
    return 0


def convert(kind: int, text: str) -> Any:
    """A column's text output as its envelope value."""
    if kind == 1:
        return int(text)
    if kind == 2:
        return text == "t"
    if kind == 3:
        number = float(text)
        return number if math.isfinite(number) else text
    return text


def _cstring(data: bytes, offset: int) -> tuple[str, int]:
    end = data.index(b"\0", offset)
    return data[offset:end].decode(), end + 1


def parse_relation(data: bytes) -> Relation:
    """An 'R' message (data[0] == ord('R'))."""
    (oid,) = _U32.unpack_from(data, 1)
    schema, offset = _cstring(data, 5)
    name, offset = _cstring(data, offset)
    identity = chr(data[offset])
    (ncols,) = _U16.unpack_from(data, offset + 1)
    offset += 3
    columns = []
    for _ in range(ncols):
        flags = data[offset]
        column_name, offset = _cstring(data, offset + 1)
        type_oid, typmod = _RELATION_COLUMN.unpack_from(data, offset)
        offset += 8
        columns.append(Column(column_name, type_oid, bool(flags & 1), value_kind(type_oid), typmod))
    return Relation(oid, schema or "public", name, identity, columns)


def parse_begin(data: bytes) -> tuple[int, int, int]:
    """(final LSN, commit time in Unix ms, xid) of a 'B' message."""
    final_lsn, commit_us, xid = _BEGIN.unpack_from(data, 1)
    return final_lsn, pg_time_ms(commit_us), xid


def parse_begin_us(data: bytes) -> int:
    """The commit time of a 'B' message in Unix microseconds."""
    commit_us: int = _BEGIN.unpack_from(data, 1)[1]
    return PG_EPOCH_MS * 1000 + commit_us


def parse_commit(data: bytes) -> tuple[int, int, int]:
    """(commit LSN, end LSN, commit time in Unix ms) of a 'C' message."""
    _flags, commit_lsn, end_lsn, commit_us = _COMMIT.unpack_from(data, 1)
    return commit_lsn, end_lsn, pg_time_ms(commit_us)


def parse_origin(data: bytes) -> tuple[int, str]:
    """(commit LSN on the origin server, origin name) of an 'O' message."""
    (origin_lsn,) = _U64.unpack_from(data, 1)
    name, _ = _cstring(data, 9)
    return origin_lsn, name


def parse_message(data: bytes) -> tuple[bool, str, bytes]:
    """(transactional, prefix, content) of an 'M' message (protocol version 1)."""
    transactional = bool(data[1] & 1)
    prefix, offset = _cstring(data, 10)
    (length,) = _U32.unpack_from(data, offset)
    return transactional, prefix, data[offset + 4 : offset + 4 + length]


def parse_type(data: bytes) -> tuple[int, str, str]:
    """(type oid, schema, name) of a 'Y' message."""
    (oid,) = _U32.unpack_from(data, 1)
    schema, offset = _cstring(data, 5)
    name, _ = _cstring(data, offset)
    return oid, schema, name


def parse_truncate(data: bytes) -> list[int]:
    """Relation oids of a 'T' message."""
    (count,) = _U32.unpack_from(data, 1)
    return [_U32.unpack_from(data, 6 + 4 * i)[0] for i in range(count)]


def undecoded(raw: bytes) -> dict[str, str]:
    """The rendering of a text value that is not UTF-8 (a ``SQL_ASCII`` database holds any
    bytes): its bytes as lowercase hex, lossless."""
    return {"undecoded": raw.hex()}


def parse_tuple(
    data: bytes,
    offset: int,
    fields: list[tuple[str, int]],
    bad: list[tuple[str, bytes]] | None = None,
) -> tuple[dict[str, Any], list[str], int]:
    """A TupleData: (row, names of unchanged TOASTed columns, next offset).

    ``fields`` is the relation's (name, kind) list. Integers and floats are
    converted straight from the bytes (``int(b"42")``), without a decode. A text
    value that is not UTF-8 becomes :func:`undecoded` and ``(column, bytes)`` is added
    to ``bad``; without ``bad`` it raises ``UnicodeDecodeError``.
    """
    ncols = (data[offset] << 8) | data[offset + 1]
    offset += 2
    row: dict[str, Any] = {}
    unchanged: list[str] = _NONE_UNCHANGED
    u32 = _U32.unpack_from
    isfinite = math.isfinite
    for name, kind in fields[:ncols]:
        marker = data[offset]
        if marker == 116:  # 't' text
            start = offset + 5
            offset = start + u32(data, offset + 1)[0]
            if kind == 0:
                try:
                    row[name] = data[start:offset].decode()
                except UnicodeDecodeError:
                    if bad is None:
                        raise
                    bad.append((name, data[start:offset]))
                    row[name] = undecoded(data[start:offset])
            elif kind == 1:
                row[name] = int(data[start:offset])
            elif kind == 3:
                number = float(data[start:offset])
                row[name] = number if isfinite(number) else data[start:offset].decode()
            else:
                row[name] = data[start] == 116  # bool: 't' / 'f'
        elif marker == 110:  # 'n' null
            offset += 1
            row[name] = None
        elif marker == 117:  # 'u' unchanged TOAST
            offset += 1
            row[name] = UNCHANGED_TOAST
            if unchanged is _NONE_UNCHANGED:
                unchanged = []
            unchanged.append(name)
        elif marker == 98:  # 'b' binary (not requested)
            offset += 5 + u32(data, offset + 1)[0]
            row[name] = None
        else:
            raise ValueError(f"unknown tuple column marker {marker!r}")
    return row, unchanged, offset


_NONE_UNCHANGED: list[str] = []


def parse_change(
    data: bytes, relations: dict[int, Relation], bad: list[tuple[str, bytes]] | None = None
) -> tuple[str, Relation, dict[str, Any] | None, dict[str, Any] | None, list[str], bool]:
    """An 'I', 'U' or 'D' message: (op, relation, before, after, unchanged, full_before).

    ``full_before`` tells whether ``before`` is the whole old row ('O') rather
    than only its key columns ('K'). ``bad``: see :func:`parse_tuple`.
    """
    tag = data[0]
    (oid,) = _U32.unpack_from(data, 1)
    relation = relations[oid]
    columns = relation.fields
    offset = 5
    before = None
    after = None
    unchanged: list[str] = []
    full = False
    if tag == 73:  # 'I'
        after, unchanged, offset = parse_tuple(data, offset + 1, columns, bad)
        return "c", relation, None, after, unchanged, False
    if tag == 85:  # 'U'
        marker = data[offset]
        if marker in (75, 79):  # 'K' / 'O'
            full = marker == 79
            before, _, offset = parse_tuple(data, offset + 1, columns, bad)
            marker = data[offset]
        after, unchanged, offset = parse_tuple(data, offset + 1, columns, bad)
        return "u", relation, before, after, unchanged, full
    if tag == 68:  # 'D'
        marker = data[offset]
        full = marker == 79
        before, _, offset = parse_tuple(data, offset + 1, columns, bad)
        return "d", relation, before, None, [], full
    raise ValueError(f"not a change message: {chr(tag)!r}")


__all__ = [
    "UNCHANGED_TOAST",
    "Column",
    "Relation",
    "convert",
    "lsn_text",
    "parse_begin",
    "parse_begin_us",
    "parse_change",
    "parse_commit",
    "parse_lsn",
    "parse_origin",
    "parse_relation",
    "parse_truncate",
    "parse_type",
    "undecoded",
    "value_kind",
]
_ = (_I32, _I64, _U8)
