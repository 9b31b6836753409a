"""What the ``mysql`` source shares about talking to the server: quoting, the server's error
codes (those a reconnect fixes, those it cannot), and the catalog query of a table's columns."""

from __future__ import annotations

from typing import Any

import msgspec


def quote_name(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def server_error(exc: BaseException) -> tuple[int, str]:
    args: tuple[Any, ...] = tuple(getattr(exc, "args", ()))
    if len(args) >= 2 and isinstance(args[0], int):
        return args[0], str(args[1])
    return 0, str(exc)


def json_text(text: str) -> str:
    return msgspec.json.encode(text).decode()


DESCRIBE_COLUMNS = (
    "SELECT COLUMN_NAME, COLUMN_TYPE, DATA_TYPE, DATETIME_PRECISION, IS_NULLABLE, "
    "COLUMN_DEFAULT FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = %s AND "
    "TABLE_NAME = %s ORDER BY ORDINAL_POSITION"
)


# Errors that mean "the server went away": reconnect with backoff.
TRANSIENT = frozenset({2003, 2006, 2013, 2055, 1053, 1927})


# Errors of a backfill's chunk that reading it again cannot fix: the request fails.
CHUNK_FATAL = frozenset({1054, 1064, 1142, 1143, 1146, 1305, 1792})


# Errors writing the signal table that trying again cannot fix (privileges).
SIGNAL_FATAL = frozenset({1044, 1142, 1143, 1290, 1792})


# Column types whose values a backfill's chunks keep as the server's text.
TEXT_FIELDS = (0, 246, 7, 10, 11, 12, 13, 14)  # DECIMAL, NEWDECIMAL, TIMESTAMP, DATE, TIME,
# DATETIME, YEAR, NEWDATE


SYSTEM_SCHEMAS = frozenset({"mysql", "information_schema", "performance_schema", "sys"})
"""Schemas the source never reads."""
