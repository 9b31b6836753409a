"""The registry's thread: what kazoo tells, handled off kazoo's threads.

kazoo's connection listener must not block, and neither may its watch callbacks; both
hand their work to the :class:`Dispatcher`'s thread, which

- tells :meth:`Dispatcher.watch_connection` watchers when the connection is interrupted
  (``SUSPENDED``, ``LOST``) and back (``CONNECTED``), each change once and in order;
- after a reconnect (and whenever a write was put off, :meth:`Dispatcher.resync_later`)
  calls the resync hooks, which register this process's nodes again;
- refreshes watches (:mod:`wormhole.connectors.zookeeper.watches`): a fired watch is read
  again, and every watch is read again (and its function called) after a reconnect. A
  watch that fails while connected is tried again after a pause.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from wormhole.connectors.zookeeper.watches import ConnectionWatch, Watch

if TYPE_CHECKING:
    from wormhole.connectors.zookeeper.session import Session

log = logging.getLogger("wormhole.zookeeper")

T = TypeVar("T")


class Dispatcher:
    """The registry's thread, and the watches and connection watchers it serves."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.resync_hooks: list[Callable[[int | None], None]] = []
        """Called with the session id when registrations must be made again (after a
        reconnect, or a write put off)."""
        self._cond = threading.Condition()
        self._watches: list[Watch[Any]] = []
        self._pending: dict[int, Watch[Any]] = {}
        self._reconnected = False
        self._resync = False
        self._thread: threading.Thread | None = None
        self._connection_watchers: list[ConnectionWatch] = []
        self._connection_lock = threading.Lock()
        """Held while calling connection watchers, so they hear every change in order."""
        self._connection_events: list[bool] = []

    def first_connection(self) -> None:
        """Connected for the first time: nothing to register again."""
        with self._cond:
            self._reconnected = False

    def start(self, name: str) -> None:
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """The session is closing: the thread ends."""
        with self._cond:
            self._cond.notify_all()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    # ------------------------------------------------- from kazoo's listener
    def connection_changed(self, connected: bool) -> None:
        """From kazoo's listener (must not block): the thread tells the watchers, and
        after a reconnect registers and reads everything again."""
        with self._cond:
            if connected:
                self._reconnected = True
            self._connection_events.append(connected)
            self._cond.notify_all()

    # ---------------------------------------------------------------- watches
    def watch(
        self, what: str, read: Callable[[Callable[[Any], None]], T], fn: Callable[[T], None]
    ) -> Callable[[], None]:
        """Call ``fn`` with ``read(watch)`` now and whenever a watch ``read`` set fires and
        the value changed (and after every reconnect), until the function returned is
        called: it ends the watch (a ZooKeeper watch still armed then fires into nothing)."""
        session = self.session
        watch = Watch(what, read, fn, self._schedule)
        with self._cond:
            self._watches.append(watch)
        try:
            if not session.connected.is_set():
                raise session.unreachable_error("not connected")
            watch.refresh()
        except session.errors() as exc:
            log.warning(
                "cannot read %s from ZooKeeper at %s now (%s); the watch starts once it "
                "is reachable",
                what,
                session.options.hosts,
                type(exc).__name__,
            )
            self._schedule(watch)
        return lambda: self._unwatch(watch)

    def _unwatch(self, watch: Watch[Any]) -> None:
        watch.stop()
        with self._cond:
            if watch in self._watches:
                self._watches.remove(watch)
            self._pending.pop(id(watch), None)

    def watched(self) -> int:
        """How many watches are kept (each refreshed after every reconnect)."""
        with self._cond:
            return len(self._watches)

    def watch_connection(self, fn: Callable[[bool], None]) -> None:
        watcher = ConnectionWatch(fn)
        with self._connection_lock:
            self._connection_watchers.append(watcher)
            if self.session.connected.is_set():
                watcher.tell(True)

    def _schedule(self, watch: Watch[Any]) -> None:
        with self._cond:
            self._pending[id(watch)] = watch
            self._cond.notify_all()

    def resync_later(self) -> None:
        """A registration could not be written now: the thread tries again."""
        with self._cond:
            self._resync = True
            self._cond.notify_all()

    # ----------------------------------------------------------------- thread
    def _tell_connection(self, events: list[bool]) -> None:
        with self._connection_lock:
            for connected in events:
                for watcher in list(self._connection_watchers):
                    watcher.tell(connected)

    def _resync_now(self) -> bool:
        """Call the resync hooks; False if they must be tried again."""
        session = self.session
        sid = session.session_id()
        try:
            for hook in self.resync_hooks:
                if session.closed:
                    return True
                hook(sid)
        except session.errors() as exc:
            log.debug("registering again interrupted: %r", exc)
            return False
        except Exception:
            log.exception("registering again in %s failed", session.describe())
            return False
        return True

    def _next(self, backlog: list[Watch[Any]], pause: bool) -> list[bool] | None:
        """Wait for something to do; the connection events to tell (None: closed)."""
        with self._cond:
            if pause:
                self._cond.wait(timeout=1.0)
            while not (
                self.session.closed
                or self._reconnected
                or self._resync
                or self._pending
                or self._connection_events
            ):
                if not self._cond.wait(timeout=1.0 if backlog else None):
                    break
            if self.session.closed:
                return None
            events, self._connection_events = self._connection_events, []
            return events

    def _run(self) -> None:
        session = self.session
        errors = session.errors()
        backlog: list[Watch[Any]] = []  # failed while connected: again after a pause
        pause = False
        while True:
            events = self._next(backlog, pause)
            pause = False
            if events is None:
                return
            if events:
                self._tell_connection(events)
            with self._cond:
                if session.closed:
                    return
                if not session.connected.is_set():
                    # Everything is registered and read again on CONNECTED.
                    self._reconnected = self._resync = False
                    self._pending.clear()
                    backlog = []
                    continue
                reconnected = self._reconnected
                resync = self._resync or reconnected
                self._reconnected = self._resync = False
                if reconnected:
                    watches = list(self._watches)
                else:
                    watches = list(self._pending.values())
                    watches += [w for w in backlog if w not in watches]
                self._pending.clear()
                backlog = []
            if resync and not self._resync_now():
                self._resync = pause = True
            for watch in watches:
                if session.closed:
                    return
                try:
                    watch.refresh(force=reconnected)
                except errors as exc:
                    log.debug("watch of %s interrupted: %r", watch.what, exc)
                    backlog.append(watch)
                except Exception:
                    log.exception("watch of %s failed", watch.what)
                    backlog.append(watch)
