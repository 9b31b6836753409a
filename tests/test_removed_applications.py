"""An application taken out of the pipeline keeps its place: its stored datamarkers hold
the publisher log back until it is added again or forgotten (``wormhole forget``)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from wormhole.testing import read_envelopes, run_cli, write_pipeline


def _append(path: Path, start: int, count: int) -> None:
    with open(path, "a") as f:
        for i in range(start, start + count):
            row = {"id": i, "pad": "x" * 200}
            f.write(json.dumps({"op": "c", "key": {"id": i}, "after": row}) + "\n")


def _pipeline(tmp_path: Path, *apps: str) -> Path:
    applications: dict[str, Any] = {
        name: {"sink": {"type": "jsonl", "path": str(tmp_path / f"{name}.jsonl")}} for name in apps
    }
    return write_pipeline(
        tmp_path / "p.yml",
        {
            "pipeline": "removed",
            "state_dir": str(tmp_path / "state"),
            "dataset": {"shards": 4},
            "source": {"type": "filelog", "path": str(tmp_path / "data")},
            "transport": {"type": "inprocess"},
            # Small segments: every run rolls several and collects what flows passed.
            "log": {"roll_size": "16KiB", "tail_updates": 64},
            "applications": applications,
        },
    )


def _ids(path: Path) -> list[int]:
    return [e["key"]["id"] for e in read_envelopes(path)]


def _segments(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "state" / "log").glob("log.*"))


def test_a_removed_application_resumes_where_it_stopped_when_added_back(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    source = tmp_path / "data" / "events.jsonl"
    _append(source, 0, 500)
    both = _pipeline(tmp_path, "a", "b")
    assert run_cli("run", str(both), "--once", cwd=tmp_path).returncode == 0
    assert _ids(tmp_path / "b.jsonl") == list(range(500))

    # b is taken out; more data rolls segments, and garbage collection runs.
    only_a = _pipeline(tmp_path, "a")
    _append(source, 500, 2000)
    result = run_cli("run", str(only_a), "--once", "--json", cwd=tmp_path)
    assert result.returncode == 0, result
    assert _ids(tmp_path / "a.jsonl") == list(range(2500))

    status = run_cli("status", str(only_a), "--json", cwd=tmp_path)
    removed = json.loads(status.stdout)["removed_applications"]
    assert [r["application"] for r in removed] == ["b"]
    assert removed[0]["datamarker"] == 500
    assert removed[0]["lag"] == 2000
    text = run_cli("status", str(only_a), cwd=tmp_path).stdout
    assert "wormhole forget" in text and "b" in text

    # b comes back: it resumes after what it acknowledged, and a goes on too.
    _append(source, 2500, 100)
    back = _pipeline(tmp_path, "a", "b")
    result = run_cli("run", str(back), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    assert _ids(tmp_path / "b.jsonl") == list(range(2600))
    assert _ids(tmp_path / "a.jsonl") == list(range(2600))


def test_forget_releases_the_log_a_removed_application_held(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    source = tmp_path / "data" / "events.jsonl"
    _append(source, 0, 500)
    assert (
        run_cli("run", str(_pipeline(tmp_path, "a", "b")), "--once", cwd=tmp_path).returncode == 0
    )
    only_a = _pipeline(tmp_path, "a")
    _append(source, 500, 2000)
    assert run_cli("run", str(only_a), "--once", cwd=tmp_path).returncode == 0
    held = _segments(tmp_path)

    # An application still in the file is not forgotten: it would only start over.
    refused = run_cli("forget", str(_pipeline(tmp_path, "a", "b")), "b", cwd=tmp_path)
    assert refused.returncode == 2
    assert "applications.b" in refused.stderr
    only_a = _pipeline(tmp_path, "a")
    unknown = run_cli("forget", str(only_a), "nosuch", cwd=tmp_path)
    assert unknown.returncode == 2 and "nosuch" in unknown.stderr

    forgotten = run_cli("forget", str(only_a), "b", cwd=tmp_path)
    assert forgotten.returncode == 0, forgotten
    assert (
        json.loads(run_cli("status", str(only_a), "--json", cwd=tmp_path).stdout)[
            "removed_applications"
        ]
        == []
    )
    _append(source, 2500, 10)
    assert run_cli("run", str(only_a), "--once", cwd=tmp_path).returncode == 0
    assert len(_segments(tmp_path)) < len(held)

    # Added back after forget, b starts over from its start point (earliest retained).
    result = run_cli("run", str(_pipeline(tmp_path, "a", "b")), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    assert _ids(tmp_path / "b.jsonl")[:500] == list(range(500))
    assert _ids(tmp_path / "b.jsonl")[500] > 500


def test_an_application_that_cannot_start_does_not_stop_the_others(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    source = tmp_path / "data" / "events.jsonl"
    _append(source, 0, 100)
    both = _pipeline(tmp_path, "a", "b")
    assert run_cli("run", str(both), "--once", cwd=tmp_path).returncode == 0
    # Damage b's stored datamarkers: they point past the end of the log.
    with sqlite3.connect(tmp_path / "state" / "state.db") as db:
        db.execute("UPDATE datamarkers SET position = 10000 WHERE application = 'b'")
    _append(source, 100, 50)
    result = run_cli("run", str(both), "--once", cwd=tmp_path)
    assert _ids(tmp_path / "a.jsonl") == list(range(150))
    assert result.returncode != 0
    assert "application b" in result.stderr and "10000" in result.stderr
