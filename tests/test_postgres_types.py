"""Every common PostgreSQL type, decoded by the ``postgres`` source and by the server's
own ``test_decoding`` plugin (a second logical slot on the same WAL): the same changes,
in the same order, with the same keys and the same values, value by value.

The oracle slot is created before the rows the source's initial snapshot reads, so its
inserts are the snapshot's rows too: the snapshot's values are checked against the same
decoder as the stream's.
"""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path
from typing import Any

import msgspec
from pg_oracle import oracle_lines

from wormhole.connectors.postgres.options import PostgresOptions
from wormhole.connectors.postgres.source import PostgresSource
from wormhole.plugins.components import SourceContext
from wormhole.testing.helpers import read_updates
from wormhole.testing.postgres import run_sql as sql

TYPES = [
    "CREATE TYPE mood AS ENUM ('sad', 'ok', 'with space', 'it''s \"quoted\"')",
    "CREATE TYPE pair AS (a int, b text, c char(3))",
    "CREATE DOMAIN posint AS integer CHECK (VALUE > 0)",
    "CREATE DOMAIN flag AS boolean",
    "CREATE DOMAIN ratio AS double precision",
    "CREATE DOMAIN label AS text",
    'CREATE DOMAIN tag AS "char"',
    "CREATE DOMAIN padded AS char(4)",
    "CREATE DOMAIN address AS inet",
]

# (column, type, literals): row n takes the n-th literal (NULL past the end).
COLUMNS: list[tuple[str, str, list[str]]] = [
    ("c_int2", "smallint", ["-32768", "32767", "0"]),
    ("c_int4", "integer", ["-2147483648", "2147483647", "0"]),
    ("c_int8", "bigint", ["-9223372036854775808", "9223372036854775807", "0"]),
    ("c_oid", "oid", ["0", "4294967295"]),
    ("c_xid", "xid", ["'12345'"]),
    ("c_xid8", "xid8", ["'18446744073709551615'", "'0'"]),
    (
        "c_num",
        "numeric",
        [
            "'NaN'",
            "'Infinity'",
            "'-Infinity'",
            "'123456789012345678901234567890.123456789012345678901234567890'",
            "'-0.000000000000000000001'",
            "'0'",
            "'1e-30'",
        ],
    ),
    ("c_num_scaled", "numeric(10, 3)", ["1.5", "-0", "9999999.999"]),
    (
        "c_float4",
        "real",
        ["'-0'", "'NaN'", "'Infinity'", "'-Infinity'", "'3.4028235e38'", "'1e-45'", "'0.1'", "'2'"],
    ),
    (
        "c_float8",
        "double precision",
        [
            "'-0'",
            "'NaN'",
            "'Infinity'",
            "'-Infinity'",
            "'1.7976931348623157e308'",
            "'5e-324'",
            "'0.1'",
            "'123456789.123456789'",
            "'1e20'",
        ],
    ),
    ("c_money", "money", ["'12.34'", "'-92233720368547758.08'", "'92233720368547758.07'"]),
    ("c_bool", "boolean", ["true", "false"]),
    (
        "c_date",
        "date",
        ["'2026-11-21'", "'infinity'", "'-infinity'", "'4713-01-01 BC'", "'5874897-12-31'"],
    ),
    ("c_time", "time", ["'00:00'", "'23:59:59.999999'", "'24:00:00'"]),
    ("c_timetz", "timetz", ["'12:00+05:30'", "'23:59:59.999999-15:59'"]),
    (
        "c_ts",
        "timestamp",
        [
            "'infinity'",
            "'-infinity'",
            "'2000-01-01 00:00:00.000001'",
            "'4713-01-01 00:00:00 BC'",
            "'294276-12-31 23:59:59.999999'",
        ],
    ),
    ("c_ts3", "timestamp(3)", ["'2026-11-21 10:00:00.123456'"]),
    (
        "c_tstz",
        "timestamptz",
        [
            "'infinity'",
            "'-infinity'",
            "'2026-03-29 01:30:00+00'",
            "'0044-03-15 12:00:00+00 BC'",
        ],
    ),
    (
        "c_interval",
        "interval",
        [
            "'1 year 2 mons 3 days 04:05:06.789'",
            "'-178000000 years'",
            "'-1 day +01:00'",
            "'0'",
        ],
    ),
    ("c_bytea", "bytea", ["'\\x'", "'\\x00ff5c27'", "'\\xdeadbeef'"]),
    ("c_bit", "bit(5)", ["B'10101'", "B'00000'"]),
    ("c_varbit", "varbit", ["B''", "B'1'", "B'1010101010101010101'"]),
    (
        "c_uuid",
        "uuid",
        ["'00000000-0000-0000-0000-000000000000'", "'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11'"],
    ),
    (
        "c_json",
        "json",
        [
            '\'{"a": [1, 2.50, "x\\u00e9"],   "b": null}\'',
            "'  [ ]  '",
            "'\"\\u0000\"'",
            "'1e400'",
        ],
    ),
    (
        "c_jsonb",
        "jsonb",
        ['\'{"z": 1, "a": {"nested": [true, null]}}\'', "'\"é\\n\"'", "'1.000'"],
    ),
    ("c_jsonpath", "jsonpath", ["'$.a[*] ? (@ > 1)'"]),
    ("c_int_arr", "int[]", ["'{1,NULL,3}'", "'{{1,2},{3,4}}'", "'{}'", "'[0:1]={7,8}'"]),
    (
        "c_text_arr",
        "text[]",
        ["ARRAY['a b', 'c\"d', NULL, '', 'NULL', E'e\\\\f', '{}', 'ü,€']"],
    ),
    ("c_float_arr", "float8[]", ["'{NaN,-0,Infinity,1.5}'"]),
    ("c_bool_arr", "bool[]", ["'{t,f,NULL}'"]),
    ("c_char_arr", "char(2)[]", ["'{a,bc}'"]),
    ("c_int4range", "int4range", ["'[1,10)'", "'empty'", "'(,5]'", "'(,)'"]),
    ("c_int8range", "int8range", ["'[1,2]'"]),
    ("c_numrange", "numrange", ["'[1.5,2.5]'", "'(NaN,)'"]),
    ("c_tsrange", "tsrange", ["'[2026-01-01, infinity)'"]),
    ("c_tstzrange", "tstzrange", ["'[2026-01-01 00:00+00, 2026-01-02 00:00+00)'"]),
    ("c_daterange", "daterange", ["'[2026-01-01,2026-02-01]'", "'empty'"]),
    ("c_multirange", "int4multirange", ["'{[1,3), [5,7)}'", "'{}'"]),
    ("c_enum", "mood", ["'sad'", "'with space'", "'it''s \"quoted\"'"]),
    ("c_enum_arr", "mood[]", ["ARRAY['sad', 'with space']::mood[]"]),
    ("c_posint", "posint", ["5", "2147483647"]),
    ("c_flag", "flag", ["true", "false"]),
    ("c_ratio", "ratio", ["'NaN'", "1.5", "'-0'"]),
    ("c_label", "label", ["'domain text'"]),
    ("c_tag", "tag", ["'x'", "'\\200'", "''"]),
    ("c_padded", "padded", ["'ab'"]),
    ("c_address", "address", ["'10.0.0.1'", "'::1/128'"]),
    ("c_pair", "pair", ["ROW(1, 'p q', 'a')", "ROW(NULL, '', NULL)", "ROW(2, 'a\"b\\c', 'xyz')"]),
    ("c_inet", "inet", ["'10.0.0.1'", "'10.0.0.1/8'", "'::ffff:1.2.3.4'", "'192.168.0.0/16'"]),
    ("c_cidr", "cidr", ["'10.0.0.0/8'", "'::/0'", "'192.168.1.0/24'"]),
    ("c_macaddr", "macaddr", ["'08:00:2b:01:02:03'", "'08-00-2B-01-02-04'"]),
    ("c_macaddr8", "macaddr8", ["'08:00:2b:01:02:03:04:05'"]),
    ("c_tsvector", "tsvector", ["'a fat cat sat on a mat'", "$$'it''s' 'a:1A' b:2,3$$"]),
    ("c_tsquery", "tsquery", ["'fat & (rat | cat)'"]),
    (
        "c_xml",
        "xml",
        [
            "'<a b=\"1\">x &amp; y</a>'",
            "'just text'",
            '\'<?xml version="1.0" encoding="UTF-8"?><doc/>\'',
        ],
    ),
    ("c_point", "point", ["'(1,2)'", "'(-0,NaN)'"]),
    ("c_line", "line", ["'{1,2,3}'"]),
    ("c_lseg", "lseg", ["'[(0,0),(1,1)]'"]),
    ("c_box", "box", ["'(1,1),(0,0)'"]),
    ("c_path", "path", ["'[(0,0),(1,1),(2,0)]'", "'((0,0),(1,1))'"]),
    ("c_polygon", "polygon", ["'((0,0),(1,1),(1,0))'"]),
    ("c_circle", "circle", ["'<(0,0),1.5>'"]),
    ("c_pg_lsn", "pg_lsn", ["'16/B374D848'"]),
    ("c_regclass", "regclass", ["'pg_class'"]),
    (
        "c_text",
        "text",
        [
            "E'tab\\there'",
            "E'line\\nbreak\\r\\n'",
            "'quote '' and \"double\" and \\backslash'",
            "'😀 ünïcode € \u2028 \u200b e\u0301'",
            "''",
            "'null'",
            "'unchanged-toast-datum'",
        ],
    ),
    ("c_varchar", "varchar(10)", ["'abc'", "' lead'"]),
    ("c_char", "char(5)", ["'ab'", "''"]),
    ("c_qchar", '"char"', ["'q'"]),
    ("c_name", "name", ["'some name'"]),
]


def _big(seed: int) -> str:
    # Incompressible, so PostgreSQL stores it out of line (TOAST).
    import hashlib

    chunks = (hashlib.sha256(f"{seed}-{k}".encode()).hexdigest() for k in range(300))
    return "'" + "".join(chunks) + "'"


ROWS = max(len(values) for _, _, values in COLUMNS)


def _insert(table: str, first_id: int, rows: int) -> list[str]:
    names = ", ".join(name for name, _, _ in COLUMNS)
    statements = []
    for n in range(rows):
        values = [v[n] if n < len(v) else "NULL" for _, _, v in COLUMNS]
        big = _big(first_id + n) if n % 2 == 0 else "NULL"
        statements.append(
            f"INSERT INTO {table} (id, {names}, c_big) VALUES "
            f"({first_id + n}, {', '.join(values)}, {big})"
        )
    statements.append(f"INSERT INTO {table} (id) VALUES ({first_id + rows})")  # all NULL
    return statements


def _create(table: str) -> str:
    columns = ", ".join(f"{name} {type_}" for name, type_, _ in COLUMNS)
    return f"CREATE TABLE {table} (id int PRIMARY KEY, {columns}, c_big text)"


def _same_value(ours: Any, oracle: Any, where: str) -> None:
    """One value: ours (a JSON value) against test_decoding's text, exactly."""
    from pg_oracle import UNCHANGED

    if oracle is None or oracle is UNCHANGED:
        expected = None if oracle is None else "__unchanged_toast__"
        assert ours == expected, f"{where}: {ours!r} != {expected!r}"
    elif isinstance(ours, bool):
        # test_decoding prints bool as true/false, a domain over it as its text, t/f.
        expected_texts = ("true", "t") if ours else ("false", "f")
        assert oracle in expected_texts, f"{where}: {ours!r} != {oracle!r}"
    elif isinstance(ours, int):
        assert str(ours) == oracle, f"{where}: {ours!r} != {oracle!r}"
    elif isinstance(ours, float):
        # Finite floats are JSON numbers: the same number, the sign of zero included.
        expected_number = float(oracle)
        assert ours == expected_number, f"{where}: {ours!r} != {oracle!r}"
        assert math.copysign(1, ours) == math.copysign(1, expected_number), where
    else:
        assert ours == oracle, f"{where}: {ours!r} != {oracle!r}"


FLOATS = {"c_float4", "c_float8", "c_ratio"}


def _same_row(ours: dict[str, Any], oracle: dict[str, Any], where: str, image: bool) -> None:
    for name in FLOATS & set(ours):  # a float is a JSON float (2.0, -0.0), or text: NaN
        assert ours[name] is None or type(ours[name]) in (float, str), f"{where}, {name}"
    if image:  # test_decoding leaves NULL columns out of an old row image
        ours = {k: v for k, v in ours.items() if v is not None or k in oracle}
    assert set(ours) == set(oracle), f"{where}: {sorted(set(ours) ^ set(oracle))}"
    for name in oracle:
        _same_value(ours[name], oracle[name], f"{where}, column {name}")


def test_every_common_type_agrees_value_for_value_with_test_decoding(
    tmp_path: Path, postgres_dsn: str
) -> None:
    from pg_oracle import UNCHANGED, parse_change

    sql(
        postgres_dsn,
        *TYPES,
        _create("types"),
        _create("types_full"),
        "ALTER TABLE types_full REPLICA IDENTITY FULL",
        "ALTER TABLE types ALTER COLUMN c_big SET STORAGE EXTERNAL",
        "SELECT pg_create_logical_replication_slot('oracle', 'test_decoding')",
    )
    # Rows the initial snapshot reads (the oracle sees them as inserts).
    snapshot_rows = _insert("types", 1, ROWS) + _insert("types_full", 1, ROWS)
    # Flushed at each commit (the test cluster runs with synchronous_commit off), so that
    # the oracle, which decodes only flushed WAL, sees every change.
    sql(postgres_dsn, "SET synchronous_commit TO on", *snapshot_rows)
    tables = ["public.types", "public.types_full"]
    source = PostgresSource(PostgresOptions(dsn=postgres_dsn, tables=tables, slot="ours"))
    context = SourceContext("ours", tmp_path / "ours", 4, threading.Event(), logging.getLogger("t"))
    source.open(context, None)
    try:
        snapshot = read_updates(source, len(snapshot_rows))
        assert {u.op for u in snapshot} == {"r"}
        stream_sql = []
        for table in ("types", "types_full"):
            stream_sql += _insert(table, 100, ROWS)
            stream_sql += [
                # Unchanged TOASTed values (c_big) in an update, and every value changed.
                f"UPDATE {table} SET c_int4 = c_int4 + 1 WHERE id = 100",
                f"UPDATE {table} SET c_text = 'now' || c_text, c_num = c_num * 2 WHERE id < 103",
                f"UPDATE {table} SET c_big = NULL WHERE id = 102",
                f"DELETE FROM {table} WHERE id IN (101, 102, {100 + ROWS})",
            ]
        sql(postgres_dsn, "SET synchronous_commit TO on", *stream_sql)
        oracle = [parse_change(line) for line in oracle_lines(postgres_dsn)]
        per_table = (ROWS + 1) + 1 + (ROWS + 1 + 3) + 1 + 3
        assert len(oracle) == len(snapshot_rows) + 2 * per_table
        stream = read_updates(source, len(oracle) - len(snapshot_rows))
        # A backfill reads the rows as they are now, by the stream's value rules.
        backfilled = {}
        for table in tables:
            plan = source.backfill_plan("ours", table, None)
            rows = source.backfill_chunk(plan, None, 100)
            backfilled.update({(u.table, u.key["id"]): u for u in rows})
    finally:
        source.close()
    assert len(stream) == len(oracle) - len(snapshot_rows)

    # The snapshot: each table's rows in any order, the same values as the inserts.
    by_key = {(u.table, u.key["id"]): u for u in snapshot}
    for op, table, _old, new in oracle[: len(snapshot_rows)]:
        assert op == "c" and new is not None
        update = by_key[(table, int(new["id"]))]
        row = msgspec.json.decode(bytes(update.after))
        _same_row(row, new, f"snapshot row {table} id {new['id']}", image=False)

    # The workload has unchanged TOASTed values in updates of both tables.
    unchanged = {t for op, t, _, new in oracle if new and UNCHANGED in new.values()}
    assert unchanged == set(tables)

    # The stream: change for change, in order.
    for index, (update, (op, table, old, new)) in enumerate(
        zip(stream, oracle[len(snapshot_rows) :], strict=True)
    ):
        where = f"change {index} ({op} {table})"
        assert (update.op, update.table) == (op, table), where
        before = msgspec.json.decode(bytes(update.before))
        after = msgspec.json.decode(bytes(update.after))
        row = old if op == "d" else new
        assert row is not None
        assert update.key == {"id": int(row["id"])}, where
        if new is not None:
            if table == "public.types_full" and old is not None:
                # FULL: an unchanged TOASTed value is taken from the old row image.
                new = {k: old[k] if v is UNCHANGED and k in old else v for k, v in new.items()}
            _same_row(after, new, f"{where} after", image=False)
        if old is not None:
            _same_row(before, old, f"{where} before", image=table == "public.types_full")

    # The backfill: each row as the oracle's changes left it.
    now: dict[tuple[str, int], dict[str, Any]] = {}
    for op, table, _old, new in oracle:
        if op == "d":
            now.pop((table, int((_old or {})["id"])))
        else:
            assert new is not None
            previous = now.get((table, int(new["id"])), {})
            now[(table, int(new["id"]))] = {
                k: previous.get(k) if v is UNCHANGED else v for k, v in new.items()
            }
    assert set(backfilled) == set(now)
    for (table, key), row in now.items():
        update = backfilled[(table, key)]
        assert update.op == "r" and update.key == {"id": key}
        ours = msgspec.json.decode(bytes(update.after))
        _same_row(ours, row, f"backfilled row {table} id {key}", image=False)
