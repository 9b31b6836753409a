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
