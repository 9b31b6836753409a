"""Values and messages of the ``postgres`` source that cannot be decoded.

A ``SQL_ASCII`` database stores the bytes a client sent, unchecked, so a text value
(or a logical message under the source's own prefix) may not be UTF-8. One such value
never ends the stream: with ``on_decode_error: fallback`` (the default) the change is
delivered with the value as ``{"undecoded": "<hex>"}``, a warning names the table,
column, position and fix, and ``wormhole_source_undecoded_values`` counts it; with
``on_decode_error: stop`` the source stops with that message.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from wormhole.connectors.postgres.pgoutput import undecoded
from wormhole.connectors.postgres.sql import escaped, is_utf8
from wormhole.core.errors import SourceError
from wormhole.plugins import events

log = logging.getLogger("wormhole.postgres")

_LOGGED_PER_COLUMN = 10
_FIX = (
    "The database is SQL_ASCII and holds bytes that are not UTF-8: store the text as UTF-8 "
    "(or keep such data in a bytea column)"
)


def _shown(raw: bytes) -> str:
    return raw[:64].hex() + ("..." if len(raw) > 64 else "")


class DecodeErrors:
    """Applies ``on_decode_error`` to one source's undecodable values."""

    def __init__(self, stop: bool) -> None:
        self.stop = stop
        self.logged: dict[tuple[str, str], int] = {}

    def value(self, table: str, column: str, raw: bytes, at: str, kept: str = "WAL") -> Any:
        """A text value of ``table``.``column`` at ``at`` that is not UTF-8: its
        rendering, or :class:`SourceError` under ``on_decode_error: stop``."""
        where = f"column {column} of {table} at {at}"
        if self.stop:
            raise SourceError(
                f"source: cannot decode {where}: not valid UTF-8; bytes {_shown(raw)}. "
                f"{_FIX}. The {kept} keeps the value: set source.on_decode_error: fallback to "
                f'deliver it as {{"undecoded": "<hex>"}}'
            )
        events.undecoded_value(table, column)
        self._warn(table, column, f"cannot decode {where}: not valid UTF-8", raw)
        return undecoded(raw)

    def chunk_row(self, table: str, row: Any, n_keys: int, at: str) -> Any:
        """A row (key values, then its JSON) of a SQL_ASCII database read by the snapshot or
        a backfill: each text value (key or column) that is not UTF-8 as :func:`undecoded`
        (a column's through :meth:`value`)."""
        document = row[n_keys]
        if document.isascii() or is_utf8(document):
            return row
        values = json.loads(document.decode("utf-8", "surrogateescape"))
        for column, value in values.items():
            if isinstance(value, str) and not is_utf8(raw := escaped(value)):
                values[column] = self.value(table, column, raw, at, "table")
        # A key value is also in the row: counted and logged there.
        keys = [
            undecoded(k) if isinstance(k, bytes) and not is_utf8(k) else k for k in row[:n_keys]
        ]
        return (*keys, json.dumps(values, ensure_ascii=False).encode())

    def message(self, prefix: str, raw: bytes, at: str) -> None:
        """A transactional logical message under the source's watermark prefix whose
        content is not UTF-8 (not a watermark the source wrote): ignored, or a stop."""
        where = f"the logical message with prefix {prefix} at {at}"
        if self.stop:
            raise SourceError(
                f"source: cannot decode {where}: not valid UTF-8; bytes {_shown(raw)}. Only "
                f"the source writes messages with this prefix (backfill watermarks): set "
                f"source.on_decode_error: fallback to ignore it, and stop the program that "
                f"writes it"
            )
        events.undecoded_value("pg_logical_emit_message", prefix)
        self._warn(
            "pg_logical_emit_message",
            prefix,
            f"ignoring {where}: not valid UTF-8, so not a backfill watermark this source "
            f"wrote. Stop the program that writes messages with this prefix",
            raw,
            delivered=False,
        )

    def _warn(self, table: str, column: str, text: str, raw: bytes, delivered: bool = True) -> None:
        logged = self.logged.get((table, column), 0)
        if logged >= _LOGGED_PER_COLUMN:
            return
        self.logged[(table, column)] = logged + 1
        log.warning(
            "%s; %s. %s, or set source.on_decode_error: stop to stop at such a value%s",
            text,
            f'delivered as {{"undecoded": "{_shown(raw)}"}}'
            if delivered
            else f"bytes {_shown(raw)}",
            _FIX,
            " (further ones of this column are only counted)"
            if logged == _LOGGED_PER_COLUMN - 1
            else "",
        )
