"""The connection to ZooKeeper: one kazoo client, its session, and the operations on it.

Operations wait a bounded time for ZooKeeper's answer (:meth:`Session.do`); those a caller
must see through retry while ZooKeeper cannot be reached, up to ``connect_timeout_s``
(:meth:`Session.retrying`). kazoo's connection listener (:meth:`Session._on_state`) only
records the state and hands the rest to the registry's thread
(:mod:`wormhole.connectors.zookeeper.dispatch`). A session that expires (``LOST``) counts
in :attr:`Session.expiries` and calls the expiry hooks at once (serving claims went with
it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from wormhole.connectors.zookeeper.dispatch import Dispatcher
from wormhole.connectors.zookeeper.options import ZooKeeperOptions
from wormhole.core.errors import ConfigError, StateError, Stopped

log = logging.getLogger("wormhole.zookeeper")

T = TypeVar("T")


class Session:
    """A kazoo client for one registry and the operations on it (its thread: :attr:`dispatcher`)."""

    def __init__(self, options: ZooKeeperOptions) -> None:
        self.options = options
        self.client: Any = None
        self.connected = threading.Event()
        self.closed = False
        self.expiries = 0
        """Sessions of this process that expired."""
        self.expiry_hooks: list[Callable[[], None]] = []
        """Called from kazoo's listener when the session expired: must not block."""
        self.dispatcher = Dispatcher(self)

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
        self.dispatcher.first_connection()

    def begin_close(self) -> bool:
        """Mark the session closed and wake the thread; False if it was closed already."""
        if self.closed:
            return False
        self.closed = True
        self.dispatcher.wake()
        return True

    def finish_close(self) -> None:
        """Wait for the thread, then stop and close the client."""
        client = self.client
        if client is None:
            return
        self.dispatcher.join(timeout=self.options.session_timeout_ms / 1000 + 1)
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

    def children(
        self, parent: str, watcher: Callable[[Any], None] | None = None
    ) -> list[tuple[str, str, bytes, Any]]:
        """The children of ``parent`` in name order, each as (name, path, data, stat),
        leaving out those deleted meanwhile; none if ``parent`` does not exist. A
        ``watcher`` is set on the list of children and on each child read (or on the
        parent's creation)."""
        from kazoo.exceptions import NoNodeError

        try:
            names = self.do("get_children", parent, watch=watcher)
        except NoNodeError:
            if watcher is not None:
                self.do("exists", parent, watch=watcher)
            return []
        out: list[tuple[str, str, bytes, Any]] = []
        for name in sorted(names):
            path = f"{parent}/{name}"
            try:
                data, stat = self.do("get", path, watch=watcher)
            except NoNodeError:
                continue
            out.append((name, path, data, stat))
        return out

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

    # ------------------------------------------------------------------ state
    def _on_state(self, state: str) -> None:
        """kazoo's connection listener: must not block."""
        if self.closed:
            return
        if state == "CONNECTED":
            self.connected.set()
            self.dispatcher.connection_changed(True)
        elif state == "SUSPENDED":
            self.connected.clear()
            self.dispatcher.connection_changed(False)
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
            self.dispatcher.connection_changed(False)
            log.warning(
                "the ZooKeeper session with %s expired: this process's registrations are "
                "gone until it reconnects and registers them again",
                self.options.hosts,
            )
