"""A Debezium consumer reads ``envelope: debezium``: PySpark, knowing only Debezium's documented
format (the code of docs/debezium.md, "Reading it with Spark", run as it is written there),
applies the events of ``pipelines/postgres-debezium-for-spark.yml`` and gets each table as
``SELECT * FROM`` it gives it, from the records with schemas and from the debezium-json values."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from datetime import UTC
from decimal import Decimal
from typing import Any

import pytest
from conftest import REPO

from wormhole.testing import run_cli
from wormhole.testing.postgres import run_sql

PIPELINE = REPO / "pipelines" / "postgres-debezium-for-spark.yml"
PREFIX = "dbz"

SCHEMA = [
    """CREATE TABLE accounts (
        id int PRIMARY KEY, name text, active bool, score float8, visits bigint,
        price numeric(10,2), amount numeric, born date, seen timestamp, changed timestamptz,
        doc jsonb, blob bytea, tags int[])""",
    "CREATE TABLE pairs (k text, n int, v text, PRIMARY KEY (k, n))",
]

INITIAL = [
    "INSERT INTO accounts VALUES (1, 'ada', true, 1.5, 9000000000, 12.34, 1.23456789, "
    "'1815-12-10', '2024-01-02 03:04:05.123456', '2024-01-02 03:04:05.1+02', "
    """'{"a": [1, 2]}', '\\x0102ff', '{1,NULL,3}')""",
    "INSERT INTO accounts VALUES (2, 'grace', false, -0.25, -7, 0, 0.000001, '1906-12-09', "
    "'1999-12-31 23:59:59.999999', '1999-12-31 23:59:59.999999-08', '[]', '\\x', '{}')",
    "INSERT INTO accounts (id) VALUES (3)",
    "INSERT INTO pairs SELECT 'p' || (g % 3), g, 'v' || g FROM generate_series(1, 9) g",
]

WORKLOAD = [
    "INSERT INTO accounts VALUES (4, 'new', true, 'Infinity', 1, -99999999.99, "
    "123456789012345678901234567890.123456789, '1969-12-31', '1960-06-01 00:00:00', "
    """'1960-06-01 00:00:00.5+00', '{"b": {"c": null}}', '\\xdeadbeef', '{-1}')""",
    "UPDATE accounts SET price = -0.5, amount = -1e-20, doc = '{\"x\": \"ü\"}', blob = '\\x00', "
    "tags = '{4,5}' WHERE id = 1",
    "UPDATE accounts SET name = NULL, seen = NULL, changed = NULL WHERE id = 2",
    "DELETE FROM accounts WHERE id = 3",
    "UPDATE accounts SET id = 20 WHERE id = 2",  # a key change
    # One transaction: the same key twice, and a deleted key back again.
    "BEGIN; UPDATE accounts SET visits = visits + 1 WHERE id = 1; "
    "UPDATE accounts SET visits = visits * 10, score = 0 WHERE id = 1; "
    "INSERT INTO accounts (id, name) VALUES (3, 'back'); COMMIT",
    "UPDATE pairs SET v = 'changed' WHERE n = 3",
    "DELETE FROM pairs WHERE n = 4",
    "UPDATE pairs SET k = 'moved' WHERE n = 5",  # a change of a composite key
    "TRUNCATE pairs",
    # After the truncate: a key the table had before, and a new one changed again.
    "INSERT INTO pairs VALUES ('p1', 1, 'again'), ('after', 1, 'x')",
    "UPDATE pairs SET v = 'y' WHERE k = 'after'",
    "INSERT INTO accounts (id, name) VALUES (5, 'last')",
]


def documented_code() -> str:
    """The first Python block of docs/debezium.md's "Reading it with Spark"."""
    text = (REPO / "docs" / "debezium.md").read_text()
    section = text.split("## Reading it with Spark", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "docs/debezium.md: no Python block under 'Reading it with Spark'"
    return match.group(1)


@pytest.fixture(scope="module")
def events(postgres_server: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The example pipeline's files after an initial snapshot and :data:`WORKLOAD`, and the
    tables as the database has them then."""
    import psycopg2

    tmp = tmp_path_factory.mktemp("consumer")
    database = postgres_server.create_database()
    dsn = postgres_server.dsn(database)
    env = {
        "PG_DSN": dsn,
        "PG_PUBLICATION": "consumer",
        "PG_STATE": str(tmp / "state"),
        "DBZ_OUT": str(tmp / "out"),
        "DBZ_PREFIX": PREFIX,
    }
    try:
        run_sql(dsn, *SCHEMA, *INITIAL, "CREATE PUBLICATION consumer FOR TABLE accounts, pairs")
        first = run_cli("run", str(PIPELINE), "--once", env=env, timeout=120)
        assert first.returncode == 0, first.stderr
        run_sql(dsn, *WORKLOAD)
        second = run_cli("run", str(PIPELINE), "--once", env=env, timeout=120)
        assert second.returncode == 0, second.stderr
        conn = psycopg2.connect(dsn)
        try:
            tables = {}
            with conn.cursor() as cur:
                for table in ("accounts", "pairs"):
                    cur.execute(f"SELECT * FROM {table}")
                    names = [c.name for c in cur.description]
                    tables[table] = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        finally:
            conn.close()
    finally:
        postgres_server.drop_database(database)
    return {"out": tmp / "out", "tables": tables}


@pytest.fixture(scope="module")
def reader(spark: Any) -> dict[str, Any]:
    """The documented reader's names, run in the test session's Spark."""
    namespace: dict[str, Any] = {"__name__": "debezium_reader"}
    exec(compile(documented_code(), "docs/debezium.md", "exec"), namespace)
    return namespace


def canonical(table: str, row: dict[str, Any]) -> dict[str, Any]:
    """A row as comparable values, from Spark or from psycopg2: numerics as their text,
    timestamptz as an aware UTC time, JSON parsed, bytes as bytes."""
    out = dict(row)
    if table != "accounts":
        return out
    for name in ("price", "amount"):
        if out[name] is not None:
            out[name] = str(Decimal(out[name]))
    if out["changed"] is not None:
        # Spark gives a local time without a zone, psycopg2 an aware one.
        out["changed"] = out["changed"].astimezone(UTC)
    if isinstance(out["doc"], str):
        out["doc"] = json.loads(out["doc"])
    if out["blob"] is not None:
        out["blob"] = bytes(out["blob"])
    return out


def by_key(table: str, rows: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    key = ("id",) if table == "accounts" else ("k", "n")
    out = {tuple(r[k] for k in key): canonical(table, r) for r in rows}
    assert len(out) == len(rows), f"{table}: a key twice in {rows}"
    return out


@pytest.mark.parametrize("form", ["records", "values"])
def test_spark_applies_the_events_and_gets_each_table(
    events: dict[str, Any], reader: dict[str, Any], spark: Any, form: str
) -> None:
    from pyspark.sql.types import IntegerType, StringType

    pairs_row = reader["struct"](k=StringType(), n=IntegerType(), v=StringType())
    rows = {"accounts": reader["ACCOUNTS"], "pairs": pairs_row}
    keys = {"accounts": ["id"], "pairs": ["k", "n"]}
    for table, expected in events["tables"].items():
        path = str(events["out"] / f"{form}.jsonl")
        if form == "records":
            topic = f"{PREFIX}.public.{table}"
            read = reader["record_events"](spark, path, topic, rows[table])
        else:
            read = reader["value_events"](spark, path, f"public.{table}", rows[table])
        state = reader["table_state"](read, keys[table])
        if table == "accounts":
            state = reader["typed_accounts"](state)
        got = by_key(table, [r.asDict(recursive=True) for r in state.collect()])
        want = by_key(table, expected)
        assert got.keys() == want.keys(), f"{form}: {table}"
        problems = [
            f"{form}: {table} {key}: {name}: Spark {got[key][name]!r} != {want[key][name]!r}"
            for key in want
            for name in want[key]
            if got[key].get(name) != want[key][name]
        ]
        assert not problems, "\n".join(problems)
        assert got == want


def test_the_workload_has_what_the_consumer_must_handle(events: dict[str, Any]) -> None:
    """Snapshot rows, creates, updates, deletes with their tombstones, a key change and a
    truncate reach the consumer, and each key's events come with rising LSNs."""
    out = events["out"]
    lines = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    ops: dict[str, int] = defaultdict(int)
    lsns: dict[tuple[str, str], list[int]] = defaultdict(list)
    tombstones = 0
    for record in lines:
        if record["value"] is None:
            tombstones += 1
            continue
        event = record["value"]["payload"]
        ops[event["op"]] += 1
        if event["op"] != "t":
            row = event["after"] if event["op"] != "d" else event["before"]
            key = json.dumps(record["key"]["payload"], sort_keys=True)
            assert {k: row[k] for k in record["key"]["payload"]} == record["key"]["payload"]
            lsns[(record["topic"], key)].append(event["source"]["lsn"])
    assert ops == {"r": 12, "c": 7, "u": 6, "d": 4, "t": 1}, ops
    assert tombstones == ops["d"]
    for key, seen in lsns.items():
        assert seen == sorted(set(seen)), f"{key}: LSNs {seen}"
    # values.jsonl: each event's value, without the tombstones.
    values = (out / "values.jsonl").read_text().splitlines()
    assert len(values) == len(lines) - tombstones
