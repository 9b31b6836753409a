"""The replication connection's pgoutput messages, as typed messages.

:class:`StreamReader` reads the messages the server sends and decodes each into one of the
message classes below (by its first byte, the message type of "Logical Replication Message
Formats"); the stream (:mod:`stream`) dispatches on their classes. A change's rows are
decoded only when they are wanted (:meth:`Change.decode`): a change emitted before a
restart is skipped undecoded. Message types the source has no use for (``Y``, a type) are
read and dropped here.
"""

from __future__ import annotations

import select
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from wormhole.connectors.postgres import pgoutput as pg


@dataclass(slots=True)
class Begin:
    """``B``: a transaction begins."""

    final_lsn: int
    """Its commit LSN."""
    ts_ms: int
    """Its commit time, Unix milliseconds."""
    xid: int
    commit_us: int
    """Its commit time, Unix microseconds."""
    wal: int
    """The message's own WAL position."""


@dataclass(slots=True)
class Commit:
    """``C``: the transaction commits."""

    end_lsn: int
    """The end of its commit record."""
    wal: int


@dataclass(slots=True)
class Change:
    """``I``, ``U`` or ``D``: a row inserted, updated or deleted."""

    data: bytes
    wal: int

    def decode(
        self, relations: dict[int, pg.Relation], bad: list[tuple[str, bytes]]
    ) -> tuple[str, pg.Relation, dict[str, Any] | None, dict[str, Any] | None, list[str], bool]:
        """(op, relation, before, after, unchanged, full_before): see
        :func:`pgoutput.parse_change`."""
        return pg.parse_change(self.data, relations, bad)


@dataclass(slots=True)
class Truncate:
    """``T``: tables truncated."""

    oids: list[int]
    wal: int


@dataclass(slots=True)
class RelationMessage:
    """``R``: a table's columns and replica identity, before its first change (again after
    each change of them)."""

    relation: pg.Relation


@dataclass(slots=True)
class Origin:
    """``O``: the transaction was replicated from another server."""

    lsn: int
    """Its commit LSN on the origin server."""


@dataclass(slots=True)
class LogicalMessage:
    """``M``: a logical decoding message (``pg_logical_emit_message``)."""

    transactional: bool
    prefix: str
    content: bytes


Message = Begin | Commit | Change | Truncate | RelationMessage | Origin | LogicalMessage


def _begin(data: bytes, wal: int) -> Begin:
    final_lsn, ts_ms, xid = pg.parse_begin(data)
    return Begin(final_lsn, ts_ms, xid, pg.parse_begin_us(data), wal)


def _commit(data: bytes, wal: int) -> Commit:
    _commit_lsn, end_lsn, _ts = pg.parse_commit(data)
    return Commit(end_lsn, wal)


def _truncate(data: bytes, wal: int) -> Truncate:
    return Truncate(pg.parse_truncate(data), wal)


def _relation(data: bytes, wal: int) -> RelationMessage:
    return RelationMessage(pg.parse_relation(data))


def _origin(data: bytes, wal: int) -> Origin:
    lsn, _name = pg.parse_origin(data)
    return Origin(lsn)


def _message(data: bytes, wal: int) -> LogicalMessage:
    return LogicalMessage(*pg.parse_message(data))


_DECODERS: dict[int, Callable[[bytes, int], Message]] = {
    ord("B"): _begin,
    ord("C"): _commit,
    ord("I"): Change,
    ord("U"): Change,
    ord("D"): Change,
    ord("T"): _truncate,
    ord("R"): _relation,
    ord("O"): _origin,
    ord("M"): _message,
}
"""Message type -> its decoder (payload, the message's WAL position)."""


class StreamReader:
    """The typed messages of a replication cursor (psycopg2's, after
    ``start_replication(decode=False)``); a new one for each start of replication."""

    def __init__(self, cursor: Any) -> None:
        self.cursor = cursor
        self.held: Message | None = None
        """A message read when a batch was full: :meth:`next` returns it first."""

    def next(self) -> Message | None:
        """The next message, or None when none has arrived."""
        held = self.held
        if held is not None:
            self.held = None
            return held
        read = self.cursor.read_message
        decoders = _DECODERS
        while True:
            raw = read()
            if raw is None:
                return None
            data = raw.payload
            decoder = decoders.get(data[0])
            if decoder is not None:
                return decoder(data, raw.data_start)

    def hold(self, message: Message) -> None:
        """Return ``message`` again from the next :meth:`next`."""
        self.held = message

    def feedback(self, flush_lsn: int) -> None:
        """Record the position the slot may be confirmed to (psycopg2 reports it every
        ``status_interval``)."""
        self.cursor.send_feedback(flush_lsn=flush_lsn)

    @property
    def wal_end(self) -> int:
        """The server's WAL end as its last message or keepalive said (0: not known yet)."""
        wal_end: int = self.cursor.wal_end
        return wal_end

    def wait(self, timeout: float) -> None:
        """Until a message may have arrived, or ``timeout`` seconds."""
        select.select([self.cursor], [], [], timeout)
