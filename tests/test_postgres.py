"""The postgres source against a real PostgreSQL cluster (wal_level=logical)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg2

from wormhole.testing import read_envelopes, run_cli, write_pipeline


def sql(dsn: str, *statements: str) -> None:
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        for statement in statements:
            cur.execute(statement)
    conn.close()


def pg_pipeline(tmp_path: Path, dsn: str, **source: Any) -> Path:
    return write_pipeline(
        tmp_path / "pg.yml",
        {
            "pipeline": "pg",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "postgres", "dsn": dsn, **source},
            "transport": {"type": "inprocess"},
            "applications": {
                "out": {"sink": {"type": "jsonl", "path": str(tmp_path / "out.jsonl")}}
            },
        },
    )


def test_snapshot_then_stream(tmp_path: Path, postgres_dsn: str) -> None:
    sql(
        postgres_dsn,
        "CREATE TABLE users (id int PRIMARY KEY, name text, score float8, ok boolean)",
        "INSERT INTO users SELECT g, 'u' || g, g / 2.0, g % 2 = 0 FROM generate_series(1, 50) g",
    )
    pipeline = pg_pipeline(tmp_path, postgres_dsn, tables=["public.users"])
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    out = read_envelopes(tmp_path / "out.jsonl")
    assert len(out) == 50 and {e["op"] for e in out} == {"r"}
    assert out[0]["after"] == {"id": 1, "name": "u1", "score": 0.5, "ok": False}
    sql(
        postgres_dsn,
        "UPDATE users SET name = 'x' WHERE id = 2",
        "DELETE FROM users WHERE id = 3",
        "INSERT INTO users VALUES (100, 'new', 'NaN', true)",
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    out = read_envelopes(tmp_path / "out.jsonl")[50:]
    assert [(e["op"], e["key"]) for e in out] == [
        ("u", {"id": 2}),
        ("d", {"id": 3}),
        ("c", {"id": 100}),
    ]
    assert out[0]["after"]["name"] == "x" and out[0]["before"] == {"id": 2}
    assert out[2]["after"]["score"] == "NaN"
    assert out[0]["source"]["connector"] == "postgres"
    assert out[0]["source"]["table"] == "public.users"
    assert out[0]["source"]["position"].endswith(":0")
