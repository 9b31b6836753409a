"""Character sets as the server defines them, as decoders of a column's bytes.

Each single-byte character set decodes by the server's own table of it, read from the
server with ``CONVERT`` (so ``latin1``'s 0x81 is U+0081, as in MariaDB, not undefined as
in Python's cp1252); a byte the server does not map (``ascii``'s 0xff) cannot be decoded.
The Unicode ones decode by their byte order (``ucs2``, ``utf16`` and ``utf32`` are
big-endian, ``utf16le`` little-endian) and the East Asian ones by Python's codec of the
same standard (:data:`MULTIBYTE_CODECS`).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from typing import Any

Text = Callable[[bytes], str]
"""Decodes a character set's bytes; raises ValueError (UnicodeDecodeError) if it cannot."""
BINARY_COLLATION = 63


# Multi-byte character sets and the Python codec that decodes them as the server does.
MULTIBYTE_CODECS = {
    "utf8mb3": "utf-8",
    "utf8mb4": "utf-8",
    "utf8": "utf-8",
    "ucs2": "utf-16-be",
    "utf16": "utf-16-be",
    "utf16le": "utf-16-le",
    "utf32": "utf-32-be",
    "big5": "big5",
    "cp932": "cp932",
    "sjis": "shift_jis",
    "ujis": "euc_jp",
    "eucjpms": "euc_jp",
    "euckr": "euc_kr",
    "gb2312": "gb2312",
    "gbk": "gbk",
    "gb18030": "gb18030",
}
_ALL_BYTES = bytes(range(256)).hex()
_UNMAPPED = "\ufffe"  # charmap_decode's "undefined"


def single_byte_table(utf32_hex: str) -> str:
    """A charmap decoding table from the server's conversion of bytes 0..255 to utf32.

    The server converts a byte it does not map to ``?``; such a byte maps to nothing.
    """
    table = []
    for byte in range(256):
        point = int(utf32_hex[byte * 8 : byte * 8 + 8], 16)
        table.append(_UNMAPPED if point == 0x3F and byte != 0x3F else chr(point))
    return "".join(table)


class Charsets:
    """The server's collations and character sets, as decoders of column bytes."""

    def __init__(self, collations: dict[int, str], single_byte: dict[str, str]) -> None:
        self.collations = collations
        self.decoders: dict[str, Text] = {}
        for name, table in single_byte.items():
            self.decoders[name] = _charmap(table)
        for name, codec in MULTIBYTE_CODECS.items():
            self.decoders.setdefault(name, _codec(codec))

    @classmethod
    def from_server(cls, query: Callable[[str], Sequence[Sequence[Any]]]) -> Charsets:
        """Read the collations and the single-byte character sets' tables from the server."""
        collations = {
            int(i): str(c)
            for i, c in query(
                "SELECT ID, CHARACTER_SET_NAME FROM information_schema.COLLATIONS "
                "WHERE ID IS NOT NULL"
            )
        }
        collations.update(_applicable_collations(query))
        names = [
            str(r[0])
            for r in query(
                "SELECT CHARACTER_SET_NAME FROM information_schema.CHARACTER_SETS "
                "WHERE MAXLEN = 1 AND CHARACTER_SET_NAME <> 'binary' ORDER BY 1"
            )
        ]
        single: dict[str, str] = {}
        if names:
            select = ", ".join(
                f"HEX(CONVERT(CAST(UNHEX('{_ALL_BYTES}') AS CHAR CHARACTER SET {n}) USING utf32))"
                for n in names
                if n.isidentifier()
            )
            (row,) = query(f"SELECT {select}")
            single = {
                n: single_byte_table(str(h))
                for n, h in zip([n for n in names if n.isidentifier()], row, strict=True)
            }
        return cls(collations, single)

    def charset(self, collation: int | None) -> str | None:
        if collation is None:
            return None
        return self.collations.get(collation)

    def text(self, collation: int | None) -> tuple[str, Text | None]:
        """(character set name, its decoder); decoder None for ``binary``."""
        if collation == BINARY_COLLATION:
            return "binary", None
        name = self.charset(collation)
        if name is None:  # no metadata (an old server): the server's default
            return f"collation {collation}" if collation else "utf8mb4", (
                self.decoders["utf8mb4"] if collation is None else _unknown(collation)
            )
        if name == "binary":
            return name, None
        return name, self.decoders.get(name) or _unknown(name)


def _applicable_collations(query: Callable[[str], Sequence[Sequence[Any]]]) -> dict[int, str]:
    """MariaDB 10.10 and later: collations shared by several character sets (the
    ``uca1400`` ones) appear once in ``COLLATIONS``, without an id; each character set's id
    of them (2048 and up) is in ``COLLATION_CHARACTER_SET_APPLICABILITY``. Older servers and
    MySQL have no ``ID`` column there: nothing to add."""
    try:
        rows = query(
            "SELECT ID, CHARACTER_SET_NAME FROM "
            "information_schema.COLLATION_CHARACTER_SET_APPLICABILITY WHERE ID IS NOT NULL"
        )
    except Exception:  # no ID column there: a server without such collations
        return {}
    return {int(i): str(c) for i, c in rows}


def _charmap(table: str) -> Text:
    decode = codecs.charmap_decode

    def text(raw: bytes) -> str:
        return decode(raw, "strict", table)[0]

    return text


def _codec(codec: str) -> Text:
    decoder = codecs.getdecoder(codec)

    def text(raw: bytes) -> str:
        return decoder(raw, "strict")[0]

    return text


def _unknown(what: Any) -> Text:
    def text(raw: bytes) -> str:
        raise ValueError(f"the character set {what} has no decoder here")

    return text


def members_text(members: list[str], collation: int | None, charsets: Charsets) -> list[str]:
    """ENUM/SET members decoded by their column's character set (the table map holds them in
    it; :func:`keep_member_bytes` keeps each byte of them)."""
    _name, decode = charsets.text(collation)
    if decode is None:
        return members
    out = []
    for member in members:
        raw = member.encode("utf-8", "surrogateescape")
        try:
            out.append(decode(raw))
        except ValueError:
            out.append(raw.decode("utf-8", "replace"))
    return out


def keep_member_bytes(table_map_event: Any) -> None:
    """Make the library keep every byte of the ENUM/SET members a table map holds.

    It decodes them as UTF-8 and drops a member that is not (latin1's ``é``); here each
    stays UTF-8 with surrogate escapes, which :func:`_members` turns back into the bytes
    and decodes by the column's character set.
    """

    def read_type_values(self: Any, length: int) -> list[list[str]]:
        packet = self.packet
        result = []
        read_until = packet.read_bytes + length
        while packet.read_bytes < read_until:
            count = packet.read_length_coded_binary()
            result.append(
                [
                    packet.read_variable_length_string().decode("utf-8", "surrogateescape")
                    for _ in range(count)
                ]
            )
        return result

    table_map_event._read_type_values = read_type_values
