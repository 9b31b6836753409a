"""Backfill chunks of a MariaDB / MySQL table: key-order SQL, and key values back to SQL.

A chunk is ``SELECT <the snapshot's columns> FROM t WHERE (<--where>) AND <key after the
last chunk's last key> ORDER BY <primary key> LIMIT n``. The "after" condition is written
out as ``k1 > a1 OR (k1 = a1 AND k2 > a2) OR ...``: MariaDB reads that as a range of the
primary key, where a row constructor ``(k1, k2) > (a1, a2)`` makes it scan the index from
its start for every chunk.

The last key comes back as the stream's JSON values (``values.py``): text for DECIMAL,
temporal, BIT, binary, ENUM and SET columns. Each is turned back into what compares as the
column does in ``ORDER BY``: an ENUM by its member's number and a SET by its bit mask (they
sort by those, not by their text), bytes for binary strings, a FLOAT through ``CAST(... AS
FLOAT)`` (a single-precision value is not the double its shortest text reads as), a DECIMAL
through ``CAST(... AS DECIMAL(p, s))`` (a string would be compared as a double).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from wormhole.connectors.mysql.values import Layout, schema_layout

AS_TEXT = frozenset({"decimal", "datetime", "timestamp", "date", "time", "year"})
"""Types whose values the chunks' connection leaves as the server's text (see
:func:`chunk_layout`)."""
BINARY_TYPES = frozenset({"binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob"})


def quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def qualified(schema: str, table: str) -> str:
    return f"{quote(schema)}.{quote(table)}"


def select_list(columns: list[tuple[Any, ...]], as_bytes: set[str] | None = None) -> str:
    """The SELECT list of a table's columns ``(name, data_type, ...)``, as the snapshot
    reads them: FLOAT as text has about 6 digits; as a double it has the stored value,
    which the layout renders exactly as the binlog's. The columns of ``as_bytes`` are read
    as their bytes (text the layout decodes by its character set)."""
    as_bytes = as_bytes or set()
    return ", ".join(
        f"({quote(c[0])} + 0e0)"
        if str(c[1]).lower() == "float"
        else f"CAST({quote(c[0])} AS BINARY)"
        if c[0] in as_bytes
        else quote(c[0])
        for c in columns
    )


def chunk_layout(columns: list[tuple[Any, ...]], keys: list[str]) -> Layout:
    """The snapshot's layout of a table, less the conversions of the :data:`AS_TEXT` types:
    the chunks' connection does not parse those into Python values, and the text the
    server sends (with ``time_zone = '+00:00'``) is what the layout would render them as.
    ``columns`` as for :func:`chunks`."""
    layout = schema_layout([c[:4] for c in columns], keys)
    text = {c[0] for c in columns if str(c[1]).lower() in AS_TEXT}
    special = [(n, f) for n, f in layout.special if n not in text]
    return Layout(layout.columns, layout.key, special)


def members(column_type: str) -> list[str]:
    """The members of ``enum('a','b''c')`` or ``set(...)``, in definition order."""
    text = column_type[column_type.index("(") + 1 : column_type.rindex(")")]
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if text[i] != "'":
            i += 1
            continue
        i += 1
        chars: list[str] = []
        while i < n:
            if text[i] == "'" and i + 1 < n and text[i + 1] == "'":
                chars.append("'")
                i += 2
            elif text[i] == "\\" and i + 1 < n:
                chars.append(text[i + 1])
                i += 2
            elif text[i] == "'":
                i += 1
                break
            else:
                chars.append(text[i])
                i += 1
        out.append("".join(chars))
    return out


def _identity(value: Any) -> Any:
    return value


def _bits(value: Any) -> Any:
    return int(value, 2) if isinstance(value, str) else value


def _bytes(value: Any) -> Any:
    if isinstance(value, str) and value.startswith("\\x"):
        return bytes.fromhex(value[2:])
    return value


def key_argument(
    data_type: str, column_type: str, precision: Any, scale: Any
) -> tuple[str, Callable[[Any], Any]]:
    """How a key column's JSON value goes back into SQL: the placeholder expression, and
    the value to bind to it."""
    t = data_type.lower()
    if t == "float":
        return "CAST(%s AS FLOAT)", _identity
    if t == "decimal":
        return f"CAST(%s AS DECIMAL({int(precision or 10)}, {int(scale or 0)}))", _identity
    if t == "bit":
        return "%s", _bits
    if t == "enum":
        number = {m: i + 1 for i, m in enumerate(members(column_type))}
        return "%s", lambda v: number.get(v, 0) if isinstance(v, str) else v
    if t == "set":
        bit = {m: 1 << i for i, m in enumerate(members(column_type))}

        def mask(value: Any) -> Any:
            if not isinstance(value, str):
                return value
            return sum(bit.get(m, 0) for m in value.split(",") if m)

        return "%s", mask
    if t in BINARY_TYPES:
        return "%s", _bytes
    return "%s", _identity


@dataclass(frozen=True)
class Chunks:
    """How the chunks of one backfill are read (``BackfillPlan.detail``)."""

    first: str
    """The first chunk's SQL, without its LIMIT."""
    following: str
    """The next chunks' SQL (the key after ``%s`` arguments), without its LIMIT."""
    order: list[int]
    """For each ``%s`` of ``following``, the index of its key value."""
    convert: list[Callable[[Any], Any]]
    """For each key, its JSON value -> the value to bind."""
    layout: Layout

    def arguments(self, after: list[Any]) -> list[Any]:
        values = [c(v) for c, v in zip(self.convert, after, strict=True)]
        return [values[i] for i in self.order]


def chunks(
    schema: str,
    table: str,
    columns: list[tuple[Any, ...]],
    keys: list[str],
    where: str | None,
    layout: Layout,
) -> Chunks:
    """The chunk SQL of a table: ``columns`` are information_schema rows of (name,
    data_type, datetime_precision, numeric_precision, numeric_scale, column_type)."""
    by_name = {c[0]: c for c in columns}
    expressions: list[str] = []
    convert: list[Callable[[Any], Any]] = []
    for k in keys:
        _name, data_type, _dt, precision, scale, column_type = by_name[k]
        expression, to_sql = key_argument(str(data_type), str(column_type), precision, scale)
        expressions.append(expression)
        convert.append(to_sql)
    quoted = [quote(k) for k in keys]
    alternatives: list[str] = []
    order: list[int] = []
    for i in range(len(keys)):
        parts = []
        for j in range(i):
            parts.append(f"{quoted[j]} = {expressions[j]}")
            order.append(j)
        parts.append(f"{quoted[i]} > {expressions[i]}")
        order.append(i)
        alternatives.append(" AND ".join(parts))
    after = " OR ".join(f"({a})" if len(keys) > 1 else a for a in alternatives)
    head = f"SELECT {select_list(columns)} FROM {qualified(schema, table)}"
    tail = f" ORDER BY {', '.join(quoted)}"
    if where is None:
        first = head + tail
        following = f"{head} WHERE {after}{tail}"
    else:
        first = f"{head} WHERE ({where}){tail}"
        # The arguments are formatted in with %: a literal % of the condition stays one.
        following = f"{head} WHERE ({where.replace('%', '%%')}) AND ({after}){tail}"
    return Chunks(first, following, order, convert, layout)
