"""The publisher log and the datamarker store, for a transport that reads the log itself
(spec ``reads_log``): the hub answers these calls of the
:class:`~wormhole.plugins.components.PublisherView` with a :class:`LogAccess`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wormhole.core.publisher_log import LogReader, PublisherLog
from wormhole.core.update import Update
from wormhole.plugins.components import Datamarker, DatamarkerStore

if TYPE_CHECKING:
    from wormhole.core.hub import Hub


class LogAccess:
    """The hub's publisher log and datamarker store (set by the publisher before the
    transport starts)."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    def _log(self) -> PublisherLog:
        publisher_log = self.hub.publisher_log
        assert publisher_log is not None, "the publisher sets the log before the transport starts"
        return publisher_log

    def _store(self) -> DatamarkerStore:
        assert self.hub.store is not None, (
            "the publisher sets the store before the transport starts"
        )
        return self.hub.store

    def log_range(self) -> tuple[int, int]:
        publisher_log = self._log()
        return publisher_log.first_seq, publisher_log.next_seq

    def read_log(self, position: int, row_type: type[Any] = Update) -> LogReader:
        return self._log().reader(position, row_type)

    def wait_for_log(self, position: int, timeout: float) -> bool:
        return self._log().wait_for(position, timeout)

    def stored_datamarkers(self) -> dict[tuple[str, int], Datamarker]:
        return self._store().load()

    def store_datamarkers(
        self, datamarkers: list[Datamarker], meta: dict[str, str] | None = None
    ) -> None:
        publisher_log, store = self._log(), self._store()
        if not publisher_log.fsync:
            # Datamarkers must never be on disk ahead of the data they point past.
            publisher_log.sync()
        store.save(datamarkers)
        for key, value in (meta or {}).items():
            store.set_meta(key, value)

    def stored_meta(self, key: str) -> str | None:
        return self._store().get_meta(key)


__all__ = ["LogAccess"]
