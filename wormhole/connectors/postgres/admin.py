"""What the ``postgres`` source sets up and asks of the server apart from its data: the
server's settings, the publication, the schema trigger, the replication slot and the start
of replication, the end marker of ``--once``, the heartbeat, and the slot's lag."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from wormhole.connectors.postgres import pgoutput as pg
from wormhole.connectors.postgres import schema_trigger
from wormhole.connectors.postgres.driver import psycopg2
from wormhole.connectors.postgres.sql import qualified, quote
from wormhole.core.errors import SourceError, first_line
from wormhole.plugins.database_source import close_quietly

if TYPE_CHECKING:
    from wormhole.connectors.postgres.source import PostgresSource

log = logging.getLogger("wormhole.postgres")


class PostgresAdmin:
    """The server-side set-up of one :class:`PostgresSource` (on its connection), and the
    connections of its own that the heartbeat and the lag use."""

    def __init__(self, source: PostgresSource) -> None:
        self.source = source
        self.last_heartbeat = 0.0
        self.heartbeat_conn: Any = None
        self.lag_conn: Any = None
        self.lag_lock = threading.Lock()

    def connect(self, replication: bool = False) -> Any:
        """A connection to the DSN: autocommit, or a logical replication connection."""
        dsn = self.source.options.dsn
        try:
            if replication:
                return psycopg2.connect(
                    dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection
                )
            conn = psycopg2.connect(dsn)
            conn.autocommit = True
            return conn
        except psycopg2.OperationalError as exc:
            raise SourceError(
                f"source.dsn: cannot connect to PostgreSQL ({first_line(exc)}); check the "
                f"DSN, that the server is up, and that pg_hba.conf lets this user connect to the "
                f"database (logical replication uses the database's own entry)"
            ) from exc

    def check_server(self) -> None:
        """wal_level, the encoding (SQL_ASCII: ``raw_text``), the version, the privilege."""
        source = self.source
        query = source._query
        (level,) = query("SHOW wal_level")[0]
        if level != "logical":
            raise SourceError(
                f"source: the server's wal_level is {level!r}; logical decoding needs "
                f"wal_level = logical (set it in postgresql.conf and restart the server)"
            )
        (encoding,) = query("SHOW server_encoding")[0]
        if encoding not in ("UTF8", "SQL_ASCII"):
            raise SourceError(
                f"source: the database encoding is {encoding}; this source reads UTF8 databases"
            )
        source.raw_text = encoding == "SQL_ASCII"
        (version,) = query("SHOW server_version_num")[0]
        source.server_version = int(version)
        rows = query(
            "SELECT rolreplication OR rolsuper, quote_ident(current_user) FROM pg_roles "
            "WHERE rolname = current_user"
        )
        if not rows or not rows[0][0]:
            user = rows[0][1] if rows else "<user>"
            raise SourceError(
                f"source.dsn: the user {user} needs the REPLICATION privilege; as a superuser, "
                f"run: ALTER ROLE {user} WITH REPLICATION"
            )

    def prepare(self, first_run: bool) -> None:
        """Before the slot is created or read: the publication (created on a first run),
        the warning about keys stored out of line, the schema trigger."""
        self._ensure_publication(first_run)
        self.source.catalog.warn_about_out_of_line_keys()
        self._ensure_schema_trigger()

    def _ensure_publication(self, first_run: bool) -> None:
        source = self.source
        publication = source.publication
        exists = source._query("SELECT 1 FROM pg_publication WHERE pubname = %s", (publication,))
        if exists:
            return
        if not first_run:
            raise SourceError(
                f"source.publication: publication {publication!r} does not exist (was it "
                f"dropped?); the stream cannot continue without it. Recreate it with the same "
                f"tables, or remove the state_dir to start over with a new snapshot"
            )
        tables = source.options.tables
        if tables:
            target = "FOR TABLE " + ", ".join(qualified(t) for t in tables)
        else:
            target = "FOR ALL TABLES"
        try:
            source._query(f"CREATE PUBLICATION {quote(publication)} {target}")
        except psycopg2.Error as exc:
            raise SourceError(
                f"source.tables: cannot create publication {publication!r} "
                f"({str(exc).strip()}); check the table names and that the user owns them "
                f"(FOR ALL TABLES needs a superuser)"
            ) from exc
        log.info("created publication %s %s", publication, target)

    def _ensure_schema_trigger(self) -> None:
        """With ``schema_trigger``: install the trigger unless it is there (see
        :mod:`schema_trigger`). ``schema_events`` needs it."""
        source = self.source
        options, version = source.options, source.server_version
        if not options.schema_trigger:
            if options.schema_events and not (
                version >= schema_trigger.MINIMUM_VERSION
                and schema_trigger.installed(source._query)
            ):
                raise SourceError(
                    "source.schema_events: schema-change events come from the schema "
                    "trigger, which is not installed in this database; set "
                    "schema_trigger: true (needs a superuser) or have a superuser run "
                    "`wormhole postgres-schema-trigger PIPELINE`"
                    + (
                        f" (it needs PostgreSQL 14 or later; this server is {version})"
                        if version < schema_trigger.MINIMUM_VERSION
                        else ""
                    )
                )
            return
        if version < schema_trigger.MINIMUM_VERSION:
            raise SourceError(
                f"source.schema_trigger: the schema trigger needs PostgreSQL 14 or later "
                f"(pgoutput sends logical decoding messages from 14 on); this server is "
                f"{version}. Set schema_trigger: false"
            )
        if schema_trigger.installed(source._query):
            return
        try:
            source._query(schema_trigger.INSTALL)
        except psycopg2.Error as exc:
            raise SourceError(
                f"source.schema_trigger: cannot install the schema trigger ({first_line(exc)}); "
                f"{schema_trigger.PRIVILEGE_HINT}, or set schema_trigger: false"
            ) from exc
        log.info("installed the schema trigger (event triggers %s)", schema_trigger.TRIGGERS)

    # ----------------------------------------------------------------- slot
    def _slot_exists(self) -> bool:
        source = self.source
        return bool(
            source._query(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND database = "
                "current_database()",
                (source.slot,),
            )
        )

    def require_slot(self) -> None:
        if not self._slot_exists():
            raise SourceError(
                f"source.slot: replication slot {self.source.slot!r} does not exist (was it "
                f"dropped?). Changes since the last confirmed position may be gone, so it is "
                f"not recreated silently: remove the state_dir to start over with a new initial "
                f"snapshot"
            )

    def drop_slot(self) -> None:
        source = self.source
        if self._slot_exists():
            source._query("SELECT pg_drop_replication_slot(%s)", (source.slot,))

    def create_slot(self) -> tuple[int, str]:
        """Create the slot on a new replication connection (the source's ``repl``), which
        exports its snapshot: (the slot's consistent point, the snapshot's name). The
        snapshot can be imported until that connection runs its next command."""
        source = self.source
        slot = source.slot
        if self._slot_exists():
            raise SourceError(
                f"source.slot: replication slot {slot!r} already exists, but this state_dir "
                f"has no record of reading it. Drop it (SELECT pg_drop_replication_slot("
                f"'{slot}')) or name another slot"
            )
        source.repl = self.connect(replication=True)
        source.cursor = source.repl.cursor()
        # The exported snapshot shows the catalog exactly as it is at the slot's start,
        # for the schema history, even when no rows are read from it.
        source.cursor.execute(
            f"CREATE_REPLICATION_SLOT {quote(slot)} LOGICAL pgoutput EXPORT_SNAPSHOT"
        )
        _slot, consistent_point, snapshot_name, _plugin = source.cursor.fetchone()
        log.info("created replication slot %s at %s", slot, consistent_point)
        return pg.parse_lsn(consistent_point), snapshot_name

    def start_replication(self, confirmed: int) -> Any:
        """Start replication from the slot (``confirmed``: the position the publisher log
        holds, 0 for the slot's own); the replication cursor."""
        source = self.source
        if source.repl is None:
            source.repl = self.connect(replication=True)
            source.cursor = source.repl.cursor()
        options = {"proto_version": "1", "publication_names": source.publication}
        if source.server_version >= 140000:
            # Logical decoding messages: the watermarks of backfills.
            options["messages"] = "true"
        try:
            source.cursor.start_replication(
                slot_name=source.slot,
                decode=False,
                start_lsn=pg.lsn_text(confirmed) if confirmed else 0,
                options=options,
                status_interval=source.options.status_interval_s,
            )
        except psycopg2.Error as exc:
            text = str(exc).strip()
            if "does not exist" in text:
                self.require_slot()
            raise SourceError(
                f"source: cannot start replication from slot {source.slot}: {text}"
            ) from exc
        return source.cursor

    def published_tables(self) -> list[str]:
        """The publication's tables (``schema.table``), but the heartbeat's."""
        source = self.source
        rows = source._query(
            "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s "
            "ORDER BY 1, 2",
            (source.publication,),
        )
        heartbeat = source.options.heartbeat_tables
        return [f"{s}.{n}" for s, n in rows if f"{s}.{n}" not in heartbeat]

    # --------------------------------------------------------------- --once
    def end_marker(self) -> int:
        """Write the end marker; its LSN.

        The server's WAL positions alone do not do: with ``synchronous_commit`` off, a
        COMMIT returns once its record is in the WAL buffers, before it is written, so
        ``pg_current_wal_lsn()`` (the write position) can be short of a transaction the
        client saw committed; ``pg_current_wal_insert_lsn()`` includes it, but the stream
        sees only flushed WAL, and at a page boundary that position lies past the page
        header, where no record ends until something more is written.

        The marker is an empty transactional logical decoding message under the source's
        end prefix, in a savepoint that is rolled back, in a transaction committed with
        ``synchronous_commit`` on. Its LSN (the end of its record) comes after the commit of
        every transaction committed before it; the commit (the transaction has an xid from
        the message) flushes the WAL past it, so the stream decodes all of them, and then
        the commit, whether or not anything is written after it. Rolled back, the message
        reaches no reader of the WAL (this source, another pipeline, Debezium), and the
        transaction has no change: pgoutput sends it as an empty transaction, or from
        PostgreSQL 15 on skips it and moves the position it reports past it.
        """
        conn = None
        # The prefix is this slot's own (never decoded: rolled back).
        prefix = f"wormhole.end.{self.source.slot}"
        try:
            # Its own connection: during a snapshot, the source's holds the snapshot.
            conn = self.connect()
            with conn.cursor() as cur:
                cur.execute("SET synchronous_commit TO on")
                cur.execute("BEGIN")
                cur.execute("SAVEPOINT wormhole_end")
                cur.execute("SELECT pg_logical_emit_message(true, %s, '')::text", (prefix,))
                (lsn,) = cur.fetchone()
                cur.execute("ROLLBACK TO SAVEPOINT wormhole_end")
                cur.execute("COMMIT")
        except psycopg2.Error as exc:
            hint = (
                "grant EXECUTE on the function pg_logical_emit_message to the DSN's user "
                "(PUBLIC has it unless it was revoked)"
                if exc.pgcode == "42501"
                else "check that the DSN names the primary server (a standby cannot write WAL)"
            )
            raise SourceError(
                f"source: run --once marks the end it reads to with a logical decoding "
                f"message, and writing it failed ({first_line(exc)}); {hint}"
            ) from exc
        finally:
            close_quietly(conn)
        return pg.parse_lsn(lsn)

    # ----------------------------------------------------- heartbeat and lag
    def heartbeat(self) -> None:
        """Write the heartbeat table's row, every ``heartbeat.interval_s``."""
        options = self.source.options
        heartbeat = options.heartbeat
        if heartbeat is None:
            return
        now = time.monotonic()
        if now - self.last_heartbeat < heartbeat.interval_s:
            return
        self.last_heartbeat = now
        try:
            if self.heartbeat_conn is None:
                self.heartbeat_conn = psycopg2.connect(options.dsn)
                self.heartbeat_conn.autocommit = True
            with self.heartbeat_conn.cursor() as cur:
                cur.execute(
                    f"CREATE TABLE IF NOT EXISTS {qualified(heartbeat.table)} "
                    f"(id int PRIMARY KEY, ts timestamptz NOT NULL)"
                )
                cur.execute(
                    f"INSERT INTO {qualified(heartbeat.table)} VALUES (1, now()) "
                    f"ON CONFLICT (id) DO UPDATE SET ts = excluded.ts"
                )
        except psycopg2.Error as exc:
            log.warning("heartbeat write to %s failed: %s", heartbeat.table, str(exc).strip())
            self.heartbeat_conn = None

    def lag(self) -> dict[str, float]:
        """For metrics (called at scrape time, from another thread): ``lag_bytes``, WAL
        between the server's current position and what the publisher log holds (the
        stream's ``confirmed``); ``retained_bytes``, WAL the slot keeps on the server (from
        its ``restart_lsn``)."""
        source = self.source
        with self.lag_lock:
            try:
                if self.lag_conn is None:
                    self.lag_conn = psycopg2.connect(
                        source.options.dsn,
                        connect_timeout=5,
                        options="-c statement_timeout=5000",
                    )
                    self.lag_conn.autocommit = True
                with self.lag_conn.cursor() as cur:
                    cur.execute(
                        "SELECT pg_current_wal_lsn()::text, confirmed_flush_lsn::text, "
                        "restart_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                        (source.slot,),
                    )
                    row = cur.fetchone()
            except psycopg2.Error:
                close_quietly(self.lag_conn)
                self.lag_conn = None
                raise
        if row is None:
            return {}
        current = pg.parse_lsn(row[0])
        confirmed = max(source.stream.confirmed, pg.parse_lsn(row[1]) if row[1] else 0)
        restart = pg.parse_lsn(row[2]) if row[2] else current
        return {
            "lag_bytes": float(max(0, current - confirmed)),
            "retained_bytes": float(max(0, current - restart)),
        }

    def close(self, *connections: Any) -> None:
        """Close ``connections`` (the source's), then the heartbeat's and the lag's."""
        with self.lag_lock:
            close_quietly(*connections, self.heartbeat_conn, self.lag_conn)
            self.lag_conn = None
