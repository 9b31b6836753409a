"""Spark Declarative Pipelines: ``spark-pipelines run`` of pipelines/spark-declarative/ (its
streaming table reads ``format("wormhole")``, its materialized view derives from it) against
a real Spark Connect server (``local[2]`` inside), with updates published by ``wormhole run``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml
from conftest import REPO

from wormhole.testing import run_cli

EXAMPLE = REPO / "pipelines" / "spark-declarative"


def _project(tmp_path: Path, spec_name: str = "spark-pipeline.yml") -> Path:
    """The example, copied with its changes replaced by the test's, its storage in tmp_path."""
    project = tmp_path / "project"
    shutil.copytree(
        EXAMPLE,
        project,
        ignore=shutil.ignore_patterns(
            ".wormhole", "spark-warehouse", "metastore_db", "derby.log", "__pycache__"
        ),
    )
    for old in (project / "orders").iterdir():
        old.unlink()
    spec_path = project / spec_name
    spec = yaml.safe_load(spec_path.read_text())
    spec["storage"] = (tmp_path / "storage").as_uri()
    spec_path.write_text(yaml.safe_dump(spec))
    return project


def _publish(project: Path, name: str, lines: list[dict[str, Any]]) -> None:
    with open(project / "orders" / name, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    result = run_cli("run", "wormhole.yml", "--once", cwd=project)
    assert result.returncode == 0, result


def _spark_pipelines(project: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    import pyspark

    command = Path(pyspark.__file__).parent / "bin" / "spark-pipelines"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(command), "--remote", url, *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _spark_pipelines_run(project: Path, url: str) -> None:
    result = _spark_pipelines(project, url, "run")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "Run is COMPLETED" in result.stdout + result.stderr


def _upsert(k: int, qty: int) -> dict[str, Any]:
    return {"op": "u", "key": {"id": k}, "after": {"id": k, "item": f"item{k}", "qty": qty}}


def _delete(k: int) -> dict[str, Any]:
    return {"op": "d", "key": {"id": k}, "before": {"id": k}}


def _updates(warehouse: Path) -> list[tuple[int, str, str, str, dict[str, Any] | None]]:
    rows = pq.read_table(warehouse / "wormhole_updates").to_pylist()
    return sorted(
        (r["seq"], r["op"], r["table"], r["key"], r["after"] and json.loads(r["after"]))
        for r in rows
    )


def _current(warehouse: Path) -> dict[str, dict[str, Any]]:
    rows = pq.read_table(warehouse / "wormhole_current").to_pylist()
    assert all(r["table"] == "orders" for r in rows)
    current = {r["key"]: json.loads(r["row"]) for r in rows}
    assert len(current) == len(rows), "one row per key"
    return current


def _markers(project: Path) -> set[int]:
    result = run_cli("status", "wormhole.yml", "--json", cwd=project)
    assert result.returncode == 0, result
    flows = json.loads(result.stdout)["flows"]
    return {f["datamarker"] for f in flows if f["application"] == "analytics"}


def test_spark_pipelines_run_the_example_into_a_streaming_table_and_a_materialized_view(
    tmp_path: Path, spark_connect: Any
) -> None:
    project = _project(tmp_path)
    warehouse = spark_connect.warehouse

    # Round 1: ten keys, key 3 updated, key 4 deleted.
    first = [_upsert(k, 1) for k in range(10)] + [_upsert(3, 2), _delete(4)]
    _publish(project, "0001.jsonl", first)
    _spark_pipelines_run(project, spark_connect.url)
    expected = [
        (seq, u["op"], "orders", json.dumps(u["key"]).replace(" ", ""), u.get("after"))
        for seq, u in enumerate(first)
    ]
    assert _updates(warehouse) == expected
    live = {f'{{"id":{k}}}': {"id": k, "item": f"item{k}", "qty": 1} for k in range(10)}
    live['{"id":3}']["qty"] = 2
    del live['{"id":4}']
    assert _current(warehouse) == live
    # Spark commits a batch's offsets when it plans the next one: none stored yet.
    assert _markers(project) == {0}

    # A run with no new updates appends nothing: the checkpoint holds the offsets.
    _spark_pipelines_run(project, spark_connect.url)
    assert _updates(warehouse) == expected
    assert _current(warehouse) == live

    # Round 2: key 4 comes back, key 5 updated twice, key 0 deleted.
    second = [_upsert(4, 7), _upsert(5, 8), _upsert(5, 9), _delete(0)]
    _publish(project, "0002.jsonl", second)
    _spark_pipelines_run(project, spark_connect.url)
    expected += [
        (len(first) + n, u["op"], "orders", json.dumps(u["key"]).replace(" ", ""), u.get("after"))
        for n, u in enumerate(second)
    ]
    assert _updates(warehouse) == expected
    live['{"id":4}'] = {"id": 4, "item": "item4", "qty": 7}
    live['{"id":5}'] = {"id": 5, "item": "item5", "qty": 9}
    del live['{"id":0}']
    assert _current(warehouse) == live
    # Planning round 2 committed round 1's end: the application's datamarkers, which
    # `wormhole status` shows and the publisher's log collection respects.
    assert _markers(project) == {len(first)}


def test_the_auto_cdc_variant_is_a_valid_graph_and_needs_a_table_format_with_merge(
    tmp_path: Path, spark_connect: Any
) -> None:
    """Delta and Iceberg cannot be installed here: check what runs without them. The Auto CDC
    flow's definition resolves against the source's schema (keys, sequence, deletes), and a run
    stops only because Parquet has no MERGE."""
    project = _project(tmp_path, "auto-cdc.yml")
    spec_path = project / "auto-cdc.yml"
    spec = yaml.safe_load(spec_path.read_text())
    spec["configuration"]["spark.wormhole.table_format"] = "parquet"
    spec_path.write_text(yaml.safe_dump(spec))
    _publish(project, "0001.jsonl", [_upsert(1, 1), _delete(1)])

    checked = _spark_pipelines(project, spark_connect.url, "dry-run", "--spec", "auto-cdc.yml")
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-5000:]
    assert "Run is COMPLETED" in checked.stdout + checked.stderr

    run = _spark_pipelines(project, spark_connect.url, "run", "--spec", "auto-cdc.yml")
    assert run.returncode != 0
    assert "AUTOCDC_TARGET_DOES_NOT_SUPPORT_MERGE" in run.stdout + run.stderr


def _documented_run() -> list[str]:
    """The arguments of ``spark-pipelines`` in docs/spark.md's command for the example."""
    docs = (REPO / "docs" / "spark.md").read_text()
    lines = [
        line
        for line in docs.splitlines()
        if line.startswith("PYSPARK_PYTHON=") and " spark-pipelines " in line
    ]
    assert len(lines) == 1, lines
    return lines[0].split(" spark-pipelines ", 1)[1].split()


def test_the_example_runs_again_on_a_local_server_exactly_as_documented(tmp_path: Path) -> None:
    """No ``--remote``: ``spark-pipelines`` starts a local Spark Connect server for each run,
    and the server's catalog must outlive it as the tables' files do. Three runs from a fresh
    copy of the example, with docs/spark.md's command: the second has nothing new and appends
    nothing; the third appends only what was published since."""
    import pyspark

    project = _project(tmp_path)
    warehouse = project / "spark-warehouse"
    command = Path(pyspark.__file__).parent / "bin" / "spark-pipelines"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}

    def run() -> None:
        result = subprocess.run(
            ["bash", str(command), *_documented_run()],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        output = result.stdout + result.stderr
        assert result.returncode == 0, output[-5000:]
        assert "Run is COMPLETED" in output

    first = [_upsert(k, 1) for k in range(6)] + [_delete(2)]
    _publish(project, "0001.jsonl", first)
    run()
    expected = [
        (seq, u["op"], "orders", json.dumps(u["key"]).replace(" ", ""), u.get("after"))
        for seq, u in enumerate(first)
    ]
    assert _updates(warehouse) == expected

    run()  # nothing new: nothing appended
    assert _updates(warehouse) == expected

    second = [_upsert(2, 5), _upsert(3, 6)]
    _publish(project, "0002.jsonl", second)
    run()
    expected += [
        (len(first) + n, u["op"], "orders", json.dumps(u["key"]).replace(" ", ""), u.get("after"))
        for n, u in enumerate(second)
    ]
    assert _updates(warehouse) == expected
    live = {f'{{"id":{k}}}': {"id": k, "item": f"item{k}", "qty": 1} for k in range(6)}
    live['{"id":2}']["qty"] = 5
    live['{"id":3}']["qty"] = 6
    assert _current(warehouse) == live
