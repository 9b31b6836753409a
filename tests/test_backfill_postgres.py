"""Backfills of PostgreSQL tables while the stream flows (DBLog watermarks), against a real
PostgreSQL cluster: values, application scope, bad input, a concurrent writer, kill -9."""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psycopg2

from wormhole.testing import run_cli, write_pipeline
from wormhole.testing.helpers import cli_command
from wormhole.testing.postgres import run_sql as sql


def _pipeline(tmp_path: Path, dsn: str, tables: list[str], **extra: Any) -> Path:
    apps = {
        name: {"sink": {"type": "latest", "path": str(tmp_path / f"{name}.sqlite")}}
        for name in ("a", "b")
    }
    return write_pipeline(
        tmp_path / "pg.yml",
        {
            "pipeline": "bf",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "postgres", "dsn": dsn, "tables": tables, "snapshot": "never"},
            "transport": {"type": "inprocess"},
            "applications": apps,
            **extra,
        },
    )


def _latest(path: Path, table: str) -> dict[Any, dict[str, Any]]:
    """The latest sink's rows of ``table``, by the key's ``id``."""
    if not path.exists():
        return {}
    db = sqlite3.connect(path)
    try:
        rows = db.execute("SELECT key, row FROM latest WHERE source_table = ?", (table,)).fetchall()
    finally:
        db.close()
    return {json.loads(k)["id"]: json.loads(r) for k, r in rows}


def _table(dsn: str, query: str) -> dict[Any, dict[str, Any]]:
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(query)
            names = [d[0] for d in cur.description]
            return {row[0]: dict(zip(names, row, strict=True)) for row in cur.fetchall()}
    finally:
        conn.close()


def _backfills(pipeline: Path) -> list[dict[str, Any]]:
    result = run_cli("backfill", str(pipeline), "--list", "--json")
    assert result.returncode == 0, result
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    return rows


def test_a_backfill_for_one_application_with_a_condition_and_bad_input(
    tmp_path: Path, postgres_dsn: str
) -> None:
    sql(
        postgres_dsn,
        "CREATE TABLE items (id int PRIMARY KEY, name text, n bigint, price numeric(10, 2), "
        "ok boolean, score float8, at timestamptz, tags text[], doc jsonb)",
        "INSERT INTO items SELECT g, 'item ' || g, g * 10, g / 4.0, g % 2 = 0, g / 8.0, "
        "'2026-01-01 00:00:00+00'::timestamptz + g * interval '1 minute', "
        "ARRAY['a', 'b' || g], jsonb_build_object('g', g) FROM generate_series(1, 1000) g",
        "CREATE TABLE keyless (v text)",
        "CREATE TABLE elsewhere (id int PRIMARY KEY)",
    )
    pipeline = _pipeline(tmp_path, postgres_dsn, ["public.items", "public.keyless"])
    assert run_cli("run", str(pipeline), "--once").returncode == 0  # the slot, from now on

    for args, words in (
        (["--table", "public.keyless"], ["no primary key", "ADD PRIMARY KEY"]),
        (["--table", "public.elsewhere"], ["not in publication", "ALTER PUBLICATION"]),
        (["--table", "public.nosuch"], ["no table public.nosuch"]),
        (["--table", "public.items", "--where", "nosuch > 1"], ["--where", "nosuch"]),
        (["--table", "public.items", "--where", "id >"], ["--where", "syntax"]),
        (["--table", "public.items", "--app", "nobody"], ["--app nobody", "a, b"]),
        ([], ["--table"]),
    ):
        result = run_cli("backfill", str(pipeline), *args)
        assert result.returncode == 2, result
        for word in words:
            assert word in result.stderr, (word, result.stderr)

    result = run_cli(
        "backfill",
        str(pipeline),
        "--table",
        "public.items",
        "--where",
        "id <= 500",
        "--app",
        "a",
        "--chunk-size",
        "64",
    )
    assert result.returncode == 0, result
    assert "queued" in result.stdout and "not running" in result.stdout
    again = run_cli("backfill", str(pipeline), "--table", "public.items")
    assert again.returncode == 2 and "already queued" in again.stderr, again
    # Another application's backfill of the same table may run next to it.
    other = run_cli("backfill", str(pipeline), "--table", "public.items", "--app", "b")
    assert other.returncode == 0, other
    cancelled = run_cli("backfill", str(pipeline), "--cancel", "2")
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout, cancelled

    # `run --once` runs the queue to its end, with the stream.
    sql(postgres_dsn, "UPDATE items SET name = 'changed' WHERE id = 7")
    result = run_cli("run", str(pipeline), "--once")
    assert result.returncode == 0, result
    got = _latest(tmp_path / "a.sqlite", "public.items")
    assert sorted(got) == list(range(1, 501))
    expected = _table(
        postgres_dsn,
        "SELECT id, name, n, price::text AS price, ok, score, at::text AS at, tags::text AS "
        "tags, doc::text AS doc FROM items WHERE id <= 500",
    )
    assert got == expected
    # Only application a asked: b has the stream's change and nothing else.
    assert list(_latest(tmp_path / "b.sqlite", "public.items")) == [7]
    [done, gone] = _backfills(pipeline)
    assert done["state"] == "done" and done["rows"] == 500 and done["read"] == 500
    assert done["chunks"] >= 8 and done["application"] == "a"
    assert gone["state"] == "cancelled" and gone["rows"] == 0
    status = json.loads(run_cli("status", str(pipeline), "--json").stdout)
    assert [b["state"] for b in status["backfills"]] == ["done", "cancelled"]
