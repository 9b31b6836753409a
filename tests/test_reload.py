"""Adding and removing applications of a running pipeline (SIGHUP)."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from wormhole.testing import read_envelopes, start_cli, wait_until, write_pipeline


def _append(path: Path, start: int, count: int) -> None:
    with open(path, "a") as f:
        for i in range(start, start + count):
            f.write(json.dumps({"op": "c", "key": {"id": i}, "after": {"id": i}}) + "\n")


def _lines(path: Path) -> int:
    return len(read_envelopes(path))


@pytest.mark.parametrize("transport", ["inprocess", "tcp"])
def test_sighup_adds_and_removes_applications_without_disturbing_the_others(
    tmp_path: Path, transport: str
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    source = data / "events.jsonl"
    _append(source, 0, 100)

    def pipeline(*apps: str) -> Path:
        applications: dict[str, Any] = {
            name: {"sink": {"type": "jsonl", "path": str(tmp_path / f"{name}.jsonl")}}
            for name in apps
        }
        return write_pipeline(
            tmp_path / "p.yml",
            {
                "pipeline": "reload",
                "state_dir": str(tmp_path / "state"),
                "source": {"type": "filelog", "path": str(data), "poll_interval_ms": 20},
                "transport": {"type": transport},
                "delivery": {"datamarker_interval_ms": 50},
                "applications": applications,
            },
        )

    path = pipeline("a")
    proc = start_cli("run", str(path), cwd=tmp_path)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    try:
        wait_until(lambda: _lines(a) == 100, 60, "a to receive the first 100")
        # Add b: it starts at earliest and catches up; a is not disturbed.
        pipeline("a", "b")
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: _lines(b) == 100, 60, "b to catch up")
        _append(source, 100, 50)
        wait_until(lambda: _lines(a) == 150 and _lines(b) == 150, 60, "both to get 50 more")
        # Remove a: it stops; b goes on.
        pipeline("b")
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: (tmp_path / "state" / "live.json").exists(), 10, "live status")

        def a_gone() -> bool:
            live = json.loads((tmp_path / "state" / "live.json").read_text())
            return all(c["applications"] == ["b"] for c in live["caravans"])

        wait_until(a_gone, 60, "a to leave its caravan")
        _append(source, 150, 50)
        wait_until(lambda: _lines(b) == 200, 60, "b to get 50 more")
        assert _lines(a) == 150
        # Add a back: it resumes from its kept datamarkers, not from its start.
        pipeline("a", "b")
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: _lines(a) == 200, 60, "a to resume from its datamarkers")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "application b added, from position 0" in err
    assert "application a removed (its datamarkers are kept)" in err
    assert "application a added, from position 150" in err
    for name in ("a", "b"):
        ids = [e["key"]["id"] for e in read_envelopes(tmp_path / f"{name}.jsonl")]
        assert ids == list(range(200)), name  # every update once, in order
