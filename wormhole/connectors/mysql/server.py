"""What the ``mysql`` source shares about talking to the server: quoting, the server's error
codes (those a reconnect fixes, those it cannot), the catalog query of a table's columns, and
:class:`MySQLServer`: connections, the checks that the server is set up for change capture,
and its binlog positions."""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from wormhole.connectors.mysql.charsets import Charsets
from wormhole.connectors.mysql.position import BinlogPosition
from wormhole.core.errors import SourceError

if TYPE_CHECKING:
    from wormhole.connectors.mysql.options import MySQLOptions

try:  # optional dependency: the `mysql` extra
    import pymysql
    import pymysql.converters
    import pymysql.cursors

    HAVE_DRIVER = True
except ImportError:  # pragma: no cover - reported at open()
    HAVE_DRIVER = False

log = logging.getLogger("wormhole.mysql")

NO_DRIVER = (
    "source.type: mysql needs mysql-replication; install the extra: pip install "
    "'wormhole-cdc[mysql]'"
)


def quote_name(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def server_error(exc: BaseException) -> tuple[int, str]:
    args: tuple[Any, ...] = tuple(getattr(exc, "args", ()))
    if len(args) >= 2 and isinstance(args[0], int):
        return args[0], str(args[1])
    return 0, str(exc)


def json_text(text: str) -> str:
    return msgspec.json.encode(text).decode()


DESCRIBE_COLUMNS = (
    "SELECT COLUMN_NAME, COLUMN_TYPE, DATA_TYPE, DATETIME_PRECISION, IS_NULLABLE, "
    "COLUMN_DEFAULT FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = %s AND "
    "TABLE_NAME = %s ORDER BY ORDINAL_POSITION"
)


# Errors that mean "the server went away": reconnect with backoff.
TRANSIENT = frozenset({2003, 2006, 2013, 2055, 1053, 1927})


# Errors of a backfill's chunk that reading it again cannot fix: the request fails.
CHUNK_FATAL = frozenset({1054, 1064, 1142, 1143, 1146, 1305, 1792})


# Errors writing the signal table that trying again cannot fix (privileges).
SIGNAL_FATAL = frozenset({1044, 1142, 1143, 1290, 1792})


# Column types whose values a backfill's chunks keep as the server's text.
TEXT_FIELDS = (0, 246, 7, 10, 11, 12, 13, 14)  # DECIMAL, NEWDECIMAL, TIMESTAMP, DATE, TIME,
# DATETIME, YEAR, NEWDATE


SYSTEM_SCHEMAS = frozenset({"mysql", "information_schema", "performance_schema", "sys"})
"""Schemas the source never reads."""


FATAL_HINTS = {
    1045: "the user name or password is wrong",
    1227: "the user lacks a privilege: it needs REPLICATION SLAVE and BINLOG MONITOR "
    "(MariaDB; REPLICATION CLIENT on MySQL) and SELECT on the tables",
    1236: "the server cannot send the binlog from the saved position",
}
"""Errors a reconnect cannot fix, and what to do about them."""

COMPRESS_FIX = (
    "SET GLOBAL log_bin_compress=OFF on the server (and log_bin_compress=OFF in its config)"
)


def reader_id(options: MySQLOptions, pipeline: str) -> int:
    """The server id the binlog reader of ``pipeline`` registers with."""
    return options.server_id or (1_000_000 + zlib.crc32(pipeline.encode()) % 1_000_000_000)


def text_conversions() -> dict[Any, Any]:
    """PyMySQL's conversions less those of DECIMAL, temporal and YEAR values, which stay the
    server's text (see ``chunks.chunk_layout``): parsing them into Python values only to
    render them back as that text was most of the driver's work."""
    conv = dict(pymysql.converters.conversions)
    for field_type in TEXT_FIELDS:
        conv.pop(field_type, None)
    return conv


class MySQLServer:
    """The server one source reads: its connections, whether it is set up for row-based
    change capture, and its binlog positions. ``query`` runs a statement on the source's
    catalog connection (which a reconnect replaces)."""

    def __init__(
        self, settings: dict[str, Any], query: Callable[..., list[tuple[Any, ...]]]
    ) -> None:
        self.settings = settings
        self.query = query
        self.mariadb = True
        self.server_id = 0
        """The server's own ``@@server_id``."""
        self.charsets: Charsets | None = None
        """The server's collations and single-byte character sets, for text."""

    @property
    def address(self) -> str:
        return f"{self.settings['host']}:{self.settings['port']}"

    def connect(self, **extra: Any) -> Any:
        """A new autocommit connection (``extra``: more of ``pymysql.connect``'s settings)."""
        try:
            return pymysql.connect(**self.settings, charset="utf8mb4", autocommit=True, **extra)
        except pymysql.err.OperationalError as exc:
            code, message = server_error(exc)
            hint = FATAL_HINTS.get(code, "check the DSN and that the server is up")
            raise SourceError(
                f"source.dsn: cannot connect to {self.address} ({message}); {hint}"
            ) from exc

    def variable(self, name: str) -> str | None:
        rows = self.query("SHOW GLOBAL VARIABLES LIKE %s", (name,))
        return str(rows[0][1]) if rows else None

    def check(self) -> None:
        """Raise :class:`SourceError` naming what the server lacks for change capture."""
        (version,) = self.query("SELECT VERSION()")[0]
        self.mariadb = "mariadb" in str(version).lower()
        problems: list[str] = []
        if (self.variable("log_bin") or "OFF").upper() != "ON":
            problems.append("the binlog is off: start the server with log_bin (log-bin=mysql-bin)")
        wanted = {"binlog_format": "ROW", "binlog_row_image": "FULL"}
        metadata = self.variable("binlog_row_metadata")
        if metadata is not None:  # MariaDB 10.5+, MySQL 8.0.14+
            wanted["binlog_row_metadata"] = "FULL"
        for name, value in wanted.items():
            actual = (self.variable(name) or "").upper()
            if actual != value:
                problems.append(
                    f"{name} is {actual or 'unset'}; set {name}={value} in the server's "
                    f"config and restart it (or SET GLOBAL {name}='{value}' for new sessions)"
                )
        if (self.variable("log_bin_compress") or "OFF").upper() == "ON":
            problems.append(
                f"log_bin_compress is ON: compressed binlog events cannot be read; {COMPRESS_FIX}"
            )
        if not self.mariadb and (self.variable("gtid_mode") or "OFF").upper() != "ON":
            problems.append(
                "gtid_mode is not ON; set gtid_mode=ON and enforce_gtid_consistency=ON "
                "(transactions need GTIDs to be resumed exactly)"
            )
        self.server_id = int(self.variable("server_id") or 0)
        if self.server_id == 0:
            problems.append("server_id is 0; set server_id to a unique number and restart")
        if problems:
            raise SourceError(
                f"source: the server at {self.address} is not set up for row-based change "
                f"capture: " + "; ".join(problems)
            )
        if metadata is None:
            log.warning(
                "this server has no binlog_row_metadata (MariaDB < 10.5, MySQL < 8.0.14): column "
                "names come from the current schema, so rows from before an ALTER TABLE may "
                "decode with the wrong names"
            )
        self._check_binlog_readable()
        if self.charsets is None:
            self.charsets = Charsets.from_server(self.query)

    def _check_binlog_readable(self) -> None:
        try:
            self.binlog_end()
        except pymysql.err.Error as exc:
            code, message = server_error(exc)
            raise SourceError(
                f"source.dsn: cannot read the binlog position ({message}); "
                f"{FATAL_HINTS.get(code, '')}"
            ) from exc

    def binlog_end(self) -> tuple[str, int]:
        """The binlog's end: ``(file, offset)``."""
        try:
            rows = self.query("SHOW MASTER STATUS")
        except pymysql.err.ProgrammingError:  # MySQL 8.4 renamed it
            rows = self.query("SHOW BINARY LOG STATUS")
        if not rows:
            raise SourceError("source: SHOW MASTER STATUS is empty: the binlog is off")
        return str(rows[0][0]), int(rows[0][1])

    def binlogs(self) -> list[str]:
        """The binlog files the server keeps, oldest first."""
        return [str(r[0]) for r in self.query("SHOW BINARY LOGS")]

    def position(self, file: str, pos: int) -> BinlogPosition:
        """The position ``file:pos`` of this server, with its GTID state there (MariaDB)."""
        gtid_state = ""
        if self.mariadb:
            (state,) = self.query("SELECT BINLOG_GTID_POS(%s, %s)", (file, pos))[0]
            gtid_state = str(state or "")
        return BinlogPosition(file, pos, gtid_state, server_id=self.server_id)

    def start_snapshot(self) -> tuple[Any, BinlogPosition]:
        """A connection in a consistent-snapshot transaction (read in UTC, DECIMAL, temporal
        and YEAR values as the server's text), and the binlog position the snapshot sees."""
        conn = self.connect(cursorclass=pymysql.cursors.SSCursor, conv=text_conversions())
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
        return conn, self.position(file, pos)

    def lost(self, exc: Exception, at: BinlogPosition) -> str:
        """Why the binlog stream failed at ``at``, when a reconnect may help; else raise."""
        code, message = server_error(exc)
        if code == 1236:
            raise SourceError(
                f"source: the server cannot continue the binlog from "
                f"{at.file}:{at.pos} / GTID {at.gtid_state or '-'} "
                f"({message}); the binlog was probably purged past the saved position. Keep "
                f"binlogs longer, and remove the state_dir to start over with a new snapshot"
            ) from exc
        if code in FATAL_HINTS:
            raise SourceError(f"source: {message}; {FATAL_HINTS[code]}") from exc
        if not isinstance(exc, (pymysql.err.Error, OSError, EOFError)) or (
            code and code not in TRANSIENT
        ):
            raise SourceError(f"source: reading the binlog failed: {exc!r}") from exc
        # The server went away: reconnect with backoff, then resume after what was emitted.
        return message
