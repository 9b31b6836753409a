"""What the CLI tells an operator is true: exit codes, summaries, errors (issue "Tell
operators the truth"). Each test runs `wormhole` as a user does and asserts its exit code
and message."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from tcp_support import Process

from wormhole.testing import run_cli, wait_until, write_pipeline


def _write_lines(path: Path, count: int, table: str = "rows") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for i in range(count):
            row = {"id": i, "note": "x" * 40}
            f.write(json.dumps({"table": table, "key": {"id": i}, "after": row}) + "\n")


def _gated_pipeline(tmp_path: Path, gate: Path, entered: Path) -> Path:
    return write_pipeline(
        tmp_path / "gated.yml",
        {
            "pipeline": "gated",
            "state_dir": str(tmp_path / "state"),
            # Small batches: the subscriber holds a few (transport credits), the log many more.
            "source": {"type": "filelog", "path": str(tmp_path / "data"), "batch_bytes": "4KiB"},
            "transport": {"type": "tcp", "credits": 2},
            "applications": {
                "slow": {"sink": {"type": "gate", "gate": str(gate), "entered": str(entered)}}
            },
        },
    )


def test_an_interrupted_run_once_exits_3_and_says_what_is_left(
    tmp_path: Path, support_env: dict[str, str]
) -> None:
    _write_lines(tmp_path / "data" / "rows" / "0001.jsonl", 5000)
    gate, entered = tmp_path / "gate-open", tmp_path / "entered"
    pipeline = _gated_pipeline(tmp_path, gate, entered)
    proc = Process("run", str(pipeline), "--once", "--json", cwd=tmp_path, env=support_env)
    try:
        # The sink holds its first batch until the stop is under way: the subscriber then
        # finishes the few batches it holds, and the rest of the log is left.
        wait_until(entered.exists, 60, "the sink's first write")
        os.kill(proc.pid, signal.SIGINT)
        wait_until(lambda: "SIGINT: draining" in proc.stderr, 30, "the drain")
        gate.touch()
        code = proc.wait(60)
    finally:
        proc.kill()
    out, err = proc.stdout, proc.stderr
    assert code == 3, err
    summary = json.loads(out)
    assert summary["complete"] is False
    # Left: updates in the publisher log the application did not acknowledge, and (if the
    # stop came before the source was read to its end) the rest of the source.
    left = summary["remaining"]["applications"].get("slow", 0)
    assert left == summary["applications"]["slow"]["lag"]
    assert left > 0 or summary["remaining"]["source"] is True
    assert "run --once stopped before its end" in err
    if left:
        assert f"slow: {left:,} updates not acknowledged" in err
    if summary["remaining"]["source"]:
        assert "the source was not read to its end position" in err
    assert "run it again to deliver the rest" in err

    # Run again: the rest is delivered and the run says it is complete.
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, env=support_env)
    assert result.returncode == 0, result
    assert "complete: every application acknowledged the end position" in result.stdout
    result = run_cli("run", str(pipeline), "--once", "--json", cwd=tmp_path, env=support_env)
    assert result.returncode == 0, result
    summary = json.loads(result.stdout)
    assert summary["complete"] is True
    assert summary["remaining"] == {"source": False, "applications": {}}


def test_run_help_documents_the_exit_codes() -> None:
    result = run_cli("run", "--help")
    assert result.returncode == 0, result
    text = " ".join(result.stdout.split())
    assert "3 when stopped (SIGINT, SIGTERM) before the end of --once" in text
