"""Fault injection: a stream of updates under a seeded loop of faults, then a full check.

For each source (file log, PostgreSQL, MariaDB), ``wormhole run`` delivers a stream of
KEYS x ROUNDS updates over TCP to two applications with jsonl sinks (``audit`` with one
subscriber, ``search`` with two that share one file) while the faults of a seeded
schedule hit it. Afterwards every update must have reached both applications, in order
per flow (and so per key), with duplicates only as replays from a persisted datamarker
(see delivery.py). docs/concepts.md says what this proves.

Rerun a seed: ``WORMHOLE_CHAOS_SEED=N pytest tests/chaos -k filelog``.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import faults as f
import pytest
from conftest import check_rounds
from delivery import Snapshot, check_flows, log_seqs
from tcp_support import Process

from wormhole.core.datamarkers import read_datamarkers
from wormhole.core.publisher_log import inspect_log
from wormhole.testing import free_port, run_cli, wait_until, write_pipeline

try:  # a proxy that slows a link down: throttling the source needs it
    from wormhole.testing.proxy import ThrottlingProxy
except ImportError:  # pragma: no cover - not in this version of wormhole.testing
    ThrottlingProxy = None

KEYS = 2_000
ROUNDS = 100  # 200,000 updates
CHUNK = 500  # updates per write (one transaction for the databases)
RATE = 5_000  # updates/s the writer aims at: the stream lasts about 40 s
FAULTS = 20
DEADLINE_S = 150  # from the first write to the graceful stop
HEARTBEAT_MS, HEARTBEAT_TIMEOUT_MS = 300, 1500
APPLICATIONS = {"audit": 1, "search": 2}  # subscribers each


def chaos_seed() -> int:
    value = os.environ.get("WORMHOLE_CHAOS_SEED")
    return int(value) if value else random.SystemRandom().randrange(1 << 32)


# ----------------------------------------------------------------------------- workloads
class Workload(threading.Thread):
    """Writes round after round of every key (``n`` = the round) in chunks of CHUNK keys,
    at about RATE updates/s; a database connection lost by a fault is retried."""

    errors: tuple[type[BaseException], ...] = ()

    def __init__(self) -> None:
        super().__init__(name="chaos workload", daemon=True)
        self.stop = threading.Event()
        self.written = 0
        self.retries = 0
        self.finished = 0.0
        """When the last write returned (monotonic)."""
        self.error: BaseException | None = None

    def run(self) -> None:
        started = time.monotonic()
        try:
            for n in range(ROUNDS):
                for first in range(0, KEYS, CHUNK):
                    last = min(first + CHUNK, KEYS) - 1
                    self._write_through_faults(n, first, last)
                    self.written += last - first + 1
                    if self.stop.wait(max(0.0, started + self.written / RATE - time.monotonic())):
                        return
        except BaseException as exc:
            self.error = exc
        finally:
            self.finished = time.monotonic()
            self.close()

    def _write_through_faults(self, n: int, first: int, last: int) -> None:
        retrying = False
        give_up = time.monotonic() + 60
        while True:
            try:
                if not (retrying and self.committed(n, first)):
                    self.write(n, first, last)
                return
            except self.errors:
                # The server restarted, or the connection was cut: the commit may or may
                # not have happened, and writing it twice would change the log.
                self.close()
                retrying = True
                self.retries += 1
                if time.monotonic() > give_up:
                    raise
                if self.stop.wait(0.2):  # the server is coming back up
                    raise

    def write(self, n: int, first: int, last: int) -> None:
        raise NotImplementedError

    def committed(self, n: int, first: int) -> bool:
        """Whether the chunk starting at key ``first`` of round ``n`` was committed."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class FileLogWorkload(Workload):
    """Appends JSON lines, a new file every 25 rounds (the last one is tailed)."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def write(self, n: int, first: int, last: int) -> None:
        op = "c" if n == 0 else "u"
        lines = "".join(
            f'{{"table":"events","op":"{op}","key":{{"id":{i}}},"after":{{"id":{i},"n":{n}}}}}\n'
            for i in range(first, last + 1)
        )
        with open(self.directory / f"{n // 25:04d}.jsonl", "a") as out:
            out.write(lines)


class DatabaseWorkload(Workload):
    """One statement (one transaction) per chunk, over a connection made on demand."""

    def __init__(self) -> None:
        super().__init__()
        self.conn: Any = None

    def connect(self) -> Any:
        raise NotImplementedError

    def statement(self, n: int, first: int, last: int) -> str:
        raise NotImplementedError

    def _execute(self, sql: str) -> Any:
        if self.conn is None:
            self.conn = self.connect()
        with self.conn.cursor() as cur:
            cur.execute(sql)
            return cur.fetchone() if cur.description else None

    def write(self, n: int, first: int, last: int) -> None:
        self._execute(self.statement(n, first, last))

    def committed(self, n: int, first: int) -> bool:
        row = self._execute(f"SELECT n FROM events WHERE id = {first}")
        return row is not None and row[0] == n

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):  # already broken by the fault
                self.conn.close()
            self.conn = None


class PostgresWorkload(DatabaseWorkload):
    def __init__(self, dsn: str) -> None:
        import psycopg2

        super().__init__()
        self.errors = (psycopg2.OperationalError, psycopg2.InterfaceError)
        self.dsn = dsn

    def connect(self) -> Any:
        import psycopg2

        conn = psycopg2.connect(self.dsn)
        conn.autocommit = True
        return conn

    def statement(self, n: int, first: int, last: int) -> str:
        return (
            f"INSERT INTO events SELECT g, {n} FROM generate_series({first}, {last}) g "
            f"ON CONFLICT (id) DO UPDATE SET n = excluded.n"
        )


class MariaDBWorkload(DatabaseWorkload):
    def __init__(self, server: Any, database: str) -> None:
        import pymysql

        super().__init__()
        self.errors = (pymysql.err.OperationalError, pymysql.err.InterfaceError)
        self.server = server
        self.database = database

    def connect(self) -> Any:
        return self.server.connect(self.database)

    def statement(self, n: int, first: int, last: int) -> str:
        return (
            f"INSERT INTO events SELECT seq, {n} FROM seq_{first}_to_{last} "
            f"ON DUPLICATE KEY UPDATE n = VALUES(n)"
        )


# ----------------------------------------------------------------------------- sources
class Source:
    """One source under test: its pipeline entry, its workload and its own faults."""

    name = ""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.proxy: Any = None
        self.source_port: int | None = None
        """The port the publisher connects to for the source (None: no connection)."""

    def config(self) -> dict[str, Any]:
        raise NotImplementedError

    def workload(self) -> Workload:
        raise NotImplementedError

    def port(self) -> int | None:
        return self.source_port

    def restart(self) -> None:
        raise NotImplementedError

    def recover(self) -> None:
        """After the test: leave the shared server running."""

    def fault_kinds(self) -> list[str]:
        kinds = [f.KILL_PUBLISHER, f.KILL_SUBSCRIBER, f.PAUSE_SUBSCRIBER, f.CUT_SUBSCRIBERS]
        if self.port() is not None:
            kinds += [f.RESTART_DATABASE, f.CUT_SOURCE]
            if self.proxy is not None:
                kinds.append(f.THROTTLE_SOURCE)
        return kinds

    def through_proxy(self, port: int) -> int:
        """The port to reach the server on: a throttling proxy's, when one is available."""
        if ThrottlingProxy is None:
            return port
        self.proxy = ThrottlingProxy(f"127.0.0.1:{port}")
        return int(self.proxy.port)

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()


class FileLogSource(Source):
    name = "filelog"

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        self.directory = tmp_path / "data"
        self.directory.mkdir()

    def config(self) -> dict[str, Any]:
        return {"type": "filelog", "path": str(self.directory), "poll_interval_ms": 20}

    def workload(self) -> Workload:
        return FileLogWorkload(self.directory)


class PostgresSource(Source):
    name = "postgres"

    def __init__(self, tmp_path: Path, request: pytest.FixtureRequest) -> None:
        from wormhole.testing.postgres import run_sql

        super().__init__(tmp_path)
        self.server = request.getfixturevalue("postgres_server")
        self.dsn = request.getfixturevalue("postgres_dsn")
        run_sql(self.dsn, "CREATE TABLE events (id int PRIMARY KEY, n int NOT NULL)")
        self.source_port = self.through_proxy(self.server.port)

    def config(self) -> dict[str, Any]:
        dsn = self.dsn.replace(f"port={self.server.port}", f"port={self.source_port}")
        return {"type": "postgres", "dsn": dsn, "tables": ["public.events"], "snapshot": "never"}

    def workload(self) -> Workload:
        return PostgresWorkload(self.dsn)

    def restart(self) -> None:
        from wormhole.testing.postgres import restart_postgres

        restart_postgres(self.server, mode="fast")


class MariaDBSource(Source):
    name = "mysql"

    def __init__(self, tmp_path: Path, request: pytest.FixtureRequest) -> None:
        super().__init__(tmp_path)
        self.server = request.getfixturevalue("mariadb_server")
        self.database = request.getfixturevalue("mysql_database")
        self.server.sql(
            "CREATE TABLE events (id INT PRIMARY KEY, n INT NOT NULL)", database=self.database
        )
        self.source_port = self.through_proxy(self.server.port)

    def config(self) -> dict[str, Any]:
        dsn = f"mysql://{self.server.user}@{self.server.host}:{self.source_port}/"
        return {"type": "mysql", "dsn": dsn, "tables": [f"{self.database}.events"]}

    def workload(self) -> Workload:
        return MariaDBWorkload(self.server, self.database)

    def restart(self) -> None:
        self.server.stop()
        self.server.start()

    def recover(self) -> None:
        if self.server.process.poll() is not None:
            self.server.start()


def make_source(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> Source:
    if name == "filelog":
        return FileLogSource(tmp_path)
    if name == "postgres":
        return PostgresSource(tmp_path, request)
    return MariaDBSource(tmp_path, request)


# ----------------------------------------------------------------------------- the run
class Chaos:
    """A running ``wormhole run`` and the faults injected into it."""

    def __init__(self, tmp_path: Path, source: Source, rng: random.Random) -> None:
        self.tmp_path = tmp_path
        self.source = source
        self.port = free_port()
        self.state_dir = tmp_path / "state"
        self.outputs = {app: tmp_path / f"{app}.jsonl" for app in APPLICATIONS}
        pipeline: dict[str, Any] = {
            "pipeline": f"chaos_{source.name}",
            "state_dir": str(self.state_dir),
            "source": source.config(),
            "transport": {
                "type": "tcp",
                "listen": f"127.0.0.1:{self.port}",
                "heartbeat_ms": HEARTBEAT_MS,
                "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS,
            },
            "delivery": {"datamarker_interval_ms": 500},
            # Small segments and a short memory tail: restarts read the log from disk
            # across rolls. Every segment is kept, to check deliveries against it.
            "log": {"roll_size": "4MiB", "tail_updates": 20_000, "keep_rolled": 10_000},
            "applications": {
                app: {"sink": {"type": "jsonl", "path": str(out)}, "subscribers": n}
                for (app, n), out in zip(APPLICATIONS.items(), self.outputs.values(), strict=True)
            },
        }
        self.pipeline = write_pipeline(tmp_path / "chaos.yml", pipeline)
        # The same pipeline in-process, for a first `run --once` that sets up the source
        # without starting subscriber processes.
        self.setup_pipeline = write_pipeline(
            tmp_path / "setup.yml", {**pipeline, "transport": {"type": "inprocess"}}
        )
        self.schedule = f.schedule(rng, source.fault_kinds(), FAULTS)
        self.snapshots: list[Snapshot] = []
        self.done: list[str] = []
        self.publishers: list[Process] = []
        self.paused: int | None = None
        self.stop = threading.Event()

    @property
    def publisher(self) -> Process:
        return self.publishers[-1]

    def start(self) -> None:
        self.publishers.append(Process("run", str(self.pipeline), cwd=self.tmp_path))

    def inject_all(self, deadline: float) -> None:
        started = time.monotonic()
        for number, fault in enumerate(self.schedule, 1):
            if self.stop.wait(fault.gap_s) or time.monotonic() > deadline:
                return
            self.supervise()
            self.snapshots.append(Snapshot.take(fault.kind, self.state_dir, self.outputs))
            effect = self.inject(fault)
            self.done.append(f"#{number} +{time.monotonic() - started:.1f}s {fault.kind}: {effect}")

    def inject(self, fault: f.Fault) -> str:
        if fault.kind == f.KILL_PUBLISHER:
            old = self.publisher
            children = self.kill_publisher(old)
            self.start()
            return f"pid {old.pid} and its {children} subscribers; restarted"
        if fault.kind == f.CUT_SUBSCRIBERS:
            return f"{f.cut_port(self.port)} sockets closed"
        if fault.kind == f.RESTART_DATABASE:
            self.source.restart()
            return "restarted"
        if fault.kind == f.CUT_SOURCE:
            return f"{f.cut_process_connections(self.publisher.pid, self.source.port())} closed"
        if fault.kind == f.THROTTLE_SOURCE:
            self.source.proxy.set_rate(32 * 1024)
            self.stop.wait(2 * fault.hold_s)
            self.source.proxy.set_rate(None)
            return f"32 KiB/s for {2 * fault.hold_s:.1f}s"
        (app, instance), pid = self.pick_subscriber(fault.victim)
        if fault.kind == f.KILL_SUBSCRIBER:
            f.send(pid, signal.SIGKILL)
            return f"{app}/{instance} (pid {pid})"
        assert fault.kind == f.PAUSE_SUBSCRIBER
        before = set(f.tcp_connections(pid))
        self.paused = pid
        f.send(pid, signal.SIGSTOP)
        # Past the heartbeat timeout: the publisher gives its shards to another owner.
        self.stop.wait(HEARTBEAT_TIMEOUT_MS / 1000 + fault.hold_s)
        f.send(pid, signal.SIGCONT)
        self.paused = None

        def reconnected() -> bool:
            # A new connection means it gave up the old one, and anything it wrote late
            # (the batch it was handling) is in the file before the next fault.
            now = f.tcp_connections(pid)
            return not f.alive(pid) or any(
                inode not in before and remote == self.port for inode, (_, remote) in now.items()
            )

        wait_until(reconnected, 30, f"{app}/{instance} to reconnect after SIGCONT")
        return f"{app}/{instance} (pid {pid}) for {HEARTBEAT_TIMEOUT_MS / 1000 + fault.hold_s:.1f}s"

    def supervise(self) -> None:
        """Restart a publisher that stopped because its source was unreachable as it
        started (a database restart at that moment): it exits 2 then, as documented,
        and is left to its supervisor. Any other exit of its own fails the test."""
        code = self.publisher.proc.poll()
        if code is None:
            return
        self.publisher.wait()
        stderr = self.publisher.stderr
        assert code == 2 and "source.dsn: cannot connect" in stderr, (
            f"the publisher exited {code} by itself:\n{stderr[-3000:]}"
        )
        self.done.append("   (the publisher exited 2: source unreachable at start; restarted)")
        self.start()

    @staticmethod
    def kill_publisher(publisher: Process) -> int:
        """kill -9; its subscribers die with it. Returns how many there were."""
        children = list(f.subscribers_of(publisher.pid).values())
        publisher.kill()
        # The next publisher's subscribers must not overlap them.
        wait_until(lambda: not any(map(f.alive, children)), 30, "its subscribers to exit")
        return len(children)

    def pick_subscriber(self, victim: int) -> tuple[tuple[str, int], int]:
        found: dict[tuple[str, int], int] = {}

        def some() -> bool:
            self.supervise()
            found.update(f.subscribers_of(self.publisher.pid))
            return bool(found)

        wait_until(some, 30, "a subscriber process to pick")
        key = sorted(found)[victim % len(found)]
        return key, found[key]

    def caught_up(self, total: int) -> bool:
        self.supervise()
        end = inspect_log(self.state_dir / "log").next_seq
        markers = read_datamarkers(self.state_dir)
        return end >= total and all(
            (app, shard) in markers and markers[(app, shard)].position >= end
            for app in APPLICATIONS
            for shard in range(16)
        )

    def all_serving(self) -> bool:
        """Every subscriber process is up and connected to the publisher."""
        self.supervise()
        found = f.subscribers_of(self.publisher.pid)
        return len(found) == sum(APPLICATIONS.values()) and all(
            any(remote == self.port for _, remote in f.tcp_connections(pid).values())
            for pid in found.values()
        )

    def close(self) -> None:
        self.stop.set()
        if self.paused is not None:
            f.send(self.paused, signal.SIGCONT)
        for publisher in self.publishers:
            self.kill_publisher(publisher)

    def stderr_tail(self, lines: int = 40) -> str:
        return "".join(self.publishers[-1].stderr_lines[-lines:]) if self.publishers else ""


@contextmanager
def reported(seed: int, source: str, chaos: Callable[[], Chaos | None]) -> Iterator[None]:
    """Any failure names the seed, the faults injected so far and the publisher's log."""
    try:
        yield
    except Exception as exc:  # a skip (a service missing outside CI) passes through
        run = chaos()
        context = ""
        if run is not None:
            context = "\nfaults:\n  " + "\n  ".join(run.done or ["(none)"])
            context += f"\npublisher stderr (last lines):\n{run.stderr_tail()}"
        raise AssertionError(
            f"chaos {source} failed with seed {seed} (rerun: WORMHOLE_CHAOS_SEED={seed} "
            f"pytest tests/chaos -k {source}): {type(exc).__name__}: {exc}{context}"
        ) from exc


@pytest.mark.chaos
@pytest.mark.parametrize("source_name", ["filelog", "postgres", "mysql"])
def test_every_update_reaches_every_application_in_order_through_random_faults(
    tmp_path: Path, request: pytest.FixtureRequest, source_name: str
) -> None:
    seed = chaos_seed()
    print(f"chaos seed {seed}: rerun with WORMHOLE_CHAOS_SEED={seed}")
    rng = random.Random(seed)
    total = KEYS * ROUNDS
    run: Chaos | None = None
    with reported(seed, source_name, lambda: run):
        source = make_source(source_name, tmp_path, request)
        workload = None
        try:
            run = Chaos(tmp_path, source, rng)
            print("faults: " + "; ".join(fault.describe() for fault in run.schedule))
            if source.port() is not None:  # creates the replication slot / binlog position
                result = run_cli("run", str(run.setup_pipeline), "--once", cwd=tmp_path)
                assert result.returncode == 0, result
            started = time.monotonic()
            deadline = started + DEADLINE_S
            run.start()
            workload = source.workload()
            workload.start()
            run.inject_all(deadline)
            faults_done = time.monotonic()
            workload.join(max(1.0, deadline - time.monotonic()))
            assert not workload.is_alive(), f"the workload wrote {workload.written} of {total}"
            assert workload.error is None, f"the workload failed: {workload.error!r}"
            wait_until(
                lambda: run is not None and run.caught_up(total),
                max(1.0, deadline - time.monotonic()),
                "every application to acknowledge every update",
            )
            caught_up = time.monotonic()
            # Every process up first: a publisher restarted by the last fault that gets SIGTERM
            # before its signal handlers exist ends by the signal (as a crash would: nothing
            # is lost, but the exit is not 0), and this check is about a graceful stop.
            wait_until(run.all_serving, max(1.0, deadline - time.monotonic()), "subscribers")
            code = run.publisher.stop()
            assert code == 0, f"the graceful stop exited {code}"
            stopped = time.monotonic()
        finally:
            if workload is not None:
                workload.stop.set()
                workload.join(30)
            if run is not None:
                run.close()
            source.recover()
            source.close()
        # Count the faults, not the notes between them (a publisher restarted after exiting).
        faults = [line for line in run.done if line.startswith("#")]
        assert len(faults) == len(run.schedule), "the deadline cut the fault schedule short"
        seqs = log_seqs(run.state_dir)
        assert len(seqs) == total, f"the publisher log holds {len(seqs)} updates, not {total}"
        print(
            f"{total} updates written in {workload.finished - started:.1f}s (faults done at "
            f"{faults_done - started:.1f}s, {workload.retries} writes retried), caught up at "
            f"{caught_up - started:.1f}s, stopped at {stopped - started:.1f}s"
        )
        print("faults injected:\n  " + "\n  ".join(run.done))
        for app, path in run.outputs.items():
            per_key = check_rounds(path, KEYS, ROUNDS)  # every key's n in order, no gap
            report = check_flows(app, path, seqs, run.snapshots)
            assert report.duplicates == per_key
            assert report.lines == total + report.duplicates
            print(
                f"{app}: {report.lines} lines, {report.duplicates} duplicates in "
                f"{len(report.replays)} replays; by the last fault before them in the file: "
                f"{report.per_fault(run.snapshots)}"
            )
        tracebacks = [p.pid for p in run.publishers if "Traceback" in p.stderr]
        assert not tracebacks, f"a traceback in the log of publisher(s) {tracebacks}"
