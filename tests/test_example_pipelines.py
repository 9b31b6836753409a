"""Every example pipeline under pipelines/ validates, and each one runs."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from conftest import REPO

from wormhole.testing import read_envelopes, run_cli

PIPELINES = sorted((REPO / "pipelines").glob("*.yml"))


def test_there_are_example_pipelines() -> None:
    assert {p.name for p in PIPELINES} >= {"quickstart.yml", "orders-jsonl.yml"}


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.name)
def test_example_pipeline_validates(pipeline: Path) -> None:
    result = run_cli("validate", str(pipeline))
    assert result.returncode == 0, result


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
