"""`wormhole top`: a live view of a real publisher and real subscriber processes."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import uuid
from pathlib import Path

from tcp_support import Process, stop_all

from wormhole.testing import run_cli, write_pipeline
from wormhole.testing.helpers import cli_command, require, wait_until

COLUMNS = [
    "subscribers",
    "updates/s",
    "delivered",
    "acknowledged",
    "dead_letters",
    "lag",
    "lag_s",
    "caravan",
    "caravan_lag",
]


def _write(data: Path, name: str, ids: range) -> None:
    lines = [{"op": "c", "key": {"id": i}, "after": {"id": i}} for i in ids]
    temporary = data / f".{name}"
    temporary.write_text("".join(json.dumps(x) + "\n" for x in lines))
    temporary.rename(data / name)


def _pipeline(tmp_path: Path, port: int) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    return write_pipeline(
        tmp_path / "top.yml",
        {
            "pipeline": "top",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(data), "poll_interval_ms": 20},
            "transport": {"type": "tcp", "listen": f"127.0.0.1:{port}"},
            "delivery": {"datamarker_interval_ms": 50},
            "metrics": {"listen": "127.0.0.1:0"},
            "applications": {
                name: {"sink": {"type": "jsonl", "path": str(tmp_path / f"{name}.jsonl")}}
                for name in ("a", "b")
            },
        },
    )


def _frame(pipeline: Path, cwd: Path) -> str:
    result = run_cli("top", str(pipeline), "--once", cwd=cwd)
    assert result.returncode == 0, result
    return result.stdout


def _rows(frame: str) -> dict[str, dict[str, str]]:
    """The applications table: name -> column -> cell."""
    rows = {}
    for line in frame.splitlines():
        cells = line.split()
        if len(cells) == len(COLUMNS) + 1 and cells[0] in ("a", "b"):
            rows[cells[0]] = dict(zip(COLUMNS, cells[1:], strict=True))
    return rows


def test_top_once_shows_delivery_lag_subscribers_and_source_lag(
    tmp_path: Path, free_port: int
) -> None:
    pipeline = _pipeline(tmp_path, free_port)
    _write(tmp_path / "data", "1.jsonl", range(200))
    publisher = Process("publish", str(pipeline), cwd=tmp_path)
    subscribers = {
        name: Process("subscribe", str(pipeline), "--app", name, cwd=tmp_path)
        for name in ("a", "b")
    }
    processes = [publisher, *subscribers.values()]
    try:
        frames: list[str] = []

        def caught_up() -> bool:
            frames.append(_frame(pipeline, tmp_path))
            rows = _rows(frames[-1])
            return "source (filelog): 200 updates read" in frames[-1] and all(
                rows.get(n, {}).get("acknowledged") == "200" and rows[n]["lag"] == "0"
                for n in ("a", "b")
            )

        wait_until(caught_up, 60, "both applications at 200 updates, lag 0")
        frame = frames[-1]
        assert "publisher running, pid" in frame, frame
        for row in _rows(frame).values():
            assert row["subscribers"] == "1" and row["delivered"] == "200", frame
            assert row["lag_s"] == "0.0" and row["caravan"].startswith("#"), frame
        # Updates read, and the source's own lag scraped from the metrics endpoint.
        assert "source (filelog): 200 updates read" in frame and "lag bytes 0 B" in frame, frame

        # b's subscriber stops: what comes next waits for it, a goes on.
        assert subscribers["b"].stop() == 0
        _write(tmp_path / "data", "2.jsonl", range(200, 300))

        def a_moves_on() -> bool:
            frames.append(_frame(pipeline, tmp_path))
            rows = _rows(frames[-1])
            # b's lag in seconds is the age of its oldest update: it grows from 0.0.
            return (
                rows["a"]["acknowledged"] == "300"
                and rows["b"]["subscribers"] == "0"
                and float(rows["b"]["lag_s"]) > 0
            )

        wait_until(a_moves_on, 60, "a at 300 updates while b has no subscriber")
        rows = _rows(frames[-1])
        assert rows["a"]["lag"] == "0", frames[-1]
        assert rows["b"]["acknowledged"] == "200" and rows["b"]["lag"] == "100", frames[-1]
        # b is released by its caravan, or moved off onto one of its own that waits at its
        # datamarker (which one depends on when the caravan found no subscriber).
        assert rows["b"]["caravan"] == "-" or rows["b"]["caravan_lag"] == "100", frames[-1]
        assert rows["a"]["caravan"] != rows["b"]["caravan"], frames[-1]
    finally:
        stop_all(processes)
    assert publisher.proc.returncode == 0, publisher.stderr

    # No publisher: the frame says so, and the lag comes from the stored datamarkers.
    frame = _frame(pipeline, tmp_path)
    assert "publisher NOT RUNNING" in frame
    rows = _rows(frame)
    assert rows["a"]["lag"] == "0" and rows["b"]["lag"] == "100", frame


def test_top_refreshes_in_place_in_a_terminal(tmp_path: Path, free_port: int) -> None:
    tmux = shutil.which("tmux")
    require(tmux is not None, "tmux (Debian package tmux; `make services`)")
    assert tmux is not None
    pipeline = _pipeline(tmp_path, free_port)
    _write(tmp_path / "data", "1.jsonl", range(50))
    processes = [Process("run", str(pipeline), cwd=tmp_path)]
    session = f"wormhole-top-{uuid.uuid4().hex[:8]}"
    top = shlex.join(cli_command("top", str(pipeline), "--interval", "0.2"))
    command = f"{top}; echo top-exit=$?; sleep 120"
    # A tmux server of its own (-L): it runs the command with this test's environment.
    server = [tmux, "-L", session]
    size = ["-x", "120", "-y", "40"]
    subprocess.run(
        [*server, "new-session", "-d", "-s", session, *size, "-c", str(tmp_path), command],
        check=True,
    )

    def screen(history: bool = False) -> str:
        args = [*server, "capture-pane", "-p", "-t", session] + (["-S", "-"] if history else [])
        return subprocess.run(args, check=True, capture_output=True, text=True).stdout

    def shown(count: str) -> bool:
        rows = _rows(screen())
        return all(rows.get(n, {}).get("acknowledged") == count for n in ("a", "b"))

    try:
        wait_until(lambda: shown("50"), 60, "a and b at 50 updates on the screen")
        first = screen()
        _write(tmp_path / "data", "2.jsonl", range(50, 80))
        wait_until(lambda: shown("80"), 60, "a and b at 80 updates on the screen")
        # Many frames were drawn; the screen, scrollback included, holds one of them,
        # where the first one was.
        assert screen(history=True).count("wormhole top: pipeline top") == 1, screen(True)
        assert first.index("wormhole top: pipeline top") == screen().index(
            "wormhole top: pipeline top"
        )
        # Ctrl-C ends the view, with exit code 0.
        subprocess.run([*server, "send-keys", "-t", session, "C-c"], check=True)
        wait_until(lambda: "top-exit=" in screen(), 30, "top to exit on Ctrl-C")
        assert "top-exit=0" in screen(), screen()
    finally:
        subprocess.run([*server, "kill-server"], check=False)
        stop_all(processes)


def test_top_shows_a_postgres_sources_lag_and_snapshot_figures(
    tmp_path: Path, postgres_dsn: str
) -> None:
    from wormhole.testing.postgres import run_sql

    run_sql(
        postgres_dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v text)",
        "INSERT INTO t SELECT g, 'x' FROM generate_series(1, 1000) g",
    )
    pipeline = write_pipeline(
        tmp_path / "pg.yml",
        {
            "pipeline": "pgtop",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "postgres", "dsn": postgres_dsn, "tables": ["public.t"]},
            "transport": {"type": "inprocess"},
            "delivery": {"datamarker_interval_ms": 50},
            "metrics": {"listen": "127.0.0.1:0"},
            "applications": {"out": {"sink": {"type": "null"}}},
        },
    )
    processes = [Process("run", str(pipeline), cwd=tmp_path)]
    try:
        frames: list[str] = []

        def shown() -> bool:
            frames.append(_frame(pipeline, tmp_path))
            return (
                "source (postgres): 1,000 updates read" in frames[-1] and "retained" in frames[-1]
            )

        wait_until(shown, 60, "the snapshot's 1,000 rows and the slot's figures")
        # The source's gauges, whatever they are called, from the metrics endpoint.
        assert re.search(r"lag bytes [\d,.]+ (B|KiB|MiB)", frames[-1]), frames[-1]
        assert re.search(r"retained bytes [\d,.]+ (B|KiB|MiB)", frames[-1]), frames[-1]
    finally:
        stop_all(processes)


def test_render_shows_progress_failures_and_what_metrics_lack() -> None:
    from rich.console import Console

    from wormhole.observability.top import Reading, render

    live = {
        "pid": 1,
        "updated_ms": 0,
        "log": {"first": 0, "end": 10},
        "caravans": [],
        "failed": {"broken": "no column nosuch"},
        "source": {"updates": 10, "read_rate": 2.5},
        "progress": [
            {"name": "initial snapshot", "unit": "rows", "done": 400, "total": 1000,
             "detail": "public.big", "rate": 200.0, "eta_seconds": 3.0}
        ],
    }  # fmt: skip
    reading = Reading("p", Path("/nowhere"), live, 0, 10, 1, 100, source_type="x")
    reading.source_note = "serve metrics (metrics.listen) to see the source's lag"
    console = Console(width=160, file=None, record=True)
    with console.capture() as captured:
        console.print(render(reading))
    text = captured.get()
    assert "initial snapshot: 400 of ~1,000 rows, 200 rows/s, ETA 3s (public.big)" in text
    assert "application broken stopped: no column nosuch" in text
    assert "source (x): 10 updates read, 2.5 updates/s; lag: serve metrics" in text
    assert "(none: no subscriber connected)" in text


def test_top_counts_each_applications_dead_letters(tmp_path: Path) -> None:
    import threading

    from rich.console import Console

    from wormhole.core.pipeline import load_pipeline
    from wormhole.core.update import Update
    from wormhole.observability.top import read, render
    from wormhole.subscriber import dead_letters as dl
    from wormhole.testing import write_pipeline

    state = tmp_path / "state"
    path = write_pipeline(
        tmp_path / "dl.yml",
        {
            "pipeline": "dl",
            "state_dir": str(state),
            "source": {"type": "filelog", "path": str(tmp_path / "data")},
            "applications": {
                "app": {
                    "sink": {"type": "null"},
                    "on_error": {"policy": "dead_letter", "retries": 1, "backoff_ms": 1},
                },
                "other": {"sink": {"type": "null"}},
            },
        },
    )

    class Rejects:
        def write(self, updates: list[Update]) -> None:
            if any(u.key["id"] == 1 for u in updates):
                raise OSError("rejected on purpose")

    guard = dl.GuardedSink(
        Rejects(), "app", "dead_letter", 1, 0.001, 0.001, state, threading.Event()
    )
    guard.write(
        [
            Update.create(op="u", key={"id": k}, table="t", after={"id": k, "n": n})
            for n, k in enumerate((1, 2, 1))
        ]
    )
    reading = read(load_pipeline(path))
    assert reading.applications["app"]["dead_letters"] == 2  # one dead letter, one parked
    assert reading.applications["other"]["dead_letters"] is None
    console = Console(width=200, record=True)
    with console.capture() as captured:
        console.print(render(reading))
    row = next(line for line in captured.get().splitlines() if line.strip().startswith("app "))
    assert " 2 " in row, row
