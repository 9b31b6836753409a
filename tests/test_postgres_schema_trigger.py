"""Schema changes in-band: with the schema trigger, every DDL is written into the WAL at
its own position, and the ``postgres`` source keys each change by the primary key its
table had when the change was made, however late the WAL is decoded, after a replay too."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from wormhole.connectors.postgres.options import PostgresOptions
from wormhole.connectors.postgres.source import PostgresSource
from wormhole.core.errors import SourceError
from wormhole.core.update import Update
from wormhole.plugins.components import SourceContext
from wormhole.testing import read_envelopes, run_cli, write_pipeline
from wormhole.testing.helpers import read_updates
from wormhole.testing.postgres import run_sql as sql

BIG = "repeat('k', 2000)"

# Every table is created after the slot and dropped (or re-keyed) before the source
# decodes any of it: the catalog, read at decode time, knows none of these versions.
WORKLOAD = [
    # PostgreSQL's toast.sql `toasted_several`: FULL, its TOASTed primary key not the
    # first unique column.
    "CREATE TABLE several (id serial UNIQUE NOT NULL, toasted_key text PRIMARY KEY, "
    "c1 text, c2 text)",
    "ALTER TABLE several REPLICA IDENTITY FULL",
    "ALTER TABLE several ALTER COLUMN toasted_key SET STORAGE EXTERNAL",
    f"INSERT INTO several (toasted_key, c1) VALUES ({BIG}, 'a')",
    "UPDATE several SET c1 = 'b'",
    "DELETE FROM several",
    # ... and its transaction larger than logical_decoding_work_mem (spilled to disk).
    "BEGIN",
    "INSERT INTO several (toasted_key) SELECT g::text FROM generate_series(1, 10234) g",
    "UPDATE several SET c1 = c2 WHERE id = 2",
    "DELETE FROM several WHERE id = 2",
    "COMMIT",
    "DROP TABLE several",
    # The primary key moves to another column, the columns unchanged.
    "CREATE TABLE rekeyed (id int PRIMARY KEY, code int NOT NULL, v text)",
    "ALTER TABLE rekeyed REPLICA IDENTITY FULL",
    "INSERT INTO rekeyed VALUES (1, 10, 'x')",
    "UPDATE rekeyed SET v = 'y'",
    "ALTER TABLE rekeyed DROP CONSTRAINT rekeyed_pkey, ADD PRIMARY KEY (code)",
    "UPDATE rekeyed SET v = 'z'",
    "DELETE FROM rekeyed",
    # ... and back, inside one transaction, between its changes.
    "BEGIN",
    "INSERT INTO rekeyed VALUES (2, 20, 'x')",
    "ALTER TABLE rekeyed DROP CONSTRAINT rekeyed_pkey, ADD PRIMARY KEY (id)",
    "UPDATE rekeyed SET v = 'y'",
    "COMMIT",
    # A renamed and a retyped column.
    "CREATE TABLE renamed (id int PRIMARY KEY, v text)",
    "ALTER TABLE renamed REPLICA IDENTITY FULL",
    "INSERT INTO renamed VALUES (1, 'abc')",
    "ALTER TABLE renamed RENAME COLUMN id TO ident",
    "UPDATE renamed SET v = 'abcd'",
    "ALTER TABLE renamed ALTER COLUMN v TYPE int USING length(v)",
    "UPDATE renamed SET v = v + 1",
    "DROP TABLE renamed",
    # No primary key, then one.
    "CREATE TABLE keyless (a int NOT NULL, v int)",
    "ALTER TABLE keyless REPLICA IDENTITY FULL",
    "INSERT INTO keyless VALUES (1, 1)",
    "UPDATE keyless SET v = 2",
    "ALTER TABLE keyless ADD PRIMARY KEY (a)",
    "UPDATE keyless SET v = 3",
    "DROP TABLE keyless",
    # NOTHING: inserts only.
    "CREATE TABLE nothing (id int PRIMARY KEY, v text)",
    "ALTER TABLE nothing REPLICA IDENTITY NOTHING",
    "INSERT INTO nothing VALUES (1, 'x')",
    "DROP TABLE nothing",
    # A partition, keyed by the partitioned table's primary key, which a command on the
    # partitioned table changes.
    "CREATE TABLE parted (id int, code int NOT NULL, v text, PRIMARY KEY (id)) "
    "PARTITION BY LIST (id)",
    "CREATE TABLE parted_1 PARTITION OF parted FOR VALUES IN (1)",
    "ALTER TABLE parted_1 REPLICA IDENTITY FULL",
    "INSERT INTO parted VALUES (1, 10, 'x')",
    "UPDATE parted SET v = 'y'",
    "ALTER TABLE parted DROP CONSTRAINT parted_pkey, ADD PRIMARY KEY (id, code)",
    "UPDATE parted SET v = 'z'",
    "DROP TABLE parted",
    # Created, filled, keyed and renamed in one transaction; a key of two columns.
    "BEGIN",
    "CREATE TABLE onetx (a int NOT NULL, b int NOT NULL, v text)",
    "ALTER TABLE onetx REPLICA IDENTITY FULL",
    "INSERT INTO onetx VALUES (1, 2, 'x')",
    "ALTER TABLE onetx ADD PRIMARY KEY (b, a)",
    "UPDATE onetx SET v = 'y'",
    "ALTER TABLE onetx RENAME TO onetx_renamed",
    "UPDATE onetx_renamed SET v = 'z'",
    "COMMIT",
    "DROP TABLE onetx_renamed",
    # A table that was there at the slot's start: a column added, then dropped.
    "ALTER TABLE before_slot ADD COLUMN extra int",
    "UPDATE before_slot SET extra = 1",
    "DROP TABLE before_slot",
]

EXPECTED = [
    ("c", "several", {"toasted_key": "k" * 2000}),
    ("u", "several", {"toasted_key": "k" * 2000}),
    ("d", "several", {"toasted_key": "k" * 2000}),
    *[("c", "several", {"toasted_key": str(n)}) for n in range(1, 10235)],
    ("u", "several", {"toasted_key": "1"}),
    ("d", "several", {"toasted_key": "1"}),
    ("c", "rekeyed", {"id": 1}),
    ("u", "rekeyed", {"id": 1}),
    ("u", "rekeyed", {"code": 10}),
    ("d", "rekeyed", {"code": 10}),
    ("c", "rekeyed", {"code": 20}),
    ("u", "rekeyed", {"id": 2}),
    ("c", "renamed", {"id": 1}),
    ("u", "renamed", {"ident": 1}),
    ("u", "renamed", {"ident": 1}),
    ("c", "keyless", {"a": 1, "v": 1}),
    ("d", "keyless", {"a": 1, "v": 1}),  # keyed by every column: a key change
    ("c", "keyless", {"a": 1, "v": 2}),
    ("u", "keyless", {"a": 1}),
    ("c", "nothing", {"id": 1}),
    ("c", "parted_1", {"id": 1}),
    ("u", "parted_1", {"id": 1}),
    ("u", "parted_1", {"id": 1, "code": 10}),
    ("c", "onetx", {"a": 1, "b": 2, "v": "x"}),  # no primary key yet: every column
    ("u", "onetx", {"a": 1, "b": 2}),  # in column order
    ("u", "onetx_renamed", {"a": 1, "b": 2}),
    ("u", "before_slot", {"id": 1}),
]


def _open(tmp_path: Path, dsn: str, checkpoint: Any = None, **options: Any) -> PostgresSource:
    source = PostgresSource(
        PostgresOptions(dsn=dsn, slot="late", publication="every", snapshot="never", **options)
    )
    context = SourceContext(
        "late", tmp_path / "state", 4, threading.Event(), logging.getLogger("late")
    )
    try:
        source.open(context, checkpoint)
    except BaseException:
        source.close()
        raise
    return source


def _keys(updates: list[Update]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(u.op, u.table.partition(".")[2], u.key) for u in updates]


def test_changes_are_keyed_by_the_primary_key_at_their_position_after_any_ddl_and_replay(
    tmp_path: Path, postgres_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    sql(
        postgres_dsn,
        "CREATE TABLE before_slot (id int PRIMARY KEY, v text)",
        "ALTER TABLE before_slot REPLICA IDENTITY FULL",
        "INSERT INTO before_slot VALUES (1, 'x')",
        "CREATE PUBLICATION every FOR ALL TABLES",
    )
    database = postgres_dsn.split("dbname=")[1].split()[0]
    sql(postgres_dsn, f"ALTER DATABASE {database} SET logical_decoding_work_mem = '64kB'")
    source = _open(tmp_path, postgres_dsn, schema_trigger=True)
    try:
        start = source.read(0.2)  # the new slot's position, announced
        assert start is not None and start.updates == []
        sql(postgres_dsn, *WORKLOAD)
        with caplog.at_level(logging.WARNING, logger="wormhole.postgres"):
            decoded = read_updates(source, len(EXPECTED))
    finally:
        source.close()
    assert _keys(decoded) == EXPECTED
    assert not [r for r in caplog.records if "is not known" in r.getMessage()]
    conn = psycopg2.connect(postgres_dsn)
    with conn.cursor() as cur:
        cur.execute("SELECT spill_txns FROM pg_stat_replication_slots WHERE slot_name = 'late'")
        assert cur.fetchone()[0] > 0  # the large transaction was decoded from disk
    conn.close()
    # A replay of the same WAL (a restart from an earlier checkpoint: nothing was
    # confirmed), with a schema history that already holds every later version.
    again = _open(tmp_path, postgres_dsn, start.checkpoint)
    try:
        replayed = read_updates(again, len(EXPECTED))
    finally:
        again.close()
    assert _keys(replayed) == EXPECTED
    assert [u.position for u in replayed] == [u.position for u in decoded]


def test_without_the_trigger_the_catalog_cannot_tell_a_dropped_tables_key(
    tmp_path: Path, postgres_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """What the trigger fixes (and docs/postgres.md says happens without it)."""
    sql(postgres_dsn, "CREATE PUBLICATION every FOR ALL TABLES")
    with pytest.raises(SourceError) as refused:
        _open(tmp_path, postgres_dsn, schema_events=True)
    assert "source.schema_events:" in str(refused.value)
    assert "set schema_trigger: true" in str(refused.value)
    source = _open(tmp_path, postgres_dsn)
    try:
        source.read(0.2)
        several = [*WORKLOAD[: WORKLOAD.index("BEGIN")], "DROP TABLE several"]
        rekeyed = [s for s in WORKLOAD if "rekeyed" in s][:7]
        sql(postgres_dsn, *several, *rekeyed)
        with caplog.at_level(logging.WARNING, logger="wormhole.postgres"):
            decoded = read_updates(source, 8)
    finally:
        source.close()
    keys = _keys(decoded)
    all_columns = {"id": 1, "toasted_key": "k" * 2000, "c1": "a", "c2": None}
    assert keys[0] == ("c", "several", all_columns)  # every column: the table is gone
    assert keys[4] == ("c", "rekeyed", {"code": 10})  # the catalog's key, not id's
    assert any("the primary key of public.several" in r.getMessage() for r in caplog.records)


def test_schema_changes_of_published_tables_are_delivered_as_events_when_asked(
    tmp_path: Path, postgres_dsn: str
) -> None:
    import msgspec

    sql(
        postgres_dsn,
        "CREATE SCHEMA app",
        "CREATE PUBLICATION every FOR TABLES IN SCHEMA app",
        "CREATE TABLE public.unpublished (id int PRIMARY KEY)",
    )
    source = _open(tmp_path, postgres_dsn, schema_trigger=True, schema_events=True)
    try:
        source.read(0.2)
        sql(
            postgres_dsn,
            "CREATE TABLE app.t (id int PRIMARY KEY, v varchar(20))",
            "INSERT INTO app.t VALUES (1, 'x')",
            "ALTER TABLE public.unpublished ADD COLUMN v text",  # not published: no event
            "BEGIN",
            "ALTER TABLE app.t ADD COLUMN n numeric(5, 2), REPLICA IDENTITY FULL",
            "UPDATE app.t SET n = 1.5",
            "COMMIT",
            "DROP TABLE app.t",
        )
        decoded = read_updates(source, 5)
    finally:
        source.close()
    events = [
        (u.op, u.table, u.key, msgspec.json.decode(bytes(u.after)) if u.after else None)
        for u in decoded
    ]
    create = {
        "table": "app.t",
        "tag": "CREATE TABLE",
        "ddl": "CREATE TABLE app.t (id int PRIMARY KEY, v varchar(20))",
        "columns": [
            {"name": "id", "type": "integer"},
            {"name": "v", "type": "character varying(20)"},
        ],
        "primary_key": ["id"],
        "replica_identity": "default",
    }
    alter = {
        "table": "app.t",
        "tag": "ALTER TABLE",
        "ddl": "ALTER TABLE app.t ADD COLUMN n numeric(5, 2), REPLICA IDENTITY FULL",
        "columns": [
            {"name": "id", "type": "integer"},
            {"name": "v", "type": "character varying(20)"},
            {"name": "n", "type": "numeric(5,2)"},
        ],
        "primary_key": ["id"],
        "replica_identity": "full",
    }
    drop = {"table": "app.t", "tag": "DROP TABLE", "ddl": "DROP TABLE app.t", "dropped": True}
    assert events == [
        ("c", "wormhole.schema_changes", {"table": "app.t"}, create),
        ("c", "app.t", {"id": 1}, {"id": 1, "v": "x"}),
        ("c", "wormhole.schema_changes", {"table": "app.t"}, alter),
        ("u", "app.t", {"id": 1}, {"id": 1, "v": "x", "n": "1.50"}),
        ("c", "wormhole.schema_changes", {"table": "app.t"}, drop),
    ]
    # An event has a position of its own, before the changes after it in its transaction.
    assert decoded[2].position.endswith(":0") and decoded[3].position.endswith(":1")
    assert decoded[2].txid == decoded[3].txid


def test_the_history_keeps_only_what_a_change_still_to_decode_can_need(tmp_path: Path) -> None:
    from wormhole.connectors.postgres.schema_history import Entry, SchemaHistory

    history = SchemaHistory(tmp_path / "history.json")
    columns = [("id", 23, -1)]
    for oid, lsn, index, identity in [
        (1, 100, 0, "f"),
        (1, 200, 0, "f"),
        (1, 200, 2, "n"),
        (1, 300, 0, "f"),
        (2, 100, 0, "f"),
        (2, 150, 1, ""),  # dropped
    ]:
        history.record_in_band(oid, Entry(lsn, identity, columns, ["id"], index, True))
    history.record_in_band(1, Entry(200, "n", columns, ["id"], 2, True))  # a replay
    assert [(e.lsn, e.index) for e in history.in_band[1]] == [
        (100, 0),
        (200, 0),
        (200, 2),
        (300, 0),
    ]
    assert history.in_band_at(1, 200, 1).index == 0  # type: ignore[union-attr]
    assert history.in_band_at(1, 200, 2).identity == "n"  # type: ignore[union-attr]
    assert history.in_band_at(1, 99, 5) is None
    history.prune(250)
    assert [(e.lsn, e.index) for e in history.in_band[1]] == [(200, 2), (300, 0)]
    assert 2 not in history.in_band
    history.save()
    assert SchemaHistory(tmp_path / "history.json").in_band[1] == history.in_band[1]


def _trigger_pipeline(tmp_path: Path, dsn: str) -> Path:
    return write_pipeline(
        tmp_path / "pg.yml",
        {
            "pipeline": "pg",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "postgres", "dsn": dsn},
            "applications": {"out": {"sink": {"type": "null"}}},
        },
    )


def _installed(dsn: str) -> int:
    conn = psycopg2.connect(dsn)
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_event_trigger WHERE evtname LIKE 'wormhole_%'")
        (count,) = cur.fetchone()
    conn.close()
    return int(count)


def test_the_command_installs_and_removes_the_trigger_and_names_the_privilege(
    tmp_path: Path, postgres_dsn: str
) -> None:
    plain = f"plain_{int(time.time() * 1000) % 10**9}"
    sql(postgres_dsn, f"CREATE ROLE {plain} LOGIN REPLICATION")
    try:
        refused = run_cli(
            "postgres-schema-trigger",
            str(_trigger_pipeline(tmp_path, f"{postgres_dsn} user={plain}")),
            cwd=tmp_path,
        )
        assert refused.returncode == 2, refused
        assert "cannot install the schema trigger" in refused.stderr
        assert "needs a superuser" in refused.stderr and "--sql" in refused.stderr
        # The source's option says the same, naming itself.
        sql(postgres_dsn, "CREATE PUBLICATION every FOR ALL TABLES")
        with pytest.raises(SourceError) as stopped:
            _open(tmp_path, f"{postgres_dsn} user={plain}", schema_trigger=True)
        assert "source.schema_trigger: cannot install the schema trigger" in str(stopped.value)
        assert "needs a superuser" in str(stopped.value)
        assert "schema_trigger: false" in str(stopped.value)
        assert _installed(postgres_dsn) == 0
    finally:
        sql(postgres_dsn, f"DROP ROLE {plain}")
    pipeline = str(_trigger_pipeline(tmp_path, postgres_dsn))
    printed = run_cli("postgres-schema-trigger", pipeline, "--sql", cwd=tmp_path)
    assert printed.returncode == 0 and "CREATE EVENT TRIGGER" in printed.stdout
    assert _installed(postgres_dsn) == 0
    for _ in range(2):  # idempotent
        done = run_cli("postgres-schema-trigger", pipeline, cwd=tmp_path)
        assert done.returncode == 0, done
        assert _installed(postgres_dsn) == 2
    # A pipeline's application receives the events in the envelope, in order with the rows.
    events = write_pipeline(
        tmp_path / "events.yml",
        {
            "pipeline": "events",
            "state_dir": str(tmp_path / "events"),
            "source": {"type": "postgres", "dsn": postgres_dsn, "schema_events": True},
            "transport": {"type": "inprocess"},
            "applications": {"out": {"sink": {"type": "jsonl", "path": str(tmp_path / "o.jsonl")}}},
        },
    )
    assert run_cli("run", str(events), "--once", cwd=tmp_path).returncode == 0
    sql(postgres_dsn, "CREATE TABLE t (id int PRIMARY KEY)", "INSERT INTO t VALUES (1)")
    assert run_cli("run", str(events), "--once", cwd=tmp_path).returncode == 0
    out = read_envelopes(tmp_path / "o.jsonl")
    assert [(e["op"], e["source"]["table"], e["key"]) for e in out] == [
        ("c", "wormhole.schema_changes", {"table": "public.t"}),
        ("c", "public.t", {"id": 1}),
    ]
    assert out[0]["after"]["columns"] == [{"name": "id", "type": "integer"}]
    removed = run_cli("postgres-schema-trigger", pipeline, "--remove", cwd=tmp_path)
    assert removed.returncode == 0, removed
    assert _installed(postgres_dsn) == 0
