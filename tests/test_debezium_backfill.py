"""A backfill with ``envelope: debezium`` against Debezium's incremental snapshot of the
same table (``execute-snapshot`` of type ``incremental`` through its signal table): the
same rows, keys and typed values, op ``r``, ``source.snapshot`` ``incremental``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_debezium import ROW, SCHEMA, compare_by_key, incremental, read_lines, records_pipeline

from wormhole.testing import run_cli
from wormhole.testing.debezium import Message, debezium_messages
from wormhole.testing.postgres import run_sql

ROWS = 23
CHUNK = 5


def _comparable(value: dict[str, Any]) -> dict[str, Any]:
    """A backfill event without what differs by nature: when each reader read the row
    (ts_*), and the stream position it was read at (lsn, txId, sequence, the chunk's
    watermarks are each reader's own)."""
    payload = dict(value["payload"])
    for name in ("ts_ms", "ts_us", "ts_ns"):
        payload.pop(name)
    payload["source"] = {
        k: v
        for k, v in payload["source"].items()
        if k not in ("ts_ms", "ts_us", "ts_ns", "lsn", "txId", "sequence")
    }
    return {"schema": value["schema"], "payload": payload}


def test_a_backfill_matches_debezium_incremental_snapshot_row_by_row(
    postgres_server: Any, tmp_path: Path
) -> None:
    database = postgres_server.create_database()
    dsn = postgres_server.dsn(database)
    columns = "id, i2, i8, b, f4, f8, n, nv, tx, vc, ch, by, d, tm, tms, ts, ts3, tz, tz3, tmz, "
    columns += "dflt, dn, u, j, jb, ai, at, iv, x, m"
    run_sql(
        dsn,
        *SCHEMA[:2],
        "CREATE TABLE dbz_signal (id varchar(64) PRIMARY KEY, type varchar(32) NOT NULL, "
        "data varchar(2048))",
        *[f"INSERT INTO a_typed ({columns}) VALUES ({n}, {ROW})" for n in range(1, ROWS)],
        f"INSERT INTO a_typed (id, i8) VALUES ({ROWS}, -5)",  # NULLs and defaults
        "CREATE PUBLICATION compared FOR TABLE a_typed",
    )
    where = {
        "host": postgres_server.host,
        "port": postgres_server.port,
        "dbname": database,
        "user": postgres_server.user,
    }

    def signal() -> None:
        run_sql(
            dsn,
            "INSERT INTO dbz_signal VALUES ('bf', 'execute-snapshot', "
            '\'{"data-collections": ["public.a_typed"], "type": "incremental"}\')',
        )

    out = tmp_path / "events.jsonl"
    source = {
        "type": "postgres",
        "dsn": dsn,
        "publication": "compared",
        "tables": ["public.a_typed"],
        "snapshot": "never",
    }
    pipeline = records_pipeline(tmp_path / "bf.yml", "dbz_incremental", source, out)
    try:
        expected: list[Message] = debezium_messages(
            where,
            ["public.a_typed", "public.dbz_signal"],
            schemas=True,
            snapshot_mode="no_data",
            workload=signal,
            until=lambda received: len(incremental(received)) >= ROWS,
            properties={
                "signal.data.collection": "public.dbz_signal",
                "incremental.snapshot.chunk.size": str(CHUNK),
            },
        )
        assert run_cli("run", str(pipeline), "--once").returncode == 0
        queued = run_cli(
            "backfill", str(pipeline), "--table", "public.a_typed", "--chunk-size", str(CHUNK)
        )
        assert queued.returncode == 0, queued
        result = run_cli("run", str(pipeline), "--once")
        assert result.returncode == 0, result.stderr
    finally:
        postgres_server.drop_database(database)
    theirs = incremental(expected)
    ours = read_lines(out)
    compare_by_key(ours, theirs, _comparable)
    assert len(ours) == ROWS
    # Both in key order, chunk after chunk.
    assert [e["key"]["payload"]["id"] for e in ours] == list(range(1, ROWS + 1))
    assert [m.key["payload"]["id"] for m in theirs] == list(range(1, ROWS + 1))
