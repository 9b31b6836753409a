"""The ``mysql`` source: the row-based binlog of MariaDB (and MySQL), with an initial snapshot.

Positions. A change's native position is ``<binlog file>:<offset of its
transaction's GTID event>:<index in the transaction>``; its logical position is
the transaction's GTID (MariaDB ``domain-server-sequence``, MySQL
``uuid:sequence``). The checkpoint stored with every batch is::

    {"phase": "stream", "file": F, "pos": P, "gtid_state": "0-1-41,1-2-7",
     "gtid": "0-1-42", "index": 17, "server_id": 1}

``F:P`` is the end of the last complete transaction emitted and ``gtid_state``
the GTID position there; ``gtid``/``index`` name the transaction emitted in part
(a large transaction goes out in chunks) and the last change of it emitted.
A restart on the same server resumes at ``F:P``; on another server (a replica
that took over) it resumes from ``gtid_state`` by GTID, which MariaDB keeps
the same on every copy. Either way the part of ``gtid`` already emitted is
skipped, so nothing repeats and nothing is lost.

Nothing is confirmed to the server: the binlog is the server's to keep and
purge (``expire_logs_days`` / ``binlog_expire_logs_seconds``). A position that
was purged is a fatal error.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import re
import threading
import time
import zlib
from typing import Any

import msgspec

from wormhole.connectors.mysql.backfill import MySQLBackfill
from wormhole.connectors.mysql.charsets import Charsets, keep_member_bytes
from wormhole.connectors.mysql.options import MySQLOptions
from wormhole.connectors.mysql.server import (
    SYSTEM_SCHEMAS,
    TEXT_FIELDS,
    TRANSIENT,
    json_text,
    server_error,
)
from wormhole.connectors.mysql.snapshot import MySQLSnapshot
from wormhole.connectors.mysql.tables import TableMaps
from wormhole.connectors.mysql.values import Layout
from wormhole.core.errors import SourceError
from wormhole.core.update import NULL, Update
from wormhole.plugins.components import BackfillPlan, SourceBatch, SourceContext, Watermark
from wormhole.plugins.database_source import DatabaseSource, SnapshotTable, close_quietly

log = logging.getLogger("wormhole.mysql")

# MariaDB's QUERY_COMPRESSED_EVENT and the compressed rows events, v1 and v2 (log_bin_compress).
_COMPRESSED_EVENTS = frozenset(range(165, 172))
_COMPRESS_FIX = (
    "SET GLOBAL log_bin_compress=OFF on the server (and log_bin_compress=OFF in its config)"
)

try:  # optional dependency: the `mysql` extra
    import pymysql
    import pymysql.converters
    import pymysql.cursors
    from pymysqlreplication import BinLogStreamReader
    from pymysqlreplication.event import (
        GtidEvent,
        HeartbeatLogEvent,
        MariadbGtidEvent,
        NotImplementedEvent,
        QueryEvent,
        RotateEvent,
        XidEvent,
    )
    from pymysqlreplication.row_event import (
        DeleteRowsEvent,
        TableMapEvent,
        UpdateRowsEvent,
        WriteRowsEvent,
    )

    keep_member_bytes(TableMapEvent)
    HAVE_DRIVER = True
except ImportError:  # pragma: no cover - reported at open()
    HAVE_DRIVER = False

_TRUNCATE = re.compile(r"^\s*TRUNCATE\s+(?:TABLE\s+)?(`?[\w$]+`?(?:\s*\.\s*`?[\w$]+`?)?)", re.I)
_FATAL_HINTS = {
    1045: "the user name or password is wrong",
    1227: "the user lacks a privilege: it needs REPLICATION SLAVE and BINLOG MONITOR "
    "(MariaDB; REPLICATION CLIENT on MySQL) and SELECT on the tables",
    1236: "the server cannot send the binlog from the saved position",
}


def _connect_for_replication(**settings: Any) -> Any:
    """``pymysql.connect`` for the replication library, which names its control
    connection's database ``db``: PyMySQL deprecates that name for ``database``."""
    if "db" in settings:
        settings["database"] = settings.pop("db")
    return pymysql.connect(**settings)


def _reader_id(options: MySQLOptions, pipeline: str) -> int:
    """The server id the binlog reader of ``pipeline`` registers with."""
    return options.server_id or (1_000_000 + zlib.crc32(pipeline.encode()) % 1_000_000_000)


def _file_number(name: str) -> int:
    match = re.search(r"(\d+)$", name)
    return int(match.group(1)) if match else 0


def _gtid_state_text(state: dict[int, str]) -> str:
    return ",".join(state[d] for d in sorted(state))


def _parse_gtid_state(text: str) -> dict[int, str]:
    state: dict[int, str] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        state[int(part.split("-")[0])] = part
    return state


_DETAILS_END = b',"thread":null,"query":null}'


class MySQLSource(DatabaseSource):
    connector = "mysql"
    logger = log
    stream_name = "the binlog stream"
    stopped_reconnecting = "source: stopped while reconnecting to the server"
    max_backoff_s = 10.0

    def __init__(self, options: MySQLOptions) -> None:
        super().__init__(options.batch_updates)
        self.options = options
        self.settings: dict[str, Any] = options.connection()
        self.stream: Any = None
        self.mariadb = True
        self.server_id = 0  # the server's own @@server_id
        self.pos_server = 0  # the server whose binlog file/pos is self.file/self.pos
        self.reader_id = 0  # the id this reader registers as
        # Emitted state (what the next checkpoint says).
        self.file = ""
        self.pos = 4
        self.gtid_state: dict[int, str] = {}
        self.partial_gtid = ""
        self.partial_index = -1
        # Resume: the part of a transaction emitted before a restart.
        self.skip_gtid = ""
        self.skip_index = -1
        self.seen_seq: dict[int, int] = {}
        self.by_gtid = False
        # The transaction being read.
        self.txn_gtid = ""
        self.txn_name = ""
        """Debezium's id of the transaction being read (with transaction metadata)."""
        self.held_event: Any = None
        """A rows event read when a batch was full (transaction metadata): read first next."""
        self.txn_domain = -1
        self.txn_seq = 0
        self.txn_began = False
        self.skip_txn = False
        self.charsets: Charsets | None = None
        self.tables = TableMaps(self)
        """Table maps: each table's row decoder and description, by table id."""
        self.included: dict[tuple[str, str], bool] = {}
        self.snapshots = MySQLSnapshot(self)
        self.emitted: dict[str, Any] = {}
        # For lag(): what the publisher log holds, and the stream's position when it last
        # waited with nothing left to read (after the emitted checkpoint).
        self.confirmed: tuple[str, int] | None = None
        self.read_ts_ms = int(time.time() * 1000)
        """When the last transaction read was written (until one is read: when this source
        was created, which makes ``lag_seconds`` a lower bound after a restart)."""
        self.idle: tuple[tuple[str, int], str, int, float] | None = None
        self.lag_conn: Any = None
        self.lag_lock = threading.Lock()
        # Backfills: the signal table where watermarks are written, this pipeline's row in
        # it, the watermark met in the transaction being read, and the backfill's queries.
        schema, _, table = options.signal_table.partition(".")
        self.signal = (schema, table)
        self.signal_id = ""
        self.pending_watermark: str | None = None
        self.backfills = MySQLBackfill(self)

    # ------------------------------------------------------------------ open
    def _connect_and_check(self, context: SourceContext) -> None:
        if not HAVE_DRIVER:
            raise SourceError(
                "source.type: mysql needs mysql-replication; install the extra: pip install "
                "'wormhole-cdc[mysql]'"
            )
        self.reader_id = _reader_id(self.options, context.pipeline)
        self.signal_id = self._signal_id(context.pipeline)
        self.conn = self._connect()
        self._check_server()

    def _start(self, interrupted: bool) -> None:
        if interrupted:
            log.warning(
                "the initial snapshot was interrupted; taking it again (rows already "
                "delivered are delivered again)"
            )
        if self.options.snapshot == "initial":
            self._begin_snapshot()
        else:
            file, pos = self._binlog_end()
            self.file, self.pos, self.pos_server = file, pos, self.server_id
            self.gtid_state = _parse_gtid_state(self._gtid_at(file, pos))
            self.announce = True  # the start position goes into the log at once
            self._open_stream()
            self._checkpoint()

    def _resume(self, checkpoint: Any) -> None:
        self._restore(checkpoint)
        self._open_stream()
        self._checkpoint()

    def _connect(self, **extra: Any) -> Any:
        try:
            return pymysql.connect(**self.settings, charset="utf8mb4", autocommit=True, **extra)
        except pymysql.err.OperationalError as exc:
            code, message = server_error(exc)
            hint = _FATAL_HINTS.get(code, "check the DSN and that the server is up")
            raise SourceError(
                f"source.dsn: cannot connect to {self.settings['host']}:{self.settings['port']} "
                f"({message}); {hint}"
            ) from exc

    def _variable(self, name: str) -> str | None:
        rows = self._query("SHOW GLOBAL VARIABLES LIKE %s", (name,))
        return str(rows[0][1]) if rows else None

    def _check_server(self) -> None:
        (version,) = self._query("SELECT VERSION()")[0]
        self.mariadb = "mariadb" in str(version).lower()
        problems: list[str] = []
        if (self._variable("log_bin") or "OFF").upper() != "ON":
            problems.append("the binlog is off: start the server with log_bin (log-bin=mysql-bin)")
        wanted = {"binlog_format": "ROW", "binlog_row_image": "FULL"}
        metadata = self._variable("binlog_row_metadata")
        if metadata is not None:  # MariaDB 10.5+, MySQL 8.0.14+
            wanted["binlog_row_metadata"] = "FULL"
        for name, value in wanted.items():
            actual = (self._variable(name) or "").upper()
            if actual != value:
                problems.append(
                    f"{name} is {actual or 'unset'}; set {name}={value} in the server's "
                    f"config and restart it (or SET GLOBAL {name}='{value}' for new sessions)"
                )
        if (self._variable("log_bin_compress") or "OFF").upper() == "ON":
            problems.append(
                f"log_bin_compress is ON: compressed binlog events cannot be read; {_COMPRESS_FIX}"
            )
        if not self.mariadb and (self._variable("gtid_mode") or "OFF").upper() != "ON":
            problems.append(
                "gtid_mode is not ON; set gtid_mode=ON and enforce_gtid_consistency=ON "
                "(transactions need GTIDs to be resumed exactly)"
            )
        self.server_id = int(self._variable("server_id") or 0)
        if self.server_id == 0:
            problems.append("server_id is 0; set server_id to a unique number and restart")
        if problems:
            raise SourceError(
                f"source: the server at {self.settings['host']}:{self.settings['port']} is not "
                f"set up for row-based change capture: " + "; ".join(problems)
            )
        if metadata is None:
            log.warning(
                "this server has no binlog_row_metadata (MariaDB < 10.5, MySQL < 8.0.14): column "
                "names come from the current schema, so rows from before an ALTER TABLE may "
                "decode with the wrong names"
            )
        try:
            self._binlog_end()
        except pymysql.err.Error as exc:
            code, message = server_error(exc)
            raise SourceError(
                f"source.dsn: cannot read the binlog position ({message}); "
                f"{_FATAL_HINTS.get(code, '')}"
            ) from exc
        if self.charsets is None:
            # The server's own collations and single-byte character sets, for text.
            self.charsets = Charsets.from_server(self._query)

    def _binlog_end(self) -> tuple[str, int]:
        try:
            rows = self._query("SHOW MASTER STATUS")
        except pymysql.err.ProgrammingError:  # MySQL 8.4 renamed it
            rows = self._query("SHOW BINARY LOG STATUS")
        if not rows:
            raise SourceError("source: SHOW MASTER STATUS is empty: the binlog is off")
        return str(rows[0][0]), int(rows[0][1])

    def _binlogs(self) -> list[str]:
        return [str(r[0]) for r in self._query("SHOW BINARY LOGS")]

    def _gtid_at(self, file: str, pos: int) -> str:
        if not self.mariadb:
            return ""
        (state,) = self._query("SELECT BINLOG_GTID_POS(%s, %s)", (file, pos))[0]
        return str(state or "")

    # ------------------------------------------------------------ tables
    def _wanted(self, schema: str, table: str) -> bool:
        found = self.included.get((schema, table))
        if found is None:
            name = f"{schema}.{table}"
            include = self.options.tables
            found = (
                schema not in SYSTEM_SCHEMAS
                and (schema, table) != self.signal
                and (include is None or any(fnmatch.fnmatchcase(name, p) for p in include))
                and not any(fnmatch.fnmatchcase(name, p) for p in self.options.exclude_tables)
            )
            self.included[(schema, table)] = found
        return found

    # ------------------------------------------------------------ snapshot
    def _begin_snapshot(self) -> None:
        # DECIMAL, temporal and YEAR values stay the server's text, as backfill chunks
        # take them (see chunk_layout): parsing them into Python values only to render
        # them back as that text was most of the driver's work.
        conv = dict(pymysql.converters.conversions)
        for field_type in TEXT_FIELDS:
            conv.pop(field_type, None)
        conn = self._connect(cursorclass=pymysql.cursors.SSCursor, conv=conv)
        with conn.cursor() as cur:
            cur.execute("SET SESSION time_zone = '+00:00'")
            cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            locked = False
            if not self.mariadb:
                # MySQL has no binlog_snapshot_* status: hold the global read lock for the
                # moment it takes to start the snapshot and read the position.
                cur.execute("FLUSH TABLES WITH READ LOCK")
                locked = True
            cur.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY")
            if self.mariadb:
                cur.execute("SHOW STATUS LIKE 'binlog_snapshot_%'")
                status = {str(k).lower(): v for k, v in cur.fetchall()}
                file = str(status["binlog_snapshot_file"])
                pos = int(status["binlog_snapshot_position"])
            else:
                cur.execute("SHOW MASTER STATUS")
                row = cur.fetchall()[0]
                file, pos = str(row[0]), int(row[1])
            if locked:
                cur.execute("UNLOCK TABLES")
        self.snapshots.conn = conn
        self.file, self.pos, self.pos_server = file, pos, self.server_id
        self.gtid_state = _parse_gtid_state(self._gtid_at(file, pos))
        self.snapshot_position = f"{file}:{pos}"
        self.snapshots.ts_us = int(time.time()) * 1_000_000
        self.snapshot_logical = _gtid_state_text(self.gtid_state)
        self.snapshot_tables = self.snapshots.plan()
        self.phase = "snapshot"
        log.info("initial snapshot of %d tables at %s:%d", len(self.snapshot_tables), file, pos)

    def snapshot_pending(self) -> list[str]:
        """Tables whose every row this open's initial snapshot is about to read (a new
        application starting at the log end gets them all: its start backfill is not needed)."""
        if self.phase != "snapshot":
            return []
        return [f"{schema}.{name}" for schema, name, _layout, _select in self.snapshot_tables]

    # DatabaseSource's hooks, answered by the source's MySQLSnapshot (snapshot.py).
    def _snapshot_estimate(self) -> int | None:
        return self.snapshots.estimate()

    def _open_snapshot_table(self, table: tuple[str, str, Layout, str]) -> SnapshotTable:
        return self.snapshots.open_table(table)

    def _snapshot_details(self, table: SnapshotTable, flag: str) -> msgspec.Raw:
        return self.snapshots.details(table, flag)

    def _end_snapshot(self) -> None:
        self.snapshots.end()

    def _start_stream(self) -> None:
        self.phase = "stream"
        self._open_stream()
        self._checkpoint()

    # ------------------------------------------------------------ backfills
    def _signal_id(self, pipeline: str) -> str:
        """This pipeline's row of the signal table: its reader's server id, which is unique
        among the server's replicas, and its name, for people."""
        return f"{_reader_id(self.options, pipeline)}:{pipeline}"[:191]

    def _signal_rows(self, event: Any, written: bool) -> None:
        """Rows of the signal table: this pipeline's row carries a backfill watermark,
        reported at the transaction's commit; other pipelines' rows are theirs."""
        values_of = "values" if written else "after_values"
        for row in event.rows:
            values = row[values_of]
            row_id, token = values.get("id"), values.get("token")
            if isinstance(row_id, bytes):
                row_id = row_id.decode("utf-8", "replace")
            if row_id == self.signal_id:
                if isinstance(token, bytes):
                    token = token.decode("utf-8", "replace")
                self.pending_watermark = str(token)

    def _at_watermark(self, updates: list[Update]) -> SourceBatch:
        """The batch that ends at the commit of a watermark's transaction."""
        token, self.pending_watermark = self.pending_watermark, None
        assert token is not None
        return SourceBatch(
            updates,
            self._checkpoint(),
            Watermark(token, self.txn_position, self.txn_logical),
        )

    # SourceBackfill, answered by the source's MySQLBackfill (backfill.py).
    def backfill_plan(self, pipeline: str, table: str, where: str | None) -> BackfillPlan:
        return self.backfills.plan(pipeline, table, where)

    def backfill_watermark(self, token: str) -> None:
        self.backfills.watermark(token)

    def backfill_chunk(
        self, plan: BackfillPlan, after: list[Any] | None, limit: int
    ) -> list[Update]:
        return self.backfills.chunk(plan, after, limit)

    # ------------------------------------------------------------ stream
    def _restore(self, checkpoint: dict[str, Any]) -> None:
        self.file = str(checkpoint["file"])
        self.pos = int(checkpoint["pos"])
        self.gtid_state = _parse_gtid_state(str(checkpoint.get("gtid_state", "")))
        self.partial_gtid = str(checkpoint.get("gtid", ""))
        self.partial_index = int(checkpoint.get("index", -1))
        saved_server = int(checkpoint.get("server_id", self.server_id))
        self.pos_server = saved_server
        self.by_gtid = saved_server != self.server_id
        if self.by_gtid and not self.mariadb:
            raise SourceError(
                f"source: the saved position is on server_id {saved_server}, but this server is "
                f"{self.server_id}; moving between MySQL servers by GTID is not supported: point "
                f"the DSN back at the server the position came from"
            )
        if self.by_gtid:
            log.warning(
                "the saved position came from server_id %d; this is server_id %d: resuming by "
                "GTID after %s",
                saved_server,
                self.server_id,
                _gtid_state_text(self.gtid_state) or "(the beginning)",
            )

    def _open_stream(self) -> None:
        """(Re)start the binlog stream after the emitted state."""
        self.held_event = None
        self.skip_gtid, self.skip_index = self.partial_gtid, self.partial_index
        self.seen_seq = {
            d: int(g.rsplit("-", 1)[1]) for d, g in self.gtid_state.items() if "-" in g
        }
        self.in_txn = False
        self.skip_txn = False
        self.pending_watermark = None
        kwargs: dict[str, Any] = {}
        if self.by_gtid:
            kwargs = {"auto_position": _gtid_state_text(self.gtid_state), "is_mariadb": True}
        else:
            binlogs = self._binlogs()
            if self.file not in binlogs:
                raise SourceError(
                    f"source: binlog file {self.file} (saved position {self.file}:{self.pos}) "
                    f"is no longer on the server (oldest retained: "
                    f"{binlogs[0] if binlogs else 'none'}); the changes since were purged. "
                    f"Keep binlogs longer (binlog_expire_logs_seconds / expire_logs_days), and "
                    f"remove the state_dir to start over with a new snapshot"
                )
            kwargs = {"log_file": self.file, "log_pos": self.pos, "resume_stream": True}
        settings = dict(self.settings)
        settings["read_timeout"] = max(30.0, self.options.heartbeat_s * 10)
        self.stream = BinLogStreamReader(
            connection_settings=settings,
            server_id=self.reader_id,
            blocking=True,
            only_events=[
                TableMapEvent,
                MariadbGtidEvent,
                GtidEvent,
                QueryEvent,
                XidEvent,
                WriteRowsEvent,
                UpdateRowsEvent,
                DeleteRowsEvent,
                RotateEvent,
                HeartbeatLogEvent,
                # Events the library does not decode: compressed ones must not pass unseen.
                NotImplementedEvent,
            ],
            filter_non_implemented_events=False,
            slave_heartbeat=self.options.heartbeat_s,
            enable_logging=False,
            pymysql_wrapper=_connect_for_replication,
            **kwargs,
        )
        self.phase = "stream"

    def _checkpoint(self) -> dict[str, Any]:
        checkpoint = {
            "phase": "stream",
            "file": self.file,
            "pos": self.pos,
            "gtid_state": _gtid_state_text(self.gtid_state),
            "gtid": self.partial_gtid,
            "index": self.partial_index,
            "server_id": self.pos_server,
        }
        self.emitted = checkpoint
        return checkpoint

    # ------------------------------------------------------------- reconnect
    def _lost(self, exc: Exception) -> str:
        code, message = server_error(exc)
        if code == 1236:
            raise SourceError(
                f"source: the server cannot continue the binlog from "
                f"{self.file}:{self.pos} / GTID {_gtid_state_text(self.gtid_state) or '-'} "
                f"({message}); the binlog was probably purged past the saved position. Keep "
                f"binlogs longer, and remove the state_dir to start over with a new snapshot"
            ) from exc
        if code in _FATAL_HINTS:
            raise SourceError(f"source: {message}; {_FATAL_HINTS[code]}") from exc
        if not isinstance(exc, (pymysql.err.Error, OSError, EOFError)) or (
            code and code not in TRANSIENT
        ):
            raise SourceError(f"source: reading the binlog failed: {exc!r}") from exc
        # The server went away: reconnect with backoff, then resume after what was emitted.
        return message

    def _disconnect(self) -> None:
        self._close_stream()
        close_quietly(self.conn)

    def _reconnect(self) -> str | None:
        try:
            self.conn = self._connect()
            self._check_server()
        except SourceError as again:
            return str(again)
        # Resume after what was emitted: changes read since then were not returned.
        self._restore(self.emitted)
        self._open_stream()
        log.info("binlog stream resumed at %s:%d", self.file, self.pos)
        return None

    def _read_stream(self, deadline: float) -> SourceBatch | None:
        limit = self.options.batch_updates
        updates: list[Update] = []
        stream = self.stream
        fetch = stream.fetchone
        append = updates.append
        # With transaction metadata, a batch that is full inside a transaction ends before
        # the next rows event of it (held for the next call), not right after the last one
        # read: the last change of a transaction must be known as such (its END).
        marker = self.marker
        full = False
        held, self.held_event = self.held_event, None
        while True:
            if held is None:
                event = fetch()
            else:
                event, held = held, None
            if event is None:  # the stream ended (not blocking): reconnect
                raise EOFError("the server closed the binlog stream")
            kind = type(event)
            if kind in (WriteRowsEvent, UpdateRowsEvent, DeleteRowsEvent):
                if full:
                    self.held_event = event
                    return SourceBatch(updates, self._checkpoint())
                if self.skip_txn or not self._wanted(event.schema, event.table):
                    if (
                        event.table == self.signal[1]
                        and event.schema == self.signal[0]
                        and not self.skip_txn
                        and kind is not DeleteRowsEvent
                    ):
                        self._signal_rows(event, kind is WriteRowsEvent)
                    continue
                table = f"{event.schema}.{event.table}"
                layout = self.tables.decoder(event, table)
                op = "c" if kind is WriteRowsEvent else "u" if kind is UpdateRowsEvent else "d"
                details = self._rows_details(event) if self.describe else None
                first_index = self.txn_index + 1
                first_update = len(updates)
                for row in self.tables.rows(event, layout, table, op == "u"):
                    self.txn_index += 1
                    if details is not None:
                        self.change_details = msgspec.Raw(
                            b"%s%d%s" % (details, self.txn_index - first_index, _DETAILS_END)
                        )
                    if self.txn_gtid == self.skip_gtid and self.txn_index <= self.skip_index:
                        continue
                    if op == "u":
                        before, after = row
                        old_key = {k: before[k] for k in layout.key}
                        new_key = {k: after[k] for k in layout.key}
                        if old_key != new_key:
                            # The old key may live in another shard: it gets a delete, the
                            # new key an insert, so both flows see the change.
                            append(self._update("d", table, old_key, before, None))
                            append(self._update("c", table, new_key, None, after))
                        else:
                            append(self._update("u", table, new_key, before, after))
                    else:
                        values = row
                        key = {k: values[k] for k in layout.key}
                        if op == "c":
                            append(self._update("c", table, key, None, values))
                        else:
                            append(self._update("d", table, key, values, None))
                    self.partial_gtid, self.partial_index = self.txn_gtid, self.txn_index
                if marker is not None:
                    for update in updates[first_update:]:
                        marker.mark(update, self.txn_name)
                if len(updates) >= limit:
                    # A large transaction goes out in chunks: memory stays bounded.
                    if marker is None:
                        return SourceBatch(updates, self._checkpoint())
                    full = True
            elif kind is TableMapEvent:
                self.tables.table_map(event)
            elif kind is XidEvent:
                self._commit()
                if self.pending_watermark is not None:
                    return self._at_watermark(updates)
                if not updates:
                    self._nothing_pending()  # a transaction with nothing of ours
                if len(updates) >= limit or time.monotonic() >= deadline:
                    return SourceBatch(updates, self._checkpoint()) if updates else None
            elif kind is MariadbGtidEvent or kind is GtidEvent:
                self._begin(event)
            elif kind is QueryEvent:
                query = event.query.strip() if isinstance(event.query, str) else ""
                upper = query[:12].upper()
                if upper.startswith("BEGIN"):
                    self.txn_began = True
                    continue
                if upper.startswith("XA "):
                    continue
                if upper.startswith("COMMIT") or upper == "ROLLBACK":
                    self._commit()
                    if self.pending_watermark is not None:
                        return self._at_watermark(updates)
                elif self.in_txn and self.txn_began:
                    # Inside a transaction (SAVEPOINT, ROLLBACK TO, RELEASE SAVEPOINT):
                    # not its end.
                    continue
                else:
                    # DDL, in a GTID group of its own: a transaction of its own.
                    truncate = self._truncate(event, query)
                    if truncate is not None:
                        append(truncate)
                        if marker is not None:
                            marker.mark(truncate, self.txn_name)
                    if self.in_txn:
                        self._commit()
                if not updates and not self.in_txn:
                    self._nothing_pending()
                if len(updates) >= limit or time.monotonic() >= deadline:
                    return SourceBatch(updates, self._checkpoint()) if updates else None
            elif kind is RotateEvent:
                if self.in_txn:
                    # The reader reconnected by itself in the middle of a transaction (it
                    # resends from where it started): resume properly from what was emitted.
                    raise EOFError("the binlog stream restarted inside a transaction")
            elif kind is NotImplementedEvent:
                if event.event_type in _COMPRESSED_EVENTS:
                    packet = event.packet
                    raise SourceError(
                        f"source: the binlog holds a compressed event at "
                        f"{self.stream.log_file}:{packet.log_pos - packet.event_size} (type "
                        f"{event.event_type}): the server writes compressed events "
                        f"(log_bin_compress=ON), which the source cannot read, and skipping it "
                        f"would lose its changes. {_COMPRESS_FIX}, then start the source after "
                        f"this binlog position (a new state_dir with a snapshot, or a backfill "
                        f"of the tables written while it was on)"
                    )
            elif kind is HeartbeatLogEvent:
                if not self.in_txn and not updates:
                    self._nothing_pending()
                if not self.in_txn and time.monotonic() >= deadline:
                    return SourceBatch(updates, self._checkpoint()) if updates else None
            elif time.monotonic() >= deadline and not self.in_txn:
                return SourceBatch(updates, self._checkpoint()) if updates else None

    def _rows_details(self, event: Any) -> bytes:
        """The start of ``Update.details`` of a rows event's rows (up to ``"row":``), as
        Debezium's MySQL connector writes its ``source`` block; sets ``change_columns``."""
        columns, db, table = self.tables.described[event.table_id]
        self.change_columns = columns
        packet = event.packet
        seconds = int(event.timestamp)
        gtid = "null" if self.mariadb or not self.txn_gtid else json_text(self.txn_gtid)
        return (
            f'{{"connector":"mysql","snapshot":"false","db":{db},"sequence":null,'
            f'"ts_us":{seconds * 1_000_000},"ts_ns":{seconds * 1_000_000_000},"table":{table},'
            f'"server_id":{packet.server_id},"gtid":{gtid},'
            f'"file":{json_text(self.stream.log_file)},'
            f'"pos":{packet.log_pos - packet.event_size},"row":'
        ).encode()

    def _nothing_pending(self) -> None:
        """Between transactions, with nothing read since the emitted checkpoint: the binlog
        up to the stream's position holds nothing more for the publisher log (for lag())."""
        emitted = (str(self.emitted.get("file", "")), int(self.emitted.get("pos", 0)))
        stream = self.stream
        self.idle = (emitted, str(stream.log_file), int(stream.log_pos), time.time())

    def _begin(self, event: Any) -> None:
        if isinstance(event, MariadbGtidEvent):
            self.txn_gtid = event.gtid
            self.txn_domain = event.domain_id
            self.txn_seq = event.gtid_seq_no
            # MariaDB writes no BEGIN: a group is transactional unless flagged standalone.
            self.txn_began = not (event.flags & 1)
        else:
            self.txn_gtid = str(event.gtid)
            self.txn_domain = 0
            self.txn_seq = 0
            self.txn_began = False  # MySQL writes a BEGIN query for a transaction
        self.txn_logical = self.txn_gtid
        self.txn_id = self.txn_seq or None
        packet = event.packet
        self.txn_position = f"{self.stream.log_file}:{packet.log_pos - packet.event_size}"
        self.txn_ts = int(event.timestamp) * 1000
        self.txn_index = -1
        self.in_txn = True
        self.pending_watermark = None
        if self.marker is not None:
            # Debezium's transaction id: the GTID (MariaDB's as Debezium's MariaDB connector
            # writes it), or where the transaction starts.
            self.txn_name = (
                self.txn_gtid
                or f"file={self.stream.log_file},pos={packet.log_pos - packet.event_size}"
            )
            self.marker.begin(self.txn_name, self.txn_ts)
        # After a reconnect by GTID the server may send transactions already emitted.
        self.skip_txn = (
            self.by_gtid
            and self.mariadb
            and self.txn_seq <= self.seen_seq.get(self.txn_domain, -1)
            and self.txn_gtid != self.skip_gtid
        )

    def _commit(self) -> None:
        self.in_txn = False
        self.read_ts_ms = self.txn_ts
        self.file, self.pos = self.stream.log_file, self.stream.log_pos
        self.pos_server = self.server_id
        if self.skip_txn:
            self.skip_txn = False
            self.pending_watermark = None
            return
        if self.marker is not None:
            self.marker.commit(self.txn_name)
        if self.txn_gtid:
            if self.mariadb:
                self.gtid_state[self.txn_domain] = self.txn_gtid
                self.seen_seq[self.txn_domain] = self.txn_seq
            else:
                self.gtid_state[0] = self.txn_gtid
        self.partial_gtid, self.partial_index = "", -1
        if self.txn_gtid == self.skip_gtid:
            self.skip_gtid, self.skip_index = "", -1

    def _truncate(self, event: Any, query: str) -> Update | None:
        match = _TRUNCATE.match(query)
        if match is None or self.skip_txn:
            return None
        name = match.group(1).replace("`", "").replace(" ", "")
        schema, _, table = name.rpartition(".")
        schema = schema or str(
            event.schema.decode() if isinstance(event.schema, bytes) else event.schema
        )
        if not self._wanted(schema, table):
            return None
        self.txn_index += 1
        if self.txn_gtid == self.skip_gtid and self.txn_index <= self.skip_index:
            return None
        self.partial_gtid, self.partial_index = self.txn_gtid, self.txn_index
        self.change_columns = self.change_details = NULL
        return self._update("t", f"{schema}.{table}", {}, None, None)

    # --------------------------------------------------------------- --once
    def capture_end(self) -> Any:
        file, pos = self._binlog_end()
        return [file, pos]

    def _stream_reached(self, end: Any) -> bool:
        if self.stream is None:
            return False
        file, pos = end
        here = (_file_number(self.stream.log_file or ""), int(self.stream.log_pos or 0))
        return here >= (_file_number(file), int(pos))

    def confirm(self, checkpoint: Any) -> None:
        """Nothing to tell the server, which keeps the binlog by its own retention settings;
        the position is kept for :meth:`lag`."""
        if checkpoint.get("phase") == "stream":
            self.confirmed = (str(checkpoint["file"]), int(checkpoint["pos"]))

    def lag(self) -> dict[str, float]:
        """For metrics (called at scrape time, from another thread): ``lag_bytes``, binlog
        between what the publisher log holds and the server's binlog end; ``lag_seconds``,
        how long ago the last transaction read was written, while behind (else 0)."""
        confirmed = self.confirmed
        if confirmed is None:
            return {}  # still in the initial snapshot
        file, pos = confirmed
        idle = self.idle
        if idle is not None and idle[0] == confirmed:
            file, pos = idle[1], idle[2]
        with self.lag_lock:
            try:
                if self.lag_conn is None:
                    self.lag_conn = pymysql.connect(
                        **{**self.settings, "read_timeout": 5, "connect_timeout": 5},
                        autocommit=True,
                    )
                with self.lag_conn.cursor() as cur:
                    cur.execute("SHOW BINARY LOGS")
                    logs = [(str(r[0]), int(r[1])) for r in cur.fetchall()]
            except pymysql.err.Error:
                close_quietly(self.lag_conn)
                self.lag_conn = None
                raise
        here = _file_number(file)
        behind = 0
        for name, size in logs:
            number = _file_number(name)
            if number > here:
                behind += size
            elif number == here:
                behind += max(0, size - pos)
        seconds = 0.0
        if behind:
            since = max(self.read_ts_ms / 1000.0, idle[3] if idle is not None else 0.0)
            seconds = max(0.0, time.time() - since) if since else 0.0
        return {"lag_bytes": float(behind), "lag_seconds": seconds}

    def _close_stream(self) -> None:
        if self.stream is not None:
            with contextlib.suppress(Exception):
                self.stream.close()
            self.stream = None

    def close(self) -> None:
        self._close_stream()
        snapshot_cursor = self.snapshot.cursor if self.snapshot is not None else None
        close_quietly(snapshot_cursor, self.snapshots.conn, self.conn)
        self.backfills.close()
        with self.lag_lock:
            close_quietly(self.lag_conn)
            self.lag_conn = None
