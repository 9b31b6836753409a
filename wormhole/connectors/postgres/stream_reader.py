"""The replication connection's pgoutput messages, as typed messages.

:class:`StreamReader` reads the messages the server sends and decodes each into one of the
message classes below (by its first byte, the message type of "Logical Replication Message
Formats"); the stream (:mod:`stream`) dispatches on their classes. A change's rows are
decoded only when they are wanted (:func:`pgoutput.parse_change`): a change emitted before
a restart is skipped undecoded. Message types the source has no use for (``Y``, a type) are
read and dropped here. The messages are msgspec structs (made in C, without a ``__init__``
in Python: one for each change) that hold no reference cycles, so the garbage collector
does not track them.
"""

from __future__ import annotations

import select
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from wormhole.connectors.postgres import pgoutput as pg


class Begin(msgspec.Struct, gc=False):
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


class Commit(msgspec.Struct, gc=False):
    """``C``: the transaction commits."""

    end_lsn: int
    """The end of its commit record."""
    wal: int


class Change(msgspec.Struct, gc=False):
    """``I``, ``U`` or ``D``: a row inserted, updated or deleted."""

    data: bytes
    """The message, whose rows :func:`pgoutput.parse_change` decodes."""
    wal: int


class Truncate(msgspec.Struct, gc=False):
    """``T``: tables truncated."""

    oids: list[int]
    wal: int


class RelationMessage(msgspec.Struct, gc=False):
    """``R``: a table's columns and replica identity, before its first change (again after
    each change of them)."""

    relation: pg.Relation


class Origin(msgspec.Struct, gc=False):
    """``O``: the transaction was replicated from another server."""

    lsn: int
    """Its commit LSN on the origin server."""


class LogicalMessage(msgspec.Struct, gc=False):
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
        """A message read when a batch was full: :meth:`messages` gives it first."""

    def messages(self) -> Iterator[Message | None]:
        """The messages as they arrive, None each time none has (a message held comes
        first)."""
        read = self.cursor.read_message
        decoders = _DECODERS
        while True:
            held = self.held
            if held is not None:
                self.held = None
                yield held
                continue
            raw = read()
            if raw is None:
                yield None
                continue
            data = raw.payload
            decoder = decoders.get(data[0])
            if decoder is not None:
                yield decoder(data, raw.data_start)

    def hold(self, message: Message) -> None:
        """Give ``message`` again, first."""
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
