"""What the backfill tests of every source share: the latest sink's state, the backfill
list, comparing a state with the table, stopping a run, and kill -9 mid-backfill."""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

from wormhole.core.backfill_queue import summary
from wormhole.core.pipeline import load_pipeline
from wormhole.testing import run_cli
from wormhole.testing.helpers import cli_command


def latest(path: Path, table: str) -> dict[Any, dict[str, Any]]:
    """The latest sink's rows of ``table``, by the key's ``id``."""
    if not path.exists():
        return {}
    db = sqlite3.connect(path)
    try:
        rows = db.execute("SELECT key, row FROM latest WHERE source_table = ?", (table,)).fetchall()
    finally:
        db.close()
    return {json.loads(k)["id"]: json.loads(r) for k, r in rows}


def backfills(pipeline: Path) -> list[dict[str, Any]]:
    """``wormhole backfill PIPELINE --list --json``."""
    result = run_cli("backfill", str(pipeline), "--list", "--json")
    assert result.returncode == 0, result
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    return rows


def assert_same_rows(got: dict[Any, Any], expected: dict[Any, Any], what: str) -> None:
    """A state per key equals the table's: no key missing, none extra, none different."""
    missing = set(expected) - set(got)
    extra = set(got) - set(expected)
    wrong = [k for k in set(got) & set(expected) if got[k] != expected[k]]
    assert not missing and not extra and not wrong, (
        what,
        sorted(missing)[:5],
        sorted(extra)[:5],
        wrong[:5],
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM a run; it must drain and exit 0."""
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def kill_mid_backfill(pipeline: Path, rounds: int, seed: int) -> int:
    """Run the pipeline ``rounds`` times, each killed with SIGKILL once the backfill read
    a seeded number of rows more; returns the rows read by then.

    The backfill's progress is read in this process (a read of its queue, milliseconds),
    not through ``wormhole backfill --list`` (a new interpreter, seconds on a loaded
    machine, in which a fast backfill could finish). Give the backfill a pause that bounds
    its rate (``--pause-ms 100`` with 500-row chunks: at most 5,000 rows a second) so a
    poll delayed by load still finds it running."""
    rnd = random.Random(seed)
    state_dir = load_pipeline(pipeline).state_dir
    read = 0
    for _round in range(rounds):
        proc = subprocess.Popen(
            cli_command("run", str(pipeline)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        target = read + rnd.randrange(2_000, 6_000)
        deadline = time.monotonic() + 120
        try:
            while read < target:
                assert time.monotonic() < deadline, "the backfill made no progress"
                time.sleep(0.02)
                [state] = summary(state_dir)
                read = state["read"]
                assert state["state"] in ("queued", "running"), state
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
    return read
