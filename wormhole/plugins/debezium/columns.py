"""Column types (PostgreSQL's and MySQL's names) to Kafka Connect schemas and value
conversions, under the modes of :class:`DebeziumFields`."""

from __future__ import annotations

import base64
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

from wormhole.plugins.debezium.options import DebeziumFields
from wormhole.plugins.debezium.values import (
    _array_items,
    _b64,
    _base,
    _bool_of,
    _bytea,
    _connect_time,
    _date_days,
    _float_of,
    _int_of,
    _interval_micros,
    _members,
    _money,
    _round_micros,
    _signed_time_micros,
    _text_of,
    _time_micros,
    _timestamp_micros,
    _unscaled,
    _unsigned64,
    _zoned_time,
    _zoned_timestamp,
)


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
