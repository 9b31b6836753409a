"""`wormhole status` of a running publisher: caravans, positions, read rates."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from wormhole.testing import run_cli, start_cli, wait_until, write_pipeline


def _status(pipeline: Path, cwd: Path) -> dict[str, Any]:
    result = run_cli("status", str(pipeline), "--json", cwd=cwd)
    assert result.returncode == 0, result
    return dict(json.loads(result.stdout))


def test_status_shows_the_caravans_of_a_running_publisher(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    lines = [{"op": "c", "key": {"id": i}, "after": {"id": i}} for i in range(500)]
    (data / "t.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    pipeline = write_pipeline(
        tmp_path / "p.yml",
        {
            "pipeline": "live",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(data)},
            "transport": {"type": "inprocess"},
            "delivery": {"datamarker_interval_ms": 50},
            "applications": {
                "a": {"sink": {"type": "null"}},
                "b": {"sink": {"type": "null"}},
            },
        },
    )
    proc = start_cli("run", str(pipeline), cwd=tmp_path)
    try:

        def caught_up() -> bool:
            status = _status(pipeline, tmp_path)
            # Both applications start together: one caravan reads for both.
            return status["running"] and [
                (sorted(c["applications"]), c["position"]) for c in status["caravans"]
            ] == [(["a", "b"], 500)]

        wait_until(caught_up, 60, "one caravan for both at the end of the log")
        text = run_cli("status", str(pipeline), cwd=tmp_path).stdout
        assert "running (pid" in text and "caravans:" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    status = _status(pipeline, tmp_path)
    assert status["running"] is False and status["caravans"] == []
    assert {f["lag"] for f in status["flows"]} == {0}


def test_status_while_a_publisher_is_creating_its_store_shows_no_datamarkers(
    tmp_path: Path,
) -> None:
    # A publisher starting up has created state.db but not yet its tables: status read it
    # then and failed with a traceback ("no such table: datamarkers").
    import sqlite3

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x").touch()
    (tmp_path / "state").mkdir()
    db = sqlite3.connect(tmp_path / "state" / "state.db")
    db.execute("PRAGMA journal_mode=WAL")
    db.close()
    pipeline = write_pipeline(
        tmp_path / "p.yml",
        {
            "pipeline": "p",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path / "data" / "x")},
            "applications": {"out": {"sink": {"type": "null"}}},
        },
    )
    result = run_cli("status", str(pipeline), "--json", cwd=tmp_path)
    assert result.returncode == 0, result
    assert "Traceback" not in result.stderr
    shown = json.loads(result.stdout)
    assert shown["pipeline"] == "p", shown
