"""The connection to ZooKeeper: one kazoo client, its session, and the registry's thread.

kazoo's connection listener must not block, and neither may its watch callbacks; both
hand their work to one thread of the registry's (:meth:`Session._run`), which

- tells :meth:`Session.watch_connection` watchers when the connection is interrupted
  (``SUSPENDED``, ``LOST``) and back (``CONNECTED``), in order;
- after a reconnect (and whenever a write was put off, :meth:`Session.resync_later`) calls
  the resync hooks, which register this process's nodes again;
- refreshes watches (:mod:`wormhole.connectors.zookeeper.watches`): a fired watch is read
  again, and every watch is read again (and its function called) after a reconnect.

A session that expires (``LOST``) counts in :attr:`Session.expiries` and calls the expiry
hooks at once (serving claims went with it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from wormhole.connectors.zookeeper.options import ZooKeeperOptions
from wormhole.connectors.zookeeper.watches import ConnectionWatch, Watch
from wormhole.core.errors import ConfigError, StateError, Stopped

log = logging.getLogger("wormhole.zookeeper")

T = TypeVar("T")


class Session:
    """A kazoo client for one registry, the operations on it, and its thread."""

    def __init__(self, options: ZooKeeperOptions) -> None:
        self.options = options
        self.client: Any = None
        self.connected = threading.Event()
        self.closed = False
        self.expiries = 0
        """Sessions of this process that expired."""
        self.resync_hooks: list[Callable[[int | None], None]] = []
        """Called from the thread with the session id when registrations must be made
        again (after a reconnect, or a write put off)."""
        self.expiry_hooks: list[Callable[[], None]] = []
        """Called from kazoo's listener when the session expired: must not block."""
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

    # ------------------------------------------------------------- lifecycle
    def describe(self) -> str:
        return f"zookeeper {self.options.hosts}{self.options.root.rstrip('/')}"

    def unreachable(self) -> str:
        return f"is ZooKeeper running at {self.options.hosts}? check registry.hosts"

    def connect(self, stop: threading.Event) -> None:
        """Start the client and wait until it is connected (StateError after
        ``connect_timeout_s``, Stopped once ``stop`` is set)."""
        from kazoo.client import KazooClient
        from kazoo.retry import KazooRetry

        hosts = self.options.hosts
        try:
            client = KazooClient(
                hosts=hosts,
                timeout=self.options.session_timeout_ms / 1000,
                connection_retry=KazooRetry(max_tries=-1, delay=0.1, max_delay=2.0),
            )
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"registry.hosts {hosts!r}: {exc}") from None
        self.client = client
        client.add_listener(self._on_state)
        client.start_async()
        started = time.monotonic()
        deadline = started + self.options.connect_timeout_s
        next_warning = started + 1.0
        while not self.connected.wait(0.1):
            now = time.monotonic()
            if stop.is_set() or now >= deadline:
                self.client = None
                client.remove_listener(self._on_state)
                client.stop()
                client.close()
                if stop.is_set():
                    raise Stopped(f"stopped while connecting to the registry, ZooKeeper at {hosts}")
                raise StateError(
                    f"cannot connect to the registry, ZooKeeper at {hosts} (no answer within "
                    f"{self.options.connect_timeout_s:g}s): {self.unreachable()}"
                )
            if now >= next_warning:
                log.warning(
                    "cannot reach ZooKeeper at %s yet; retrying (%.0fs left)",
                    hosts,
                    deadline - now,
                )
                next_warning = now + min(5.0, 2 * (now - started))
        with self._cond:
            self._reconnected = False  # the first connection: nothing to register again

    def start_thread(self, name: str) -> None:
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def begin_close(self) -> bool:
        """Mark the session closed and wake the thread; False if it was closed already."""
        if self.closed:
            return False
        self.closed = True
        with self._cond:
            self._cond.notify_all()
        return True

    def finish_close(self) -> None:
        """Wait for the thread, then stop and close the client."""
        client = self.client
        if client is None:
            return
        if self._thread is not None:
            self._thread.join(timeout=self.options.session_timeout_ms / 1000 + 1)
        client.remove_listener(self._on_state)
        try:
            client.stop()
        finally:
            client.close()
            self.client = None

    # ----------------------------------------------------------- operations
    def errors(self) -> tuple[type[BaseException], ...]:
        """The errors that mean ZooKeeper cannot be reached (retry once connected)."""
        from kazoo.exceptions import (
            ConnectionClosedError,
            ConnectionLoss,
            OperationTimeoutError,
            SessionExpiredError,
        )

        return (
            ConnectionLoss,
            ConnectionClosedError,
            OperationTimeoutError,
            SessionExpiredError,
            self.client.handler.timeout_exception,
        )

    def unreachable_error(self, message: str) -> BaseException:
        """The first of :meth:`errors`, for an operation not tried while disconnected."""
        return self.errors()[0](message)

    def do(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """``client.<method>(...)``, waiting at most ``timeout`` for the answer (a request
        queued while disconnected may otherwise never be answered)."""
        client = self.client
        if client is None:
            from kazoo.exceptions import ConnectionClosedError

            raise ConnectionClosedError("the registry is closed")
        result = getattr(client, f"{method}_async")(*args, **kwargs)
        wait = timeout if timeout is not None else self.options.session_timeout_ms / 1000
        return result.get(timeout=wait)

    def commit(self, transaction: Any, timeout: float | None = None) -> list[Any]:
        """Commit a kazoo ``TransactionRequest``: each operation's result (an exception
        for a failed one, ``RolledBackError`` for the others)."""
        wait = timeout if timeout is not None else self.options.session_timeout_ms / 1000
        results: list[Any] = transaction.commit_async().get(timeout=wait)
        return results

    def retrying(self, what: str, op: Callable[[], T], stop: threading.Event | None = None) -> T:
        """``op()``, again while ZooKeeper cannot be reached, up to ``connect_timeout_s``;
        then StateError (Stopped once ``stop`` is set)."""
        deadline = time.monotonic() + self.options.connect_timeout_s
        errors = self.errors()
        while True:
            if self.closed:
                raise StateError(f"cannot {what}: the registry ({self.describe()}) is closed")
            if stop is not None and stop.is_set():
                raise Stopped(f"stopped while trying to {what} in {self.describe()}")
            try:
                return op()
            except errors as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StateError(
                        f"cannot {what} in the registry: ZooKeeper at {self.options.hosts} "
                        f"did not answer for {self.options.connect_timeout_s:g}s "
                        f"({type(exc).__name__}): {self.unreachable()}"
                    ) from None
                log.warning(
                    "cannot %s: ZooKeeper at %s unreachable (%s); retrying",
                    what,
                    self.options.hosts,
                    type(exc).__name__,
                )
                self.connected.wait(min(remaining, 1.0))
                if self.connected.is_set():
                    time.sleep(min(0.1, max(remaining, 0)))

    def delete_own(self, path: str, sid: int | None, timeout: float | None = None) -> None:
        """Delete ``path`` if session ``sid`` (this process's) holds it: a node of an
        earlier session may meanwhile be another process's."""
        from kazoo.exceptions import BadVersionError, NoNodeError

        try:
            stat = self.do("exists", path, timeout=timeout)
            if stat is not None and sid is not None and stat.ephemeralOwner == sid:
                self.do("delete", path, version=stat.version, timeout=timeout)
        except (NoNodeError, BadVersionError):
            pass

    def session_id(self) -> int | None:
        client = self.client
        if client is None or not client.client_id:
            return None
        sid: int = client.client_id[0]
        return sid

    # ---------------------------------------------------------------- watches
    def watch(
        self, what: str, read: Callable[[Callable[[Any], None]], T], fn: Callable[[T], None]
    ) -> None:
        """Call ``fn`` with ``read(watcher)`` now and whenever a watch ``read`` set fires
        and the value changed (and after every reconnect)."""
        watch = Watch(what, read, fn, self._schedule)
        with self._cond:
            self._watches.append(watch)
        try:
            if not self.connected.is_set():
                raise self.unreachable_error("not connected")
            watch.refresh()
        except self.errors() as exc:
            log.warning(
                "cannot read %s from ZooKeeper at %s now (%s); the watch starts once it "
                "is reachable",
                what,
                self.options.hosts,
                type(exc).__name__,
            )
            self._schedule(watch)

    def watch_connection(self, fn: Callable[[bool], None]) -> None:
        watcher = ConnectionWatch(fn)
        with self._connection_lock:
            self._connection_watchers.append(watcher)
            if self.connected.is_set():
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

    # ------------------------------------------------------- state + thread
    def _on_state(self, state: str) -> None:
        """kazoo's connection listener: must not block."""
        if self.closed:
            return
        if state == "CONNECTED":
            with self._cond:
                self.connected.set()
                self._reconnected = True
                self._connection_events.append(True)
                self._cond.notify_all()
        elif state == "SUSPENDED":
            self.connected.clear()
            self._connection_changed(False)
            log.warning(
                "lost the connection to ZooKeeper at %s; reconnecting (registrations hold "
                "for the session timeout, %dms)",
                self.options.hosts,
                self.options.session_timeout_ms,
            )
        else:  # LOST
            self.connected.clear()
            self.expiries += 1
            for hook in self.expiry_hooks:
                hook()
            self._connection_changed(False)
            log.warning(
                "the ZooKeeper session with %s expired: this process's registrations are "
                "gone until it reconnects and registers them again",
                self.options.hosts,
            )

    def _connection_changed(self, connected: bool) -> None:
        """From kazoo's listener: the registry's thread tells the watchers."""
        with self._cond:
            self._connection_events.append(connected)
            self._cond.notify_all()

    def _tell_connection(self, events: list[bool]) -> None:
        with self._connection_lock:
            for connected in events:
                for watcher in list(self._connection_watchers):
                    watcher.tell(connected)

    def _resync_now(self) -> bool:
        """Call the resync hooks; False if they must be tried again."""
        sid = self.session_id()
        try:
            for hook in self.resync_hooks:
                if self.closed:
                    return True
                hook(sid)
        except self.errors() as exc:
            log.debug("registering again interrupted: %r", exc)
            return False
        except Exception:
            log.exception("registering again in %s failed", self.describe())
            return False
        return True

    def _run(self) -> None:
        errors = self.errors()
        backlog: list[Watch[Any]] = []  # failed while connected: again after a pause
        pause = False
        while True:
            with self._cond:
                if pause:
                    self._cond.wait(timeout=1.0)
                    pause = False
                while not (
                    self.closed
                    or self._reconnected
                    or self._resync
                    or self._pending
                    or self._connection_events
                ):
                    if not self._cond.wait(timeout=1.0 if backlog else None):
                        break
                if self.closed:
                    return
                events, self._connection_events = self._connection_events, []
            if events:
                self._tell_connection(events)
            with self._cond:
                if self.closed:
                    return
                if not self.connected.is_set():
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
                if self.closed:
                    return
                try:
                    watch.refresh(force=reconnected)
                except errors as exc:
                    log.debug("watch of %s interrupted: %r", watch.what, exc)
                    backlog.append(watch)
                except Exception:
                    log.exception("watch of %s failed", watch.what)
                    backlog.append(watch)
