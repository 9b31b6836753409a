"""Row images of the binlog, decoded from their bytes as the server defines them.

python-mysql-replication frames the protocol and the events, and parses each
table map; the values of a rows event are decoded here, straight from the event's
bytes by the table map, into the envelope's values (see docs/mysql.md, *Type
mapping*):

- temporal values keep every part the server stored, zero or invalid ones included
  (``2024-00-15``, ``2001-02-29``, ``0000-00-00 00:00:00.5``), every fractional
  digit, the sign of a negative TIME with its fraction; TIMESTAMP 0 is the zero
  datetime, YEAR 0 is ``0000``;
- text is decoded by the character set of its column as the server defines it: each
  single-byte character set by the server's own table of it (read from the server
  with ``CONVERT``, so ``latin1``'s 0x81 is U+0081 as in MariaDB), the Unicode ones by
  their byte order (``ucs2``, ``utf16`` and ``utf32`` are big-endian, ``utf16le``
  little-endian), the East Asian ones by Python's codec of the same standard;
- a value that cannot be converted (bytes its character set does not map, an ENUM
  index beyond the members) raises :class:`Undecodable` with the bytes it holds; the
  source delivers it as ``{"undecoded": "<hex>"}`` or stops (``on_decode_error``).

A :class:`RowDecoder` is built once per table layout (the table map: types, their
metadata, character sets, ENUM/SET members, signedness, names).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from wormhole.connectors.mysql.charsets import Charsets, Text, members_text
from wormhole.connectors.mysql.values import float32, json_value

# FIELD_TYPE codes of the binlog (mysql/field_types.h)
_DECIMAL_OLD, _TINY, _SHORT, _LONG, _FLOAT, _DOUBLE = 0, 1, 2, 3, 4, 5
_TIMESTAMP, _LONGLONG, _INT24, _DATE, _TIME = 7, 8, 9, 10, 11
_DATETIME, _YEAR, _NEWDATE = 12, 13, 14
OLD_TEMPORALS = frozenset({_TIMESTAMP, _TIME, _DATETIME})
"""The temporal types of the pre-MariaDB-10.1 format, whose fractional variants have no
length in the table map."""
_VARCHAR, _BIT, _TIMESTAMP2, _DATETIME2, _TIME2 = 15, 16, 17, 18, 19
_JSON, _NEWDECIMAL, _ENUM, _SET = 245, 246, 247, 248
_BLOBS = frozenset({249, 250, 251, 252})
_VAR_STRING, _STRING, _GEOMETRY = 253, 254, 255

Reader = Callable[[bytes, int], tuple[Any, int]]
"""Reads one value at an offset of a row image: (value, offset after it)."""


class Undecodable(Exception):
    """A value whose bytes were read but cannot be converted; ``end`` is the offset after it."""

    def __init__(self, raw: bytes, reason: str, end: int) -> None:
        super().__init__(reason)
        self.raw = raw
        self.reason = reason
        self.end = end


class Unframed(Exception):
    """The row images do not match their table map: no value of the event can be read."""


def undecoded(raw: bytes) -> dict[str, str]:
    """The documented rendering of a value that cannot be decoded: its bytes, in hex."""
    return {"undecoded": raw.hex()}


# ------------------------------------------------------------------ readers
_INLINE: dict[Reader, struct.Struct] = {}
"""Readers of one fixed-size value that a layout's image function unpacks in line."""


def _fixed(fmt: str) -> Reader:
    layout = struct.Struct(fmt)
    unpack = layout.unpack_from
    size = layout.size

    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        return unpack(buf, pos)[0], pos + size

    _INLINE[read] = layout
    return read


def _int24(signed: bool) -> Reader:
    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        return int.from_bytes(buf[pos : pos + 3], "little", signed=signed), pos + 3

    return read


def _float() -> Reader:
    unpack = struct.Struct("<f").unpack_from

    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        return float32(unpack(buf, pos)[0]), pos + 4

    return read


_DIG2BYTES = (0, 1, 1, 2, 2, 3, 3, 4, 4, 4)


def _decimal(precision: int, scale: int) -> Reader:
    """DECIMAL(p,s) in the server's binary format (groups of 9 digits in 4 bytes).

    The value is read as one big-endian integer (sign bit flipped, every bit inverted when
    negative) and its digit groups taken apart by shifts, lowest first.
    """
    intg0, intg0x = divmod(precision - scale, 9)
    frac0, frac0x = divmod(scale, 9)
    lead = _DIG2BYTES[intg0x]
    tail = _DIG2BYTES[frac0x]
    size = lead + intg0 * 4 + frac0 * 4 + tail
    sign = 1 << (size * 8 - 1)
    ones = (1 << size * 8) - 1
    tail_bits, tail_mask = tail * 8, (1 << tail * 8) - 1
    simple = intg0 == 0 and frac0 == 0  # DECIMAL(p,s) with p-s < 9 and s < 9
    from_bytes = int.from_bytes

    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        end = pos + size
        v = from_bytes(buf[pos:end], "big")
        negative = not v & sign
        v = (v ^ ones if negative else v) & (sign - 1)
        if simple:
            text = f"{v >> tail_bits}.{v & tail_mask:0{frac0x}d}" if scale else str(v)
        else:
            parts = []
            if tail:
                parts.append(f"{v & tail_mask:0{frac0x}d}")
                v >>= tail_bits
            for _ in range(frac0):
                parts.append(f"{v & 0xFFFFFFFF:09d}")
                v >>= 32
            frac = "".join(reversed(parts))
            parts = []
            for _ in range(intg0):
                parts.append(f"{v & 0xFFFFFFFF:09d}")
                v >>= 32
            if lead:
                parts.append(str(v))
            whole = "".join(reversed(parts)).lstrip("0") or "0"
            text = whole + "." + frac if scale else whole
        if negative and text.strip("0.") != "":
            text = "-" + text
        return text, end

    return read


def _fraction(size: int, fsp: int, value: int) -> str:
    """The ``fsp`` digits of a fraction stored in ``size`` bytes (2 digits a byte)."""
    if not fsp:
        return ""
    micro = value * 10 ** (6 - 2 * size)
    return "." + f"{micro:06d}"[:fsp]


def _date() -> Reader:
    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        v = buf[pos] | buf[pos + 1] << 8 | buf[pos + 2] << 16
        return f"{v >> 9:04d}-{v >> 5 & 15:02d}-{v & 31:02d}", pos + 3

    return read


def _datetime2(fsp: int) -> Reader:
    size = (fsp + 1) // 2
    frac_bits, frac_mask = size * 8, (1 << size * 8) - 1
    scale = 10 ** (6 - 2 * size)
    from_bytes = int.from_bytes

    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        end = pos + 5 + size
        whole = from_bytes(buf[pos:end], "big")
        packed = (whole >> frac_bits) - 0x8000000000
        ymd, hms = packed >> 17, packed & 0x1FFFF
        year, month = divmod(ymd >> 5, 13)
        text = (
            f"{year:04d}-{month:02d}-{ymd & 31:02d} "
            f"{hms >> 12:02d}:{hms >> 6 & 63:02d}:{hms & 63:02d}"
        )
        if fsp:
            text += "." + f"{(whole & frac_mask) * scale:06d}"[:fsp]
        return text, end

    return read


def _utc(seconds: int) -> str:
    t = time.gmtime(seconds)
    return (
        f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d} "
        f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}"
    )


def _timestamp2(fsp: int) -> Reader:
    size = (fsp + 1) // 2
    zero = "0000-00-00 00:00:00" + ("." + "0" * fsp if fsp else "")

    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        seconds = int.from_bytes(buf[pos : pos + 4], "big")
        end = pos + 4 + size
        frac = int.from_bytes(buf[pos + 4 : end], "big") if size else 0
        if seconds == 0 and frac == 0:
            return zero, end
        return _utc(seconds) + _fraction(size, fsp, frac), end

    return read


def _time2(fsp: int) -> Reader:
    """TIME(fsp) as MySQL 5.6 / MariaDB store it (my_time_packed_from_binary)."""
    size = (fsp + 1) // 2

    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        end = pos + 3 + size
        if size == 3:
            packed = int.from_bytes(buf[pos:end], "big") - 0x800000000000
        else:
            intpart = int.from_bytes(buf[pos : pos + 3], "big") - 0x800000
            frac = int.from_bytes(buf[pos + 3 : end], "big") if size else 0
            if intpart < 0 and frac:
                intpart += 1
                frac -= 0x100 if size == 1 else 0x10000
            packed = (intpart << 24) + frac * (10_000 if size == 1 else 100)
        sign = "-" if packed < 0 else ""
        packed = abs(packed)
        hms, micro = packed >> 24, packed & 0xFFFFFF
        text = f"{sign}{hms >> 12 & 0x3FF:02d}:{hms >> 6 & 63:02d}:{hms & 63:02d}"
        if fsp:
            text += "." + f"{micro:06d}"[:fsp]
        return text, end

    return read


def _time_old() -> Reader:
    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        v = int.from_bytes(buf[pos : pos + 3], "little", signed=True)
        sign = "-" if v < 0 else ""
        hours, rest = divmod(abs(v), 10000)
        return f"{sign}{hours:02d}:{rest // 100:02d}:{rest % 100:02d}", pos + 3

    return read


def _datetime_old() -> Reader:
    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        v = int.from_bytes(buf[pos : pos + 8], "little")
        d, t = divmod(v, 1_000_000)
        return (
            f"{d // 10000:04d}-{d // 100 % 100:02d}-{d % 100:02d} "
            f"{t // 10000:02d}:{t // 100 % 100:02d}:{t % 100:02d}"
        ), pos + 8

    return read


def _timestamp_old() -> Reader:
    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        seconds = int.from_bytes(buf[pos : pos + 4], "little")
        return (_utc(seconds) if seconds else "0000-00-00 00:00:00"), pos + 4

    return read


def _year() -> Reader:
    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        v = buf[pos]
        return (f"{1900 + v:04d}" if v else "0000"), pos + 1

    return read


def _bit(bits: int, nbytes: int) -> Reader:
    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        end = pos + nbytes
        return format(int.from_bytes(buf[pos:end], "big"), f"0{bits}b"), end

    return read


def _enum(members: list[str], size: int) -> Reader:
    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        end = pos + size
        index = int.from_bytes(buf[pos:end], "little")
        if index == 0:
            return "", end  # the error value of an invalid ENUM insert
        if index > len(members):
            raise Undecodable(buf[pos:end], f"ENUM index {index} beyond its members", end)
        return members[index - 1], end

    return read


def _set(members: list[str], size: int) -> Reader:
    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        end = pos + size
        mask = int.from_bytes(buf[pos:end], "little")
        if mask >> len(members):
            raise Undecodable(buf[pos:end], f"SET bits {mask:b} beyond its members", end)
        return ",".join(m for i, m in enumerate(members) if mask >> i & 1), end

    return read


def _counted(length_size: int) -> Callable[[bytes, int], tuple[bytes, int]]:
    """Bytes after a little-endian length of ``length_size`` bytes."""
    if length_size == 1:

        def one(buf: bytes, pos: int) -> tuple[bytes, int]:
            end = pos + 1 + buf[pos]
            return buf[pos + 1 : end], end

        return one

    def read(buf: bytes, pos: int) -> tuple[bytes, int]:
        start = pos + length_size
        end = start + int.from_bytes(buf[pos:start], "little")
        return buf[start:end], end

    return read


def _text(length_size: int, charset: str, decode: Text | None, pad: int = 0) -> Reader:
    raw_of = _counted(length_size)
    if decode is None:  # the binary character set

        def binary(buf: bytes, pos: int) -> tuple[Any, int]:
            raw, end = raw_of(buf, pos)
            if pad:  # BINARY(n): the binlog drops the trailing zero bytes
                raw = raw.ljust(pad, b"\0")
            return "\\x" + raw.hex(), end

        return binary

    def text(buf: bytes, pos: int) -> tuple[Any, int]:
        raw, end = raw_of(buf, pos)
        try:
            return decode(raw), end
        except ValueError as exc:
            raise Undecodable(raw, f"not valid {charset} ({exc})", end) from None

    return text


def _json_binary(length_size: int) -> Reader:
    """MySQL's binary JSON (MariaDB stores JSON as text)."""
    import json

    from pymysqlreplication.json_binary import parse_json

    raw_of = _counted(length_size)

    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        raw, end = raw_of(buf, pos)
        if not raw:
            return "null", end
        try:
            document = parse_json(raw[0], raw[1:])
        except Exception as exc:
            raise Undecodable(raw, f"not valid binary JSON ({exc!r})", end) from None
        return json.dumps(json_value(document), ensure_ascii=False), end

    return read


# ------------------------------------------------------------------ layouts
def _reader(column: Any, collation: int | None, charsets: Charsets) -> Reader:
    t = column.type
    unsigned = bool(getattr(column, "unsigned", False))
    if t == _TINY:
        return _fixed("<B" if unsigned else "<b")
    if t == _SHORT:
        return _fixed("<H" if unsigned else "<h")
    if t == _INT24:
        return _int24(not unsigned)
    if t == _LONG:
        return _fixed("<I" if unsigned else "<i")
    if t == _LONGLONG:
        return _fixed("<Q" if unsigned else "<q")
    if t == _FLOAT:
        return _float()
    if t == _DOUBLE:
        return _fixed("<d")
    if t == _NEWDECIMAL:
        return _decimal(column.precision, column.decimals)
    if t in (_DATE, _NEWDATE):
        return _date()
    if t == _DATETIME2:
        return _datetime2(column.fsp)
    if t == _TIMESTAMP2:
        return _timestamp2(column.fsp)
    if t == _TIME2:
        return _time2(column.fsp)
    if t == _TIME:
        return _time_old()
    if t == _DATETIME:
        return _datetime_old()
    if t == _TIMESTAMP:
        return _timestamp_old()
    if t == _YEAR:
        return _year()
    if t == _BIT:
        return _bit(column.bits, column.bytes)
    if t == _ENUM:
        members = members_text(list(column.enum_values or [""])[1:], collation, charsets)
        return _enum(members, column.size)
    if t == _SET:
        return _set(members_text(list(column.set_values or []), collation, charsets), column.size)
    if t == _JSON:
        return _json_binary(column.length_size)
    if t == _GEOMETRY:
        return _text(column.length_size, "binary", None)
    charset, decode = charsets.text(collation)
    if t in (_VARCHAR, _VAR_STRING):
        return _text(2 if column.max_length > 255 else 1, charset, decode)
    if t == _STRING:
        pad = column.max_length if decode is None else 0
        return _text(2 if column.max_length > 255 else 1, charset, decode, pad)
    if t in _BLOBS:
        return _text(column.length_size, charset, decode)
    raise ValueError(f"column {column.name} has binlog type {t}, which the source cannot read")


def _is_character(column_type: int, mariadb: bool) -> bool:
    """The columns the table map's charset metadata lists, in order (as the library reads it)."""
    return column_type in (_STRING, _VAR_STRING, _VARCHAR, *_BLOBS) or (
        column_type == _GEOMETRY and mariadb
    )


def collations(columns: Sequence[Any], metadata: Any, mariadb: bool) -> list[int | None]:
    """Each column's collation id from the table map's optional metadata (None if absent)."""
    text_ids = list(getattr(metadata, "charset_collation_list", None) or [])
    set_ids = list(getattr(metadata, "enum_and_set_collation_list", None) or [])
    out: list[int | None] = []
    for column in columns:
        if _is_character(column.type, mariadb):
            out.append(int(text_ids.pop(0)) if text_ids else None)
        elif column.type in (_ENUM, _SET):
            out.append(int(set_ids.pop(0)) if set_ids else None)
        else:
            out.append(None)
    return out


def signature(columns: Sequence[Any], ids: Sequence[int | None]) -> tuple[Any, ...]:
    """Everything of a table map that decoding depends on: the cache key of its decoder."""
    return tuple(
        (
            c.name,
            c.type,
            getattr(c, "unsigned", False),
            getattr(c, "max_length", 0),
            getattr(c, "length_size", 0),
            getattr(c, "fsp", 0),
            getattr(c, "bits", 0),
            getattr(c, "size", 0),
            getattr(c, "precision", 0),
            getattr(c, "decimals", 0),
            tuple(c.enum_values or ()),
            tuple(c.set_values or ()),
            collation,
        )
        for c, collation in zip(columns, ids, strict=True)
    )


OnError = Callable[[str, bytes, str, int], Any]
"""(column, its bytes, why, row number in the event) -> the value to deliver (or raise)."""


class RowDecoder:
    """Decodes the row images of one table layout."""

    __slots__ = ("full", "key", "names", "readers")

    def __init__(
        self,
        columns: Sequence[Any],
        ids: Sequence[int | None],
        charsets: Charsets,
        key: list[str],
    ) -> None:
        self.names = [str(c.name) for c in columns]
        self.readers = [_reader(c, i, charsets) for c, i in zip(columns, ids, strict=True)]
        self.key = key or list(self.names)
        self.full = _full_image(self.names, self.readers)

    def image(
        self, buf: bytes, pos: int, present: Sequence[int], on_error: OnError, row: int
    ) -> tuple[dict[str, Any], int]:
        """One row image at ``pos``: (column -> value, the offset after it).

        ``present``: the indexes of the columns the image holds (all, with a FULL image).
        """
        if len(present) == len(self.names):
            return self.full(buf, pos, on_error, row)
        names, readers = self.names, self.readers
        values: dict[str, Any] = dict.fromkeys(names)
        nulls = int.from_bytes(buf[pos : pos + (len(present) + 7) // 8], "little")
        pos += (len(present) + 7) // 8
        for bit, i in enumerate(present):
            if nulls >> bit & 1:
                values[names[i]] = None
                continue
            try:
                values[names[i]], pos = readers[i](buf, pos)
            except Undecodable as bad:
                values[names[i]] = on_error(names[i], bytes(bad.raw), bad.reason, row)
                pos = bad.end
        return values, pos

    def rows(
        self,
        buf: bytes,
        present: Sequence[int],
        present_after: Sequence[int] | None,
        on_error: OnError,
    ) -> list[Any]:
        """Every row of a rows event's body: dicts, or (before, after) pairs for updates."""
        out: list[Any] = []
        pos, end, image = 0, len(buf), self.image
        try:
            if present_after is None and len(present) == len(self.names):
                full, append = self.full, out.append
                while pos < end:
                    values, pos = full(buf, pos, on_error, len(out))
                    append(values)
            while pos < end:
                row = len(out)
                before, pos = image(buf, pos, present, on_error, row)
                if present_after is None:
                    out.append(before)
                else:
                    after, pos = image(buf, pos, present_after, on_error, row)
                    out.append((before, after))
        except (IndexError, struct.error) as exc:
            raise Unframed(f"row {len(out)} runs past the event's end ({exc})") from exc
        if pos != end:
            raise Unframed(f"the rows end at byte {pos} of the event's {end}")
        return out


FullImage = Callable[[bytes, int, OnError, int], tuple[dict[str, Any], int]]
"""(event bytes, offset, on_error, row number) -> (column -> value, offset after it)."""


def _full_image(names: list[str], readers: list[Reader]) -> FullImage:
    """The image function of one layout, for images that hold every column.

    Generated once per layout, with the loop over the columns unrolled: each column's null
    bit is a constant mask, a fixed-size number is unpacked in line, every other value is
    one call of its reader, and the row's dict is built in one step. Per row and column, the
    generic loop's bookkeeping (the index, the tuple of each reader's answer) is what the
    decoding of a wide event spent most of its time on.
    """
    width = (len(names) + 7) // 8
    scope: dict[str, Any] = {"Undecodable": Undecodable, "from_bytes": int.from_bytes}
    lines = ["def image(buf, pos, on_error, row):"]
    if width == 1:
        lines.append("    nulls = buf[pos]")
    else:
        lines.append(f"    nulls = from_bytes(buf[pos : pos + {width}], 'little')")
    lines.append(f"    pos += {width}")
    for i, read in enumerate(readers):
        lines.append(f"    if nulls & {1 << i}:")
        lines.append(f"        v{i} = None")
        lines.append("    else:")
        layout = _INLINE.get(read)
        if layout is not None:
            scope[f"u{i}"] = layout.unpack_from
            lines.append(f"        v{i} = u{i}(buf, pos)[0]")
            lines.append(f"        pos += {layout.size}")
            continue
        scope[f"r{i}"] = read
        scope[f"n{i}"] = names[i]
        lines.append("        try:")
        lines.append(f"            v{i}, pos = r{i}(buf, pos)")
        lines.append("        except Undecodable as bad:")
        lines.append(f"            v{i} = on_error(n{i}, bytes(bad.raw), bad.reason, row)")
        lines.append("            pos = bad.end")
    row = ", ".join(f"{name!r}: v{i}" for i, name in enumerate(names))
    lines.append(f"    return {{{row}}}, pos")
    exec("\n".join(lines), scope)  # the code is built above, from the layout alone
    image: FullImage = scope["image"]
    return image


def present_columns(bitmap: bytes, count: int) -> list[int]:
    """The indexes of the columns a rows event's columns-present bitmap names."""
    return [i for i in range(count) if bitmap[i >> 3] >> (i & 7) & 1]
