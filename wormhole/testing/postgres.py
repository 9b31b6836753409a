"""A throwaway PostgreSQL cluster (wal_level=logical) on a free loopback port.

PostgreSQL refuses to run as root, so as root the cluster runs as the
``postgres`` user (Debian's package creates it) in a directory it owns.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count
from pathlib import Path

from wormhole.testing.helpers import free_port, require

_databases = count()


def postgres_bin() -> Path | None:
    """The newest installed PostgreSQL server's bin directory (Debian layout or PATH)."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(p.split("/")[4])
    )
    if found:
        return Path(found[-1]).parent
    pg_ctl = shutil.which("pg_ctl")
    return Path(pg_ctl).parent if pg_ctl else None


@dataclass
class PostgresServer:
    host: str
    port: int
    directory: Path
    bin: Path
    user: str = "postgres"

    def dsn(self, dbname: str = "postgres") -> str:
        return f"host={self.host} port={self.port} dbname={dbname} user={self.user}"

    def create_database(self) -> str:
        import psycopg2

        name = f"test_{os.getpid()}_{next(_databases)}"
        conn = psycopg2.connect(self.dsn())
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE {name}")
        conn.close()
        return name

    def drop_database(self, name: str) -> None:
        import psycopg2

        conn = psycopg2.connect(self.dsn())
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                # A terminated backend (a walsender holding a slot, say) leaves a moment
                # later: wait until none is left, or the slot is still active at the drop.
                deadline = time.monotonic() + 30
                while True:
                    cur.execute(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = %s AND pid <> pg_backend_pid()",
                        (name,),
                    )
                    cur.execute(
                        "SELECT count(*) FROM pg_replication_slots WHERE database = %s AND active",
                        (name,),
                    )
                    (active,) = cur.fetchone() or (0,)
                    if active == 0 or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
                cur.execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                    "WHERE database = %s AND NOT active",
                    (name,),
                )
                cur.execute(f"DROP DATABASE IF EXISTS {name}")
        finally:
            conn.close()


def run_sql(dsn: str, *statements: str) -> None:
    """Run statements in autocommit mode (test setup and workloads)."""
    import psycopg2

    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
    finally:
        conn.close()


def _as_postgres(command: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *command]
    return command


def start_postgres(settings: dict[str, str] | None = None) -> Iterator[PostgresServer]:
    """Start a cluster; yields it and stops it afterwards (a generator for fixtures).

    ``settings``: more server settings (``-c name=value``) for a cluster of one test's own.
    """
    bin_dir = postgres_bin()
    require(bin_dir is not None, "PostgreSQL server binaries (Debian package postgresql)")
    assert bin_dir is not None
    directory = Path(tempfile.mkdtemp(prefix="wormhole-pg-"))
    if os.geteuid() == 0:
        shutil.chown(directory, "postgres", "postgres")
    data = directory / "data"
    port = free_port()
    subprocess.run(
        _as_postgres(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(data),
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--no-sync",
            ]
        ),
        check=True,
        capture_output=True,
    )
    # fsync=off makes commits cheap; commits stay synchronous, so a transaction's WAL is
    # written when its COMMIT returns: readers that decode only written WAL (test_decoding,
    # Debezium) see it at once. `run --once` does not need it (its end marker flushes the
    # WAL before it); tests/test_postgres.py checks that on a cluster with async commits.
    options = (
        f"-p {port} -c listen_addresses=127.0.0.1 -k {directory} -c wal_level=logical "
        f"-c max_replication_slots=20 -c max_wal_senders=20 -c fsync=off "
        f"-c full_page_writes=off"
    )
    for name, value in (settings or {}).items():
        options += f" -c {name}={value}"
    subprocess.run(
        _as_postgres(
            [
                str(bin_dir / "pg_ctl"),
                "-D",
                str(data),
                "-o",
                options,
                "-l",
                str(directory / "log"),
                "-w",
                "start",
            ]
        ),
        check=True,
        capture_output=True,
    )
    server = PostgresServer("127.0.0.1", port, directory, bin_dir)
    try:
        yield server
    finally:
        subprocess.run(
            _as_postgres([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
            capture_output=True,
        )
        shutil.rmtree(directory, ignore_errors=True)


def restart_postgres(server: PostgresServer, mode: str = "fast") -> None:
    """Stop and start the cluster again on the same port (a server restart)."""
    data = server.directory / "data"
    # With a log file: the server must not inherit (and hold open) our pipes.
    log = str(server.directory / "log")
    subprocess.run(
        _as_postgres(
            [str(server.bin / "pg_ctl"), "-D", str(data), "-m", mode, "-w", "-l", log, "restart"]
        ),
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
