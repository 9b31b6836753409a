"""Every example pipeline under pipelines/ validates, and each one runs."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from wormhole.testing import read_envelopes, run_cli

PIPELINES = sorted((REPO / "pipelines").glob("*.yml"))


def test_there_are_example_pipelines() -> None:
    assert {p.name for p in PIPELINES} >= {
        "quickstart.yml",
        "orders-jsonl.yml",
        "postgres-to-jsonl.yml",
        "mysql-to-jsonl.yml",
    }


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.name)
def test_example_pipeline_validates(pipeline: Path) -> None:
    result = run_cli(
        "validate",
        str(pipeline),
        env={"PG_DSN": "host=db dbname=app", "MYSQL_DSN": "mysql://wormhole@db:3306/"},
    )
    assert result.returncode == 0, result


def test_postgres_example_runs(tmp_path: Path, postgres_dsn: str) -> None:
    import psycopg2

    conn = psycopg2.connect(postgres_dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE users (id int PRIMARY KEY, name text)")
        cur.execute("CREATE TABLE orders (id int PRIMARY KEY, user_id int, total numeric)")
        cur.execute("INSERT INTO users VALUES (1, 'ada'), (2, 'grace')")
    env = {
        "PG_DSN": postgres_dsn,
        "PG_STATE": str(tmp_path / "state"),
        "PG_OUT": str(tmp_path / "out"),
    }
    pipeline = str(REPO / "pipelines" / "postgres-to-jsonl.yml")
    result = run_cli("run", pipeline, "--once", "--json", env=env)
    assert result.returncode == 0, result
    # A new pipeline: `directory` starts before the initial snapshot, which brings it every
    # row of public.users; its start backfill would deliver them a second time.
    assert json.loads(result.stdout)["applications"]["directory"]["updates"] == 2
    assert "application directory: no backfill of public.users queued" in result.stderr
    with conn.cursor() as cur:
        cur.execute("INSERT INTO orders VALUES (10, 1, 9.99)")
        cur.execute("UPDATE users SET name = 'Ada' WHERE id = 1")
        cur.execute("DELETE FROM users WHERE id = 2")
    conn.close()
    result = run_cli("run", pipeline, "--once", env=env)
    assert result.returncode == 0, result
    audit = read_envelopes(tmp_path / "out" / "audit.jsonl")
    assert [(e["op"], e["source"]["table"]) for e in audit] == [
        ("r", "public.users"),
        ("r", "public.users"),
        ("c", "public.orders"),
        ("u", "public.users"),
        ("d", "public.users"),
    ]
    assert audit[2]["after"] == {"id": 10, "user_id": 1, "total": "9.99"}
    db = sqlite3.connect(tmp_path / "out" / "current.db")
    rows = dict(db.execute("SELECT source_table || key, row FROM latest"))
    db.close()
    assert rows == {
        'public.users{"id":1}': '{"id":1,"name":"Ada"}',
        'public.orders{"id":10}': '{"id":10,"user_id":1,"total":"9.99"}',
    }
    # `directory` has public.users only, from the snapshot (no backfill was needed).
    db = sqlite3.connect(tmp_path / "out" / "directory.db")
    rows = dict(db.execute("SELECT source_table || key, row FROM latest"))
    db.close()
    assert rows == {'public.users{"id":1}': '{"id":1,"name":"Ada"}'}
    listed = run_cli("backfill", pipeline, "--list", "--json", env=env)
    assert json.loads(listed.stdout) == []


def test_mysql_example_runs(tmp_path: Path, mariadb_server: Any, mysql_database: str) -> None:
    db = mysql_database
    mariadb_server.sql(
        "CREATE TABLE users (id INT PRIMARY KEY, name VARCHAR(20))",
        "CREATE TABLE orders (id INT PRIMARY KEY, user_id INT, total DECIMAL(8,2))",
        "CREATE TABLE sessions (id INT PRIMARY KEY)",
        "INSERT INTO users VALUES (1, 'ada'), (2, 'grace')",
        database=db,
    )
    env = {
        "MYSQL_DSN": mariadb_server.dsn(),
        "MYSQL_DB": db,
        "MYSQL_STATE": str(tmp_path / "state"),
        "MYSQL_OUT": str(tmp_path / "out"),
    }
    pipeline = str(REPO / "pipelines" / "mysql-to-jsonl.yml")
    assert run_cli("run", pipeline, "--once", env=env).returncode == 0
    mariadb_server.sql(
        "INSERT INTO orders VALUES (10, 1, 9.99)",
        "INSERT INTO sessions VALUES (1)",
        "UPDATE users SET name = 'Ada' WHERE id = 1",
        "DELETE FROM users WHERE id = 2",
        database=db,
    )
    result = run_cli("run", pipeline, "--once", env=env)
    assert result.returncode == 0, result
    audit = read_envelopes(tmp_path / "out" / "audit.jsonl")
    assert [(e["op"], e["source"]["table"]) for e in audit] == [
        ("r", f"{db}.users"),
        ("r", f"{db}.users"),
        ("c", f"{db}.orders"),
        ("u", f"{db}.users"),
        ("d", f"{db}.users"),
    ]
    assert audit[2]["after"] == {"id": 10, "user_id": 1, "total": "9.99"}
    assert audit[3]["before"] == {"id": 1, "name": "ada"}
    conn = sqlite3.connect(tmp_path / "out" / "current.db")
    rows = dict(conn.execute("SELECT source_table || key, row FROM latest"))
    conn.close()
    assert rows == {
        f'{db}.users{{"id":1}}': '{"id":1,"name":"Ada"}',
        f'{db}.orders{{"id":10}}': '{"id":10,"user_id":1,"total":"9.99"}',
    }


def test_orders_example_runs(tmp_path: Path) -> None:
    data = tmp_path / "orders"
    data.mkdir()
    lines = []
    for i in range(200):
        lines.append(
            {"table": "orders", "op": "c", "key": {"id": i}, "after": {"id": i, "status": "new"}}
        )
    for i in range(0, 200, 2):
        lines.append(
            {"table": "orders", "op": "u", "key": {"id": i}, "after": {"id": i, "status": "paid"}}
        )
    for i in range(0, 200, 10):
        lines.append({"table": "refunds", "op": "c", "key": {"id": i}, "after": {"id": i}})
        lines.append(
            {"table": "orders", "op": "d", "key": {"id": i}, "before": {"id": i, "status": "paid"}}
        )
    (data / "2026-11-21.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    env = {
        "ORDERS_STATE": str(tmp_path / "state"),
        "ORDERS_DATA": str(data),
        "ORDERS_OUT": str(tmp_path / "out"),
    }
    result = run_cli("run", str(REPO / "pipelines" / "orders-jsonl.yml"), "--once", env=env)
    assert result.returncode == 0, result
    audit = read_envelopes(tmp_path / "out" / "audit.jsonl")
    assert len(audit) == len(lines)
    db = sqlite3.connect(tmp_path / "out" / "current.db")
    current = {
        json.loads(k)["id"]: json.loads(r)["status"]
        for k, r in db.execute("SELECT key, row FROM latest")
    }
    db.close()
    assert len(current) == 180 and 0 not in current and current[2] == "paid" and current[1] == "new"
    sample = read_envelopes(tmp_path / "out" / "sample.jsonl")
    sampled = {e["key"]["id"] for e in sample}
    assert 0 < len(sampled) < 60
    # Every update of a sampled key is kept.
    assert len(sample) == sum(
        1 for x in lines if x["table"] == "orders" and x["key"]["id"] in sampled
    )


def test_orders_filtered_example_runs(tmp_path: Path) -> None:
    data = tmp_path / "orders"
    data.mkdir()
    lines = []
    for i in range(100):
        after = {
            "id": i,
            "status": "paid" if i % 2 else "new",
            "amount": f"{i * 3}.00",
            "customer": f"c{i % 7}",
            "note": "x",
        }
        lines.append(
            {
                "table": "orders",
                "op": "c",
                "key": {"id": i},
                "after": after,
            }
        )
    (data / "orders.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    env = {
        "ORDERS_STATE": str(tmp_path / "state"),
        "ORDERS_DATA": str(data),
        "ORDERS_OUT": str(tmp_path / "out"),
    }
    pipeline = str(REPO / "pipelines" / "orders-filtered.yml")
    result = run_cli("run", pipeline, "--once", env=env)
    assert result.returncode == 0, result
    fraud = read_envelopes(tmp_path / "out" / "fraud.jsonl")
    assert [e["key"]["id"] for e in fraud] == [i for i in range(100) if i % 2 and i * 3 > 100]
    assert set(fraud[0]["after"]) == {"id", "amount", "customer"}


def test_registry_example_runs_two_publishers_and_shares_their_flows(
    tmp_path: Path, zookeeper_server: Any
) -> None:
    import signal

    from tcp_support import Process

    from wormhole.testing import wait_until

    pipeline = str(REPO / "pipelines" / "registry-two-datastores.yml")
    common = {
        "ZK": zookeeper_server.hosts,
        "ZK_ROOT": "/example",
        "SHOP_STATE": str(tmp_path / "state"),
        "SHOP_OUT": str(tmp_path / "out"),
    }
    processes = []
    try:
        for datastore in ("db1", "db2"):
            data = tmp_path / datastore
            data.mkdir()
            (data / "orders.jsonl").write_text(
                "".join(
                    json.dumps({"key": {"id": f"{datastore}-{i}"}, "after": {"n": i}}) + "\n"
                    for i in range(50)
                )
            )
            env = {**common, "DATASTORE": datastore, "SHOP_DATA": str(data)}
            processes.append(Process("publish", pipeline, "-q", cwd=tmp_path, env=env))
        for instance in ("0", "1"):
            processes.append(
                Process(
                    "subscribe",
                    pipeline,
                    "--app",
                    "search",
                    "--instance",
                    instance,
                    cwd=tmp_path,
                    env=common,
                )
            )
        out = tmp_path / "out" / "search.jsonl"
        wait_until(lambda: out.exists() and len(read_envelopes(out)) == 100, 60, "100 updates")
        keys = {e["key"]["id"] for e in read_envelopes(out)}
        assert keys == {f"{d}-{i}" for d in ("db1", "db2") for i in range(50)}
    finally:
        for process in processes:
            if process.proc.poll() is None:
                process.proc.send_signal(signal.SIGTERM)
        codes = [process.wait(60) for process in processes]
    assert codes == [0, 0, 0, 0], [p.stderr[-2000:] for p in processes]


def test_mariadb_two_copies_example_serves_from_one_copy_and_fails_over(
    tmp_path: Path, zookeeper_server: Any
) -> None:
    import signal

    from tcp_support import Process, stop_all

    from wormhole.testing import wait_until
    from wormhole.testing.mysql import make_replica, start_mariadb

    pipeline = str(REPO / "pipelines" / "mariadb-two-copies.yml")
    primary_gen, replica_gen = start_mariadb(), start_mariadb()
    primary, replica = next(primary_gen), next(replica_gen)
    processes: list[Any] = []
    try:
        make_replica(replica, primary)
        db = primary.create_database()
        primary.sql("CREATE TABLE orders (id INT PRIMARY KEY, n INT)", database=db)
        (gtid,) = primary.sql("SELECT @@gtid_binlog_pos")[0]
        wait_until(lambda: replica.sql("SELECT @@gtid_slave_pos")[0][0] == gtid, 60, "replica")
        common = {
            "ZK": zookeeper_server.hosts,
            "ZK_ROOT": "/example-copies",
            "MYSQL_DB": db,
            "SHOP_STATE": str(tmp_path / "state"),
            "SHOP_OUT": str(tmp_path / "out"),
        }
        copies = {}
        for copy, server in (("primary", primary), ("replica", replica)):
            env = {**common, "COPY": copy, "MYSQL_DSN": server.dsn()}
            copies[copy] = Process("publish", pipeline, "-q", cwd=tmp_path, env=env)
            processes.append(copies[copy])
        env = {**common, "MYSQL_DSN": primary.dsn()}
        processes.append(Process("subscribe", pipeline, "--app", "audit", cwd=tmp_path, env=env))
        out = tmp_path / "out" / "audit.jsonl"

        def rows() -> set[int]:
            return {e["key"]["id"] for e in read_envelopes(out)} if out.exists() else set()

        def copy_serving() -> bool:
            return "serves it" in copies["primary"].stderr

        wait_until(copy_serving, 60, "the primary copy to serve audit")
        primary.sql("INSERT INTO orders VALUES (1, 1), (2, 1)", database=db)
        wait_until(lambda: rows() == {1, 2}, 60, "rows 1 and 2 from the primary copy")
        copies["primary"].proc.send_signal(signal.SIGKILL)
        copies["primary"].wait(10)
        primary.sql("INSERT INTO orders VALUES (3, 1)", database=db)
        wait_until(lambda: rows() == {1, 2, 3}, 60, "row 3 from the replica copy")
        assert "serves it" in copies["replica"].stderr
    finally:
        stop_all(processes)
        replica_gen.close()
        primary_gen.close()
