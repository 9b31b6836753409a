"""A publisher's log read from another machine (a transport's ``remote_log``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from wormhole.core.errors import StateError
from wormhole.core.update import Update, UpdateColumns


@dataclass(frozen=True)
class LogPositions:
    """A publisher log's extent and an external application's datamarkers in it."""

    first: int
    """The oldest retained seq."""
    end: int
    """The seq after the last update."""
    datamarkers: dict[int, int]
    """The application's stored datamarkers, by shard (a shard without one: ``first``)."""
    shards: int
    datastore: str


class RemoteLog(Protocol):
    """A publisher's log, read from another machine by an external application."""

    def positions(self) -> LogPositions: ...

    def read(self, shard: int, start: int, end: int) -> Iterator[tuple[list[int], list[Update]]]:
        """Every update of ``shard`` with ``start <= seq < end``, in order, in chunks as they
        arrive: ``(seqs, updates)``, ``seqs[i]`` the seq of ``updates[i]``. A range no
        longer retained raises :class:`RemoteLogError` naming it."""

    def commit(self, datamarkers: dict[int, int]) -> dict[int, int]:
        """Store the application's datamarkers durably at the publisher (it keeps the log
        from them on); returns them as stored (a datamarker never moves back)."""

    def close(self) -> None: ...


@runtime_checkable
class ColumnarRemoteLog(RemoteLog, Protocol):
    """A remote log that can also hand a range over a column at a time: a reader that
    builds columns (the Spark source builds Arrow record batches) then does not decode
    each update. Optional: readers fall back to :meth:`RemoteLog.read`."""

    def read_columns(self, shard: int, start: int, end: int) -> Iterator[UpdateColumns]:
        """What :meth:`RemoteLog.read` returns, as :class:`UpdateColumns` chunks."""


class RemoteLogError(StateError):
    """A remote log refused a request, or could not be reached; the message says why."""
