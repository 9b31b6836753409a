"""Spark: the ``spark`` sink (Parquet + current state) and ``readStream.format("wormhole")``,
on a real local[2] Spark (PySpark 4, Java 17)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from wormhole.connectors.spark import register
from wormhole.connectors.spark.sink import refresh_current_state
from wormhole.testing import run_cli, start_cli, write_pipeline
from wormhole.testing.helpers import subscriber_pids, wait_until
from wormhole.testing.postgres import run_sql as sql


def _rows(spark: Any, path: Path) -> dict[Any, dict[str, Any]]:
    return {r["id"]: r.asDict() for r in spark.read.parquet(str(path)).collect()}


def test_current_state_equals_the_source_table_and_transforms_run(
    tmp_path: Path, postgres_dsn: str, spark: Any
) -> None:
    sql(
        postgres_dsn,
        "CREATE TABLE orders (id int PRIMARY KEY, customer text, amount int, note text)",
        "INSERT INTO orders SELECT g, 'c' || (g % 7), g * 10, NULL FROM generate_series(1, 300) g",
    )
    lake = tmp_path / "lake"
    pipeline = write_pipeline(
        tmp_path / "spark.yml",
        {
            "pipeline": "lake",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "postgres", "dsn": postgres_dsn, "tables": ["public.orders"]},
            "transport": {"type": "inprocess"},
            "applications": {
                "lake": {
                    "sink": {
                        "type": "spark",
                        "path": str(lake),
                        "master": "local[2]",
                        "refresh_s": 0,
                        "transforms": {
                            "big_orders": "SELECT id, amount FROM public_orders "
                            "WHERE amount > 2000",
                            "per_customer": "SELECT customer, count(*) AS n FROM public_orders "
                            "GROUP BY customer",
                        },
                    }
                }
            },
        },
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result
    sql(
        postgres_dsn,
        "UPDATE orders SET amount = amount + 1, note = 'updated' WHERE id % 3 = 0",
        "DELETE FROM orders WHERE id % 5 = 0",
        "UPDATE orders SET id = id + 1000 WHERE id = 7",  # a key change
        "INSERT INTO orders VALUES (5000, 'new', 99999, 'late')",
        "UPDATE orders SET note = 'twice' WHERE id = 9",
        "UPDATE orders SET note = 'three times' WHERE id = 9",
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result

    import psycopg2

    conn = psycopg2.connect(postgres_dsn)
    with conn.cursor() as cur:
        cur.execute("SELECT id, customer, amount, note FROM orders")
        source = {
            r[0]: {"id": r[0], "customer": r[1], "amount": r[2], "note": r[3]}
            for r in cur.fetchall()
        }
    conn.close()
    current = _rows(spark, lake / "current" / "public.orders")
    assert current == source
    # Every update was appended, partitioned by table and date.
    changes = spark.read.parquet(str(lake / "changes"))
    assert changes.where("op = 'r'").count() == 300
    assert {r["table"] for r in changes.select("table").distinct().collect()} == {"public.orders"}
    assert (lake / "changes" / "table=public.orders").is_dir()
    assert any(
        p.name.startswith("date=") for p in (lake / "changes" / "table=public.orders").iterdir()
    )
    big = {r["id"] for r in spark.read.parquet(str(lake / "transforms" / "big_orders")).collect()}
    assert big == {i for i, row in source.items() if row["amount"] > 2000}
    per = spark.read.parquet(str(lake / "transforms" / "per_customer")).collect()
    assert sum(r["n"] for r in per) == len(source)


def _workload(path: Path, keys: int, rounds: range) -> dict[int, dict[str, Any] | None]:
    """Upserts every key each round; deletes keys divisible by 7 in odd rounds."""
    final: dict[int, dict[str, Any] | None] = {}
    with open(path, "a") as f:
        for n in rounds:
            for k in range(keys):
                if n % 2 and k % 7 == 0:
                    f.write(json.dumps({"op": "d", "key": {"id": k}, "before": {"id": k}}) + "\n")
                    final[k] = None
                else:
                    row = {"id": k, "n": n, "label": f"k{k}r{n}"}
                    f.write(json.dumps({"op": "u", "key": {"id": k}, "after": row}) + "\n")
                    final[k] = row
    return final


def _appended_rows(lake: Path) -> int:
    return sum(pq.ParquetFile(p).metadata.num_rows for p in (lake / "changes").rglob("*.parquet"))


def test_kill_9_of_the_sink_subscriber_and_the_publisher_then_a_restart_stay_correct(
    tmp_path: Path, spark: Any
) -> None:
    data = tmp_path / "data" / "items"
    data.mkdir(parents=True)
    lake = tmp_path / "lake"
    pipeline = write_pipeline(
        tmp_path / "spark.yml",
        {
            "pipeline": "killed",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(data), "poll_interval_ms": 20},
            # Datamarkers are persisted rarely: a restart replays what was already written.
            "delivery": {"datamarker_interval_ms": 600_000},
            "applications": {
                "lake": {"sink": {"type": "spark", "path": str(lake), "current_state": False}}
            },
        },
    )
    first = _workload(data / "0001.jsonl", 300, range(0, 20))
    proc = start_cli("run", str(pipeline), cwd=tmp_path)
    try:
        wait_until(lambda: _appended_rows(lake) >= 6000, 60, "the first rounds appended")
        (victim,) = subscriber_pids(proc.pid)
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: subscriber_pids(proc.pid) not in ([], [victim]), 60, "a new subscriber")
        final = {**first, **_workload(data / "0002.jsonl", 300, range(20, 40))}
        wait_until(lambda: _appended_rows(lake) >= 12000, 60, "every round appended")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result
    assert _appended_rows(lake) > 12000  # updates were appended again (replays)
    refresh_current_state(spark, lake)
    live = {k: v for k, v in final.items() if v is not None}
    assert _rows(spark, lake / "current" / "items") == live


def _external_pipeline(tmp_path: Path, data: Path) -> Path:
    return write_pipeline(
        tmp_path / "stream.yml",
        {
            "pipeline": "stream",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(data)},
            "transport": {"type": "inprocess"},
            "log": {"roll_size": 65536},
            "applications": {
                "analytics": {"external": True},
                "audit": {"sink": {"type": "jsonl", "path": str(tmp_path / "audit.jsonl")}},
            },
        },
    )


def _stream_once(spark: Any, pipeline: Path, application: str, out: Path, checkpoint: Path) -> None:
    frame = (
        spark.readStream.format("wormhole")
        .option("pipeline", str(pipeline))
        .option("application", application)
        .load()
    )
    query = (
        frame.writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()


def _status(pipeline: Path, cwd: Path) -> dict[str, Any]:
    result = run_cli("status", str(pipeline), "--json", cwd=cwd)
    assert result.returncode == 0, result
    return dict(json.loads(result.stdout))


def test_read_stream_exactly_once_with_datamarkers_as_offsets(tmp_path: Path, spark: Any) -> None:
    register(spark)
    data = tmp_path / "data" / "events"
    data.mkdir(parents=True)
    _workload(data / "0001.jsonl", 100, range(0, 30))
    pipeline = _external_pipeline(tmp_path, data)
    assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    _stream_once(spark, pipeline, "analytics", out, checkpoint)
    rows = spark.read.parquet(str(out))
    assert rows.count() == 3000
    assert rows.select("seq").distinct().count() == 3000
    assert rows.select("shard").distinct().count() == 16  # partitions are shards
    # The publisher keeps the log for the external application: nothing was collected.
    assert _status(pipeline, tmp_path)["log"]["first"] == 0

    _workload(data / "0002.jsonl", 100, range(30, 60))
    assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
    _stream_once(spark, pipeline, "analytics", out, checkpoint)
    rows = spark.read.parquet(str(out))
    assert rows.count() == 6000 and rows.select("seq").distinct().count() == 6000
    # Per key, the updates are in order within the stream.
    key = [r["after"] for r in rows.where("key = '{\"id\":3}'").orderBy("seq").collect()]
    assert [json.loads(a)["n"] for a in key] == list(range(60))

    # Spark committed the first micro-batch's end: the application's datamarkers moved,
    # and the publisher may now collect the segments behind them.
    status = _status(pipeline, tmp_path)
    markers = {f["datamarker"] for f in status["flows"] if f["application"] == "analytics"}
    assert markers == {3000}
    assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
    assert 0 < _status(pipeline, tmp_path)["log"]["first"] <= 3000


def test_read_stream_names_a_wrong_application(tmp_path: Path, spark: Any) -> None:
    import pytest

    register(spark)
    data = tmp_path / "data" / "events"
    data.mkdir(parents=True)
    pipeline = _external_pipeline(tmp_path, data)
    with pytest.raises(Exception, match=r"applications\.audit is not an external application"):
        _stream_once(spark, pipeline, "audit", tmp_path / "out", tmp_path / "checkpoint")


def test_read_with_state_dir_finds_a_state_dir_the_pipeline_names_relatively(
    tmp_path: Path, spark: Any
) -> None:
    """The ``stateDir`` option points the source at the state_dir when Spark's Python workers
    run elsewhere (Spark hands the options over lower-cased)."""
    register(spark)
    data = tmp_path / "data" / "events"
    data.mkdir(parents=True)
    _workload(data / "0001.jsonl", 10, range(0, 2))
    pipeline = write_pipeline(
        tmp_path / "relative.yml",
        {
            "pipeline": "relative",
            "state_dir": "state",  # relative to where `wormhole run` runs: tmp_path
            "source": {"type": "filelog", "path": str(data)},
            "transport": {"type": "inprocess"},
            "applications": {"analytics": {"external": True}},
        },
    )
    assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
    rows = (
        spark.read.format("wormhole")
        .option("pipeline", str(pipeline))
        .option("application", "analytics")
        .option("stateDir", str(tmp_path / "state"))
        .load()
    )
    assert rows.count() == 20


def test_a_batch_read_with_nothing_to_read_is_empty(tmp_path: Path, spark: Any) -> None:
    register(spark)
    data = tmp_path / "data" / "events"
    data.mkdir(parents=True)
    pipeline = _external_pipeline(tmp_path, data)
    assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
    rows = (
        spark.read.format("wormhole")
        .option("pipeline", str(pipeline))
        .option("application", "analytics")
        .load()
    )
    assert rows.count() == 0


def test_external_applications_validate(tmp_path: Path) -> None:
    bad = write_pipeline(
        tmp_path / "bad.yml",
        {
            "pipeline": "bad",
            "source": {"type": "filelog", "path": "data"},
            "applications": {
                "analytics": {"external": True, "sink": {"type": "null"}},
            },
        },
    )
    result = run_cli("validate", str(bad), cwd=tmp_path)
    assert result.returncode == 2, result
    assert "an external application has no sink" in result.stderr


def test_the_example_pipeline_runs(tmp_path: Path, spark: Any) -> None:
    from conftest import REPO

    data = tmp_path / "orders"
    data.mkdir()
    _workload(data / "0001.jsonl", 50, range(0, 4))
    env = {
        "SPARK_DATA": str(data),
        "SPARK_STATE": str(tmp_path / "state"),
        "SPARK_OUT": str(tmp_path / "lake"),
        "SPARK_MASTER": "local[2]",
    }
    pipeline = str(REPO / "pipelines" / "spark-lake.yml")
    result = run_cli("run", pipeline, "--once", env=env, timeout=300)
    assert result.returncode == 0, result
    current = _rows(spark, tmp_path / "lake" / "current" / "orders")
    assert len(current) == 50 - len(range(0, 50, 7)) and current[1]["n"] == 3


def _network_pipeline(tmp_path: Path, data: Path, port: int) -> Path:
    return write_pipeline(
        tmp_path / "network.yml",
        {
            "pipeline": "network",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(data), "poll_interval_ms": 20},
            "transport": {"type": "tcp", "listen": f"127.0.0.1:{port}", "token": "s3cret"},
            "applications": {
                "analytics": {"external": True},
                "audit": {"sink": {"type": "null"}},
            },
        },
    )


def _stream_network(
    spark: Any,
    port: int,
    out: Path,
    checkpoint: Path,
    application: str = "analytics",
    **options: str,
) -> None:
    reader = (
        spark.readStream.format("wormhole")
        .option("publishers", f"127.0.0.1:{port}")
        .option("application", application)
        .option("token", "s3cret")
    )
    for key, value in options.items():
        reader = reader.option(key, value)
    writer = (
        reader.load()
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
    )
    writer.trigger(availableNow=True).start().awaitTermination()


def test_read_stream_over_the_network_commits_datamarkers_through_the_publisher(
    tmp_path: Path, spark: Any
) -> None:
    import pytest

    from wormhole.testing.helpers import free_port

    register(spark)
    data = tmp_path / "data" / "events"
    data.mkdir(parents=True)
    port = free_port()
    pipeline = _network_pipeline(tmp_path, data, port)
    publisher = start_cli("publish", str(pipeline), "-q", cwd=tmp_path)
    try:
        _workload(data / "0001.jsonl", 100, range(0, 30))
        wait_until(lambda: _status(pipeline, tmp_path)["log"]["end"] >= 3000, 60, "3000 updates")
        out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
        _stream_network(spark, port, out, checkpoint)
        rows = spark.read.parquet(str(out))
        assert rows.count() == 3000
        assert rows.select("seq").distinct().count() == 3000
        assert rows.select("shard").distinct().count() == 16  # partitions are flows
        assert {r["datastore"] for r in rows.select("datastore").distinct().collect()} == {
            "network"
        }

        _workload(data / "0002.jsonl", 100, range(30, 60))
        wait_until(lambda: _status(pipeline, tmp_path)["log"]["end"] >= 6000, 60, "6000 updates")
        # At most 1000 updates a micro-batch: several batches, the same rows in the end.
        _stream_network(spark, port, out, checkpoint, maxUpdatesPerTrigger="1000")
        rows = spark.read.parquet(str(out))
        assert rows.count() == 6000 and rows.select("seq").distinct().count() == 6000
        key = [r["after"] for r in rows.where("key = '{\"id\":3}'").orderBy("seq").collect()]
        assert [json.loads(a)["n"] for a in key] == list(range(60))
        batches = {p.name for p in (checkpoint / "commits").iterdir() if p.name.isdigit()}
        assert len(batches) >= 4, batches
        # Spark commits a micro-batch's end when it plans the next one, through the
        # publisher: the status shows those datamarkers, at a batch boundary of this run.
        markers = {
            f["datamarker"]
            for f in _status(pipeline, tmp_path)["flows"]
            if f["application"] == "analytics"
        }
        assert len(markers) == 1 and 4000 <= min(markers) <= 6000, markers

        # Bad input: the query fails naming the cause.
        with pytest.raises(Exception, match="authentication failed: wrong token"):
            _stream_network(spark, port, tmp_path / "o2", tmp_path / "c2", token="wrong")
        with pytest.raises(Exception, match=r"not an external application 'audit'"):
            _stream_network(spark, port, tmp_path / "o3", tmp_path / "c3", application="audit")
    finally:
        publisher.terminate()
        publisher.communicate(timeout=60)
    assert publisher.returncode == 0


def test_read_stream_finds_every_publisher_of_a_dataset_through_the_registry(
    tmp_path: Path, spark: Any, zookeeper_server: Any
) -> None:
    from tcp_support import Process

    from wormhole.connectors.tcp.ranges import TcpRemoteLog
    from wormhole.plugins.components import RemoteLogError, RemoteLogRequest
    from wormhole.testing.helpers import free_port

    register(spark)
    root = "/spark-registry"
    ports = {}
    publishers = []
    for datastore in ("db1", "db2"):
        data = tmp_path / "data" / datastore
        data.mkdir(parents=True)
        ports[datastore] = free_port()
        pipeline = write_pipeline(
            tmp_path / f"{datastore}.yml",
            {
                "pipeline": "shop",
                "registry": {"type": "zookeeper", "hosts": zookeeper_server.hosts, "root": root},
                "datastore": datastore,
                "state_dir": str(tmp_path / f"state-{datastore}"),
                "dataset": {"shards": 4},
                "source": {"type": "filelog", "path": str(data), "poll_interval_ms": 20},
                "transport": {"type": "tcp", "listen": f"127.0.0.1:{ports[datastore]}"},
                "applications": {"lake": {"external": True}},
            },
        )
        _workload(data / "0001.jsonl", 50, range(0, 20))
        publishers.append(Process("publish", str(pipeline), "-q", cwd=tmp_path))

    def logged(datastore: str, end: int) -> bool:
        remote = TcpRemoteLog(RemoteLogRequest(f"127.0.0.1:{ports[datastore]}", "lake"))
        try:
            return remote.positions().end >= end
        except RemoteLogError:
            return False

    try:
        for datastore in ports:
            wait_until(lambda d=datastore: logged(d, 1000), 60, f"{datastore} to log 1000")
        out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
        query = (
            spark.readStream.format("wormhole")
            .option("registry", f"zookeeper://{zookeeper_server.hosts}{root}")
            .option("dataset", "shop")
            .option("application", "lake")
            .load()
            .writeStream.format("parquet")
            .option("path", str(out))
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        rows = spark.read.parquet(str(out))
        assert rows.count() == 2000
        assert rows.select("datastore", "seq").distinct().count() == 2000
        per_store = {
            r["datastore"]: r["count"] for r in rows.groupBy("datastore").count().collect()
        }
        assert per_store == {"db1": 1000, "db2": 1000}
        # Offsets are per datastore: {"db1": {"0": ...}, "db2": {...}}.
        offsets = json.loads((checkpoint / "offsets" / "0").read_text().splitlines()[-1])
        assert set(offsets) == {"db1", "db2"} and all(len(v) == 4 for v in offsets.values())
    finally:
        for publisher in publishers:
            assert publisher.stop() == 0, publisher.stderr
