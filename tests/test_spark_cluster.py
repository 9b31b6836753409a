"""The ``spark`` sink against a real Spark standalone cluster (a master and two workers on
loopback, started from the pyspark wheel): the refresh's tasks run in executor JVMs that the
workers start, and one of them is killed while the run goes on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from wormhole.testing import start_cli, wait_until, write_pipeline


def test_the_sink_refreshes_on_a_standalone_cluster_with_an_executor_killed(
    tmp_path: Path, spark_cluster: Any
) -> None:
    data = tmp_path / "data" / "items"
    data.mkdir(parents=True)
    expected: dict[int, dict[str, Any]] = {}
    with open(data / "0001.jsonl", "w") as f:
        for n in range(4):
            for k in range(400):
                if n == 3 and k % 5 == 0:
                    f.write(json.dumps({"op": "d", "key": {"id": k}, "before": {"id": k}}) + "\n")
                    expected.pop(k, None)
                else:
                    row = {"id": k, "n": n, "label": f"k{k}r{n}"}
                    f.write(json.dumps({"op": "u", "key": {"id": k}, "after": row}) + "\n")
                    expected[k] = row
    lake = tmp_path / "lake"
    pipeline = write_pipeline(
        tmp_path / "cluster.yml",
        {
            "pipeline": "cluster",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(data)},
            "transport": {"type": "inprocess"},
            "applications": {
                "lake": {
                    "sink": {
                        "type": "spark",
                        "path": str(lake),
                        "master": spark_cluster.master_url,
                        "refresh_s": 0,
                        "app_name": "wormhole-cluster-test",
                        "spark_conf": {
                            "spark.driver.host": "127.0.0.1",
                            "spark.executor.memory": "512m",
                            "spark.ui.enabled": "false",
                            "spark.sql.shuffle.partitions": "4",
                        },
                    }
                }
            },
        },
    )
    proc = start_cli("run", str(pipeline), "--once", cwd=tmp_path)
    try:
        # The refresh at the end of the run starts an application: one executor per worker.
        wait_until(lambda: len(spark_cluster.executors()) == 2, 120, "two executors")
        killed = spark_cluster.kill_executor()
        _stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr[-3000:]
    assert proc.pid != killed and killed not in spark_cluster.executors()

    rows = pq.read_table(lake / "current" / "items").to_pylist()
    assert {r["id"]: r for r in rows} == expected

    # The tasks ran in executors started by both workers, and the killed one was replaced.
    def completed() -> list[dict[str, Any]]:
        apps = spark_cluster.state()["completedapps"]
        return [a for a in apps if a["name"] == "wormhole-cluster-test"]

    wait_until(lambda: len(completed()) == 1, 60, "the application to finish on the master")
    app = completed()[0]
    ran = {w.name: [d.name for d in (w / app["id"]).iterdir()] for w in spark_cluster.work_dirs()}
    assert set(ran) == {"worker-0", "worker-1"} and all(ran.values()), ran
    assert sum(len(executors) for executors in ran.values()) >= 3, ran


def _updates(path: Path, keys: int, rounds: range) -> None:
    with open(path, "a") as f:
        for n in rounds:
            for k in range(keys):
                row = {"id": k, "n": n}
                f.write(json.dumps({"op": "u", "key": {"id": k}, "after": row}) + "\n")


def test_executors_read_flows_over_the_network_exactly_once_through_kills(
    tmp_path: Path, spark_cluster: Any, spark: Any
) -> None:
    """The network source on the cluster: tasks read each flow's range from the publisher
    over TCP and never open its state_dir (a guard refuses and records any open there);
    an executor is killed, then the driver is killed and restarted with the same
    checkpoint: every update lands exactly once, in per-key order."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import REPO
    from tcp_support import Process

    from wormhole.testing.helpers import free_port

    data = tmp_path / "data"
    data.mkdir()
    state = tmp_path / "state"
    port = free_port()
    pipeline = write_pipeline(
        tmp_path / "network.yml",
        {
            "pipeline": "network",
            "state_dir": str(state),
            "dataset": {"shards": 4},  # four tasks a micro-batch: each starts a Python worker
            "source": {"type": "filelog", "path": str(data), "poll_interval_ms": 20},
            "transport": {"type": "tcp", "listen": f"127.0.0.1:{port}", "token": "s3cret"},
            "applications": {"lake": {"external": True}},
        },
    )
    publisher = Process("publish", str(pipeline), "-q", cwd=tmp_path)
    guard_log = tmp_path / "guard.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "guard"), str(REPO)]),
        "WORMHOLE_GUARD_DIR": str(state),
        "WORMHOLE_GUARD_LOG": str(guard_log),
        "PYSPARK_PYTHON": sys.executable,
    }
    driver_script = str(REPO / "tests" / "support" / "spark_source_driver.py")
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"

    # Not in tmp_path: Spark's driver looks for data sources in every module of its cwd.
    driver_cwd = tmp_path / "driver"
    driver_cwd.mkdir()

    def driver(*args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, driver_script, "--master", spark_cluster.master_url, *args],
            env=env,
            cwd=driver_cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def committed() -> int:
        commits = checkpoint / "commits"
        return len([p for p in commits.iterdir() if p.name.isdigit()]) if commits.exists() else 0

    stream = ["--publishers", f"127.0.0.1:{port}", "--token", "s3cret"]
    stream += ["--out", str(out), "--checkpoint", str(checkpoint), "--max-updates", "4000"]
    running: list[subprocess.Popen[str]] = []
    try:
        # The guard works on the executors: a task that opens the state dir is refused.
        _updates(data / "0001.jsonl", 200, range(0, 100))
        trip = driver("--trip", str(state / "state.db"))
        running.append(trip)
        tripped, errors = trip.communicate(timeout=180)
        assert trip.returncode == 0, errors[-3000:]
        assert "refused: guarded directory" in tripped, tripped
        assert str(state / "state.db") in guard_log.read_text()
        guard_log.unlink()

        first = driver(*stream)
        running.append(first)
        wait_until(lambda: committed() >= 1 or first.poll() is not None, 180, "a batch")
        assert first.poll() is None, first.communicate()[1][-3000:]
        killed = spark_cluster.kill_executor()
        _updates(data / "0002.jsonl", 200, range(100, 150))
        wait_until(lambda: committed() >= 4 or first.poll() is not None, 180, "four batches")
        assert first.poll() is None, first.communicate()[1][-3000:]
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)
        assert killed not in spark_cluster.executors()

        second = driver(*stream, "--available-now")
        running.append(second)
        _, errors = second.communicate(timeout=300)
        assert second.returncode == 0, errors[-3000:]
    finally:
        for proc in running:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
        assert publisher.stop() == 0, publisher.stderr

    rows = spark.read.parquet(str(out))
    assert rows.count() == 30000
    assert rows.select("datastore", "seq").distinct().count() == 30000
    by_key: dict[int, list[tuple[int, int]]] = {}
    for r in rows.select("seq", "key", "after").collect():
        by_key.setdefault(json.loads(r["key"])["id"], []).append(
            (r["seq"], json.loads(r["after"])["n"])
        )
    assert {k: [n for _, n in sorted(v)] for k, v in by_key.items()} == {
        k: list(range(150)) for k in range(200)
    }
    # No Python process of the job opened the publisher's state dir.
    assert not guard_log.exists(), guard_log.read_text()
