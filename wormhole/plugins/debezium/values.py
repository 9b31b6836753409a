"""Value conversions: a database's text output (and JSON numbers and booleans) into the
values Debezium's default mappings write."""

from __future__ import annotations

import base64
import datetime as dt
import re
from decimal import MAX_EMAX, MAX_PREC, MIN_EMIN, Context, Decimal
from typing import Any

import msgspec

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
