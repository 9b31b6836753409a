"""SQL the ``postgres`` source writes: quoting, a row's JSON with the stream's value rules,
key values, and a check that a condition does not end its statement. Shared by the initial
snapshot and backfills (their rows read as the stream gives them)."""

from __future__ import annotations

import re
from typing import Any

from wormhole.connectors.postgres import pgoutput as pg

ROW_ESTIMATE = "GREATEST(c.reltuples, COALESCE(s.n_live_tup, 0), -1)"
"""A table's row count, estimated without counting (the alias ``c`` is its ``pg_class`` row,
``s`` its ``pg_stat_user_tables`` row): the planner's count from the last ANALYZE (-1 when
never analyzed) or the statistics' live rows, which follow inserts, whichever is larger."""


def identifier(name: str) -> str:
    return re.sub(r"[^a-z0-9_]", "_", name.lower())[:60]


def quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def qualified(table: str) -> str:
    schema, _, name = table.rpartition(".")
    return f"{quote(schema or 'public')}.{quote(name)}"


NATIVE_INTS = frozenset({20, 21, 23})  # int8 int2 int4: the driver gives Python ints


PADDED_OR_SHOWN = frozenset({1042, 869, 650, 142, 18})
"""bpchar, inet, cidr, xml, "char": their cast to text differs from their output (it trims
the padding, shows the netmask, keeps the XML declaration, and before PostgreSQL 15 gives a
byte over 127 raw where the output escapes it as ``\\ooo``), so their text is taken from the
output function, as pgoutput sends it."""


def text_of(expr: str, base: int) -> str:
    """SQL for a value's text as pgoutput sends it (the type's output function)."""
    if base == pg.BOOL_TYPE:
        return f"CASE WHEN {expr} THEN 't' WHEN NOT {expr} THEN 'f' END"
    if base in PADDED_OR_SHOWN:
        return f"CASE WHEN num_nulls({expr}) = 1 THEN NULL ELSE concat({expr}) END"
    return f"{expr}::text"


def json_value(expr: str, kind: int, base: int) -> str:
    """SQL for a column in a backfilled row's JSON: the stream's value rules (numbers and
    booleans as JSON values, every other type as its text)."""
    if kind == 1:
        return expr if base in NATIVE_INTS else f"{expr}::text::numeric"
    if kind == 3:
        # As the stream's: a finite float is a JSON number with a fraction or an exponent
        # (row_to_json writes -0 as "-0", which JSON readers take for the integer 0), a
        # non-finite one its text.
        return (
            f"CASE WHEN {expr}::text ~ '^-?[0-9]+$' THEN ({expr}::text || '.0')::json "
            f"ELSE to_json({expr}) END"
        )
    if kind == 2:
        return expr  # row_to_json writes booleans
    return text_of(expr, base)


def native_key(kind: int, base: int) -> bool:
    return (kind == 1 and base in NATIVE_INTS) or kind == 2


def key_value_sql(expr: str, kind: int, base: int) -> str:
    return expr if native_key(kind, base) else text_of(expr, base)


def key_value(kind: int, base: int, value: Any) -> Any:
    """A key value a backfill selected (text as bytes) as the stream gives it."""
    if value is None or native_key(kind, base) or not isinstance(value, bytes):
        return value  # a native key, or one rendered already (undecoded)
    return pg.convert(kind, value.decode())


def is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def escaped(text: str) -> bytes:
    """The bytes of a string decoded with ``surrogateescape``."""
    return text.encode("utf-8", "surrogateescape")


def unused_name(name: str, taken: set[str]) -> str:
    while name in taken:
        name += "_"
    return name


_DOLLAR_TAG = re.compile(r"\$(?:[A-Za-z_][A-Za-z0-9_]*)?\$")


def statement_separators(sql: str) -> list[int]:
    """Where ``sql`` has a ``;`` outside string literals, quoted identifiers, dollar quotes
    and comments (it would end the statement)."""
    found: list[int] = []
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c == ";":
            found.append(i)
            i += 1
        elif c == "'":
            backslashes = i > 0 and sql[i - 1] in "eE"
            i += 1
            while i < n:
                if backslashes and sql[i] == "\\":
                    i += 2
                    continue
                if sql[i] == "'":
                    if i + 1 < n and sql[i + 1] == "'":
                        i += 2
                        continue
                    break
                i += 1
            i += 1
        elif c == '"':
            end = sql.find('"', i + 1)
            i = n if end < 0 else end + 1
        elif sql.startswith("--", i):
            end = sql.find("\n", i)
            i = n if end < 0 else end + 1
        elif sql.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if sql.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif sql.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c == "$" and (match := _DOLLAR_TAG.match(sql, i)):
            end = sql.find(match.group(), match.end())
            i = n if end < 0 else end + len(match.group())
        else:
            i += 1
    return found


def json_row_select(columns: list[tuple[str, int, int]], keys: list[str], alias: str) -> str:
    """The select list of a row read as the stream gives it: the key columns' values, then
    the row's JSON object (PostgreSQL's ``row_to_json``, with the stream's value rules) as
    text, of table alias ``t``. Backfill chunks and the initial snapshot read rows so."""
    kinds = {n: (kind, base) for n, kind, base in columns}
    row_list = ", ".join(
        f"{json_value(f't.{quote(n)}', kind, base)} AS {quote(n)}" for n, kind, base in columns
    )
    document = (
        f"(SELECT row_to_json({alias})::text FROM (SELECT {row_list}) {alias})"
        if columns
        else "'{}'::text"
    )
    key_list = [key_value_sql(f"t.{quote(k)}", *kinds[k]) for k in keys]
    return ", ".join([*key_list, document])


_QUOTED_CONSTANT = re.compile(r"^'((?:[^']|'')*)'(?:::[\w .\[\]\"(),]+)?$")


_NUMBER_CONSTANT = re.compile(r"^\(?(-?\d+(?:\.\d+)?)\)?(?:::[\w ]+)?$")


def constant(expression: str | None) -> str | None:
    """A column default that is a constant (``0``, ``'abc'::text``, ``true``) as the text
    its values are written in; None for an expression (``now()``, ``nextval(...)``)."""
    if expression is None:
        return None
    quoted = _QUOTED_CONSTANT.match(expression)
    if quoted:
        return quoted.group(1).replace("''", "'")
    number = _NUMBER_CONSTANT.match(expression)
    if number:
        return number.group(1)
    if expression in ("true", "false"):
        return expression
    return None
