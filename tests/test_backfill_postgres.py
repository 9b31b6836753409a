"""Backfills of PostgreSQL tables while the stream flows (DBLog watermarks), against a real
PostgreSQL cluster: values, application scope, bad input, a concurrent writer, kill -9."""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psycopg2
from backfill_support import assert_same_rows, kill_mid_backfill
from backfill_support import backfills as _backfills
from backfill_support import latest as _latest
from backfill_support import stop as _stop

from wormhole.testing import read_envelopes, run_cli, write_pipeline
from wormhole.testing.helpers import cli_command, free_port
from wormhole.testing.postgres import run_sql as sql


def _pipeline(tmp_path: Path, dsn: str, tables: list[str], **extra: Any) -> Path:
    apps = {
        name: {"sink": {"type": "latest", "path": str(tmp_path / f"{name}.sqlite")}}
        for name in ("a", "b")
    }
    return write_pipeline(
        tmp_path / "pg.yml",
        {
            "pipeline": "bf",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "postgres", "dsn": dsn, "tables": tables, "snapshot": "never"},
            "transport": {"type": "inprocess"},
            "applications": apps,
            **extra,
        },
    )


def _table(dsn: str, query: str) -> dict[Any, dict[str, Any]]:
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(query)
            names = [d[0] for d in cur.description]
            return {row[0]: dict(zip(names, row, strict=True)) for row in cur.fetchall()}
    finally:
        conn.close()


def test_a_backfill_for_one_application_with_a_condition_and_bad_input(
    tmp_path: Path, postgres_dsn: str
) -> None:
    sql(
        postgres_dsn,
        "CREATE TABLE items (id int PRIMARY KEY, name text, n bigint, price numeric(10, 2), "
        "ok boolean, score float8, at timestamptz, tags text[], doc jsonb)",
        "INSERT INTO items SELECT g, 'item ' || g, g * 10, g / 4.0, g % 2 = 0, g / 8.0, "
        "'2026-01-01 00:00:00+00'::timestamptz + g * interval '1 minute', "
        "ARRAY['a', 'b' || g], jsonb_build_object('g', g) FROM generate_series(1, 1000) g",
        "CREATE TABLE keyless (v text)",
        "CREATE TABLE elsewhere (id int PRIMARY KEY)",
    )
    pipeline = _pipeline(tmp_path, postgres_dsn, ["public.items", "public.keyless"])
    assert run_cli("run", str(pipeline), "--once").returncode == 0  # the slot, from now on

    for args, words in (
        (["--table", "public.keyless"], ["no primary key", "ADD PRIMARY KEY"]),
        (["--table", "public.elsewhere"], ["not in publication", "ALTER PUBLICATION"]),
        (["--table", "public.nosuch"], ["no table public.nosuch"]),
        (["--table", "public.items", "--where", "nosuch > 1"], ["--where", "nosuch"]),
        (["--table", "public.items", "--where", "id >"], ["--where", "syntax"]),
        (
            ["--table", "public.items", "--where", "true); DELETE FROM items WHERE (true"],
            ["cannot end a statement"],
        ),
        (["--table", "public.items", "--chunk-size", "0"], ["--chunk-size 0"]),
        (["--table", "public.items", "--app", "nobody"], ["--app nobody", "a, b"]),
        ([], ["--table"]),
    ):
        result = run_cli("backfill", str(pipeline), *args)
        assert result.returncode == 2, result
        for word in words:
            assert word in result.stderr, (word, result.stderr)

    result = run_cli(
        "backfill",
        str(pipeline),
        "--table",
        "public.items",
        "--where",
        "id <= 500 AND name LIKE 'item %' AND ';' <> '' -- a comment; with a ;",
        "--app",
        "a",
        "--chunk-size",
        "64",
    )
    assert result.returncode == 0, result
    assert "queued" in result.stdout and "not running" in result.stdout
    again = run_cli("backfill", str(pipeline), "--table", "public.items")
    assert again.returncode == 2 and "already queued" in again.stderr, again
    # Another application's backfill of the same table may run next to it.
    other = run_cli("backfill", str(pipeline), "--table", "public.items", "--app", "b")
    assert other.returncode == 0, other
    cancelled = run_cli("backfill", str(pipeline), "--cancel", "2")
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout, cancelled

    # `run --once` runs the queue to its end, with the stream.
    sql(postgres_dsn, "UPDATE items SET name = 'changed' WHERE id = 7")
    result = run_cli("run", str(pipeline), "--once")
    assert result.returncode == 0, result
    got = _latest(tmp_path / "a.sqlite", "public.items")
    assert sorted(got) == list(range(1, 501))
    expected = _table(
        postgres_dsn,
        "SELECT id, name, n, price::text AS price, ok, score, at::text AS at, tags::text AS "
        "tags, doc::text AS doc FROM items WHERE id <= 500",
    )
    assert got == expected
    # Only application a asked: b has the stream's change and nothing else.
    assert list(_latest(tmp_path / "b.sqlite", "public.items")) == [7]
    [done, gone] = _backfills(pipeline)
    # id 7 no longer meets the condition (its name changed): the stream brought it.
    assert (done["state"], done["rows"], done["read"]) == ("done", 499, 499), done
    assert done["chunks"] >= 8 and done["application"] == "a"
    assert gone["state"] == "cancelled" and gone["rows"] == 0
    status = json.loads(run_cli("status", str(pipeline), "--json").stdout)
    assert [b["state"] for b in status["backfills"]] == ["done", "cancelled"]


class Writer(threading.Thread):
    """Random inserts, updates and deletes in small transactions, aimed at the keys just
    past the backfill's progress (the chunks being read), until stopped."""

    def __init__(self, dsn: str, state_dir: Path, seed: int, keys: int, spread: int) -> None:
        super().__init__(daemon=True)
        self.dsn, self.queue = dsn, state_dir / "backfills.sqlite"
        self.random = random.Random(seed)
        self.keys, self.spread = keys, spread
        self.halt = threading.Event()
        self.writes = 0
        self.failure: BaseException | None = None

    def _position(self) -> int:
        try:
            db = sqlite3.connect(f"file:{self.queue}?mode=ro", uri=True, timeout=5)
            try:
                row = db.execute(
                    "SELECT after_key FROM backfills WHERE state = 'running' ORDER BY id"
                ).fetchone()
            finally:
                db.close()
        except sqlite3.Error:
            return 0
        return int(json.loads(row[0])[0]) if row and row[0] else 0

    def run(self) -> None:
        try:
            conn = psycopg2.connect(self.dsn)
            conn.autocommit = True
            cur = conn.cursor()
            rnd = self.random
            while not self.halt.is_set():
                base = self._position()
                for _ in range(20):
                    key = min(self.keys + 500, base + rnd.randrange(self.spread))
                    op = rnd.random()
                    if op < 0.5:
                        cur.execute("UPDATE orders SET n = n + 1 WHERE id = %s", (key,))
                    elif op < 0.75:
                        cur.execute("DELETE FROM orders WHERE id = %s", (key,))
                    else:
                        cur.execute(
                            "INSERT INTO orders VALUES (%s, %s, 'again') ON CONFLICT (id) DO "
                            "UPDATE SET n = excluded.n, note = 'upserted'",
                            (key, rnd.randrange(1000)),
                        )
                    self.writes += 1
            conn.close()
        except BaseException as exc:  # reported by the test
            self.failure = exc


def _fill_orders(dsn: str, rows: int) -> None:
    sql(
        dsn,
        "CREATE TABLE orders (id int PRIMARY KEY, n int NOT NULL, note text)",
        f"INSERT INTO orders SELECT g, g % 1000, 'order ' || g FROM generate_series(1, {rows}) g",
        "ANALYZE orders",
    )


def _assert_state_equals_select(tmp_path: Path, dsn: str, apps: tuple[str, ...]) -> None:
    expected = _table(dsn, "SELECT id, n, note FROM orders")
    for app in apps:
        assert_same_rows(_latest(tmp_path / f"{app}.sqlite", "public.orders"), expected, app)


def test_a_backfill_while_a_writer_changes_the_chunks_being_read(
    tmp_path: Path, postgres_dsn: str
) -> None:
    rows = 200_000
    _fill_orders(postgres_dsn, rows)
    pipeline = _pipeline(tmp_path, postgres_dsn, ["public.orders"])
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    metrics = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        cli_command("run", str(pipeline), "--metrics", metrics),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    writer = Writer(postgres_dsn, tmp_path / "state", seed=21, keys=rows, spread=4_000)
    writer.start()
    try:
        result = run_cli(
            "backfill",
            str(pipeline),
            "--table",
            "public.orders",
            "--chunk-size",
            "2000",
            "--wait",
            timeout=300,
        )
        assert result.returncode == 0, result
        scraped = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    finally:
        writer.halt.set()
        writer.join(30)
    assert writer.failure is None, writer.failure
    _stop(proc)
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    [done] = _backfills(pipeline)
    series = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in scraped.splitlines()
        if line.startswith("wormhole_backfill")
    }
    labels = '{application="*",table="public.orders"}'
    assert series[f"wormhole_backfill_rows_total{labels}"] == done["rows"], series
    assert series[f"wormhole_backfill_dropped_rows_total{labels}"] == done["dropped"]
    assert series["wormhole_backfill_chunks_total"] == done["chunks"]
    assert series["wormhole_backfill_running"] == 0
    assert done["state"] == "done" and done["read"] >= rows - writer.writes, done
    # The writer hit chunks between their watermarks: their rows were left to the stream.
    assert done["dropped"] > 0 and writer.writes > 100, (done, writer.writes)
    assert done["rows"] + done["dropped"] == done["read"]
    _assert_state_equals_select(tmp_path, postgres_dsn, ("a", "b"))


def test_kill_9_of_the_publisher_mid_backfill_loses_nothing(
    tmp_path: Path, postgres_dsn: str
) -> None:
    rows = 60_000
    _fill_orders(postgres_dsn, rows)
    pipeline = _pipeline(tmp_path, postgres_dsn, ["public.orders"])
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    queued = run_cli(
        "backfill",
        str(pipeline),
        "--table",
        "public.orders",
        "--app",
        "a",
        "--chunk-size",
        "500",
        "--pause-ms",
        "100",
    )
    assert queued.returncode == 0, queued
    writer = Writer(postgres_dsn, tmp_path / "state", seed=7, keys=rows, spread=2_000)
    writer.start()
    try:
        read = kill_mid_backfill(pipeline, rounds=3, seed=9)
    finally:
        writer.halt.set()
        writer.join(30)
    assert writer.failure is None, writer.failure
    assert read < rows, "the kills were not mid-backfill"
    result = run_cli("run", str(pipeline), "--once", timeout=300)
    assert result.returncode == 0, result
    [done] = _backfills(pipeline)
    assert done["state"] == "done", done
    _assert_state_equals_select(tmp_path, postgres_dsn, ("a",))
    # b asked for no backfill: it holds only what the writer changed since the slot.
    assert len(_latest(tmp_path / "b.sqlite", "public.orders")) < rows // 2


def test_a_table_added_to_the_publication_and_an_application_starting_with_a_backfill(
    tmp_path: Path, postgres_dsn: str
) -> None:
    sql(
        postgres_dsn,
        "CREATE TABLE items (id int PRIMARY KEY, name text)",
        "CREATE TABLE pairs (a text, b uuid, v text, PRIMARY KEY (a, b))",
        "INSERT INTO pairs SELECT 'k' || (g % 7), md5(g::text)::uuid, 'v' || g "
        "FROM generate_series(1, 3000) g",
    )
    pipeline = _pipeline(tmp_path, postgres_dsn, ["public.items"])
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    refused = run_cli("backfill", str(pipeline), "--table", "public.pairs")
    assert refused.returncode == 2 and "not in publication" in refused.stderr, refused
    # Added to the running slot's publication: changes from here on are streamed, and a
    # backfill brings the rows from before; no new slot.
    sql(postgres_dsn, "ALTER PUBLICATION wormhole_bf ADD TABLE pairs")
    sql(postgres_dsn, "UPDATE pairs SET v = 'changed' WHERE v = 'v5'")
    queued = run_cli(
        "backfill", str(pipeline), "--table", "public.pairs", "--chunk-size", "256", "--app", "a"
    )
    assert queued.returncode == 0, queued
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    expected = _table(postgres_dsn, "SELECT a || '/' || b AS k, a, b::text AS b, v FROM pairs")

    def by_key(path: Path) -> dict[str, dict[str, Any]]:
        db = sqlite3.connect(path)
        try:
            rows = db.execute(
                "SELECT row FROM latest WHERE source_table = 'public.pairs'"
            ).fetchall()
        finally:
            db.close()
        return {f"{r['a']}/{r['b']}": r for r in (json.loads(row) for (row,) in rows)}

    want = {k: {"a": r["a"], "b": r["b"], "v": r["v"]} for k, r in expected.items()}
    assert by_key(tmp_path / "a.sqlite") == want
    assert len(by_key(tmp_path / "b.sqlite")) == 1  # the streamed update only

    # A new application asks for its backfill at its start: it starts at the log end, and
    # the backfill brings it the table, once (not again at the next run).
    text = pipeline.read_text()
    late = {"start": {"backfill": ["public.pairs"]}, "filter": {"tables": ["public.pairs"]}}
    late["sink"] = {"type": "latest", "path": str(tmp_path / "late.sqlite")}
    import yaml

    raw = yaml.safe_load(text)
    raw["applications"]["late"] = late
    pipeline.write_text(yaml.safe_dump(raw))
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    assert by_key(tmp_path / "late.sqlite") == want
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    requests = _backfills(pipeline)
    assert [(r["application"], r["origin"], r["state"]) for r in requests] == [
        ("a", "command", "done"),
        ("late", "start", "done"),
    ]


def test_a_running_backfill_is_cancelled_and_stays_stopped(
    tmp_path: Path, postgres_dsn: str
) -> None:
    rows = 40_000
    _fill_orders(postgres_dsn, rows)
    pipeline = _pipeline(tmp_path, postgres_dsn, ["public.orders"])
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    proc = subprocess.Popen(
        cli_command("run", str(pipeline)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        queued = run_cli(
            "backfill",
            str(pipeline),
            "--table",
            "public.orders",
            "--chunk-size",
            "500",
            "--pause-ms",
            "100",
        )
        assert queued.returncode == 0, queued
        deadline = time.monotonic() + 60
        while True:
            [state] = _backfills(pipeline)
            if state["read"] > 0:
                break
            assert time.monotonic() < deadline, state
            time.sleep(0.05)
        cancelled = run_cli("backfill", str(pipeline), "--cancel", str(state["id"]))
        assert cancelled.returncode == 0, cancelled
        again = run_cli("backfill", str(pipeline), "--cancel", str(state["id"]))
        assert again.returncode == 2 and "already cancelled" in again.stderr, again
    finally:
        _stop(proc)
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    [state] = _backfills(pipeline)
    assert state["state"] == "cancelled" and state["read"] < rows // 2, state
    delivered = _latest(tmp_path / "a.sqlite", "public.orders")
    assert 0 < len(delivered) < rows // 2


def test_a_backfill_for_one_application_over_the_kafka_transport(
    tmp_path: Path, postgres_dsn: str, tansu: Any
) -> None:
    """Kafka keeps one topic for every application: the backfill's messages carry an
    ``audience`` header, and the other applications' consumers skip them."""
    sql(
        postgres_dsn,
        "CREATE TABLE items (id int PRIMARY KEY, name text)",
        "INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, 300) g",
    )
    apps = {
        name: {"sink": {"type": "jsonl", "path": str(tmp_path / f"{name}.jsonl")}}
        for name in ("a", "b")
    }
    pipeline = write_pipeline(
        tmp_path / "kafka.yml",
        {
            "pipeline": "bfk",
            "state_dir": str(tmp_path / "state"),
            "dataset": {"shards": 4},
            "source": {
                "type": "postgres",
                "dsn": postgres_dsn,
                "tables": ["public.items"],
                "snapshot": "never",
            },
            "transport": {
                "type": "kafka",
                "bootstrap_servers": tansu.bootstrap,
                "topic_prefix": f"t{free_port()}",
                "consumer": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500},
            },
            "applications": apps,
        },
    )
    assert run_cli("run", str(pipeline), "--once", timeout=300).returncode == 0
    queued = run_cli("backfill", str(pipeline), "--table", "public.items", "--app", "a")
    assert queued.returncode == 0, queued
    sql(postgres_dsn, "UPDATE items SET name = 'changed' WHERE id = 3")
    result = run_cli("run", str(pipeline), "--once", timeout=300)
    assert result.returncode == 0, result
    a = read_envelopes(tmp_path / "a.jsonl")
    b = read_envelopes(tmp_path / "b.jsonl")
    assert sorted(e["key"]["id"] for e in a if e["op"] == "r") == list(range(1, 301))
    assert [(e["op"], e["key"]) for e in b] == [("u", {"id": 3})]
    assert [(e["op"], e["key"]) for e in a if e["op"] != "r"] == [("u", {"id": 3})]


def test_snapshot_stream_and_backfill_agree_on_every_value_and_key(
    tmp_path: Path, postgres_dsn: str
) -> None:
    """The same rows read three ways (the initial snapshot, an update through the stream,
    a backfill) give the same keys and values: booleans, padded char(n), inet, oid, real,
    numeric, timestamps, arrays, a column named like the query's own aliases."""
    sql(
        postgres_dsn,
        "CREATE TABLE typed (k char(4), r real, b boolean, addr inet, o oid, n numeric, "
        "ts timestamptz, c char(3), arr int[], t text, wormhole_row int, "
        "PRIMARY KEY (r, k))",
        "INSERT INTO typed SELECT 'k' || (g % 3), g / 10.0, g % 2 = 0, "
        "('10.0.0.' || g)::inet, g, g / 3.0, '2026-01-01 00:00:00+00'::timestamptz + "
        "g * interval '1 hour', 'x', ARRAY[g, g + 1], E'tab\\there', g FROM "
        "generate_series(1, 40) g",
    )
    out = tmp_path / "out.jsonl"
    pipeline = write_pipeline(
        tmp_path / "typed.yml",
        {
            "pipeline": "typed",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "postgres", "dsn": postgres_dsn, "tables": ["public.typed"]},
            "transport": {"type": "inprocess"},
            "applications": {"out": {"sink": {"type": "jsonl", "path": str(out)}}},
        },
    )
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    snapshot = read_envelopes(out)
    sql(postgres_dsn, "UPDATE typed SET t = t")
    queued = run_cli("backfill", str(pipeline), "--table", "public.typed", "--chunk-size", "7")
    assert queued.returncode == 0, queued
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    later = read_envelopes(out)[len(snapshot) :]
    streamed = [e for e in later if e["op"] == "u"]
    backfilled = [e for e in later if e["op"] == "r"]

    def by_key(events: list[dict[str, Any]]) -> dict[str, Any]:
        return {json.dumps(e["key"], sort_keys=True): e["after"] for e in events}

    assert len(snapshot) == len(streamed) == len(backfilled) == 40, _backfills(pipeline)
    assert by_key(snapshot) == by_key(streamed) == by_key(backfilled)
    first = by_key(streamed)[json.dumps({"k": "k1  ", "r": 0.1}, sort_keys=True)]
    assert first["b"] is False and first["o"] == 1 and first["addr"] == "10.0.0.1"
    assert first["c"] == "x  " and first["t"] == "tab\there" and first["arr"] == "{1,2}"
    assert any(e["after"]["b"] is True for e in snapshot)


def test_a_backfill_waits_for_the_initial_snapshot_to_end(
    tmp_path: Path, postgres_dsn: str
) -> None:
    """The snapshot's transaction holds the catalog connection: a watermark written there
    would commit only with it, after every change made meanwhile. The source says it is not
    ready for a backfill until it streams, and the engine asks before every chunk."""
    import threading as _threading

    from wormhole.connectors.postgres.options import PostgresOptions
    from wormhole.connectors.postgres.source import PostgresSource
    from wormhole.plugins.components import SourceBackfill, SourceContext

    _fill_orders(postgres_dsn, 3_000)
    source = PostgresSource(
        PostgresOptions(dsn=postgres_dsn, tables=["public.orders"], batch_updates=500)
    )
    assert isinstance(source, SourceBackfill)
    context = SourceContext(
        "ready", tmp_path, 4, _threading.Event(), __import__("logging").getLogger()
    )
    source.open(context, None)
    try:
        ready = []
        for _ in range(20):
            ready.append((source.phase, source.backfill_ready()))
            if source.phase == "stream":
                break
            source.read(1.0)
        assert ("snapshot", False) in ready and ("stream", True) in ready, ready
        assert all(r == (p == "stream") for p, r in ready), ready
    finally:
        source.close()


def test_a_backfill_keeps_to_the_publications_row_filter_and_column_list(
    tmp_path: Path, postgres_dsn: str
) -> None:
    """What the stream does not send (PostgreSQL 15 row filters and column lists: rows and
    columns left out on purpose), a backfill does not send either."""
    sql(
        postgres_dsn,
        "CREATE TABLE people (id int PRIMARY KEY, name text, secret text)",
        "INSERT INTO people SELECT g, 'p' || g, 'hidden' FROM generate_series(1, 50) g",
        "CREATE PUBLICATION wormhole_bf FOR TABLE people (id, name) WHERE (id > 10)",
    )
    pipeline = _pipeline(tmp_path, postgres_dsn, ["public.people"])
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    sql(postgres_dsn, "UPDATE people SET name = 'changed' WHERE id IN (5, 20)")
    queued = run_cli("backfill", str(pipeline), "--table", "public.people", "--chunk-size", "9")
    assert queued.returncode == 0, queued
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    got = _latest(tmp_path / "a.sqlite", "public.people")
    assert sorted(got) == list(range(11, 51))
    assert got[20] == {"id": 20, "name": "changed"} and got[11] == {"id": 11, "name": "p11"}


def test_a_server_restart_mid_backfill_reconnects_and_the_backfill_goes_on(
    tmp_path: Path, postgres_dsn: str, postgres_server: Any
) -> None:
    """PostgreSQL restarted (immediate mode: no clean shutdown) while a backfill runs and a
    writer changes its rows: the stream, the watermarks' connection and the chunks'
    connection come back, and the backfill ends with each key as in the table."""
    from wormhole.testing.postgres import restart_postgres

    rows = 40_000
    _fill_orders(postgres_dsn, rows)
    pipeline = _pipeline(tmp_path, postgres_dsn, ["public.orders"])
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    queued = run_cli(
        "backfill",
        str(pipeline),
        "--table",
        "public.orders",
        "--chunk-size",
        "1000",
        "--pause-ms",
        "20",
    )
    assert queued.returncode == 0, queued
    proc = subprocess.Popen(
        cli_command("run", str(pipeline)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        while _backfills(pipeline)[0]["read"] < 5_000:
            assert time.monotonic() < deadline, "no progress before the restart"
            time.sleep(0.05)
        restart_postgres(postgres_server, mode="immediate")
        sql(postgres_dsn, "UPDATE orders SET n = -1 WHERE id % 97 = 0")
        while (state := _backfills(pipeline)[0])["state"] != "done":
            assert state["state"] == "running", state
            assert time.monotonic() < deadline + 120, "the backfill did not end"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert b"reconnected to PostgreSQL" in err, err[-2000:]
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    _assert_state_equals_select(tmp_path, postgres_dsn, ("a", "b"))
