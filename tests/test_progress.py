"""Progress of long work: initial snapshots of real databases, and ``run --once``."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from wormhole.plugins.progress import Progress
from wormhole.testing import run_cli, write_pipeline
from wormhole.testing.mysql import MariaDBServer
from wormhole.testing.postgres import run_sql as sql

ROWS = 50_000
SNAPSHOT_LINE = re.compile(
    r"initial snapshot: ([\d,]+) of ~?([\d,]+) rows \((\d+)%\), ([\d,]+) rows/s, "
    r"(ETA \d+:\d\d:\d\d|done in \d+:\d\d:\d\d)"
)


def _pipeline(tmp_path: Path, source: dict[str, Any]) -> Path:
    return write_pipeline(
        tmp_path / "p.yml",
        {
            "pipeline": "progress",
            "state_dir": str(tmp_path / "state"),
            "source": {**source, "batch_updates": 1000},
            "transport": {"type": "inprocess"},
            "progress": {"interval_ms": 10},
            "applications": {"out": {"sink": {"type": "null"}}},
        },
    )


def _snapshot_lines(stderr: str) -> list[tuple[int, int, str]]:
    found = []
    for line in stderr.splitlines():
        match = SNAPSHOT_LINE.search(line)
        if match:
            done, total = (int(match.group(i).replace(",", "")) for i in (1, 2))
            found.append((done, total, match.group(5)))
    return found


def _check_snapshot_progress(stderr: str, estimate_at_least: int) -> None:
    lines = _snapshot_lines(stderr)
    assert lines, stderr
    # Periodic lines while it runs, rows done going up, then the last one at the end.
    running = [(d, t) for d, t, end in lines if end.startswith("ETA")]
    assert len(running) >= 2, stderr
    done_counts = [d for d, _ in running]
    assert done_counts == sorted(done_counts) and 0 < done_counts[0] < ROWS
    assert all(t >= estimate_at_least for _, t in running)
    last_done, _total, end = lines[-1]
    assert end.startswith("done in") and last_done == ROWS, lines[-1]


def test_postgres_snapshot_logs_rows_done_of_the_estimate(
    tmp_path: Path, postgres_dsn: str
) -> None:
    sql(
        postgres_dsn,
        "CREATE TABLE big (id int PRIMARY KEY, v text)",
        f"INSERT INTO big SELECT g, repeat('x', 20) FROM generate_series(1, {ROWS}) g",
        "ANALYZE big",  # pg_class.reltuples: the estimate
    )
    pipeline = _pipeline(tmp_path, {"type": "postgres", "dsn": postgres_dsn, "tables": ["big"]})
    result = run_cli("run", str(pipeline), "--once", "--json", cwd=tmp_path)
    assert result.returncode == 0, result
    _check_snapshot_progress(result.stderr, int(ROWS * 0.9))
    # --once: the run's overall progress to its end position, last line at the end.
    overall = [line for line in result.stderr.splitlines() if "run --once: " in line]
    assert overall and "done in" in overall[-1], result.stderr
    # The end position is known exactly by then: no "~".
    assert f"{ROWS:,} of {ROWS:,} updates (100%)" in overall[-1]


def test_mariadb_snapshot_logs_rows_done_of_the_estimate(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    db = mysql_database
    mariadb_server.sql(
        "CREATE TABLE big (id INT PRIMARY KEY, v VARCHAR(40))",
        f"INSERT INTO big SELECT seq, REPEAT('x', 20) FROM seq_1_to_{ROWS}",
        "ANALYZE TABLE big",  # information_schema.TABLES.TABLE_ROWS: the estimate
        database=db,
    )
    pipeline = _pipeline(
        tmp_path, {"type": "mysql", "dsn": mariadb_server.dsn(), "tables": [f"{db}.big"]}
    )
    result = run_cli("run", str(pipeline), "--once", "--json", cwd=tmp_path)
    assert result.returncode == 0, result
    # InnoDB's row count is an estimate: within a half of the truth.
    _check_snapshot_progress(result.stderr, ROWS // 2)


def test_progress_line_figures(caplog: Any) -> None:
    progress = Progress(logging.getLogger("wormhole.test"), interval_s=0)
    task = progress.task("copy", 1000, "rows")
    with caplog.at_level(logging.INFO, "wormhole.test"):
        task.advance(250, "t1")
        assert progress.tasks()[0]["done"] == 250
        assert progress.tasks()[0]["total"] == 1000
        task.advance(1000)  # past the estimate: no total (nor ETA) any more, never done > total
        assert progress.tasks()[0]["total"] is None
        task.finish()
    assert progress.tasks() == []
    first, past, last = caplog.messages[0], caplog.messages[1], caplog.messages[-1]
    assert first.startswith("copy: 250 of ~1,000 rows (25%), ") and "ETA" in first
    assert first.endswith("(t1)")
    assert past.startswith("copy: 1,250 rows (more than the estimated 1,000; total not known)")
    assert "ETA" not in past
    # At the end what was done is the total, exactly.
    assert last.startswith("copy: 1,250 of 1,250 rows (100%)") and "done in" in last


def test_run_once_gives_no_total_until_the_source_is_read_then_an_exact_one(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data" / "rows"
    data.mkdir(parents=True)
    with (data / "0001.jsonl").open("w") as f:
        for i in range(20_000):
            f.write(f'{{"key": {{"id": {i}}}, "after": {{"id": {i}}}}}\n')
    pipeline = write_pipeline(
        tmp_path / "p.yml",
        {
            "pipeline": "progress",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path / "data"), "batch_bytes": "4KiB"},
            "transport": {"type": "inprocess"},
            "progress": {"interval_ms": 10},
            "applications": {"out": {"sink": {"type": "null"}}},
        },
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    lines = [line for line in result.stderr.splitlines() if "run --once: " in line]
    assert lines, result.stderr
    for line in lines:
        if "reading the source" in line:
            # What the log holds so far is no total: no percentage, no ETA.
            assert "%" not in line and "ETA" not in line and " of " not in line, line
        numbers = re.search(r"run --once: ([\d,]+) of ([\d,]+) updates", line)
        if numbers:
            done, total = (int(n.replace(",", "")) for n in numbers.groups())
            assert done <= total, line
    assert "run --once: 20,000 of 20,000 updates (100%)" in lines[-1], lines[-1]


def test_a_never_analyzed_table_has_an_estimated_total(tmp_path: Path, postgres_dsn: str) -> None:
    sql(
        postgres_dsn,
        "CREATE TABLE fresh (id int PRIMARY KEY, v text)",
        f"INSERT INTO fresh SELECT g, repeat('x', 20) FROM generate_series(1, {ROWS}) g",
    )  # no ANALYZE: pg_class.reltuples is -1; the statistics counted the inserts
    pipeline = _pipeline(tmp_path, {"type": "postgres", "dsn": postgres_dsn, "tables": ["fresh"]})
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    _check_snapshot_progress(result.stderr, int(ROWS * 0.9))


def test_backfill_progress_never_shows_more_read_than_its_estimate(tmp_path: Path) -> None:
    from wormhole.core.backfill import BackfillStore

    data = tmp_path / "data"
    data.mkdir()
    pipeline = write_pipeline(
        tmp_path / "p.yml",
        {
            "pipeline": "bf",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(data)},
            "applications": {"out": {"sink": {"type": "null"}}},
        },
    )
    # A backfill that read 3,000 rows of a table estimated at 96 (its statistics were old).
    store = BackfillStore(tmp_path / "state")
    try:
        request = store.add("public.users", None, None, 1000, 0, estimate=96)
        assert store.start(request.id, None)
        assert store.progress(request.id, [3000], 3000, 3000, 0)
    finally:
        store.close()
    for args in (("backfill", str(pipeline), "--list"), ("status", str(pipeline))):
        result = run_cli(*args, cwd=tmp_path)
        assert result.returncode == 0, result
        assert "3,000 (more than the estimated 96) rows read" in result.stdout, result
        assert "of ~96" not in result.stdout
