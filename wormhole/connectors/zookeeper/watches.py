"""Watches as the registry gives them to its callers: a function called with a value read
from ZooKeeper, once when set and again when the value changes.

A :class:`Watch` pairs a read (which arms plain ZooKeeper watches on what it reads) with
the caller's function. When one of those ZooKeeper watches fires, on a kazoo thread, the
watch is only scheduled; the session's thread reads the value again, arms the watches
again and calls the function if the value changed, or always after a reconnect. So a
caller never runs on kazoo's event thread, and a value made of several nodes (the
publishers and each one's entry, an application's subscribers) is read as one.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

log = logging.getLogger("wormhole.zookeeper")

T = TypeVar("T")

_UNSET: Any = object()


class Watch(Generic[T]):
    """One watcher's function, the read behind it, and the last value it was given."""

    def __init__(
        self,
        what: str,
        read: Callable[[Callable[[Any], None]], T],
        fn: Callable[[T], None],
        schedule: Callable[[Watch[Any]], None],
    ) -> None:
        self.what = what
        self.read = read
        self.fn = fn
        self.schedule = schedule
        self.lock = threading.Lock()
        self.last: Any = _UNSET
        self.stopped = False

    def stop(self) -> None:
        """End the watch: once this returns, ``fn`` is not called again."""
        with self.lock:
            self.stopped = True

    def trigger(self, event: Any = None) -> None:
        """A ZooKeeper watch fired (a kazoo thread): refresh from the session's thread."""
        if not self.stopped:
            self.schedule(self)

    def refresh(self, force: bool = False) -> None:
        with self.lock:
            if self.stopped:
                return
            value = self.read(self.trigger)
            if not force and value == self.last:
                return
            self.last = value
            try:
                self.fn(copy.deepcopy(value))
            except Exception:
                log.exception("a watcher of %s failed", self.what)


class ConnectionWatch:
    """A watcher of the connection, told each change once."""

    def __init__(self, fn: Callable[[bool], None]) -> None:
        self.fn = fn
        self.last: bool | None = None
        """What it was last told (None: nothing yet)."""

    def tell(self, connected: bool) -> None:
        if self.last == connected:
            return
        self.last = connected
        try:
            self.fn(connected)
        except Exception:
            log.exception("a watcher of the registry connection failed")
