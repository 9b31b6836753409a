"""Column values of MariaDB / MySQL, per the envelope contract.

Integers (signed and unsigned), finite floats and text are JSON scalars. Every
other type travels as the server's own text representation, as ``SELECT`` shows
it with ``time_zone = '+00:00'``:

========================  ==========================================
DECIMAL                   ``"-12.50"`` (the column's scale)
DATETIME(n), TIMESTAMP(n) ``"2024-01-02 03:04:05.123456"`` (n digits; TIMESTAMP in UTC)
DATE                      ``"2024-02-29"``; zero dates as ``"0000-00-00"``
TIME(n)                   ``"-838:59:58.50"``
YEAR                      ``"2024"``
BIT(n)                    ``"0000000101"`` (n binary digits)
SET                       ``"x,z"`` (definition order; empty set ``""``)
ENUM                      the member, ``"b"``
BINARY/VARBINARY/BLOB     ``"\\x00ff10"`` (hex, as PostgreSQL shows bytea)
JSON                      the document's text
FLOAT                     the shortest decimal that is the same single-precision value
========================  ==========================================

A converter is built once per table layout from ``information_schema`` for the
values the snapshot's and backfills' SELECT gives; the stream decodes the binlog's
row images itself to the same output (:mod:`wormhole.connectors.mysql.rowimage`).
"""

from __future__ import annotations

import datetime
import decimal
import json
import struct
from collections.abc import Callable
from typing import Any

Converter = Callable[[Any], Any]


def float32(value: Any) -> Any:
    """A float read from a FLOAT column: the shortest decimal with the same single-precision
    value."""
    if not isinstance(value, float):
        return value
    packed = struct.pack("<f", value)
    for digits in range(6, 10):
        text = f"{value:.{digits}g}"
        if struct.pack("<f", float(text)) == packed:
            return float(text)
    return value


def _decimal(value: Any) -> Any:
    if isinstance(value, decimal.Decimal):
        return format(value, "f")
    return value


def _fraction(micro: int, fsp: int) -> str:
    return "." + f"{micro:06d}"[:fsp] if fsp else ""


def _datetime(fsp: int) -> Converter:
    def convert(value: Any) -> Any:
        if isinstance(value, datetime.datetime):
            return (
                f"{value.year:04d}-{value.month:02d}-{value.day:02d} "
                f"{value.hour:02d}:{value.minute:02d}:{value.second:02d}"
                + _fraction(value.microsecond, fsp)
            )
        return value

    return convert


def _date(value: Any) -> Any:
    if isinstance(value, datetime.date):
        return f"{value.year:04d}-{value.month:02d}-{value.day:02d}"
    return value


def _time(fsp: int) -> Converter:
    def convert(value: Any) -> Any:
        if isinstance(value, datetime.timedelta):
            total = value.days * 86_400_000_000 + value.seconds * 1_000_000 + value.microseconds
            sign = "-" if total < 0 else ""
            total = abs(total)
            seconds, micro = divmod(total, 1_000_000)
            minutes, second = divmod(seconds, 60)
            hours, minute = divmod(minutes, 60)
            return f"{sign}{hours:02d}:{minute:02d}:{second:02d}" + _fraction(micro, fsp)
        return value

    return convert


def _year(value: Any) -> Any:
    return f"{value:04d}" if isinstance(value, int) else value


def _bit(bits: int) -> Converter:
    def convert(value: Any) -> Any:
        if isinstance(value, bytes):
            value = int.from_bytes(value, "big")
        if isinstance(value, int):
            return format(value, f"0{bits}b")
        return value

    return convert


def _set(members: list[str] | None) -> Converter:
    def convert(value: Any) -> Any:
        if isinstance(value, set):
            if members:
                return ",".join(m for m in members if m in value)
            return ",".join(sorted(value))
        return value

    return convert


def _binary(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return "\\x" + value.hex()
    if isinstance(value, str):  # the binlog reader hands over an empty value as ""
        return "\\x" + value.encode("utf-8", "surrogateescape").hex()
    return value


def json_value(value: Any) -> Any:
    """A JSON document as the binlog reader parsed it, with its byte strings as text."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, dict):
        return {json_value(k): json_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_value(v) for v in value]
    return value


def _json(value: Any) -> Any:
    if isinstance(value, (str, type(None))):
        return value
    return json.dumps(json_value(value), ensure_ascii=False)


class Layout:
    """How to turn one table's rows into envelope values.

    ``special`` lists (column, converter) for the columns that need one.
    """

    __slots__ = ("columns", "key", "special")

    def __init__(
        self,
        columns: list[str],
        key: list[str],
        special: list[tuple[str, Converter]],
    ) -> None:
        self.columns = columns
        self.key = key or list(columns)
        self.special = special

    def convert(self, row: dict[str, Any]) -> dict[str, Any]:
        for name, convert in self.special:
            value = row[name]
            if value is not None:
                row[name] = convert(value)
        return row


_BINARY_TYPES = frozenset(
    {
        "binary",
        "varbinary",
        "tinyblob",
        "blob",
        "mediumblob",
        "longblob",
        "geometry",
        "point",
        "linestring",
        "polygon",
        "multipoint",
        "multilinestring",
        "multipolygon",
        "geometrycollection",
    }
)


def schema_layout(rows: list[tuple[Any, ...]], key: list[str]) -> Layout:
    """A layout from ``information_schema.COLUMNS`` rows of
    (name, data_type, datetime_precision, numeric_precision)."""
    names: list[str] = []
    special: list[tuple[str, Converter]] = []
    for name, data_type, dt_precision, num_precision in rows:
        names.append(name)
        t = str(data_type).lower()
        fsp = int(dt_precision or 0)
        conv: Converter | None = None
        if t == "float":
            conv = float32
        elif t == "decimal":
            conv = _decimal
        elif t in ("datetime", "timestamp"):
            conv = _datetime(fsp)
        elif t == "date":
            conv = _date
        elif t == "time":
            conv = _time(fsp)
        elif t == "year":
            conv = _year
        elif t == "bit":
            conv = _bit(int(num_precision or 1))
        elif t == "set":
            conv = _set(None)
        elif t == "json":
            conv = _json
        elif t in _BINARY_TYPES:
            conv = _binary
        if conv is not None:
            special.append((name, conv))
    return Layout(names, key, special)
