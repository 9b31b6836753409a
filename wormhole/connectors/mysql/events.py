"""The binlog as the ``mysql`` source reads it: a :class:`BinlogReader` from a position (a
file and offset, or a GTID state), yielding one typed message per binlog event that matters.

The messages say what an event means to the stream, whatever the server (MariaDB or MySQL)
and whichever event carries it: a transaction :class:`Begin` (a GTID event), a
:class:`BeginQuery` (MySQL's ``BEGIN``), a :class:`Commit` (an XID event, or a ``COMMIT`` or
``ROLLBACK`` statement), another :class:`Statement` (DDL, or a savepoint's inside a
transaction), a :class:`TableMap`, the :class:`Rows` of a table, a :class:`Rotate` to
another file, a :class:`Heartbeat`. Events that mean nothing to the stream (``XA``
statements, events the binlog library does not decode) yield nothing; a compressed event,
which the source cannot read, is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from wormhole.connectors.mysql.charsets import keep_member_bytes
from wormhole.connectors.mysql.position import BinlogPosition, file_number
from wormhole.connectors.mysql.server import COMPRESS_FIX
from wormhole.core.errors import SourceError

try:  # optional dependency: the `mysql` extra
    import pymysql
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
    HAVE_REPLICATION = True
except ImportError:  # pragma: no cover - reported at open()
    HAVE_REPLICATION = False

# MariaDB's QUERY_COMPRESSED_EVENT and the compressed rows events, v1 and v2 (log_bin_compress).
COMPRESSED_EVENTS = frozenset(range(165, 172))


@dataclass(slots=True)
class Begin:
    """A transaction starts (its GTID event)."""

    gtid: str
    """MariaDB's ``domain-server-sequence``, MySQL's ``uuid:sequence``."""
    domain: int
    """MariaDB's GTID domain (0 on MySQL)."""
    seq: int
    """MariaDB's sequence number (0 on MySQL)."""
    began: bool
    """The transaction is begun already: MariaDB writes no ``BEGIN`` (a group is
    transactional unless flagged standalone); MySQL writes a :class:`BeginQuery`."""
    file: str
    offset: int
    """Where the GTID event starts in ``file``."""
    ts_ms: int
    """When the transaction was written (whole seconds)."""


@dataclass(slots=True)
class BeginQuery:
    """A ``BEGIN`` statement: the transaction of the GTID before it is a transaction."""


@dataclass(slots=True)
class Commit:
    """A transaction ends (an XID event, a ``COMMIT`` or a ``ROLLBACK``)."""

    file: str
    pos: int
    """Where the binlog stands after it."""


@dataclass(slots=True)
class Statement:
    """Any other statement: DDL (a transaction of its own), or inside a transaction
    ``SAVEPOINT``, ``ROLLBACK TO``, ``RELEASE SAVEPOINT``."""

    query: str
    schema: Any
    """The statement's default database (bytes or str, as the event has it)."""
    file: str
    pos: int
    """Where the binlog stands after it."""


@dataclass(slots=True)
class TableMap:
    """A table map: the table id, name and column layout of the rows events after it."""

    event: Any


@dataclass(slots=True)
class Rows:
    """Rows of a table written (op ``c``), updated (``u``) or deleted (``d``)."""

    op: str
    schema: str
    table: str
    event: Any
    """The rows event (decoded by the table maps, from its bytes)."""
    file: str
    """The binlog file it is in."""


@dataclass(slots=True)
class Rotate:
    """The binlog goes on in another file (or the reader reconnected and starts over)."""


@dataclass(slots=True)
class Heartbeat:
    """The server has nothing more to send for now."""

    file: str
    pos: int
    """Where the binlog stands."""


Message = Begin | BeginQuery | Commit | Statement | TableMap | Rows | Rotate | Heartbeat


def _connect_for_replication(**settings: Any) -> Any:
    """``pymysql.connect`` for the replication library, which names its control
    connection's database ``db``: PyMySQL deprecates that name for ``database``."""
    if "db" in settings:
        settings["database"] = settings.pop("db")
    return pymysql.connect(**settings)


class BinlogReader:
    """The server's binlog after ``start`` (by GTID with ``by_gtid``: MariaDB's GTID state
    ``start.gtid_state``), registered as replica ``reader_id``."""

    def __init__(
        self,
        settings: dict[str, Any],
        reader_id: int,
        heartbeat_s: float,
        start: BinlogPosition,
        by_gtid: bool,
    ) -> None:
        where: dict[str, Any]
        if by_gtid:
            where = {"auto_position": start.gtid_state, "is_mariadb": True}
        else:
            where = {"log_file": start.file, "log_pos": start.pos, "resume_stream": True}
        settings = dict(settings)
        settings["read_timeout"] = max(30.0, heartbeat_s * 10)
        self.stream = BinLogStreamReader(
            connection_settings=settings,
            server_id=reader_id,
            blocking=True,
            only_events=list(_MESSAGES),
            filter_non_implemented_events=False,
            slave_heartbeat=heartbeat_s,
            enable_logging=False,
            pymysql_wrapper=_connect_for_replication,
            **where,
        )

    def messages(self) -> Iterator[Message]:
        """The binlog's messages, as the server sends them (blocking); raises ``EOFError``
        when the server ends the stream."""
        stream = self.stream
        fetch = stream.fetchone
        translate = _MESSAGES
        while True:
            event = fetch()
            if event is None:  # the stream ended (not blocking): reconnect
                raise EOFError("the server closed the binlog stream")
            message = translate[type(event)](event, stream)
            if message is not None:
                yield message

    def at(self) -> str:
        """Where the reader stands (``file:offset``), for messages."""
        return f"{self.stream.log_file}:{self.stream.log_pos}"

    def reached(self, file: str, pos: int) -> bool:
        """Whether the reader stands at ``file:pos`` or after it."""
        stream = self.stream
        here = (file_number(stream.log_file or ""), int(stream.log_pos or 0))
        return here >= (file_number(file), int(pos))

    def close(self) -> None:
        self.stream.close()


def _offset(event: Any) -> int:
    packet = event.packet
    return int(packet.log_pos - packet.event_size)


def _mariadb_gtid(event: Any, stream: Any) -> Begin:
    return Begin(
        event.gtid,
        event.domain_id,
        event.gtid_seq_no,
        not (event.flags & 1),
        stream.log_file,
        _offset(event),
        int(event.timestamp) * 1000,
    )


def _mysql_gtid(event: Any, stream: Any) -> Begin:
    return Begin(
        str(event.gtid), 0, 0, False, stream.log_file, _offset(event), int(event.timestamp) * 1000
    )


def _query(event: Any, stream: Any) -> Message | None:
    query = event.query.strip() if isinstance(event.query, str) else ""
    upper = query[:12].upper()
    if upper.startswith("BEGIN"):
        return BeginQuery()
    if upper.startswith("XA "):
        return None
    if upper.startswith("COMMIT") or upper == "ROLLBACK":
        return Commit(stream.log_file, stream.log_pos)
    return Statement(query, event.schema, stream.log_file, stream.log_pos)


def _not_implemented(event: Any, stream: Any) -> None:
    if event.event_type in COMPRESSED_EVENTS:
        raise SourceError(
            f"source: the binlog holds a compressed event at "
            f"{stream.log_file}:{_offset(event)} (type "
            f"{event.event_type}): the server writes compressed events "
            f"(log_bin_compress=ON), which the source cannot read, and skipping it "
            f"would lose its changes. {COMPRESS_FIX}, then start the source after "
            f"this binlog position (a new state_dir with a snapshot, or a backfill "
            f"of the tables written while it was on)"
        )


_MESSAGES: dict[type, Callable[[Any, Any], Message | None]] = (
    {
        WriteRowsEvent: lambda e, s: Rows("c", e.schema, e.table, e, s.log_file),
        UpdateRowsEvent: lambda e, s: Rows("u", e.schema, e.table, e, s.log_file),
        DeleteRowsEvent: lambda e, s: Rows("d", e.schema, e.table, e, s.log_file),
        TableMapEvent: lambda e, s: TableMap(e),
        XidEvent: lambda e, s: Commit(s.log_file, s.log_pos),
        MariadbGtidEvent: _mariadb_gtid,
        GtidEvent: _mysql_gtid,
        QueryEvent: _query,
        RotateEvent: lambda e, s: Rotate(),
        HeartbeatLogEvent: lambda e, s: Heartbeat(s.log_file, s.log_pos),
        # Events the library does not decode: compressed ones must not pass unseen.
        NotImplementedEvent: _not_implemented,
    }
    if HAVE_REPLICATION
    else {}
)
"""What each binlog event the reader asks for means to the stream (None: nothing)."""
