"""The postgres source against a real PostgreSQL cluster (wal_level=logical)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import psycopg2
from conftest import check_rounds

from wormhole.testing import read_envelopes, run_cli, start_cli, write_pipeline
from wormhole.testing.helpers import cli_command
from wormhole.testing.postgres import run_sql as sql


def pg_pipeline(tmp_path: Path, dsn: str, **source: Any) -> Path:
    return write_pipeline(
        tmp_path / "pg.yml",
        {
            "pipeline": "pg",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "postgres", "dsn": dsn, **source},
            "transport": {"type": "inprocess"},
            "applications": {
                "out": {"sink": {"type": "jsonl", "path": str(tmp_path / "out.jsonl")}}
            },
        },
    )


def test_snapshot_then_stream(tmp_path: Path, postgres_dsn: str) -> None:
    sql(
        postgres_dsn,
        "CREATE TABLE users (id int PRIMARY KEY, name text, score float8, ok boolean)",
        "INSERT INTO users SELECT g, 'u' || g, g / 2.0, g % 2 = 0 FROM generate_series(1, 50) g",
    )
    pipeline = pg_pipeline(tmp_path, postgres_dsn, tables=["public.users"])
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    out = read_envelopes(tmp_path / "out.jsonl")
    assert len(out) == 50 and {e["op"] for e in out} == {"r"}
    assert out[0]["after"] == {"id": 1, "name": "u1", "score": 0.5, "ok": False}
    sql(
        postgres_dsn,
        "UPDATE users SET name = 'x' WHERE id = 2",
        "DELETE FROM users WHERE id = 3",
        "INSERT INTO users VALUES (100, 'new', 'NaN', true)",
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    out = read_envelopes(tmp_path / "out.jsonl")[50:]
    assert [(e["op"], e["key"]) for e in out] == [
        ("u", {"id": 2}),
        ("d", {"id": 3}),
        ("c", {"id": 100}),
    ]
    assert out[0]["after"]["name"] == "x" and out[0]["before"] == {"id": 2}
    assert out[2]["after"]["score"] == "NaN"
    assert out[0]["source"]["connector"] == "postgres"
    assert out[0]["source"]["table"] == "public.users"
    assert out[0]["source"]["position"].endswith(":0")


WORKLOAD_SCHEMA = [
    "CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')",
    "CREATE TYPE pair AS (a int, b text)",
    "CREATE DOMAIN posint AS integer CHECK (VALUE > 0)",
    """CREATE TABLE everything (
        id serial PRIMARY KEY, c_int2 smallint, c_int4 integer, c_int8 bigint,
        c_num numeric(20, 6), c_float4 real, c_float8 double precision, c_bool boolean,
        c_text text, c_varchar varchar(20), c_char char(5), c_bytea bytea, c_date date,
        c_time time, c_timetz timetz, c_ts timestamp, c_tstz timestamptz,
        c_interval interval, c_uuid uuid, c_json json, c_jsonb jsonb, c_int_arr int[],
        c_text_arr text[], c_enum mood, c_comp pair, c_domain posint, c_inet inet,
        c_big text)""",
    "CREATE TABLE full_identity (id int PRIMARY KEY, v text, big text)",
    "ALTER TABLE full_identity REPLICA IDENTITY FULL",
    "CREATE TABLE no_identity (v text)",
    "ALTER TABLE no_identity REPLICA IDENTITY NOTHING",
    "CREATE TABLE bulk (id int PRIMARY KEY, v text)",
    # Tables whose key changes between a change and its decode.
    "CREATE TABLE k_dropped (id int PRIMARY KEY, v text)",
    "CREATE TABLE k_rekeyed (id int PRIMARY KEY, code int NOT NULL, v text)",
    "CREATE TABLE k_reidentified (id int PRIMARY KEY, code int NOT NULL, v text)",
    "CREATE UNIQUE INDEX k_reidentified_code ON k_reidentified (code)",
    "CREATE TABLE k_keyless (a int NOT NULL, v int)",
    "CREATE TABLE k_toast (k text PRIMARY KEY, big text, v int)",
    "ALTER TABLE k_toast ALTER COLUMN k SET STORAGE EXTERNAL",
    "ALTER TABLE k_toast ALTER COLUMN big SET STORAGE EXTERNAL",
    "CREATE TABLE k_toast_full (k text PRIMARY KEY, big text, v int)",
    "ALTER TABLE k_toast_full ALTER COLUMN k SET STORAGE EXTERNAL",
    "ALTER TABLE k_toast_full REPLICA IDENTITY FULL",
    "CREATE TABLE k_full (id int PRIMARY KEY, v text, extra int)",
    "ALTER TABLE k_full REPLICA IDENTITY FULL",
    "CREATE TABLE k_spill (id int PRIMARY KEY, v text)",
]
TABLES = ["public.everything", "public.full_identity", "public.no_identity", "public.bulk"]
TABLES += ["public.k_dropped", "public.k_rekeyed", "public.k_reidentified", "public.k_keyless"]
TABLES += ["public.k_toast", "public.k_toast_full", "public.k_full", "public.k_spill"]
KEY_WORKLOAD = [
    "INSERT INTO k_dropped VALUES (1, 'x')",
    "UPDATE k_dropped SET v = 'y'",
    "UPDATE k_dropped SET id = 2",  # a key change
    "DELETE FROM k_dropped",
    "DROP TABLE k_dropped",
    "INSERT INTO k_rekeyed VALUES (1, 10, 'x')",
    "UPDATE k_rekeyed SET v = 'y'",
    "ALTER TABLE k_rekeyed DROP CONSTRAINT k_rekeyed_pkey, ADD PRIMARY KEY (code)",
    "UPDATE k_rekeyed SET v = 'z'",
    "DELETE FROM k_rekeyed",
    "INSERT INTO k_reidentified VALUES (1, 10, 'x')",
    "UPDATE k_reidentified SET v = 'y'",
    "ALTER TABLE k_reidentified REPLICA IDENTITY USING INDEX k_reidentified_code",
    "UPDATE k_reidentified SET v = 'z'",
    "DELETE FROM k_reidentified",
    "ALTER TABLE k_reidentified REPLICA IDENTITY DEFAULT",
    "INSERT INTO k_keyless VALUES (1, 1)",
    "ALTER TABLE k_keyless ADD PRIMARY KEY (a)",
    "UPDATE k_keyless SET v = 2",
    "DELETE FROM k_keyless",
    "ALTER TABLE k_keyless DROP CONSTRAINT k_keyless_pkey",
    "INSERT INTO k_toast VALUES (repeat('k', 2000), repeat('b', 3000), 1)",
    "UPDATE k_toast SET v = 2",
    "UPDATE k_toast SET big = 'small'",
    "DELETE FROM k_toast",
    "INSERT INTO k_toast_full VALUES (repeat('k', 2000), repeat('b', 3000), 1)",
    "UPDATE k_toast_full SET v = 2",
    "DELETE FROM k_toast_full",
    "INSERT INTO k_full VALUES (1, 'x', 5)",
    "UPDATE k_full SET v = 'y'",
    "ALTER TABLE k_full DROP COLUMN extra",
    "UPDATE k_full SET v = 'z'",
    "DELETE FROM k_full",
    "DROP TABLE k_full",
    # A transaction larger than logical_decoding_work_mem, with DDL in the middle.
    "BEGIN",
    "INSERT INTO k_spill SELECT g, 'row ' || g FROM generate_series(1, 3000) g",
    "ALTER TABLE k_spill ADD COLUMN extra int",
    "UPDATE k_spill SET extra = id WHERE id <= 1000",
    "DELETE FROM k_spill WHERE id > 2000",
    "COMMIT",
]

ROW = """INSERT INTO everything (c_int2, c_int4, c_int8, c_num, c_float4, c_float8, c_bool,
    c_text, c_varchar, c_char, c_bytea, c_date, c_time, c_timetz, c_ts, c_tstz, c_interval,
    c_uuid, c_json, c_jsonb, c_int_arr, c_text_arr, c_enum, c_comp, c_domain, c_inet, c_big)
    VALUES ({i}, {i} * 1000, {i} * 1000000000::bigint, {i} / 7.0, {i} / 3.0, {i} / 9.0, {i} % 2 = 0,
    'line ' || {i} || E'\\nsecond ''quoted'' line ünïcode ✓ €', 'v{i}', 'c{i}',
    '\\xdeadbeef'::bytea, DATE '2026-11-21' + {i}, TIME '12:34:56.789', TIMETZ '12:00+05:30',
    TIMESTAMP '2026-11-21 10:00:00.123456' + {i} * INTERVAL '1 hour',
    TIMESTAMPTZ '2026-11-21 10:00:00+00', INTERVAL '1 day 02:03:04', gen_random_uuid(),
    '{{"a": [1, 2, {{"b": null}}]}}', '{{"z": 1, "a": "x"}}', ARRAY[1, {i}, NULL],
    ARRAY['a b', 'c"d', NULL], 'happy', ROW({i}, 'p q'), {i} + 1, '10.0.0.{i}/32',
    {big})"""


def big_text(seed: int) -> str:
    # Incompressible, so PostgreSQL stores it out of line (TOAST).
    import hashlib

    chunks = [hashlib.sha256(f"{seed}-{k}".encode()).hexdigest() for k in range(400)]
    return "'" + "".join(chunks) + "'"


def run_workload(dsn: str) -> None:
    statements = [ROW.format(i=i, big=big_text(i) if i % 3 == 0 else "NULL") for i in range(1, 13)]
    statements += [
        "INSERT INTO everything (c_float4, c_float8, c_num) VALUES ('NaN', 'Infinity', 'NaN')",
        "INSERT INTO everything (c_float8) VALUES ('-Infinity')",
        "INSERT INTO everything (c_text) VALUES (NULL)",
        # One transaction, several statements.
        "BEGIN",
        "UPDATE everything SET c_int4 = -1, c_text = 'changed' WHERE id = 2",
        "DELETE FROM everything WHERE id = 5",
        "INSERT INTO everything (c_int4) VALUES (42)",
        "COMMIT",
        # A TOASTed column left unchanged by an update.
        "UPDATE everything SET c_int2 = 7 WHERE id = 3",
        "INSERT INTO full_identity VALUES (1, 'one', " + big_text(99) + "), (2, 'two', NULL)",
        "UPDATE full_identity SET v = 'uno' WHERE id = 1",
        "DELETE FROM full_identity WHERE id = 2",
        "INSERT INTO no_identity VALUES ('a'), ('b')",
        # A 100,000-row transaction.
        "INSERT INTO bulk SELECT g, 'row ' || g FROM generate_series(1, 100000) g",
        "UPDATE bulk SET v = 'x' WHERE id <= 3",
        "TRUNCATE bulk",
        "INSERT INTO bulk VALUES (1, 'after truncate')",
        *KEY_WORKLOAD,
    ]
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        for statement in statements:
            cur.execute(statement)
    conn.close()


def oracle_changes(dsn: str) -> list[tuple[str, str, Any, Any]]:
    from pg_oracle import oracle_lines, parse_change

    changes = [parse_change(line) for line in oracle_lines(dsn)]
    return [c for c in changes if c[1] in TABLES]


def test_the_stream_agrees_change_for_change_with_test_decoding(
    tmp_path: Path, postgres_dsn: str
) -> None:
    from pg_oracle import UNCHANGED, as_text, same_row

    sql(postgres_dsn, *WORKLOAD_SCHEMA)
    # Decoding spills every transaction over 64kB to disk, the 100,000-row one included.
    database = postgres_dsn.split("dbname=")[1].split()[0]
    sql(postgres_dsn, f"ALTER DATABASE {database} SET logical_decoding_work_mem = '64kB'")
    pipeline = pg_pipeline(tmp_path, postgres_dsn, tables=TABLES, batch_updates=5000)
    first = run_cli("run", str(pipeline), "--once", cwd=tmp_path)  # slot + (empty) snapshot
    assert first.returncode == 0, first
    sql(postgres_dsn, "SELECT pg_create_logical_replication_slot('oracle', 'test_decoding')")
    run_workload(postgres_dsn)
    result = run_cli("run", str(pipeline), "--once", "--json", cwd=tmp_path)
    assert result.returncode == 0, result
    ours = read_envelopes(tmp_path / "out.jsonl")
    # A truncate reaches every shard; the oracle prints it once. A key change is one
    # UPDATE for the oracle, a delete and an insert at the same position for us.
    seen_truncates: set[str] = set()
    collapsed = []
    for e in ours:
        if e["op"] == "t":
            if e["source"]["position"] in seen_truncates:
                continue
            seen_truncates.add(e["source"]["position"])
        previous = collapsed[-1] if collapsed else {"op": None}
        if (e["op"], previous["op"]) == ("c", "d") and (
            previous["source"]["position"] == e["source"]["position"]
        ):
            collapsed[-1] = {**e, "op": "u", "before": previous["before"]}
            collapsed[-1]["old_key"] = previous["key"]
            continue
        collapsed.append(e)
    oracle = oracle_changes(postgres_dsn)
    assert len(oracle) > 100_000
    assert len(collapsed) == len(oracle)
    for index, (e, (op, table, old, new)) in enumerate(zip(collapsed, oracle, strict=True)):
        where = f"change {index}: {op} {table}"
        assert (e["op"], e["source"]["table"]) == (op, table), where
        if new is not None:
            assert same_row(e["after"], new, old), f"{where}: {str(e['after'])[:300]}"
        if op == "d" or (op == "u" and old is not None):  # key columns, or FULL: the old row
            assert same_row(e["before"], old, skip_nulls=True), f"{where}: {str(e['before'])[:300]}"
        # A key holds the values the WAL has for the row; never a TOAST placeholder.
        row = old if op == "d" else new
        old_key = e.get("old_key", e["key"] if op != "c" else {})
        for name, value in e["key"].items():
            assert as_text(value) is not UNCHANGED, where
            if op != "d" and row[name] is not UNCHANGED:
                assert as_text(value) == row[name], where
        for name, value in old_key.items():
            if old is not None and name in old:
                assert as_text(value) == old[name], where
    keyed = [
        (e["op"], e["source"]["table"][9:], e.get("old_key"), e["key"])
        for e in collapsed
        if e["source"]["table"].startswith("public.k_") and e["source"]["table"] != "public.k_spill"
    ]
    big = "k" * 2000
    assert keyed == [
        ("c", "dropped", None, {"id": 1}),
        ("u", "dropped", None, {"id": 1}),
        ("u", "dropped", {"id": 1}, {"id": 2}),
        ("d", "dropped", None, {"id": 2}),
        ("c", "rekeyed", None, {"id": 1}),
        ("u", "rekeyed", None, {"id": 1}),
        ("u", "rekeyed", None, {"code": 10}),
        ("d", "rekeyed", None, {"code": 10}),
        ("c", "reidentified", None, {"id": 1}),
        ("u", "reidentified", None, {"id": 1}),
        ("u", "reidentified", None, {"code": 10}),
        ("d", "reidentified", None, {"code": 10}),
        ("c", "keyless", None, {"a": 1, "v": 1}),
        ("u", "keyless", None, {"a": 1}),
        ("d", "keyless", None, {"a": 1}),
        ("c", "toast", None, {"k": big}),
        ("u", "toast", None, {"k": big}),
        ("u", "toast", None, {"k": big}),
        ("d", "toast", None, {"k": big}),
        ("c", "toast_full", None, {"k": big}),
        ("u", "toast_full", None, {"k": big}),
        ("d", "toast_full", None, {"k": big}),
        ("c", "full", None, {"id": 1}),
        ("u", "full", None, {"id": 1}),
        ("u", "full", None, {"id": 1}),
        ("d", "full", None, {"id": 1}),
    ]
    spill = [e for e in collapsed if e["source"]["table"] == "public.k_spill"]
    assert len(spill) == 3000 + 1000 + 1000 and len({e["source"]["txid"] for e in spill}) == 1
    assert all(e["key"] == {"id": e["after"]["id"]} for e in spill if e["op"] != "d")
    conn = psycopg2.connect(postgres_dsn)
    with conn.cursor() as cur:
        cur.execute("SELECT slot_name, spill_txns FROM pg_stat_replication_slots")
        spilled = dict(cur.fetchall())
    conn.close()
    assert spilled.get("wormhole_pg", 0) > 0, spilled
    # The unchanged TOASTed value is marked, never invented; FULL identity carries it.
    toast = [
        e
        for e in collapsed
        if e["op"] == "u" and e["key"] == {"id": 3} and e["source"]["table"] == "public.everything"
    ]
    assert as_text(toast[0]["after"]["c_big"]) is UNCHANGED
    full = [
        e for e in collapsed if e["op"] == "u" and e["source"]["table"] == "public.full_identity"
    ]
    assert full[0]["after"]["big"].startswith(big_text(99)[1:20])
    assert (
        len({e["source"]["txid"] for e in collapsed if e["source"]["table"] == "public.bulk"}) == 4
    )
    # The slot moved past the last transaction, now durable in the publisher log.
    last_commit = collapsed[-1]["source"]["position"].split(":")[0]
    conn = psycopg2.connect(postgres_dsn)
    with conn.cursor() as cur:
        cur.execute(
            "SELECT confirmed_flush_lsn > %s::pg_lsn FROM pg_replication_slots "
            "WHERE slot_name = 'wormhole_pg'",
            (last_commit,),
        )
        assert cur.fetchone()[0], "confirmed_flush_lsn did not reach the last commit"
    conn.close()


def _events_pipeline(tmp_path: Path, dsn: str, **source: Any) -> Path:
    return pg_pipeline(tmp_path, dsn, tables=["public.events"], **source)


def _write_rounds(dsn: str, keys: int, rounds: range) -> None:
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        for n in rounds:
            cur.execute(
                "INSERT INTO events SELECT g, %s FROM generate_series(0, %s) g "
                "ON CONFLICT (id) DO UPDATE SET n = excluded.n",
                (n, keys - 1),
            )
    conn.close()


def test_kill_9_during_a_million_row_stream_loses_nothing(
    tmp_path: Path, postgres_dsn: str
) -> None:
    import signal
    import subprocess
    import threading
    import time

    keys, rounds = 10_000, 100
    sql(postgres_dsn, "CREATE TABLE events (id int PRIMARY KEY, n int NOT NULL)")
    pipeline = _events_pipeline(tmp_path, postgres_dsn, snapshot="never")
    assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
    out = tmp_path / "out.jsonl"
    writer = threading.Thread(target=_write_rounds, args=(postgres_dsn, keys, range(rounds)))
    proc = subprocess.Popen(
        cli_command("run", str(pipeline)),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    writer.start()
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and out.stat().st_size > 20_000_000):
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        writer.join()
        if proc.poll() is None:
            proc.kill()
    before = out.read_bytes().count(b"\n")
    assert before < keys * rounds, "the kill was not mid-stream"
    result = run_cli("run", str(pipeline), "--once", "--json", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result
    duplicates = check_rounds(out, keys, rounds)
    assert out.read_bytes().count(b"\n") == keys * rounds + duplicates


def test_a_server_restart_mid_stream_reconnects(
    tmp_path: Path, postgres_dsn: str, postgres_server: Any
) -> None:
    import time

    from wormhole.testing.postgres import restart_postgres

    sql(postgres_dsn, "CREATE TABLE events (id int PRIMARY KEY, n int NOT NULL)")
    pipeline = _events_pipeline(tmp_path, postgres_dsn, snapshot="never")
    assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
    out = tmp_path / "out.jsonl"
    proc = start_cli("run", str(pipeline), cwd=tmp_path)
    try:
        _write_rounds(postgres_dsn, 100, range(5))
        deadline = time.monotonic() + 60
        while not (out.exists() and out.read_bytes().count(b"\n") >= 500):
            assert time.monotonic() < deadline, "no delivery before the restart"
            time.sleep(0.05)
        restart_postgres(postgres_server, mode="immediate")
        _write_rounds(postgres_dsn, 100, range(5, 10))
        while out.read_bytes().count(b"\n") < 1000:
            assert time.monotonic() < deadline + 60, "no delivery after the restart"
            time.sleep(0.05)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "lost the replication connection" in err and "reconnected to PostgreSQL" in err
    check_rounds(out, 100, 10)


def test_a_dropped_slot_or_publication_is_fatal_with_a_clear_message(
    tmp_path: Path, postgres_dsn: str
) -> None:
    sql(postgres_dsn, "CREATE TABLE events (id int PRIMARY KEY, n int NOT NULL)")
    pipeline = _events_pipeline(tmp_path, postgres_dsn)
    assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
    sql(postgres_dsn, "DROP PUBLICATION wormhole_pg")
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 2, result
    assert "publication 'wormhole_pg' does not exist" in result.stderr
    assert "Traceback" not in result.stderr
    sql(
        postgres_dsn,
        "CREATE PUBLICATION wormhole_pg FOR TABLE events",
        "SELECT pg_drop_replication_slot('wormhole_pg')",
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 2, result
    assert "replication slot 'wormhole_pg' does not exist" in result.stderr
    assert "it is not recreated silently" in result.stderr


def test_run_once_delivers_what_was_committed_asynchronously_before_it(tmp_path: Path) -> None:
    """With synchronous_commit off, COMMIT returns before its WAL is written: the WAL writer
    writes it up to wal_writer_delay later (10 s on this cluster of the test's own, so that
    the window stays open while `run --once` starts). The change was committed before the
    run, so the run delivers it, and ends even when nothing is written after it. The end
    marker each run writes reaches no reader of the WAL."""
    import random

    from wormhole.testing.postgres import start_postgres

    rng = random.Random(20261207)
    cluster = start_postgres(settings={"wal_writer_delay": "10s"})
    server = next(cluster)
    try:
        dsn = server.dsn()
        sql(dsn, "CREATE TABLE events (id int PRIMARY KEY, n int NOT NULL)")
        pipeline = _events_pipeline(tmp_path, dsn)
        assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
        # Another reader of the WAL, which would print the runs' end markers if it got them.
        sql(dsn, "SELECT pg_create_logical_replication_slot('observer', 'test_decoding')")
        writer = psycopg2.connect(dsn)
        writer.autocommit = True
        cur = writer.cursor()
        cur.execute("SET synchronous_commit TO off")
        expected: list[dict[str, int]] = []
        unwritten_rounds = 0
        deadline = time.monotonic() + 60
        for round_ in range(4):
            if round_ and time.monotonic() > deadline:
                break
            for _ in range(rng.randint(1, 3)):
                row = {"id": len(expected) + 1, "n": rng.randrange(1_000_000)}
                cur.execute("INSERT INTO events VALUES (%(id)s, %(n)s)", row)
                expected.append(row)
            # Whether the last commit's WAL is still unwritten (the case under test).
            cur.execute("SELECT pg_current_wal_lsn() < pg_current_wal_insert_lsn()")
            unwritten_rounds += cur.fetchone()[0]
            result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, timeout=120)
            assert result.returncode == 0, result
            out = read_envelopes(tmp_path / "out.jsonl")
            assert [e["after"] for e in out] == expected, f"round {round_}"
        cur.execute("SELECT data FROM pg_logical_slot_get_changes('observer', NULL, NULL)")
        seen = [data for (data,) in cur.fetchall()]
        assert sum(data.startswith("table public.events: INSERT") for data in seen) == len(expected)
        assert not [data for data in seen if "message" in data], seen
        writer.close()
        # Not vacuous: at least once, the run started while the commit was only in memory.
        assert unwritten_rounds > 0
    finally:
        cluster.close()


def test_run_once_names_the_privilege_its_end_marker_needs(
    tmp_path: Path, postgres_dsn: str
) -> None:
    """`run --once` writes a logical decoding message to mark its end: without EXECUTE on
    pg_logical_emit_message (PUBLIC has it unless revoked), it stops and says so."""
    role = f"once_{os.getpid()}"
    sql(
        postgres_dsn,
        "CREATE TABLE events (id int PRIMARY KEY, n int NOT NULL)",
        f"CREATE ROLE {role} LOGIN REPLICATION",
        f"GRANT SELECT ON events TO {role}",
        "CREATE PUBLICATION wormhole_pg FOR TABLE events",
    )
    try:
        dsn = postgres_dsn.replace("user=postgres", f"user={role}")
        pipeline = _events_pipeline(tmp_path, dsn)
        assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
        sql(
            postgres_dsn,
            "INSERT INTO events VALUES (1, 1)",
            "REVOKE EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) FROM PUBLIC",
        )
        result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
        assert result.returncode == 2, result
        assert "permission denied for function pg_logical_emit_message" in result.stderr
        assert "grant EXECUTE on the function pg_logical_emit_message to the DSN's user" in (
            result.stderr
        )
        assert "Traceback" not in result.stderr
        sql(
            postgres_dsn,
            f"GRANT EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) TO {role}",
        )
        result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
        assert result.returncode == 0, result
        assert [e["after"] for e in read_envelopes(tmp_path / "out.jsonl")] == [{"id": 1, "n": 1}]
    finally:
        # The role is the cluster's: its grants (in this database) go, then the role.
        sql(postgres_dsn, f"DROP OWNED BY {role}", f"DROP ROLE {role}")


def test_an_unreachable_server_is_named(tmp_path: Path) -> None:
    from wormhole.testing import free_port

    dsn = f"host=127.0.0.1 port={free_port()} dbname=nope user=postgres connect_timeout=2"
    result = run_cli("run", str(pg_pipeline(tmp_path, dsn)), "--once", cwd=tmp_path)
    assert result.returncode == 2, result
    assert "source.dsn: cannot connect to PostgreSQL" in result.stderr


def test_schema_changes_heartbeats_and_key_changes(tmp_path: Path, postgres_dsn: str) -> None:
    sql(postgres_dsn, "CREATE TABLE events (id int PRIMARY KEY, n int NOT NULL)")
    pipeline = _events_pipeline(
        tmp_path, postgres_dsn, heartbeat={"table": "public.events_heartbeat", "interval_s": 0.05}
    )
    assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
    sql(
        postgres_dsn,
        "INSERT INTO events VALUES (1, 1)",
        "ALTER TABLE events ADD COLUMN label text DEFAULT 'x'",
        "INSERT INTO events VALUES (2, 2, 'two')",
        "UPDATE events SET id = 3 WHERE id = 2",  # a key change
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    out = read_envelopes(tmp_path / "out.jsonl")
    assert out[0]["after"] == {"id": 1, "n": 1}
    assert out[1]["after"] == {"id": 2, "n": 2, "label": "two"}
    assert [(e["op"], e["key"]) for e in out[2:]] == [("d", {"id": 2}), ("c", {"id": 3})]
    assert {e["source"]["table"] for e in out} == {"public.events"}  # no heartbeats
    conn = psycopg2.connect(postgres_dsn)
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM events_heartbeat")
        assert cur.fetchone()[0] == 1
    conn.close()


KEY_SCHEMA = [
    "CREATE TABLE a1 (id int PRIMARY KEY, v text)",
    "CREATE TABLE a2 (id2 int NOT NULL, v int)",
    "CREATE TABLE a3 (id int PRIMARY KEY, code int NOT NULL, v int)",
    "CREATE UNIQUE INDEX a3_code ON a3 (code)",
    # Key values stored out of line: an update that leaves them alone does not send them.
    "CREATE TABLE b1 (k text PRIMARY KEY, big text, v int)",
    "ALTER TABLE b1 ALTER COLUMN k SET STORAGE EXTERNAL, ALTER COLUMN big SET STORAGE EXTERNAL",
    "CREATE TABLE b2 (k text PRIMARY KEY, big text, v int)",
    "ALTER TABLE b2 ALTER COLUMN k SET STORAGE EXTERNAL, ALTER COLUMN big SET STORAGE EXTERNAL",
    "ALTER TABLE b2 REPLICA IDENTITY FULL",
    "CREATE TABLE f1 (id int PRIMARY KEY, v text, extra int)",
    "ALTER TABLE f1 REPLICA IDENTITY FULL",
    "CREATE TABLE f2 (id int PRIMARY KEY, v text)",
    "ALTER TABLE f2 REPLICA IDENTITY FULL",
    "CREATE TABLE n1 (id int PRIMARY KEY, v text)",
    "ALTER TABLE n1 REPLICA IDENTITY NOTHING",
]
KEY_TABLES = ["public.a1", "public.a2", "public.a3", "public.b1", "public.b2"]
KEY_TABLES += ["public.f1", "public.f2", "public.n1"]
BIG_KEY = "repeat('k', 2000)"
# Each step's DDL comes before its changes, so that a run after each step decodes every
# change before any later DDL: the keys as the catalog had them at once.
KEY_STEPS = [
    [
        "INSERT INTO a1 VALUES (1, 'x')",
        "UPDATE a1 SET v = 'y' WHERE id = 1",
        "DELETE FROM a1 WHERE id = 1",
        "INSERT INTO a2 VALUES (1, 10)",
        "INSERT INTO a3 VALUES (1, 100, 1)",
        "UPDATE a3 SET v = 2",
        f"INSERT INTO b1 VALUES ({BIG_KEY}, repeat('b', 2000), 1)",
        "UPDATE b1 SET v = 2",
        f"INSERT INTO b2 VALUES ({BIG_KEY}, repeat('b', 2000), 1)",
        "UPDATE b2 SET v = 2",
        "DELETE FROM b2",
        "INSERT INTO f1 VALUES (1, 'x', 5)",
        "UPDATE f1 SET v = 'y'",
        "INSERT INTO f2 VALUES (1, 'x')",
        "UPDATE f2 SET v = 'y'",
        "INSERT INTO n1 VALUES (1, 'x')",
    ],
    [
        "DROP TABLE a1",
        "ALTER TABLE a2 ADD COLUMN id serial PRIMARY KEY",
        "INSERT INTO a2 (id2, v) VALUES (2, 20)",
        "ALTER TABLE a3 REPLICA IDENTITY USING INDEX a3_code",
        "UPDATE a3 SET v = 3",
        "ALTER TABLE f1 DROP COLUMN extra",
        "UPDATE f1 SET v = 'z'",
        "ALTER TABLE f2 DROP CONSTRAINT f2_pkey, ADD COLUMN uid serial PRIMARY KEY",
        "UPDATE f2 SET v = 'z'",
        "DROP TABLE b1, b2, n1",
    ],
    [
        "DROP TABLE f1",
        "ALTER TABLE a2 DROP CONSTRAINT a2_pkey",
        "ALTER TABLE a3 REPLICA IDENTITY DEFAULT",
    ],
]


def _keys_pipeline(tmp_path: Path, dsn: str, name: str) -> Path:
    return write_pipeline(
        tmp_path / f"{name}.yml",
        {
            "pipeline": name,
            "state_dir": str(tmp_path / name),
            "source": {"type": "postgres", "dsn": dsn, "tables": KEY_TABLES, "publication": "k"},
            "transport": {"type": "inprocess"},
            "applications": {
                "out": {"sink": {"type": "jsonl", "path": str(tmp_path / name / "out.jsonl")}}
            },
        },
    )


def test_a_change_is_keyed_as_its_table_was_whether_decoded_at_once_or_after_ddl(
    tmp_path: Path, postgres_dsn: str
) -> None:
    sql(postgres_dsn, *KEY_SCHEMA)
    prompt = _keys_pipeline(tmp_path, postgres_dsn, "prompt")
    late = _keys_pipeline(tmp_path, postgres_dsn, "late")
    for pipeline in (prompt, late):  # both slots start before the first change
        assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
    for step in KEY_STEPS:
        sql(postgres_dsn, *step)
        result = run_cli("run", str(prompt), "--once", cwd=tmp_path)
        assert result.returncode == 0, result
        assert "is not known" not in result.stderr
    result = run_cli("run", str(late), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    # f1's second version was dropped before it was decoded: its key comes from the
    # version recorded at the slot's start, whose key columns it still has.
    assert "the primary key of public.f1 at" in result.stderr
    assert "keying its changes by the primary key recorded at" in result.stderr

    def keys(name: str) -> list[tuple[str, str, dict[str, Any], str]]:
        return [
            (e["op"], e["source"]["table"][7:], e["key"], e["source"]["position"])
            for e in read_envelopes(tmp_path / name / "out.jsonl")
        ]

    at_once, after_ddl = keys("prompt"), keys("late")
    assert after_ddl == at_once
    big = "k" * 2000
    expected = [
        ("c", "a1", {"id": 1}),
        ("u", "a1", {"id": 1}),
        ("d", "a1", {"id": 1}),
        ("c", "a2", {"id2": 1, "v": 10}),  # no primary key yet: every column
        ("c", "a3", {"id": 1}),
        ("u", "a3", {"id": 1}),
        ("c", "b1", {"k": big}),
        ("u", "b1", {"k": big}),  # the key did not change: one update, never a key change
        ("c", "b2", {"k": big}),
        ("u", "b2", {"k": big}),
        ("d", "b2", {"k": big}),
        ("c", "f1", {"id": 1}),
        ("u", "f1", {"id": 1}),
        ("c", "f2", {"id": 1}),
        ("u", "f2", {"id": 1}),
        ("c", "n1", {"id": 1}),
        ("c", "a2", {"id": 2}),
        ("u", "a3", {"code": 100}),
        ("u", "f1", {"id": 1}),
        ("u", "f2", {"uid": 1}),
    ]
    assert [k[:3] for k in at_once] == expected
    b1 = [e for e in read_envelopes(tmp_path / "late" / "out.jsonl") if e["op"] == "u"][2]
    assert b1["source"]["table"] == "public.b1" and b1["after"]["k"] == big


def test_an_unchanged_toasted_key_missing_from_the_wal_stops_with_the_fix_named(
    tmp_path: Path, postgres_dsn: str, caplog: Any
) -> None:
    """Servers before the May 2022 minor releases leave such a key out of the WAL.

    No such server runs here: its UPDATE message (no old key, the key marked as an
    unchanged TOASTed value) is built by hand; the catalog checks use the real server.
    """
    import logging
    import struct

    import pytest

    from wormhole.connectors.postgres import pgoutput as pg
    from wormhole.connectors.postgres.catalog import logs_unchanged_toasted_keys
    from wormhole.connectors.postgres.options import PostgresOptions
    from wormhole.connectors.postgres.schema_history import SchemaHistory
    from wormhole.connectors.postgres.source import PostgresSource
    from wormhole.core.errors import SourceError

    assert not logs_unchanged_toasted_keys(140002) and logs_unchanged_toasted_keys(140003)
    assert not logs_unchanged_toasted_keys(100020) and logs_unchanged_toasted_keys(100021)
    assert logs_unchanged_toasted_keys(150000) and not logs_unchanged_toasted_keys(90624)
    sql(
        postgres_dsn,
        "CREATE TABLE b1 (k text PRIMARY KEY, v int)",
        "CREATE TABLE ints (id int PRIMARY KEY, v text)",
        "CREATE TABLE whole (k text PRIMARY KEY, v int)",
        "ALTER TABLE whole REPLICA IDENTITY FULL",
        "CREATE PUBLICATION p FOR TABLE b1, ints, whole",
    )
    source = PostgresSource(PostgresOptions(dsn=postgres_dsn))
    source.conn = source.admin.connect()
    source.publication = "p"
    try:
        for version, warned in ((140002, True), (140003, False), (150004, False)):
            source.server_version = version
            caplog.clear()
            with caplog.at_level(logging.WARNING, "wormhole.postgres"):
                source.catalog.warn_about_out_of_line_keys()
            listed = "can be stored out of line: public.b1. Set ALTER TABLE" in caplog.text
            assert listed is warned, caplog.text
            assert "REPLICA IDENTITY FULL" in caplog.text or not warned
            assert "ints" not in caplog.text and "whole" not in caplog.text
        source.history = SchemaHistory(tmp_path / "history.json")
        relation = pg.parse_relation(
            b"R"
            + struct.pack("!I", 7)
            + b"public\0b1\0d"
            + struct.pack("!H", 2)
            + (b"\x01k\0" + struct.pack("!Ii", 25, -1))  # flags 1: an identity column
            + (b"\x00v\0" + struct.pack("!Ii", 23, -1))
        )
        source.catalog.describe(relation)
        assert relation.key_columns == ["k"]
        # New tuple only: k unchanged TOAST ('u'), v = '2' ('t').
        message = b"U" + struct.pack("!I", 7) + b"N" + struct.pack("!H", 2) + b"ut"
        message += struct.pack("!I", 1) + b"2"
        op, _, before, after, unchanged, full = pg.parse_change(message, {7: relation})
        assert (op, before, unchanged) == ("u", None, ["k"])
        with pytest.raises(SourceError) as raised:
            source.stream.changes.change(op, relation, before, after, unchanged, full)
        text = str(raised.value)
        assert "update of public.b1" in text and "key column(s) k unchanged" in text
        assert 'ALTER TABLE "public"."b1" REPLICA IDENTITY FULL' in text
        assert "remove the state_dir" in text
    finally:
        source.conn.close()


def test_a_graceful_stop_while_the_source_reconnects_exits_0(
    tmp_path: Path, postgres_dsn: str
) -> None:
    """SIGTERM while the server is unreachable and the source waits to reconnect: nothing
    is lost or unfinished, so the run ends as any graceful stop does."""
    from tcp_support import Process

    from wormhole.testing import read_envelopes, wait_until
    from wormhole.testing.proxy import ThrottlingProxy

    sql(postgres_dsn, "CREATE TABLE t (id int PRIMARY KEY)", "INSERT INTO t VALUES (1)")
    fields = dict(part.split("=", 1) for part in postgres_dsn.split())
    with ThrottlingProxy(f"{fields['host']}:{fields['port']}") as proxy:
        dsn = " ".join(f"{k}={proxy.port if k == 'port' else v}" for k, v in fields.items())
        publisher = Process(
            "run", str(pg_pipeline(tmp_path, dsn, tables=["public.t"])), cwd=tmp_path
        )
        try:
            out = tmp_path / "out.jsonl"
            wait_until(lambda: len(read_envelopes(out)) == 1, 60, "the snapshot row")
            proxy.refuse()
            proxy.cut()
            wait_until(
                lambda: "lost the replication connection" in publisher.stderr, 60, "a reconnect"
            )
        finally:
            code = publisher.stop()
    assert code == 0, publisher.stderr


def test_a_user_without_replication_is_named_with_the_statement_to_run(
    tmp_path: Path, postgres_dsn: str
) -> None:
    role = f"reader_{tmp_path.name[-12:].lower().replace('-', '_')}"
    sql(postgres_dsn, f'CREATE ROLE "{role}" LOGIN', "CREATE TABLE t (id int PRIMARY KEY)")
    try:
        dsn = postgres_dsn.replace("user=postgres", f"user={role}")
        pipeline = pg_pipeline(tmp_path, dsn, tables=["public.t"])
        result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    finally:
        sql(postgres_dsn, f'DROP ROLE "{role}"')
    assert result.returncode == 2, result
    assert (
        f"source.dsn: the user {role} needs the REPLICATION privilege; as a superuser, run: "
        f"ALTER ROLE {role} WITH REPLICATION"
    ) in result.stderr, result


def _rows_of(dsn: str, table: str) -> dict[int, dict[str, Any]]:
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT * FROM {table}")
            names = [d[0] for d in cur.description]
            return {row[0]: dict(zip(names, row, strict=True)) for row in cur.fetchall()}
    finally:
        conn.close()


def _run_a_snapshot_of_big_and_locked(
    tmp_path: Path, dsn: str, rows: int, stderr: int, **source: Any
) -> tuple[Path, Any]:
    """Tables big (``rows`` rows) and locked (100), and ``wormhole run`` of a pipeline
    reading them (to out.jsonl) started: the pipeline file and the process."""
    import subprocess

    sql(
        dsn,
        "CREATE TABLE big (id int PRIMARY KEY, n int NOT NULL, note text)",
        f"INSERT INTO big SELECT g, g, repeat('x', 100) FROM generate_series(1, {rows}) g",
        "CREATE TABLE locked (id int PRIMARY KEY, v text)",
        "INSERT INTO locked SELECT g, 'v' || g FROM generate_series(1, 100) g",
    )
    pipeline = pg_pipeline(
        tmp_path,
        dsn,
        tables=["public.big", "public.locked"],
        batch_updates=1000,
        **source,
    )
    proc = subprocess.Popen(
        cli_command("run", str(pipeline)), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr
    )
    return pipeline, proc


def _hold_the_snapshot_before_the_locked_table(
    admin: Any, locker: Any, out: Path, rows: int
) -> int:
    """Once the run's slot exists, lock table `locked` (with `locker`, left in its
    transaction) and wait until the snapshot waits for it with the first table's `rows`
    delivered to `out`; returns the locker's backend pid."""
    from wormhole.testing.helpers import wait_until

    with admin.cursor() as cur:

        def slot_made() -> bool:
            cur.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = 'wormhole_pg'")
            return bool(cur.fetchall())

        wait_until(slot_made, 60, "the snapshot's slot")
        with locker.cursor() as lock:  # while the readers are on the first table
            lock.execute("LOCK TABLE locked IN ACCESS EXCLUSIVE MODE NOWAIT")
            lock.execute("SELECT pg_backend_pid()")
            (locker_pid,) = lock.fetchone()

        def waits_for_the_lock() -> bool:
            cur.execute(
                "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'locked'::regclass"
            )
            return bool(cur.fetchone()[0])

        wait_until(waits_for_the_lock, 60, "the snapshot to wait for the locked table")
        wait_until(
            lambda: out.exists() and out.read_bytes().count(b"\n") >= rows,
            60,
            "the first table's rows",
        )
    return int(locker_pid)


def _assert_the_snapshot_taken_again(dsn: str, out: Path) -> str:
    """The last snapshot in `out` (at the newest slot's position) holds every row of
    tables big and locked, once, as they are now; returns that snapshot's LSN."""
    reads = [e for e in read_envelopes(out) if e["op"] == "r"]
    lsn = max((e["source"]["position"].split(":")[0] for e in reads), key=_lsn)
    again = [e for e in reads if e["source"]["position"].split(":")[0] == lsn]
    for table in ("big", "locked"):
        got = [e for e in again if e["source"]["table"] == f"public.{table}"]
        expected = _rows_of(dsn, table)
        assert sorted(e["key"]["id"] for e in got) == sorted(expected), table
        assert {e["key"]["id"]: e["after"] for e in got} == expected, table
    return lsn


def test_kill_9_during_a_parallel_snapshot_takes_it_again_whole_then_streams(
    tmp_path: Path, postgres_dsn: str
) -> None:
    """Two readers split the first table by pages; the kill lands while the snapshot
    waits for the second table (locked by the test once the slot exists). The next run
    drops the slot and takes the snapshot again: each row exactly once, then the stream."""
    import signal
    import subprocess

    rows = 60_000
    pipeline, proc = _run_a_snapshot_of_big_and_locked(
        tmp_path, postgres_dsn, rows, subprocess.DEVNULL, snapshot_readers=2
    )
    out = tmp_path / "out.jsonl"
    admin = psycopg2.connect(postgres_dsn)
    admin.autocommit = True
    locker = psycopg2.connect(postgres_dsn)
    try:
        _hold_the_snapshot_before_the_locked_table(admin, locker, out, rows)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        locker.rollback()
        locker.close()
    first = read_envelopes(out)
    assert {e["source"]["table"] for e in first} == {"public.big"}, "not mid-snapshot"
    ids = [e["key"]["id"] for e in first]
    assert sorted(ids) == list(range(1, rows + 1))
    assert ids != sorted(ids), "the rows came in heap order: the table was not read in parts"
    with admin.cursor() as cur:
        cur.execute("SELECT active FROM pg_replication_slots WHERE slot_name = 'wormhole_pg'")
        assert cur.fetchall() == [(False,)]
    admin.close()
    sql(
        postgres_dsn,
        "UPDATE big SET n = -1 WHERE id % 1000 = 0",
        "DELETE FROM big WHERE id % 1000 = 1",
        "INSERT INTO locked VALUES (1000, 'new')",
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    assert "was interrupted" in result.stderr, result.stderr
    lsn = _assert_the_snapshot_taken_again(postgres_dsn, out)
    sql(
        postgres_dsn,
        "UPDATE locked SET v = 'after' WHERE id = 1",
        "DELETE FROM big WHERE id = 2",
        "INSERT INTO big VALUES (0, 0, 'zero')",
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    # From the second snapshot on (rows the first one delivered and deleted since stay
    # delivered: a sink starting over with the new snapshot drops them).
    envelopes = read_envelopes(out)
    start = next(
        i for i, e in enumerate(envelopes) if e["source"]["position"].startswith(f"{lsn}:")
    )
    for table in ("big", "locked"):
        latest: dict[int, Any] = {}
        for e in envelopes[start:]:
            if e["source"]["table"] == f"public.{table}":
                latest[e["key"]["id"]] = None if e["op"] == "d" else e["after"]
        state = {k: v for k, v in latest.items() if v is not None}
        assert state == _rows_of(postgres_dsn, table), table


def _lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) + int(low, 16)


def test_a_snapshot_reader_that_loses_its_connection_stops_the_run_and_the_next_takes_it_again(
    tmp_path: Path, postgres_dsn: str
) -> None:
    """The readers' connections are cut while the snapshot waits for a locked table: the
    reader's error ends the run (it does not hang), and the next run takes the snapshot
    again, every row of each table once."""
    import subprocess

    pipeline, proc = _run_a_snapshot_of_big_and_locked(
        tmp_path, postgres_dsn, 20000, subprocess.PIPE
    )
    out = tmp_path / "out.jsonl"
    admin = psycopg2.connect(postgres_dsn)
    admin.autocommit = True
    locker = psycopg2.connect(postgres_dsn)
    try:
        locker_pid = _hold_the_snapshot_before_the_locked_table(admin, locker, out, 20000)
        with admin.cursor() as cur:
            # The readers, idle in their snapshot's transaction.
            cur.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = "
                "current_database() AND state = 'idle in transaction' AND backend_type = "
                "'client backend' AND pid <> %s",
                (locker_pid,),
            )
            assert cur.fetchone()[0] == 2
        locker.rollback()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        locker.close()
        admin.close()
    assert proc.returncode == 2, err
    assert b"the initial snapshot failed (server closed the connection" in err, err
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    assert "was interrupted" in result.stderr, result.stderr
    _assert_the_snapshot_taken_again(postgres_dsn, out)


def test_a_stream_position_is_stored_as_the_checkpoint_every_log_holds() -> None:
    """The stream's position goes into the publisher log as the same JSON, byte for byte
    (keys, their order, their types), and comes back from it; a checkpoint of an older
    version (without ``index``, ``complete`` or ``flush``) still resumes."""
    import msgspec

    from wormhole.connectors.postgres.position import StreamPosition

    stored = b'{"phase":"stream","lsn":"0/16B3748","index":41,"complete":false,"flush":"0/16B3500"}'
    position = StreamPosition.from_checkpoint(msgspec.json.decode(stored))
    assert position == StreamPosition(0x16B3748, 41, False, 0x16B3500)
    assert msgspec.json.encode(position.checkpoint()) == stored
    older = StreamPosition.from_checkpoint({"phase": "stream", "lsn": "1/A"})
    assert older == StreamPosition((1 << 32) | 0xA, -1, True, (1 << 32) | 0xA)
    assert StreamPosition.start(0x20).checkpoint() == {
        "phase": "stream",
        "lsn": "0/20",
        "index": -1,
        "complete": True,
        "flush": "0/20",
    }
    # A resent transaction: skipped whole before the position, or up to its index in it.
    assert position.skips(0x16B3747) and not position.skips(0x16B3748)
    assert StreamPosition(0x16B3748, 41, True, 0).skips(0x16B3748)
