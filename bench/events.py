"""What the snapshot and backfill benches share: their table ``events``, the same rows in
PostgreSQL and in MariaDB, and a pipeline reading a source into a ``null`` sink."""

from __future__ import annotations

from pathlib import Path


def postgres_events(rows: int) -> list[str]:
    """The statements making table ``events`` of ``rows`` rows (5 columns) in PostgreSQL."""
    return [
        "CREATE TABLE events (id int PRIMARY KEY, rider int, lat float8, lon float8, note text)",
        f"INSERT INTO events SELECT g, g % 5000, 12.97 + g * 1e-7, 77.59, "
        f"'rider ' || (g % 5000) FROM generate_series(1, {rows}) g",
        "ANALYZE events",
    ]


def mariadb_events(rows: int) -> list[str]:
    """The statements making table ``events`` of ``rows`` rows (7 columns) in MariaDB."""
    return [
        "CREATE TABLE events (id INT PRIMARY KEY, rider INT, lat DOUBLE, lon DOUBLE, "
        "note VARCHAR(40), at DATETIME(3), fare DECIMAL(8, 2))",
        f"INSERT INTO events SELECT seq, seq % 5000, 12.97 + seq * 1e-7, 77.59, "
        f"CONCAT('rider ', seq % 5000), '2026-01-01' + INTERVAL seq SECOND, seq % 997 / 4 "
        f"FROM seq_1_to_{rows}",
        "ANALYZE TABLE events",
    ]


def null_sink_pipeline(work: Path, name: str, source: str) -> str:
    """Pipeline ``name`` (state in ``work/name``): ``source`` (YAML) into a ``null`` sink."""
    return f"""
pipeline: {name}
state_dir: {work / name}
source: {source}
transport: {{type: inprocess}}
applications:
  nulls: {{sink: {{type: "null"}}}}
"""
