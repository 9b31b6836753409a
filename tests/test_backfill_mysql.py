"""Backfills of MariaDB tables while the binlog streams (DBLog watermarks through a signal
table), against a real MariaDB server: watermarks, values, keys of every kind, versions,
application scope, bad input, a concurrent writer, kill -9."""

from __future__ import annotations

import json
import logging
import random
import sqlite3
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
from backfill_support import assert_same_rows, kill_mid_backfill
from backfill_support import backfills as _backfills
from backfill_support import latest as _latest
from backfill_support import stop as _stop
from test_mysql import KINDS, ROW

from wormhole.connectors.mysql import MapperOptions, MySQLPositionMapper
from wormhole.connectors.mysql.options import MySQLOptions
from wormhole.connectors.mysql.source import MySQLSource
from wormhole.core.update import Update
from wormhole.plugins.components import SourceBatch, SourceContext
from wormhole.testing import read_envelopes, run_cli, start_cli, write_pipeline
from wormhole.testing.helpers import cli_command, wait_until
from wormhole.testing.mysql import MariaDBServer, start_mariadb


# ------------------------------------------------------------------ in process
def _source(
    tmp_path: Path,
    server: MariaDBServer,
    pipeline: str,
    checkpoint: Any = None,
    **options: Any,
) -> MySQLSource:
    source = MySQLSource(MySQLOptions(dsn=server.dsn(), **options))
    context = SourceContext(
        pipeline, tmp_path / pipeline, 4, threading.Event(), logging.getLogger(pipeline)
    )
    source.open(context, checkpoint)
    return source


def _read_until(source: MySQLSource, token: str, timeout: float = 30) -> list[SourceBatch]:
    """Every batch the stream returns up to the one that reports watermark ``token``."""
    batches: list[SourceBatch] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = source.read(0.2)
        if batch is None:
            continue
        batches.append(batch)
        if batch.watermark is not None and batch.watermark.token == token:
            return batches
    raise AssertionError(f"watermark {token} was not reported within {timeout}s")


def _after(update: Update) -> Any:
    return msgspec.json.decode(bytes(update.after))


def test_watermarks_are_this_pipelines_own_at_their_commit_and_never_rows(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    db = mysql_database
    mariadb_server.sql("CREATE TABLE t (id INT PRIMARY KEY, v INT)", database=db)
    # Every table (tables left out): the signal table is still never read as rows.
    one = _source(tmp_path, mariadb_server, "one", snapshot="never")
    two = _source(tmp_path, mariadb_server, "two", snapshot="never", tables=[f"{db}.*"])
    try:
        one.read(0.1), two.read(0.1)  # their start positions
        one.backfill_plan("one", f"{db}.t", None)
        two.backfill_plan("two", f"{db}.t", None)
        mariadb_server.sql("INSERT INTO t VALUES (1, 1)", database=db)
        two.backfill_watermark("two-1")
        one.backfill_watermark("one-1")
        mariadb_server.sql("INSERT INTO t VALUES (2, 2)", database=db)
        one.backfill_watermark("one-2")

        batches = _read_until(one, "one-2")
        marks = [b.watermark for b in batches if b.watermark is not None]
        assert [m.token for m in marks] == ["one-1", "one-2"]  # not two's
        updates = [u for b in batches for u in b.updates]
        assert [(u.table, u.key["id"]) for u in updates] == [(f"{db}.t", 1), (f"{db}.t", 2)]
        # The batch ends at the watermark: the change before it is in it or before it,
        # the change after it after it.
        at = next(i for i, b in enumerate(batches) if b.watermark and b.watermark.token == "one-1")
        before = [u.key["id"] for b in batches[: at + 1] for u in b.updates]
        assert before == [1]
        first = marks[0]
        # The watermark's transaction: <file>:<offset of its GTID event>, its GTID.
        file, offset = first.position.split(":")
        assert file.startswith("binlog.") and int(offset) > 0
        change_1, change_2 = updates
        assert change_1.position.rsplit(":", 1)[0] != first.position
        gtid = [int(p) for p in first.logical.split("-")]
        assert gtid[1] == mariadb_server.server_id
        mapper = MySQLPositionMapper(MapperOptions())
        row = Update(op="r", key={"id": 1}, position=f"{first.position}:0", logical=first.logical)
        version = mapper.version(row)
        assert version is not None
        assert mapper.version(change_1) < version < mapper.version(change_2)  # type: ignore[operator]
        # The checkpoint of the watermark's batch is after its transaction.
        assert batches[at].checkpoint["gtid_state"].endswith(f"-{first.logical.split('-')[2]}")

        assert [b.watermark.token for b in _read_until(two, "two-1") if b.watermark] == ["two-1"]
        checkpoint = batches[-1].checkpoint
    finally:
        one.close()
        two.close()

    # Resumed after the watermark's batch (at its binlog position, and by GTID as on
    # another server): the watermarks already passed are not reported again.
    for n, resume in enumerate((checkpoint, {**checkpoint, "server_id": 999_999})):
        source = _source(tmp_path, mariadb_server, "one", resume)
        try:
            token = f"again-{n}"
            source.backfill_watermark(token)
            tokens = [b.watermark.token for b in _read_until(source, token) if b.watermark]
            assert tokens[-1] == token and not {"one-1", "one-2"} & set(tokens), tokens
            assert not [u for b in _read_until_quiet(source) for u in b.updates]
        finally:
            source.close()
    rows = mariadb_server.sql("SELECT id, token FROM wormhole.signal")
    ours = {r[1] for r in rows if r[0].endswith((":one", ":two"))}
    assert ours == {"again-1", "two-1"}  # a row a pipeline


def _read_until_quiet(source: MySQLSource) -> list[SourceBatch]:
    batches = []
    while (batch := source.read(0.5)) is not None:
        batches.append(batch)
    return batches


def test_backfilled_rows_equal_the_snapshots_and_the_streams_for_every_type(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    db = mysql_database
    mariadb_server.sql(KINDS, database=db)
    mariadb_server.sql(
        "INSERT INTO kinds VALUES " + ", ".join(ROW.format(id=i) for i in (1, 2, 3)),
        "UPDATE kinds SET dt = NULL, js = NULL, en = 'small', st = 'a,c' WHERE id = 2",
        database=db,
    )
    source = _source(tmp_path, mariadb_server, "kinds", tables=[f"{db}.kinds"])
    try:
        snapshot: dict[Any, Any] = {}
        while source.phase == "snapshot" or not snapshot:
            batch = source.read(0.2)
            for u in batch.updates if batch else []:
                snapshot[json.dumps(u.key)] = (u.key, _after(u))
        assert len(snapshot) == 3
        plan = source.backfill_plan("kinds", f"{db}.kinds", None)
        assert plan.keys == ["id"] and plan.table == f"{db}.kinds"
        rows = source.backfill_chunk(plan, None, 2) + source.backfill_chunk(plan, [2], 2)
        assert [u.op for u in rows] == ["r"] * 3
        assert {u.connector for u in rows} == {"mysql"} and rows[0].ts_ms > 0
        assert {json.dumps(u.key): (u.key, _after(u)) for u in rows} == snapshot
        # ... and the stream's, for the same rows written again.
        mariadb_server.sql(
            "CREATE TABLE copy LIKE kinds", "INSERT INTO copy SELECT * FROM kinds", database=db
        )
    finally:
        source.close()
    stream = _source(tmp_path, mariadb_server, "copy", tables=[f"{db}.copy"], snapshot="never")
    try:
        stream.read(0.1)
        mariadb_server.sql("DELETE FROM copy", database=db)
        mariadb_server.sql(
            "INSERT INTO copy SELECT * FROM kinds",
            "UPDATE copy SET id = id + 0",  # an update with no change: no event
            database=db,
        )
        plan = stream.backfill_plan("copy", f"{db}.copy", None)
        stream.backfill_watermark("end")
        changes = [u for b in _read_until(stream, "end") for u in b.updates if u.op == "c"]
        assert len(changes) == 3
        rows = stream.backfill_chunk(plan, None, 10)
        assert [(u.key, _after(u)) for u in rows] == [(u.key, _after(u)) for u in changes]
    finally:
        stream.close()


KEYED = """CREATE TABLE keyed (
  e ENUM('zeta', 'alpha', 'mid') NOT NULL, d DECIMAL(12, 3) NOT NULL, f FLOAT NOT NULL,
  t DATETIME(3) NOT NULL, b VARBINARY(4) NOT NULL, s SET('x', 'y') NOT NULL, v INT,
  PRIMARY KEY (e, d, f, t, b, s)
)"""


def test_chunks_of_one_row_walk_every_kind_of_key_once_in_order(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    db = mysql_database
    mariadb_server.sql(KEYED, database=db)
    values = []
    for n, (e, d, f, t, b, s) in enumerate(
        (e, d, f, t, b, s)
        for e in ("zeta", "alpha", "mid")
        for d in ("-1.5", "0.001", "99999.999")
        for f in ("0.1", "2.5")
        for t in ("2024-01-01 00:00:00.000", "2024-01-01 00:00:00.001")
        for b in ("x'00'", "x'00ff'", "x'ff'")
        for s in ("''", "'y'", "'x,y'")
    ):
        values.append(f"('{e}', {d}, {f}, '{t}', {b}, {s}, {n})")
    mariadb_server.sql("INSERT INTO keyed VALUES " + ", ".join(values), database=db)
    source = _source(tmp_path, mariadb_server, "keyed", tables=[f"{db}.*"], snapshot="never")
    try:
        plan = source.backfill_plan("keyed", f"{db}.keyed", "v % 2 = 0 OR v > 300")
        assert plan.keys == ["e", "d", "f", "t", "b", "s"]
        seen: list[int] = []
        after = None
        while rows := source.backfill_chunk(plan, after, 7):
            seen += [_after(u)["v"] for u in rows]
            after = [rows[-1].key[k] for k in plan.keys]
            assert len(seen) <= len(values), "a chunk came back again"
        ordered = mariadb_server.sql(
            "SELECT v FROM keyed WHERE v % 2 = 0 OR v > 300 ORDER BY e, d, f, t, b, s",
            database=db,
        )
        assert seen == [r[0] for r in ordered] and len(seen) == 162 + 12
    finally:
        source.close()


def test_the_version_of_a_backfilled_row_is_between_the_changes_around_its_watermark() -> None:
    mapper = MySQLPositionMapper(MapperOptions())

    def version(op: str, position: str, logical: str) -> Any:
        return mapper.version(Update(op=op, key={}, position=position, logical=logical))

    row = version("r", "binlog.000002:7788:41", "0-1-42")
    assert row == (42, 0)
    assert version("u", "binlog.000002:7001:999", "0-1-41") < row  # the last one before
    assert version("c", "binlog.000002:7788:0", "0-1-42") > row  # one of its own
    assert version("d", "binlog.000002:9000:0", "0-1-43") > row
    # A snapshot's rows carry the GTID position (a list): its lowest sequence.
    assert version("r", "binlog.000001:4:7", "0-1-40,1-2-9") == (9, 0)
    assert version("r", "binlog.000001:4:7", "3e11fa47-71ca-11e1-9e33-c80aa9429562:5") is None


# ------------------------------------------------------------------ the command
def _pipeline(tmp_path: Path, server: MariaDBServer, tables: list[str], **source: Any) -> Path:
    return write_pipeline(
        tmp_path / "my.yml",
        {
            "pipeline": "bf",
            "state_dir": str(tmp_path / "state"),
            "source": {
                "type": "mysql",
                "dsn": server.dsn(),
                "tables": tables,
                "snapshot": "never",
                **source,
            },
            "transport": {"type": "inprocess"},
            "applications": {
                "a": {"sink": {"type": "latest", "path": str(tmp_path / "a.sqlite")}},
                "b": {"sink": {"type": "jsonl", "path": str(tmp_path / "b.jsonl")}},
            },
        },
    )


def _select(server: MariaDBServer, database: str, query: str) -> dict[Any, dict[str, Any]]:
    conn = server.connect(database)
    try:
        with conn.cursor() as cur:
            cur.execute("SET SESSION time_zone = '+00:00'")
            cur.execute(query)
            names = [d[0] for d in cur.description]
            return {row[0]: dict(zip(names, row, strict=True)) for row in cur.fetchall()}
    finally:
        conn.close()


ITEMS = "SELECT id, name, n, CAST(price AS CHAR) AS price, CAST(at AS CHAR) AS at, doc FROM items"


def test_a_backfill_for_one_application_with_a_condition_and_bad_input(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    db = mysql_database
    mariadb_server.sql(
        "CREATE TABLE items (id INT PRIMARY KEY, name VARCHAR(40), n BIGINT, "
        "price DECIMAL(10, 2), at DATETIME(6), doc JSON)",
        "INSERT INTO items SELECT seq, CONCAT('item ', seq), seq * 10, seq / 4, "
        "'2026-01-01' + INTERVAL seq MINUTE, JSON_OBJECT('g', seq) FROM seq_1_to_1000",
        "CREATE TABLE keyless (v TEXT)",
        "CREATE TABLE elsewhere (id INT PRIMARY KEY)",
        database=db,
    )
    pipeline = _pipeline(tmp_path, mariadb_server, [f"{db}.items", f"{db}.keyless"])
    assert run_cli("run", str(pipeline), "--once").returncode == 0  # from now on

    for args, words in (
        (["--table", f"{db}.keyless"], ["no primary key", "ADD PRIMARY KEY"]),
        (["--table", f"{db}.elsewhere"], ["does not capture", "tables"]),
        (["--table", f"{db}.nosuch"], ["no table nosuch", f"database {db}"]),
        (["--table", "items"], ["database.table"]),
        (["--table", "mysql.db"], ["system schema"]),
        (["--table", f"{db}.items", "--where", "nosuch > 1"], ["--where", "nosuch"]),
        (["--table", f"{db}.items", "--where", "id >"], ["--where", "syntax"]),
        (["--table", f"{db}.items", "--where", " "], ["--where", "empty"]),
        (["--table", f"{db}.items", "--app", "nobody"], ["--app nobody", "a, b"]),
        ([], ["--table"]),
    ):
        result = run_cli("backfill", str(pipeline), *args)
        assert result.returncode == 2, (args, result)
        for word in words:
            assert word in result.stderr, (word, result.stderr)

    bad = _pipeline(tmp_path / "bad", mariadb_server, [f"{db}.items"], signal_table="signal")
    result = run_cli("backfill", str(bad), "--table", f"{db}.items")
    assert result.returncode == 2 and "signal_table" in result.stderr, result
    assert "schema.table" in result.stderr, result

    common = ["--table", f"{db}.items", "--chunk-size", "64"]
    result = run_cli("backfill", str(pipeline), *common, "--where", "id <= 500", "--app", "a")
    assert result.returncode == 0, result
    assert "queued" in result.stdout and "about" in result.stdout
    again = run_cli("backfill", str(pipeline), "--table", f"{db}.items")
    assert again.returncode == 2 and "already queued" in again.stderr, again
    signals = run_cli("backfill", str(pipeline), "--table", "wormhole.signal")  # made by now
    assert signals.returncode == 2 and "signal table" in signals.stderr, signals
    # A % in the condition, on chunks after the first.
    like = run_cli(
        "backfill", str(pipeline), *common, "--where", "name LIKE 'item 1%'", "--app", "b"
    )
    assert like.returncode == 0, like

    mariadb_server.sql("UPDATE items SET name = 'changed' WHERE id = 7", database=db)
    result = run_cli("run", str(pipeline), "--once")
    assert result.returncode == 0, result
    got = _latest(tmp_path / "a.sqlite", f"{db}.items")
    assert sorted(got) == list(range(1, 501))
    assert got == _select(mariadb_server, db, ITEMS + " WHERE id <= 500")
    # b asked for the rows of its condition only; a's backfill never reached it.
    envelopes = read_envelopes(tmp_path / "b.jsonl")
    [change] = [e for e in envelopes if e["op"] != "r"]
    assert change["key"] == {"id": 7} and change["after"]["name"] == "changed"
    rows = [e for e in envelopes if e["op"] == "r"]
    expected = _select(mariadb_server, db, ITEMS + " WHERE name LIKE 'item 1%'")
    assert {e["key"]["id"]: e["after"] for e in rows} == expected and len(rows) == 112
    # Each chunk's rows sit at their high watermark: <file>:<offset>:<n>, its GTID,
    # after the change that came before it in the binlog.
    mapper = MySQLPositionMapper(MapperOptions())
    change_version = mapper.version(_update(change))
    for e in rows:
        file, offset, n = e["source"]["position"].split(":")
        assert file.startswith("binlog.") and int(offset) > 0 and int(n) < 64
        assert mapper.version(_update(e)) > change_version  # type: ignore[operator]
    assert len({e["source"]["logical"] for e in rows}) == 2  # two chunks

    done_a, done_b = _backfills(pipeline)
    assert done_a["state"] == "done" and done_a["rows"] == 500 and done_a["read"] == 500
    assert done_a["chunks"] >= 8 and done_a["application"] == "a"
    assert done_b["state"] == "done" and done_b["rows"] == 112
    assert mariadb_server.sql("SELECT COUNT(*) FROM wormhole.signal")[0][0] >= 1


def _update(envelope: dict[str, Any]) -> Update:
    source = envelope["source"]
    return Update(op=envelope["op"], key={}, position=source["position"], logical=source["logical"])


class Writer(threading.Thread):
    """Random inserts, updates and deletes in small transactions, aimed at the keys just
    past the backfill's progress (the chunks being read), until stopped.

    At most ``rate`` a second: the binlog stream reads a few thousand one-row transactions
    a second here, and a writer faster than that would leave it ever further behind."""

    def __init__(
        self,
        server: MariaDBServer,
        database: str,
        state_dir: Path,
        seed: int,
        keys: int,
        spread: int,
        rate: int = 500,
    ) -> None:
        super().__init__(daemon=True)
        self.server, self.database = server, database
        self.queue = state_dir / "backfills.sqlite"
        self.random = random.Random(seed)
        self.keys, self.spread, self.rate = keys, spread, rate
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
            conn = self.server.connect(self.database)
            cur = conn.cursor()
            rnd = self.random
            while not self.halt.wait(20 / self.rate):
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
                            "INSERT INTO orders VALUES (%s, %s, 'again') ON DUPLICATE KEY "
                            "UPDATE n = VALUES(n), note = 'upserted'",
                            (key, rnd.randrange(1000)),
                        )
                    self.writes += 1
            conn.close()
        except BaseException as exc:  # reported by the test
            self.failure = exc


def _fill_orders(server: MariaDBServer, database: str, rows: int) -> None:
    server.sql(
        "CREATE TABLE orders (id INT PRIMARY KEY, n INT NOT NULL, note VARCHAR(40))",
        f"INSERT INTO orders SELECT seq, seq % 1000, CONCAT('order ', seq) FROM seq_1_to_{rows}",
        "ANALYZE TABLE orders",
        database=database,
    )


def _assert_state_equals_select(
    tmp_path: Path, server: MariaDBServer, database: str, app: str = "a"
) -> None:
    expected = _select(server, database, "SELECT id, n, note FROM orders")
    got = _latest(tmp_path / f"{app}.sqlite", f"{database}.orders")
    assert_same_rows(got, expected, app)


def test_a_backfill_while_a_writer_changes_the_chunks_being_read(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    db, rows = mysql_database, 200_000
    _fill_orders(mariadb_server, db, rows)
    pipeline = _pipeline(tmp_path, mariadb_server, [f"{db}.orders"])
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    proc = subprocess.Popen(
        cli_command("run", str(pipeline)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    writer = Writer(mariadb_server, db, tmp_path / "state", seed=21, keys=rows, spread=4_000)
    writer.start()
    try:
        result = run_cli(
            "backfill",
            str(pipeline),
            "--table",
            f"{db}.orders",
            "--app",
            "a",
            "--chunk-size",
            "2000",
            "--wait",
            timeout=150,
        )
        assert result.returncode == 0, result
    finally:
        writer.halt.set()
        writer.join(30)
    assert writer.failure is None, writer.failure
    _stop(proc)
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    [done] = _backfills(pipeline)
    assert done["state"] == "done" and done["read"] >= rows - writer.writes, done
    # The writer hit chunks between their watermarks: their rows were left to the stream.
    assert done["dropped"] > 0 and writer.writes > 100, (done, writer.writes)
    assert done["rows"] + done["dropped"] == done["read"]
    _assert_state_equals_select(tmp_path, mariadb_server, db)


def test_kill_9_of_the_publisher_mid_backfill_loses_nothing(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    db, rows = mysql_database, 40_000
    _fill_orders(mariadb_server, db, rows)
    pipeline = _pipeline(tmp_path, mariadb_server, [f"{db}.orders"])
    assert run_cli("run", str(pipeline), "--once").returncode == 0
    queued = run_cli(
        "backfill",
        str(pipeline),
        "--table",
        f"{db}.orders",
        "--app",
        "a",
        "--chunk-size",
        "500",
        "--pause-ms",
        "100",
    )
    assert queued.returncode == 0, queued
    writer = Writer(mariadb_server, db, tmp_path / "state", seed=7, keys=rows, spread=2_000)
    writer.start()
    try:
        read = kill_mid_backfill(pipeline, rounds=2, seed=9)
    finally:
        writer.halt.set()
        writer.join(30)
    assert writer.failure is None, writer.failure
    assert 0 < read < rows, "the kills were not mid-backfill"
    result = run_cli("run", str(pipeline), "--once", timeout=150)
    assert result.returncode == 0, result
    [done] = _backfills(pipeline)
    assert done["state"] == "done", done
    _assert_state_equals_select(tmp_path, mariadb_server, db)
    # b asked for no backfill: it holds only what the writer changed meanwhile.
    envelopes = read_envelopes(tmp_path / "b.jsonl")
    assert envelopes and {e["op"] for e in envelopes} <= {"c", "u", "d"}


def test_a_server_restart_mid_backfill_reconnects_and_the_backfill_goes_on(
    tmp_path: Path,
) -> None:
    servers = start_mariadb()
    server = next(servers)
    try:
        db, rows = server.create_database(), 20_000
        _fill_orders(server, db, rows)
        pipeline = _pipeline(tmp_path, server, [f"{db}.orders"])
        assert run_cli("run", str(pipeline), "--once").returncode == 0
        proc = start_cli("run", str(pipeline))
        try:
            queued = run_cli(
                "backfill",
                str(pipeline),
                *("--table", f"{db}.orders", "--app", "a", "--chunk-size", "500"),
                *("--pause-ms", "20"),
            )
            assert queued.returncode == 0, queued
            seen: dict[str, Any] = {}

            def started() -> bool:
                seen.update(_backfills(pipeline)[0])
                return bool(seen["read"] > 0)

            wait_until(started, 60, "the backfill to start")
            server.stop(kill=True)
            assert seen["read"] < rows and seen["state"] == "running", seen
            server.start()
            server.sql("UPDATE orders SET n = -1 WHERE id IN (1, 19999)", database=db)

            def finished() -> bool:
                [state] = _backfills(pipeline)
                assert state["state"] in ("queued", "running", "done"), state
                return bool(state["state"] == "done")

            wait_until(finished, 120, "the backfill to finish after the restart")
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "lost the binlog stream" in err and "binlog stream resumed" in err
        assert run_cli("run", str(pipeline), "--once").returncode == 0
        _assert_state_equals_select(tmp_path, server, db)
        assert _latest(tmp_path / "a.sqlite", f"{db}.orders")[19999]["n"] == -1
    finally:
        servers.close()
