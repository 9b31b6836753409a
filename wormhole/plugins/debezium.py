"""Debezium's change-event format: what ``envelope: debezium`` writes.

A sink or transport that offers the format puts :class:`DebeziumFields` into its options
model and calls :meth:`DebeziumEncoder.messages` on each batch; it gets Kafka-style
messages (topic, key, value) whose key and value are what Debezium's JsonConverter
writes for the same change. A plugin sink asks for it the same way (see
``docs/debezium.md``).

The encoder is generic: it reads an update's :attr:`~wormhole.core.update.Update.columns`
(column types, in PostgreSQL's type vocabulary) to type the values, and its
:attr:`~wormhole.core.update.Update.details` (what the source knows of the change: LSN,
transaction id, snapshot flag...) for the ``source`` block. Values arrive as the
envelope has them (numbers, booleans, and every other type as the database's text
output) and leave as Debezium's default mappings make them.
"""

from __future__ import annotations

import base64
import datetime as dt
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import MAX_EMAX, MAX_PREC, MIN_EMIN, Context, Decimal, InvalidOperation
from typing import Any, Literal

import msgspec
from pydantic import Field, model_validator

from wormhole.core.update import NULL, TRUNCATE, ColumnType, Update, decode_columns
from wormhole.plugins.components import Options

VERSION = "3.6.3.Final"
"""The Debezium release whose format is written (``source.version``)."""

UNAVAILABLE = "__debezium_unavailable_value"
"""Debezium's placeholder for a TOASTed value an update left unchanged."""

_UNCHANGED_TOAST = "__unchanged_toast__"


class DebeziumFields(Options):
    """Options of a component that can write Debezium's format (mix into its options)."""

    def describes_updates(self) -> bool:
        return self.envelope == "debezium"

    def marks_transactions(self) -> bool:
        return self.envelope == "debezium" and self.transaction_metadata

    envelope: Literal["wormhole", "debezium"] = Field(
        "wormhole",
        description="wormhole: the update envelope; debezium: Debezium's change events "
        "(see docs/debezium.md)",
    )
    schemas: bool = Field(
        False,
        description="envelope debezium: each key and value as {schema, payload}, as "
        "JsonConverter's schemas.enable",
    )
    topic_prefix: str | None = Field(
        None,
        description="envelope debezium: Debezium's topic.prefix (the source's name and the "
        "first part of each topic <prefix>.<schema>.<table>); default: the pipeline's name",
    )
    tombstones: bool = Field(
        True,
        description="envelope debezium: a message with a null value after each delete, as "
        "Debezium's tombstones.on.delete",
    )
    decimal_handling_mode: Literal["precise", "double", "string"] = Field(
        "precise", description="envelope debezium: as Debezium's decimal.handling.mode"
    )
    time_precision_mode: Literal["adaptive", "adaptive_time_microseconds", "connect"] = Field(
        "adaptive", description="envelope debezium: as Debezium's time.precision.mode"
    )
    binary_handling_mode: Literal["bytes", "base64", "base64-url-safe", "hex"] = Field(
        "bytes", description="envelope debezium: as Debezium's binary.handling.mode"
    )
    transaction_metadata: bool = Field(
        False,
        description="envelope debezium: each event's transaction block and BEGIN/END events "
        "on <prefix>.transaction, as Debezium's provide.transaction.metadata (see "
        "docs/debezium.md: with several shards, BEGIN and END come from the flows of the "
        "transaction's first and last update)",
    )
    truncates: bool = Field(
        False,
        description="envelope debezium: write a truncate as an op t event (key null), as "
        "Debezium does when skipped.operations leaves t out; off: none, its default",
    )

    @model_validator(mode="after")
    def _transactions_need_debezium(self) -> DebeziumFields:
        if self.transaction_metadata and self.envelope != "debezium":
            raise ValueError(
                "transaction_metadata is Debezium's transaction block and BEGIN/END events: "
                "set envelope: debezium as well, or leave transaction_metadata out"
            )
        return self


@dataclass(frozen=True)
class Message:
    """One Debezium record: the key and value as JSON bytes (``None`` value: a tombstone)."""

    topic: str
    key: bytes | None
    value: bytes | None


# --------------------------------------------------------------------- types
_EPOCH_DATE = dt.date(1970, 1, 1)
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_PRECISION = re.compile(r"\((\d+)(?:,(-?\d+))?\)")
_DAYS_PER_MONTH = 365.25 / 12


def _base(type_name: str) -> tuple[str, int | None, int | None]:
    """``numeric(10,2)`` -> (``numeric``, 10, 2); ``timestamp(3) without time zone`` ->
    (``timestamp without time zone``, 3, None)."""
    match = _PRECISION.search(type_name)
    if match is None:
        return type_name, None, None
    base = (type_name[: match.start()] + type_name[match.end() :]).strip()
    scale = match.group(2)
    return base, int(match.group(1)), None if scale is None else int(scale)


# Decimal arithmetic without rounding: a numeric may have far more than 28 digits.
_EXACT = Context(prec=MAX_PREC, Emax=MAX_EMAX, Emin=MIN_EMIN)


def _unscaled(value: Decimal, scale: int) -> bytes:
    """Kafka Connect's Decimal: the unscaled value, big-endian two's complement, minimal.
    Exact at any number of digits (the default context would round to 28)."""
    number = int(value.scaleb(scale, _EXACT).to_integral_value(context=_EXACT))
    length = (number + (number < 0)).bit_length() // 8 + 1
    return number.to_bytes(length, "big", signed=True)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bytea(text: str) -> bytes:
    if text.startswith("\\x"):
        return bytes.fromhex(text[2:])
    # The escape format: octal escapes and doubled backslashes.
    out = bytearray()
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\" and text[i + 1 : i + 2] == "\\":
            out.append(92)
            i += 2
        elif c == "\\":
            out.append(int(text[i + 1 : i + 4], 8))
            i += 4
        else:
            out += c.encode()
            i += 1
    return bytes(out)


def _time_micros(text: str) -> int:
    hours, minutes, seconds = text.split(":")
    whole, _, fraction = seconds.partition(".")
    micros = int((fraction + "000000")[:6])
    return ((int(hours) * 60 + int(minutes)) * 60 + int(whole)) * 1_000_000 + micros


def _round_micros(micros: int, precision: int) -> int:
    unit: int = 10 ** (6 - precision)
    rounded: int = (micros + unit // 2) // unit * unit
    return rounded


def _timestamp_micros(text: str) -> int:
    """Microseconds since the epoch of a ``timestamp`` as if in UTC."""
    bc = text.endswith(" BC")
    if bc:
        text = text[:-3]
    day, _, clock = text.partition(" ")
    year, month, dom = (int(p) for p in day.split("-"))
    if bc:
        year = 1 - year
    return _civil_days(year, month, dom) * 86_400_000_000 + (_time_micros(clock) if clock else 0)


def _civil_days(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date, for any year."""
    year -= month <= 2
    era = year // 400
    year_of_era = year - era * 400
    day_of_year = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    day_of_era = year_of_era * 365 + year_of_era // 4 - year_of_era // 100 + day_of_year
    return era * 146097 + day_of_era - 719468


def _date_days(text: str) -> int:
    return _timestamp_micros(text) // 86_400_000_000


_OFFSET = re.compile(r"([+-])(\d\d)(?::?(\d\d))?(?::?(\d\d))?$")


def _split_offset(text: str) -> tuple[str, int]:
    """``... +02`` -> (text before, offset in seconds)."""
    match = _OFFSET.search(text)
    if match is None:
        return text, 0
    sign = -1 if match.group(1) == "-" else 1
    seconds = int(match.group(2)) * 3600 + int(match.group(3) or 0) * 60 + int(match.group(4) or 0)
    return text[: match.start()], sign * seconds


def _iso_fraction(micros: int, digits: int | None) -> str:
    if digits is None:
        digits = 6
    if digits == 0:
        return ""
    return "." + f"{micros:06d}"[:digits]


def _zoned_timestamp(text: str, precision: int | None) -> str:
    bc = text.endswith(" BC")
    if bc:
        text = text[:-3]
    local, offset = _split_offset(text)
    micros = _timestamp_micros(local + (" BC" if bc else "")) - offset * 1_000_000
    when = _EPOCH + dt.timedelta(microseconds=micros)
    return when.strftime("%Y-%m-%dT%H:%M:%S") + _iso_fraction(when.microsecond, precision) + "Z"


def _zoned_time(text: str) -> str:
    local, offset = _split_offset(text)
    micros = (_time_micros(local) - offset * 1_000_000) % 86_400_000_000
    seconds, fraction = divmod(micros, 1_000_000)
    clock = f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    # Java's ISO_OFFSET_TIME: as many fraction digits as the value needs.
    return clock + (f".{fraction:06d}".rstrip("0") if fraction else "") + "Z"


_INTERVAL_PART = re.compile(r"(-?\d+) (year|mon|day)s?")


def _interval_micros(text: str) -> int:
    months = days = 0
    clock = 0
    for part in _INTERVAL_PART.finditer(text):
        n, unit = int(part.group(1)), part.group(2)
        if unit == "year":
            months += 12 * n
        elif unit == "mon":
            months += n
        else:
            days += n
    tail = text.rsplit(" ", 1)[-1]
    if ":" in tail:
        negative = tail.startswith("-")
        clock = _time_micros(tail.lstrip("+-"))
        clock = -clock if negative else clock
    return round((months * _DAYS_PER_MONTH + days) * 86_400_000_000) + clock


def _money(text: str) -> Decimal:
    negative = text.startswith("-") or text.startswith("(")
    digits = re.sub(r"[^0-9.]", "", text)
    value = Decimal(digits)
    return -value if negative else value


def _array_items(text: str) -> list[str | None]:
    """The elements of a one-dimensional PostgreSQL array literal ``{a,"b c",NULL}``."""
    if text.startswith("["):  # explicit bounds: [2:3]={...}
        text = text[text.index("=") + 1 :]
    body = text[1:-1]
    items: list[str | None] = []
    i = 0
    while i < len(body):
        if body[i] == '"':
            out = []
            i += 1
            while body[i] != '"':
                if body[i] == "\\":
                    i += 1
                out.append(body[i])
                i += 1
            items.append("".join(out))
            i += 2  # the quote and the comma
        else:
            end = body.find(",", i)
            end = len(body) if end < 0 else end
            item = body[i:end]
            items.append(None if item == "NULL" else item)
            i = end + 1
    return items


class _Converter:
    """A column's Connect schema and its value conversion, from its type name."""

    __slots__ = ("convert", "schema", "zero")

    def __init__(self, schema: dict[str, Any], convert: Any = None, zero: Any = None) -> None:
        self.schema = schema
        self.convert = convert
        self.zero = zero
        """A date type's value at the epoch: what a NOT NULL column's date with a zero part
        becomes (see :meth:`for_column`); None for other types."""

    def for_column(self, optional: bool) -> _Converter:
        """This converter for one column. MariaDB and MySQL store dates with a zero year,
        month or day (``0000-00-00``, ``2024-00-15``; a ``sql_mode`` without
        ``NO_ZERO_DATE``), which no calendar has: Debezium's MySQL connector writes null
        for them in a nullable column and the epoch in a NOT NULL one. PostgreSQL never
        writes such a date."""
        if self.zero is None:
            return self
        inner, value = self.convert, None if optional else self.zero

        def convert(v: Any) -> Any:
            if isinstance(v, str) and (v[:4] == "0000" or v[5:7] == "00" or v[8:10] == "00"):
                return value
            return inner(v)

        return _Converter(self.schema, convert)


def _named(connect: str, name: str, **extra: Any) -> dict[str, Any]:
    return {"type": connect, "name": name, "version": 1, **extra}


class DebeziumTypes:
    """Maps column types (PostgreSQL's names) to Debezium's schemas and values under the
    modes of :class:`DebeziumFields`."""

    def __init__(self, options: DebeziumFields) -> None:
        self.options = options
        self.cache: dict[str, _Converter] = {}

    def converter(self, type_name: str) -> _Converter:
        found = self.cache.get(type_name)
        if found is None:
            found = self.cache[type_name] = self._make(type_name)
        return found

    def _decimal(self, scale: int | None, precision: int | None) -> _Converter:
        mode = self.options.decimal_handling_mode
        if mode == "double":

            def to_double(v: Any) -> Any:
                number = float(v)
                # JsonConverter writes a NaN double as the string "NaN".
                return number if number == number else "NaN"

            return _Converter({"type": "double"}, to_double)
        if mode == "string":
            # Debezium writes a NaN numeric as "NAN" in this mode.
            return _Converter({"type": "string"}, lambda v: "NAN" if v == "NaN" else str(v))
        if scale is None:

            def variable(v: Any) -> Any:
                try:
                    value = Decimal(str(v))
                except InvalidOperation:
                    return None
                if not value.is_finite():
                    return None
                exponent = value.as_tuple().exponent
                digits = max(0, -exponent) if isinstance(exponent, int) else 0
                return {"scale": digits, "value": _b64(_unscaled(value, digits))}

            schema = {
                "type": "struct",
                "fields": [
                    {"type": "int32", "optional": False, "field": "scale"},
                    {"type": "bytes", "optional": False, "field": "value"},
                ],
                "name": "io.debezium.data.VariableScaleDecimal",
                "version": 1,
                "doc": "Variable scaled decimal",
            }
            return _Converter(schema, variable)

        def fixed(v: Any) -> Any:
            try:
                value = Decimal(str(v))
            except InvalidOperation:
                return None
            if not value.is_finite():
                return None
            return _b64(_unscaled(value, scale))

        parameters = {"scale": str(scale)}
        if precision is not None:
            parameters["connect.decimal.precision"] = str(precision)
        return _Converter(
            _named("bytes", "org.apache.kafka.connect.data.Decimal", parameters=parameters), fixed
        )

    def _binary(self) -> _Converter:
        mode = self.options.binary_handling_mode
        if mode == "hex":
            return _Converter({"type": "string"}, lambda v: _bytea(v).hex())
        if mode == "base64-url-safe":
            return _Converter(
                {"type": "string"}, lambda v: base64.urlsafe_b64encode(_bytea(v)).decode()
            )
        kind = "bytes" if mode == "bytes" else "string"
        return _Converter({"type": kind}, lambda v: _b64(_bytea(v)))

    def _make(self, type_name: str) -> _Converter:
        if type_name.endswith("[]"):
            return self._array(type_name[:-2])
        mysql = self._mysql(type_name)
        if mysql is not None:
            return mysql
        base, precision, scale = _base(type_name)
        plain = _PLAIN_TYPES.get(base)
        if plain is not None:
            connect, name, convert = plain
            return _Converter({"type": connect} if name is None else _named(connect, name), convert)
        build = _BUILT_TYPES.get(base)
        if build is not None:
            return build(self, precision, scale)
        return _Converter({"type": "string"}, _text_of)

    def _array(self, element_type: str) -> _Converter:
        element = self.converter(element_type)
        convert = element.convert

        def array(v: Any) -> Any:
            items = _array_items(v)
            if convert is None:
                return items
            return [None if item is None else convert(item) for item in items]

        return _Converter({"type": "array", "items": {**element.schema, "optional": True}}, array)

    # PostgreSQL types whose schema or value depends on the options or the type's precision
    # (see _BUILT_TYPES).
    def _numeric(self, precision: int | None, scale: int | None) -> _Converter:
        if precision is not None and scale is None:
            scale = 0
        return self._decimal(scale, precision)

    def _money(self, precision: int | None, scale: int | None) -> _Converter:
        converter = self._decimal(2, None)
        inner = converter.convert
        return _Converter(converter.schema, lambda v: inner(_money(v)))

    def _bytea(self, precision: int | None, scale: int | None) -> _Converter:
        return self._binary()

    def _date(self, precision: int | None, scale: int | None) -> _Converter:
        if self.options.time_precision_mode == "connect":
            return _Converter(_named("int32", "org.apache.kafka.connect.data.Date"), _date_days, 0)
        return _Converter(_named("int32", "io.debezium.time.Date"), _date_days, 0)

    def _time(self, precision: int | None, scale: int | None) -> _Converter:
        digits = 6 if precision is None else precision
        if self.options.time_precision_mode == "connect":
            return _Converter(
                _named("int32", "org.apache.kafka.connect.data.Time"),
                lambda v: _round_micros(_time_micros(v), min(digits, 3)) // 1000,
            )
        if digits <= 3 and self.options.time_precision_mode == "adaptive":
            return _Converter(
                _named("int32", "io.debezium.time.Time"),
                lambda v: _round_micros(_time_micros(v), digits) // 1000,
            )
        return _Converter(_named("int64", "io.debezium.time.MicroTime"), _time_micros)

    def _timestamp(self, precision: int | None, scale: int | None) -> _Converter:
        digits = 6 if precision is None else precision
        if self.options.time_precision_mode == "connect":
            return _Converter(
                _named("int64", "org.apache.kafka.connect.data.Timestamp"),
                lambda v: _timestamp_micros(v) // 1000,
            )
        if digits <= 3:
            return _Converter(
                _named("int64", "io.debezium.time.Timestamp"),
                lambda v: _timestamp_micros(v) // 1000,
            )
        return _Converter(_named("int64", "io.debezium.time.MicroTimestamp"), _timestamp_micros)

    def _timestamptz(self, precision: int | None, scale: int | None) -> _Converter:
        return _Converter(
            _named("string", "io.debezium.time.ZonedTimestamp"),
            lambda v: _zoned_timestamp(v, precision),
        )

    def _mysql(self, type_name: str) -> _Converter | None:
        """MariaDB / MySQL column types (``COLUMN_TYPE`` in lower case, integer display
        widths left out, temporal types with their precision), as Debezium's MySQL
        connector maps them; None for a type name of another vocabulary."""
        name = type_name
        unsigned = name.endswith(" unsigned")
        if unsigned:
            name = name[: -len(" unsigned")]
        base, paren, rest = name.partition("(")
        if paren and not rest.endswith(")"):
            return None  # timestamp(3) without time zone: PostgreSQL's
        kind = _MYSQL_INTS.get(base)
        if kind is not None:
            if base == "bigint" and unsigned:
                return _Converter({"type": "int64"}, _unsigned64)
            return _Converter({"type": kind[1] if unsigned else kind[0]}, _int_of)
        if base not in _MYSQL_TYPES:
            return None
        inside = rest[:-1]
        connect_mode = self.options.time_precision_mode == "connect"
        if base == "decimal":
            digits, _, decimals = inside.partition(",")
            return self._decimal(int(decimals or 0), int(digits) if digits else None)
        if base in ("float", "double"):
            return _Converter({"type": "float" if base == "float" else "double"}, _float_of)
        if base == "bit":
            bits = int(inside or 1)
            if bits == 1:
                return _Converter({"type": "boolean"}, lambda v: v in ("1", 1, True))
            size = (bits + 7) // 8
            return _Converter(
                _named("bytes", "io.debezium.data.Bits", parameters={"length": str(bits)}),
                lambda v: _b64(int(v, 2).to_bytes(size, "little")),
            )
        if base in ("enum", "set"):
            allowed = ",".join(_members(inside))
            name = "io.debezium.data.Enum" if base == "enum" else "io.debezium.data.EnumSet"
            return _Converter(_named("string", name, parameters={"allowed": allowed}))
        if base == "year":
            return _Converter(_named("int32", "io.debezium.time.Year"), int)
        if base == "time":
            if connect_mode:
                return _Converter(
                    _named("int32", "org.apache.kafka.connect.data.Time"), _connect_time
                )
            return _Converter(_named("int64", "io.debezium.time.MicroTime"), _signed_time_micros)
        if base == "datetime":
            if connect_mode:
                return _Converter(
                    _named("int64", "org.apache.kafka.connect.data.Timestamp"),
                    lambda v: _timestamp_micros(v) // 1000,
                    0,
                )
            if int(inside or 0) <= 3:
                return _Converter(
                    _named("int64", "io.debezium.time.Timestamp"),
                    lambda v: _timestamp_micros(v) // 1000,
                    0,
                )
            return _Converter(
                _named("int64", "io.debezium.time.MicroTimestamp"), _timestamp_micros, 0
            )
        if base == "timestamp":
            fraction = int(inside or 0)
            return _Converter(
                _named("string", "io.debezium.time.ZonedTimestamp"),
                lambda v: _zoned_timestamp(v, fraction),
                "1970-01-01T00:00:00Z",
            )
        if base in _MYSQL_BINARY:
            return self._binary()
        return _Converter({"type": "string"})


_MYSQL_INTS = {
    # type: (signed, unsigned) Connect type, as Debezium's MySQL connector maps them
    "tinyint": ("int16", "int16"),
    "smallint": ("int16", "int32"),
    "mediumint": ("int32", "int32"),
    "int": ("int32", "int64"),
    "bigint": ("int64", "int64"),
}
_MYSQL_BINARY = frozenset({"binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob"})
_MYSQL_TYPES = frozenset(
    {
        "decimal",
        "float",
        "double",
        "bit",
        "enum",
        "set",
        "year",
        "time",
        "datetime",
        "timestamp",
        "char",
        "varchar",
        "tinytext",
        "mediumtext",
        "longtext",
        *_MYSQL_BINARY,
    }
)
"""MySQL type names that PostgreSQL's vocabulary does not have (``date``, ``text`` and
``json`` map alike in both)."""


def _members(inside: str) -> list[str]:
    """The members of ``'a','b'`` (an ENUM or SET definition)."""
    return [m.replace("''", "'") for m in re.findall(r"'((?:[^']|'')*)'", inside)]


def _unsigned64(v: Any) -> Any:
    """BIGINT UNSIGNED as Debezium's default ``bigint.unsigned.handling.mode=long``: the
    same 64 bits as a signed long (values above 2^63-1 wrap to negative)."""
    number = v if isinstance(v, int) else int(v)
    return number - (1 << 64) if number >= 1 << 63 else number


def _signed_time_micros(text: str) -> int:
    """MySQL's TIME (``-838:59:58.5``) in microseconds, negative ones included."""
    negative = text.startswith("-")
    micros = _time_micros(text.lstrip("-"))
    return -micros if negative else micros


def _connect_time(text: str) -> int | None:
    """MySQL's TIME as Kafka Connect's Time (milliseconds of a day): null for a value
    outside a day (negative, or 24:00:00 and above), as Debezium writes it."""
    micros = _signed_time_micros(text)
    return micros // 1000 if 0 <= micros < 86_400_000_000 else None


def _int_of(v: Any) -> Any:
    return v if isinstance(v, int) else int(v)


def _bool_of(v: Any) -> Any:
    return v if isinstance(v, bool) else v in ("t", "true", True)


def _float_of(v: Any) -> Any:
    if isinstance(v, float | int):
        return v
    return v  # NaN / Infinity stay the strings JsonConverter writes for them


def _text_of(v: Any) -> Any:
    return v if isinstance(v, str) else msgspec.json.encode(v).decode()


_UNCHANGED_MARK = b'"__unchanged_toast__"'

_TEXT_TYPES = frozenset({"text", "character varying", "character", "name", '"char"', "citext"})

# PostgreSQL types whose schema and value depend on no option: (Connect type, schema name or
# None, conversion or None for the value as it is).
_PLAIN_TYPES: dict[str, tuple[str, str | None, Callable[[Any], Any] | None]] = {
    "smallint": ("int16", None, _int_of),
    "integer": ("int32", None, _int_of),
    "bigint": ("int64", None, _int_of),
    "oid": ("int64", None, _int_of),
    "boolean": ("boolean", None, _bool_of),
    "real": ("float", None, _float_of),
    "double precision": ("double", None, _float_of),
    "time with time zone": ("string", "io.debezium.time.ZonedTime", _zoned_time),
    "interval": ("int64", "io.debezium.time.MicroDuration", _interval_micros),
    **{text: ("string", None, None) for text in _TEXT_TYPES},
    "uuid": ("string", "io.debezium.data.Uuid", None),
    "json": ("string", "io.debezium.data.Json", None),
    "jsonb": ("string", "io.debezium.data.Json", None),
    "xml": ("string", "io.debezium.data.Xml", None),
}

# The others, built by DebeziumTypes from the options and the type's (precision, scale).
_BUILT_TYPES: dict[str, Callable[[DebeziumTypes, int | None, int | None], _Converter]] = {
    "numeric": DebeziumTypes._numeric,
    "money": DebeziumTypes._money,
    "bytea": DebeziumTypes._bytea,
    "date": DebeziumTypes._date,
    "time without time zone": DebeziumTypes._time,
    "timestamp without time zone": DebeziumTypes._timestamp,
    "timestamp with time zone": DebeziumTypes._timestamptz,
}


# ------------------------------------------------------------------- tables
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

_decode_details = msgspec.json.Decoder(dict[str, Any])
_encode = msgspec.json.Encoder().encode


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


__all__ = [
    "VERSION",
    "DebeziumEncoder",
    "DebeziumFields",
    "DebeziumTypes",
    "Message",
    "decode_message",
    "encode_lines",
]
