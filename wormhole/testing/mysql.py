"""A throwaway MariaDB server with a row-based binlog on a free loopback port.

As root the server runs as the ``mysql`` user (Debian's package creates it) in
a temporary directory it owns. Two servers can be linked as primary and
replica (:func:`make_replica`) to test a publisher moving between them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

from wormhole.testing.helpers import free_port, require

_databases = count()
_server_ids = count(1)


@dataclass
class MariaDBServer:
    host: str
    port: int
    directory: Path
    server_id: int
    process: subprocess.Popen[bytes] = field(repr=False)
    user: str = "root"
    password: str = ""
    extra_args: list[str] = field(default_factory=list, repr=False)

    def dsn(self, database: str = "") -> str:
        """A ``mysql://`` URL for the ``mysql`` source."""
        return f"mysql://{self.user}@{self.host}:{self.port}/{database}"

    def connect(self, database: str | None = None, **kwargs: Any) -> Any:
        import pymysql

        return pymysql.connect(
            host=self.host,
            port=self.port,
            user=self.user,
            password=self.password,
            database=database,
            autocommit=True,
            charset="utf8mb4",
            **kwargs,
        )

    def create_database(self) -> str:
        name = f"test_{os.getpid()}_{next(_databases)}"
        self.sql(f"CREATE DATABASE {name} CHARACTER SET utf8mb4")
        return name

    def drop_database(self, name: str) -> None:
        self.sql(f"DROP DATABASE IF EXISTS {name}")

    def sql(self, *statements: str, database: str | None = None) -> list[tuple[Any, ...]]:
        """Run statements in autocommit mode; the rows of the last one."""
        conn = self.connect(database)
        rows: list[tuple[Any, ...]] = []
        try:
            with conn.cursor() as cur:
                for statement in statements:
                    cur.execute(statement)
                    rows = list(cur.fetchall())
        finally:
            conn.close()
        return rows

    def stop(self, kill: bool = False) -> None:
        if self.process.poll() is None:
            if kill:
                self.process.kill()
            else:
                self.process.terminate()
            self.process.wait(timeout=60)

    def start(self) -> None:
        """Start (again) on the same port and data directory."""
        self.process = _spawn(self.directory, self.port, self.server_id, self.extra_args)
        _wait_ready(self)


def _mysql_user() -> list[str]:
    return ["--user=mysql"] if os.geteuid() == 0 else []


def _spawn(directory: Path, port: int, server_id: int, extra: list[str]) -> subprocess.Popen[bytes]:
    data = directory / "data"
    log = open(directory / "error.log", "ab")  # noqa: SIM115 - the server owns it
    try:
        return subprocess.Popen(
            [
                "mariadbd",
                "--no-defaults",
                f"--datadir={data}",
                *_mysql_user(),
                f"--port={port}",
                "--bind-address=127.0.0.1",
                f"--socket={directory / 'sock'}",
                f"--pid-file={directory / 'pid'}",
                f"--log-bin={data / 'binlog'}",
                "--binlog-format=ROW",
                f"--server-id={server_id}",
                "--binlog-row-image=FULL",
                "--binlog-row-metadata=FULL",
                "--log-slave-updates=1",
                "--innodb-flush-log-at-trx-commit=0",
                "--sync-binlog=0",
                "--innodb-buffer-pool-size=128M",
                "--skip-name-resolve",
                f"--log-error={directory / 'error.log'}",
                *extra,
            ],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
    finally:
        log.close()


def _wait_ready(server: MariaDBServer, timeout: float = 60) -> None:
    import pymysql

    deadline = time.monotonic() + timeout
    while True:
        if server.process.poll() is not None:
            log = (server.directory / "error.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"mariadbd exited with {server.process.returncode}:\n{log}")
        try:
            server.connect().close()
            return
        except pymysql.err.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # polling a starting server: nothing to wait on


MYSQL57_VERSION_PREFIX = "5.7.19-"
"""What a server started with ``mysql57_version`` puts before its own version string."""


def _mysql57_version() -> str:
    """``5.7.19-10.11.19-MariaDB...``: a MySQL 5.7 prefix, "MariaDB" kept in the string."""
    out = subprocess.run(["mariadbd", "--version"], capture_output=True, text=True, check=True)
    version = out.stdout.split("Ver", 1)[1].split()[0]
    return MYSQL57_VERSION_PREFIX + version


def start_mariadb(
    extra_args: list[str] | None = None, mysql57_version: bool = False
) -> Iterator[MariaDBServer]:
    """Start a server; yields it and stops it afterwards (a generator for fixtures).

    ``mysql57_version``: the server announces a MySQL 5.7 version string with MariaDB's
    after it (``5.7.19-10.11.19-MariaDB``), which Debezium's MySQL connector needs to read
    MariaDB 10.11 (it refuses a 10.x version). Only for the tests that run it.
    """
    require(shutil.which("mariadbd") is not None, "MariaDB server (Debian package mariadb-server)")
    require(
        shutil.which("mariadb-install-db") is not None,
        "mariadb-install-db (Debian package mariadb-server)",
    )
    directory = Path(tempfile.mkdtemp(prefix="wormhole-mariadb-"))
    if os.geteuid() == 0:
        shutil.chown(directory, "mysql", "mysql")
    data = directory / "data"
    subprocess.run(
        [
            "mariadb-install-db",
            "--no-defaults",
            f"--datadir={data}",
            *_mysql_user(),
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
        ],
        check=True,
        capture_output=True,
    )
    port = free_port()
    server_id = next(_server_ids) + 100 * (os.getpid() % 1000)
    extra = list(extra_args or [])
    if mysql57_version:
        extra.append(f"--version={_mysql57_version()}")
    server = MariaDBServer(
        "127.0.0.1",
        port,
        directory,
        server_id,
        _spawn(directory, port, server_id, extra),
        extra_args=extra,
    )
    try:
        _wait_ready(server)
        yield server
    finally:
        server.stop(kill=True)
        shutil.rmtree(directory, ignore_errors=True)


def make_replica(replica: MariaDBServer, primary: MariaDBServer) -> None:
    """Replicate ``primary`` into ``replica`` by GTID from the primary's first transaction."""
    replica.sql(
        "STOP SLAVE",
        "RESET SLAVE ALL",
        "SET GLOBAL gtid_slave_pos = ''",
        f"CHANGE MASTER TO MASTER_HOST='{primary.host}', MASTER_PORT={primary.port}, "
        f"MASTER_USER='{primary.user}', MASTER_PASSWORD='{primary.password}', "
        f"MASTER_USE_GTID=slave_pos",
        "START SLAVE",
    )
