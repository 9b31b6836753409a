"""The mysql source against a real MariaDB server with a row-based binlog."""

from __future__ import annotations

import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

from conftest import check_rounds

from wormhole.testing import read_envelopes, run_cli, start_cli, write_pipeline
from wormhole.testing.helpers import cli_command, wait_until
from wormhole.testing.mysql import MariaDBServer, make_replica, start_mariadb


def my_pipeline(tmp_path: Path, dsn: str, **source: Any) -> Path:
    return write_pipeline(
        tmp_path / "my.yml",
        {
            "pipeline": "my",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "mysql", "dsn": dsn, **source},
            "transport": {"type": "inprocess"},
            "applications": {
                "out": {"sink": {"type": "jsonl", "path": str(tmp_path / "out.jsonl")}}
            },
        },
    )


KINDS = """CREATE TABLE kinds (
  id INT UNSIGNED PRIMARY KEY,
  ti TINYINT, tu TINYINT UNSIGNED, si SMALLINT, mi MEDIUMINT UNSIGNED, bi BIGINT,
  bu BIGINT UNSIGNED, fl FLOAT, db DOUBLE, dc DECIMAL(20,6), dc0 DECIMAL(5,0),
  dt DATETIME(6), dt0 DATETIME, ts TIMESTAMP(3) NULL, d DATE, tm TIME(6), tm0 TIME, y YEAR,
  js JSON, bl BLOB, bn BINARY(4), vb VARBINARY(16),
  en ENUM('small','large'), st SET('a','b','c'), bt BIT(12), b1 BIT(1),
  tx TEXT, vc VARCHAR(100) CHARACTER SET utf8mb4, ch CHAR(3) CHARACTER SET latin1, bo BOOLEAN
)"""

ROW = (
    "({id}, -128, 255, -32768, 16777215, -9223372036854775808, 18446744073709551615, 0.1, "
    "-2.5e-300, -12345678901234.123456, 99999, '2024-02-29 23:59:59.000001', "
    "'1000-01-01 00:00:00', '2038-01-19 03:14:07.999', '9999-12-31', '-838:59:59.000000', "
    "'12:00:01', 1901, '{{\"k\": [1, \"é\", null]}}', x'00ff00', x'ab', x'', 'large', '', "
    "b'101010101010', b'1', REPEAT('long text ', 500), 'héllo 🐍 ünïcode', 'abc', TRUE)"
)


def _oracle_expression(name: str, data_type: str, precision: Any) -> str:
    """The server's own text representation of a column, per the envelope contract."""
    q = f"`{name}`"
    if data_type in ("decimal", "datetime", "timestamp", "date", "time", "year", "float"):
        return f"CAST({q} AS CHAR)"
    if data_type in ("blob", "binary", "varbinary"):
        return f"CONCAT('\\\\x', LOWER(HEX({q})))"
    if data_type == "bit":
        return f"LPAD(BIN({q}), {precision}, '0')"
    return q


class Oracle:
    """Reads rows back with SELECT, rendered as the server shows them (UTC)."""

    def __init__(self, server: MariaDBServer, database: str) -> None:
        self.conn = server.connect(database)
        self.database = database
        self.cur = self.conn.cursor()
        self.cur.execute("SET SESSION time_zone = '+00:00'")

    def rows(self, table: str, ids: list[int]) -> dict[int, dict[str, Any]]:
        self.cur.execute(
            "SELECT COLUMN_NAME, DATA_TYPE, NUMERIC_PRECISION FROM information_schema.COLUMNS "
            "WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
            (self.database, table),
        )
        columns = self.cur.fetchall()
        select = ", ".join(_oracle_expression(n, t, p) for n, t, p in columns)
        marks = ", ".join(str(int(i)) for i in ids)
        self.cur.execute(f"SELECT {select} FROM {table} WHERE id IN ({marks}) ORDER BY id")
        out = {}
        for values in self.cur.fetchall():
            row = {}
            for (name, data_type, _p), value in zip(columns, values, strict=True):
                row[name] = float(value) if data_type == "float" and value is not None else value
            out[row["id"]] = row
        return out

    def run(self, expected: list[Any], *statements: tuple[str, str, list[int]]) -> None:
        """Run statements in one transaction, recording the changes each must produce."""
        self.cur.execute("BEGIN")
        for op, statement, ids in statements:
            before = self.rows("kinds", ids) if op in ("u", "d", "k") else {}
            self.cur.execute(statement)
            if op == "k":  # a key change: ids[0] becomes ids[1]
                old, new = ids
                after = self.rows("kinds", [new])
                expected.append(("d", {"id": old}, before[old], None))
                expected.append(("c", {"id": new}, None, after[new]))
                continue
            after = self.rows("kinds", ids) if op in ("c", "u") else {}
            for i in ids:
                expected.append((op, {"id": i}, before.get(i), after.get(i)))
        self.cur.execute("COMMIT")


def test_types_before_and_after_images_agree_with_select(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    db = mysql_database
    mariadb_server.sql(KINDS, database=db)
    mariadb_server.sql(
        "INSERT INTO kinds VALUES " + ", ".join(ROW.format(id=i) for i in (1, 2, 3)), database=db
    )
    oracle = Oracle(mariadb_server, db)
    snapshot = oracle.rows("kinds", [1, 2, 3])
    pipeline = my_pipeline(tmp_path, mariadb_server.dsn(), tables=[f"{db}.*"], batch_updates=500)
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    out = read_envelopes(tmp_path / "out.jsonl")
    assert [e["op"] for e in out] == ["r", "r", "r"]
    assert {e["key"]["id"]: e["after"] for e in out} == snapshot

    expected: list[Any] = []
    oracle.run(
        expected,
        ("c", "INSERT INTO kinds (id) VALUES (10)", [10]),
        ("c", "INSERT INTO kinds VALUES " + ROW.format(id=11), [11]),
        (
            "u",
            "UPDATE kinds SET st = 'a,c', en = NULL, fl = 3.25, bt = b'1', tm = "
            "'01:02:03.5', ts = '1970-01-01 00:00:01' WHERE id IN (1, 2)",
            [1, 2],
        ),
    )
    oracle.run(
        expected,
        (
            "u",
            "UPDATE kinds SET dc = 0, dc0 = -1, d = '2000-01-01', y = 2155, "
            "js = '[]', bl = x'', vb = x'0001', b1 = b'0' WHERE id = 10",
            [10],
        ),
        ("d", "DELETE FROM kinds WHERE id = 3", [3]),
        ("k", "UPDATE kinds SET id = 12 WHERE id = 11", [11, 12]),
    )
    mariadb_server.sql("ALTER TABLE kinds ADD COLUMN extra VARCHAR(10) DEFAULT 'new'", database=db)
    oracle.run(
        expected,
        ("u", "UPDATE kinds SET extra = 'changed' WHERE id = 1", [1]),
        ("c", "INSERT INTO kinds (id, extra) VALUES (13, NULL)", [13]),
    )
    mariadb_server.sql(
        "CREATE TABLE bulk (id INT PRIMARY KEY, v VARCHAR(20))",
        "INSERT INTO bulk SELECT seq, CONCAT('v', seq) FROM seq_1_to_20000",
        database=db,
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    out = read_envelopes(tmp_path / "out.jsonl")[3:]
    kinds = [e for e in out if e["source"]["table"] == f"{db}.kinds"]
    got = [(e["op"], e["key"], e["before"], e["after"]) for e in kinds]
    assert got == expected
    # Positions: the transaction's binlog offset plus the change's index; logical = GTID.
    for e in kinds:
        file, offset, index = e["source"]["position"].split(":")
        assert file.startswith("binlog.") and int(offset) > 0 and int(index) >= 0
        _domain, server, seq = e["source"]["logical"].split("-")
        assert int(server) == mariadb_server.server_id and int(seq) == e["source"]["txid"]
    bulk = [e for e in out if e["source"]["table"] == f"{db}.bulk"]
    assert [e["key"]["id"] for e in bulk] == list(range(1, 20_001))
    assert len({e["source"]["logical"] for e in bulk}) == 1  # one transaction, in chunks
    assert bulk[-1]["source"]["position"].endswith(":19999")


def test_table_filters_truncate_and_schema_per_table(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    db = mysql_database
    mariadb_server.sql(
        "CREATE TABLE keep_a (id INT PRIMARY KEY, v INT)",
        "CREATE TABLE keep_b (k1 INT, k2 VARCHAR(5), v INT, PRIMARY KEY (k2, k1))",
        "CREATE TABLE skip_me (id INT PRIMARY KEY)",
        "CREATE TABLE nokey (a INT, b INT)",
        "INSERT INTO keep_a VALUES (1, 1)",
        database=db,
    )
    pipeline = my_pipeline(
        tmp_path,
        mariadb_server.dsn(),
        tables=[f"{db}.keep_*", f"{db}.nokey"],
        exclude_tables=[f"{db}.keep_b"],
        snapshot="never",
    )
    assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
    assert not (tmp_path / "out.jsonl").exists() or read_envelopes(tmp_path / "out.jsonl") == []
    mariadb_server.sql(
        "INSERT INTO keep_a VALUES (2, 2)",
        "INSERT INTO keep_b VALUES (1, 'x', 1)",
        "INSERT INTO skip_me VALUES (1)",
        "INSERT INTO nokey VALUES (5, 6)",
        "TRUNCATE TABLE keep_a",
        "TRUNCATE skip_me",
        database=db,
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    out = read_envelopes(tmp_path / "out.jsonl")
    assert [(e["op"], e["source"]["table"].split(".")[1]) for e in out][:2] == [
        ("c", "keep_a"),
        ("c", "nokey"),
    ]
    assert out[1]["key"] == {"a": 5, "b": 6}  # no primary key: every column
    truncates = out[2:]
    assert {e["op"] for e in truncates} == {"t"} and len(truncates) == 16  # every shard
    assert {e["source"]["table"] for e in truncates} == {f"{db}.keep_a"}


def _write_rounds(server: MariaDBServer, database: str, keys: int, rounds: range) -> None:
    conn = server.connect(database)
    with conn.cursor() as cur:
        for n in rounds:
            cur.execute(
                f"INSERT INTO events SELECT seq, {n} FROM seq_0_to_{keys - 1} "
                f"ON DUPLICATE KEY UPDATE n = VALUES(n)"
            )
    conn.close()


def test_kill_9_mid_stream_then_restart_loses_nothing(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    db = mysql_database
    keys, rounds = 20_000, 25  # 500,000 changes in transactions of 20,000 rows
    mariadb_server.sql("CREATE TABLE events (id INT PRIMARY KEY, n INT NOT NULL)", database=db)
    pipeline = my_pipeline(
        tmp_path, mariadb_server.dsn(), tables=[f"{db}.events"], batch_updates=2048
    )
    assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
    out = tmp_path / "out.jsonl"
    writer = threading.Thread(target=_write_rounds, args=(mariadb_server, db, keys, range(rounds)))
    proc = subprocess.Popen(
        cli_command("run", str(pipeline)),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    writer.start()
    try:
        wait_until(lambda: out.exists() and out.stat().st_size > 15_000_000, 120, "no progress")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        writer.join()
        if proc.poll() is None:
            proc.kill()
    before = out.read_bytes().count(b"\n")
    assert before < keys * rounds, "the kill was not mid-stream"
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result
    duplicates = check_rounds(out, keys, rounds)
    assert out.read_bytes().count(b"\n") == keys * rounds + duplicates


def test_snapshot_is_consistent_with_the_stream_under_concurrent_writes(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    db = mysql_database
    keys = 3000
    mariadb_server.sql(
        "CREATE TABLE events (id INT PRIMARY KEY, n INT NOT NULL)",
        f"INSERT INTO events SELECT seq, 0 FROM seq_0_to_{keys - 1}",
        database=db,
    )
    pipeline = my_pipeline(tmp_path, mariadb_server.dsn(), tables=[f"{db}.events"])
    writer = threading.Thread(target=_write_rounds, args=(mariadb_server, db, keys, range(1, 30)))
    proc = start_cli("run", str(pipeline), cwd=tmp_path)
    writer.start()
    try:
        writer.join()
        out = tmp_path / "out.jsonl"

        def done() -> bool:
            return (
                out.exists()
                and all(e["after"]["n"] == 29 for e in _latest(read_envelopes(out)).values())
                and len(_latest(read_envelopes(out))) == keys
            )

        wait_until(done, 120, "the stream did not catch up")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    envelopes = read_envelopes(tmp_path / "out.jsonl")
    snapshot = [e for e in envelopes if e["op"] == "r"]
    assert len(snapshot) == keys
    # No gap and no overlap: each key's values after its snapshot row go up by one.
    assert check_rounds(tmp_path / "out.jsonl", keys, 30) == 0


def _latest(envelopes: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {e["key"]["id"]: e for e in envelopes}


def test_bad_settings_purged_binlog_and_unreachable_server_are_clear_errors(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    from wormhole.testing import free_port

    db = mysql_database
    mariadb_server.sql("CREATE TABLE events (id INT PRIMARY KEY, n INT NOT NULL)", database=db)
    pipeline = my_pipeline(tmp_path, mariadb_server.dsn(), tables=[f"{db}.events"])
    mariadb_server.sql("SET GLOBAL binlog_format = 'STATEMENT'")
    try:
        result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    finally:
        mariadb_server.sql("SET GLOBAL binlog_format = 'ROW'")
    assert result.returncode == 2, result
    assert "binlog_format is STATEMENT; set binlog_format=ROW" in result.stderr
    assert "Traceback" not in result.stderr

    assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
    _write_rounds(mariadb_server, db, 10, range(2))
    mariadb_server.sql("FLUSH BINARY LOGS")
    (current,) = mariadb_server.sql("SHOW MASTER STATUS")[0][:1]

    def purged() -> bool:
        # MariaDB keeps a file until its binlog checkpoint has moved on (InnoDB flushed).
        mariadb_server.sql(f"PURGE BINARY LOGS TO '{current}'")
        return mariadb_server.sql("SHOW BINARY LOGS")[0][0] == current

    wait_until(purged, 60, "the old binlogs to be purged")
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 2, result
    assert "is no longer on the server" in result.stderr
    assert f"oldest retained: {current}" in result.stderr
    assert not read_envelopes(tmp_path / "out.jsonl")  # nothing skipped silently

    dsn = f"mysql://root@127.0.0.1:{free_port()}/"
    result = run_cli("run", str(my_pipeline(tmp_path, dsn)), "--once", cwd=tmp_path)
    assert result.returncode == 2, result
    assert "source.dsn: cannot connect to 127.0.0.1" in result.stderr


def test_a_server_restart_mid_stream_reconnects(tmp_path: Path) -> None:
    server_gen = start_mariadb()
    server = next(server_gen)
    try:
        db = server.create_database()
        server.sql("CREATE TABLE events (id INT PRIMARY KEY, n INT NOT NULL)", database=db)
        pipeline = my_pipeline(tmp_path, server.dsn(), tables=[f"{db}.events"])
        assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
        out = tmp_path / "out.jsonl"
        proc = start_cli("run", str(pipeline), cwd=tmp_path)
        try:
            _write_rounds(server, db, 100, range(5))
            wait_until(lambda: out.exists() and out.read_bytes().count(b"\n") >= 500, 60, "")
            server.stop(kill=True)
            server.start()
            _write_rounds(server, db, 100, range(5, 10))
            wait_until(lambda: out.read_bytes().count(b"\n") >= 1000, 120, "no delivery after")
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "lost the binlog stream" in err and "binlog stream resumed" in err
        assert check_rounds(out, 100, 10) == 0
    finally:
        server_gen.close()


def test_a_replica_continues_where_the_primary_stopped_by_gtid(tmp_path: Path) -> None:
    primary_gen, replica_gen = start_mariadb(), start_mariadb()
    primary, replica = next(primary_gen), next(replica_gen)
    try:
        make_replica(replica, primary)
        db = primary.create_database()
        primary.sql("CREATE TABLE events (id INT PRIMARY KEY, n INT NOT NULL)", database=db)
        pipeline = my_pipeline(tmp_path, primary.dsn(), tables=[f"{db}.events"])
        assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
        _write_rounds(primary, db, 50, range(3))
        assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
        _write_rounds(primary, db, 50, range(3, 6))
        # The primary's publisher stops part-way; the replica has everything.
        (gtid,) = primary.sql("SELECT @@gtid_binlog_pos")[0]

        def caught_up() -> bool:
            return bool(replica.sql("SELECT @@gtid_slave_pos")[0][0] == gtid)

        wait_until(caught_up, 60, "the replica did not catch up")
        # The replica's binlog has other files and offsets (it wrote its own events).
        replica.sql("FLUSH BINARY LOGS", "CREATE DATABASE replica_only")
        pipeline = my_pipeline(tmp_path, replica.dsn(), tables=[f"{db}.events"])
        result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
        assert result.returncode == 0, result
        assert "resuming by GTID" in result.stderr
        _write_rounds(primary, db, 50, range(6, 8))
        (gtid,) = primary.sql("SELECT @@gtid_binlog_pos")[0]
        wait_until(caught_up, 60, "the replica did not catch up")
        result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
        assert result.returncode == 0, result
        out = tmp_path / "out.jsonl"
        assert check_rounds(out, 50, 8) == 0
        envelopes = read_envelopes(out)
        assert len(envelopes) == 50 * 8
        # Logical positions are the primary's GTIDs, wherever the change was read.
        assert {e["source"]["logical"].split("-")[1] for e in envelopes if e["op"] != "r"} == {
            str(primary.server_id)
        }
    finally:
        replica_gen.close()
        primary_gen.close()


def test_a_mysql_gtid_position_comes_back_from_its_checkpoint() -> None:
    """MySQL's GTIDs (``uuid:sequence``) belong to no MariaDB domain: the GTID state after
    one goes into the checkpoint and comes back as it was (a restart or a reconnect reads
    it), and gives no sequence to skip transactions by (MySQL is never resumed by GTID)."""
    from wormhole.connectors.mysql.position import (
        BinlogPosition,
        gtid_state_text,
        parse_gtid_state,
        seen_sequences,
    )

    gtid = "3e11fa47-71ca-11e1-9e33-c80aa9429562:23"
    saved = BinlogPosition("mysql-bin.000002", 4, gtid, server_id=1).checkpoint()
    state = parse_gtid_state(BinlogPosition.from_checkpoint(saved, 1).gtid_state)
    assert gtid_state_text(state) == gtid
    assert seen_sequences(state) == {}
    mariadb = parse_gtid_state("1-2-7, 0-1-41")
    assert gtid_state_text(mariadb) == "0-1-41,1-2-7"
    assert seen_sequences(mariadb) == {0: 41, 1: 7}


def test_a_savepoint_does_not_end_its_transaction(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    import logging

    from wormhole.connectors.mysql.options import MySQLOptions
    from wormhole.connectors.mysql.source import MySQLSource
    from wormhole.plugins.components import SourceContext

    db = mysql_database
    mariadb_server.sql("CREATE TABLE t (id INT PRIMARY KEY)", database=db)
    source = MySQLSource(
        MySQLOptions(
            dsn=mariadb_server.dsn(), tables=[f"{db}.t"], snapshot="never", batch_updates=1
        )
    )
    stop = threading.Event()
    source.open(SourceContext("sp", tmp_path, 16, stop, logging.getLogger("sp")), None)
    try:
        start = source.read(1.0)  # the start position, announced
        assert start is not None and start.updates == []
        conn = mariadb_server.connect(db)
        with conn.cursor() as cur:
            for statement in (
                "BEGIN",
                "INSERT INTO t VALUES (1)",
                "SAVEPOINT s",
                "INSERT INTO t VALUES (2)",
                "ROLLBACK TO SAVEPOINT s",
                "INSERT INTO t VALUES (3)",
                "RELEASE SAVEPOINT s",
                "INSERT INTO t VALUES (4)",
                "COMMIT",
            ):
                cur.execute(statement)
        conn.close()
        batches = []
        while sum(len(b.updates) for b in batches) < 3:
            batch = source.read(1.0)
            if batch is not None and batch.updates:
                batches.append(batch)
        ids = [u.key["id"] for b in batches for u in b.updates]
        assert ids == [1, 3, 4]
        assert len({u.logical for b in batches for u in b.updates}) == 1
        # Every chunk inside the transaction resumes from before it: the savepoints did
        # not end it.
        for batch in batches:
            assert batch.checkpoint["pos"] == start.checkpoint["pos"]
            assert batch.checkpoint["gtid"] == batches[0].updates[0].logical
        # The commit moves the position past the transaction.
        while True:
            after = source.read(1.0)
            if after is None or after.checkpoint["pos"] != start.checkpoint["pos"]:
                break
        emitted = source.binlog.emitted
        assert emitted is not None
        assert emitted.pos > start.checkpoint["pos"] or after is None
    finally:
        source.close()


MARIA_KEY_SCHEMA = [
    "CREATE TABLE m1 (id INT PRIMARY KEY, v TEXT)",
    "CREATE TABLE m2 (id2 INT NOT NULL, v INT)",
    "CREATE TABLE m3 (id INT PRIMARY KEY, code INT NOT NULL, v INT)",
    "CREATE TABLE m4 (name VARCHAR(100) NOT NULL, v INT, PRIMARY KEY (name(10)))",
    "CREATE TABLE m5 (u INT NOT NULL, v INT, UNIQUE KEY (u))",
]
# Each step's DDL comes before its changes: a run after each step decodes every change
# before any later DDL.
MARIA_KEY_STEPS = [
    [
        "INSERT INTO m1 VALUES (1, 'x')",
        "UPDATE m1 SET v = 'y' WHERE id = 1",
        "DELETE FROM m1 WHERE id = 1",
        "INSERT INTO m2 VALUES (1, 10)",
        "INSERT INTO m3 VALUES (1, 100, 1)",
        "UPDATE m3 SET v = 2",
        "INSERT INTO m4 VALUES ('a-long-name', 1)",
        "UPDATE m4 SET v = 2",
        "INSERT INTO m5 VALUES (1, 1)",
        "UPDATE m5 SET v = 2",
    ],
    [
        "DROP TABLE m1",
        "ALTER TABLE m2 ADD COLUMN id INT AUTO_INCREMENT PRIMARY KEY",
        "INSERT INTO m2 (id2, v) VALUES (2, 20)",
        "ALTER TABLE m3 DROP PRIMARY KEY, ADD PRIMARY KEY (code)",
        "UPDATE m3 SET v = 3",
        "ALTER TABLE m4 DROP PRIMARY KEY, ADD COLUMN id INT AUTO_INCREMENT PRIMARY KEY",
        "ALTER TABLE m5 ADD COLUMN id INT AUTO_INCREMENT PRIMARY KEY FIRST",
    ],
    [
        "DROP TABLE m3",
        "ALTER TABLE m2 MODIFY id INT NOT NULL, DROP PRIMARY KEY",
    ],
]


def test_a_change_is_keyed_as_its_table_was_whether_decoded_at_once_or_after_ddl(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    db = mysql_database
    mariadb_server.sql(*MARIA_KEY_SCHEMA, database=db)
    pipelines = {}
    for name in ("prompt", "late"):
        (tmp_path / name).mkdir()
        pipelines[name] = my_pipeline(
            tmp_path / name, mariadb_server.dsn(), tables=[f"{db}.*"], snapshot="never"
        )
        assert run_cli("run", str(pipelines[name]), "--once", cwd=tmp_path).returncode == 0
    for step in MARIA_KEY_STEPS:
        mariadb_server.sql(*step, database=db)
        result = run_cli("run", str(pipelines["prompt"]), "--once", cwd=tmp_path)
        assert result.returncode == 0, result
    result = run_cli("run", str(pipelines["late"]), "--once", cwd=tmp_path)
    assert result.returncode == 0, result

    def keys(name: str) -> list[tuple[str, str, dict[str, Any], str]]:
        return [
            (e["op"], e["source"]["table"].split(".")[1], e["key"], e["source"]["position"])
            for e in read_envelopes(tmp_path / name / "out.jsonl")
        ]

    at_once, after_ddl = keys("prompt"), keys("late")
    assert after_ddl == at_once
    assert [k[:3] for k in at_once] == [
        ("c", "m1", {"id": 1}),
        ("u", "m1", {"id": 1}),
        ("d", "m1", {"id": 1}),
        ("c", "m2", {"id2": 1, "v": 10}),  # no primary key yet: every column
        ("c", "m3", {"id": 1}),
        ("u", "m3", {"id": 1}),
        ("c", "m4", {"name": "a-long-name"}),  # a primary key on a prefix of the column
        ("u", "m4", {"name": "a-long-name"}),
        ("c", "m5", {"u": 1}),  # a UNIQUE NOT NULL key stands in for the primary key
        ("u", "m5", {"u": 1}),
        ("c", "m2", {"id": 2}),
        ("u", "m3", {"code": 100}),
    ]


def test_a_graceful_stop_while_the_source_reconnects_exits_0(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    """SIGTERM while the server is unreachable and the source waits to reconnect: the run
    ends as any graceful stop does."""
    from tcp_support import Process

    from wormhole.testing.proxy import ThrottlingProxy

    db = mysql_database
    mariadb_server.sql(
        "CREATE TABLE t (id INT PRIMARY KEY)", "INSERT INTO t VALUES (1)", database=db
    )
    with ThrottlingProxy(f"{mariadb_server.host}:{mariadb_server.port}") as proxy:
        dsn = f"mysql://{mariadb_server.user}@127.0.0.1:{proxy.port}/"
        pipeline = my_pipeline(tmp_path, dsn, tables=[f"{db}.t"])
        publisher = Process("run", str(pipeline), cwd=tmp_path)
        try:
            out = tmp_path / "out.jsonl"
            wait_until(lambda: out.exists() and out.read_bytes().count(b"\n") == 1, 60, "the row")
            proxy.refuse()
            proxy.cut()
            wait_until(lambda: "lost the binlog stream" in publisher.stderr, 60, "a reconnect")
        finally:
            code = publisher.stop()
    assert code == 0, publisher.stderr
