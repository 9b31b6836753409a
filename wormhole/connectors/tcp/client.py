"""The subscriber library: an application's end of the TCP transport.

::

    import wormhole

    sub = wormhole.Subscriber(app="search", publishers=["10.0.0.5:7070"], token="...")
    # or every publisher of a dataset, found through its registry:
    sub = wormhole.Subscriber(app="search", registry="zookeeper://zk1:2181/wormhole",
                              dataset="shop")

    @sub.on_shard_notice
    def notice(assigned, revoked): ...

    @sub.on_updates
    def handle(flow, batch): ...   # returning acknowledges; raising retries the batch

    sub.run()                      # or: await sub.run_async()

One connection carries all of the subscriber's flows. A reader thread keeps the
socket drained and answers heartbeats while handlers run; the publisher sends at
most ``credits`` batches ahead of the acknowledgements, so memory stays bounded
however slow the handlers are. A handler that raises gets the same batch again
(with backoff) until it returns. Per flow (shard), batches arrive in order. If
the connection drops, the subscriber reconnects (trying each publisher in turn)
and resumes from its datamarkers; a refusal the publisher calls fatal (wrong
token, unknown application, version mismatch) raises :class:`SubscriberRefused`.

With a registry, the subscriber registers itself under its application, keeps one
connection per live publisher of the dataset (publishers that appear or leave are
picked up from the registry's watches), and is given its share of the dataset's flows,
(datastore, shard) pairs: ``on_shard_notice`` then receives ``(datastore, shard)``
tuples and ``on_updates`` a :class:`wormhole.Flow` with its ``datastore``. Handlers are
called one at a time, whichever connection the batch came from.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from wormhole.connectors.tcp import protocol as p
from wormhole.core.backoff import Backoff
from wormhole.core.errors import Stopped, WormholeError
from wormhole.core.metrics import reconnecting
from wormhole.plugins.components import Flow, PublisherEntry
from wormhole.subscriber.handlers import Handlers, run_handlers

log = logging.getLogger("wormhole.subscriber")


class SubscriberRefused(WormholeError):
    """The publisher refused this subscriber for a reason retrying cannot fix."""


class SubscriberGaveUp(WormholeError):
    """No session with a publisher for ``give_up_s`` seconds."""


class _Closed(Exception):
    pass


def _why(exc: BaseException) -> str:
    """A connection failure, with what it likely means where that is clear."""
    if isinstance(exc, ConnectionRefusedError):
        return (
            f"{exc} (nothing listens there: is the publisher running, and is this the address "
            f"it listens on?)"
        )
    return str(exc)


class Subscriber(Handlers):
    def __init__(
        self,
        app: str,
        publishers: list[str] | str | Callable[[], list[str]] | None = None,
        token: str = "",
        *,
        registry: str | Any = None,
        dataset: str | None = None,
        instance: str | None = None,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
        credits: int = 8,
        heartbeat_ms: int = 1000,
        heartbeat_timeout_ms: int = 3000,
        reconnect: bool = True,
        max_backoff: float = 10.0,
        max_frame: int = 1 << 30,
        give_up_s: float | None = None,
    ) -> None:
        self.app = app
        self.give_up_s = give_up_s
        """Stop retrying after this many seconds without a session (``run`` raises
        SubscriberGaveUp); None: retry for as long as it runs (a publisher restarts)."""
        self.registry = registry
        """A registry URL (``zookeeper://HOSTS/ROOT``) or component: every publisher of
        ``dataset`` is found there, instead of ``publishers``."""
        self.dataset = dataset
        if registry is not None:
            if not dataset:
                raise ValueError("dataset: give the dataset (pipeline) name with a registry")
            if publishers:
                raise ValueError("give publishers or a registry, not both")
            publishers = []
        elif publishers is None:
            raise ValueError("publishers: give at least one host:port (or a registry)")
        # A callable is asked again before every connection attempt (an address
        # that changes when the publisher restarts).
        self._publishers = publishers if callable(publishers) else None
        self.publishers = (
            publishers()
            if callable(publishers)
            else [publishers]
            if isinstance(publishers, str)
            else list(publishers)
        )
        if not self.publishers and registry is None:
            raise ValueError("publishers: give at least one host:port")
        for address in self.publishers:
            p.parse_address(address)
        self.token = token
        self.instance = instance or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.tls = tls
        self.server_name = server_name
        self.credits = credits
        self.heartbeat = heartbeat_ms / 1000.0
        self.heartbeat_timeout = heartbeat_timeout_ms / 1000.0
        self.reconnect = reconnect
        self.max_backoff = max_backoff
        self.max_frame = max_frame
        self.assigned: set[Any] = set()
        """The flows this subscriber owns: shards (one publisher) or (datastore, shard)."""
        self.publisher: str | None = None
        self.processed = 0
        self.frame_appended_ns = 0
        """When the batch being handled reached the publisher log (CLOCK_MONOTONIC ns)."""
        self._init_handlers()
        self._stop = threading.Event()
        self._handling = threading.Lock()
        self._links: dict[str, _Link] = {}
        self._every_link: list[_Link] = []
        """Every link started (a stop ends their waits between attempts)."""
        self._flow_epochs: dict[Any, int] = {}
        """The newest epoch each flow was assigned under (multiple-copy delivery)."""
        self._failure: BaseException | None = None
        self._wake = threading.Event()

    # --------------------------------------------------------------- run
    def stop(self) -> None:
        """Finish the batch in hand, acknowledge it, leave; ``run`` then returns."""
        self._stop.set()
        self._wake.set()
        for link in list(self._every_link):
            link.retry.set()

    def run(self) -> None:
        """Serve until ``stop()``; reconnects on connection loss (with backoff). Ctrl-C
        (KeyboardInterrupt) stops it too: ``run`` returns, and what the handler had not
        returned from is delivered again to the next subscriber."""
        try:
            if self.registry is None:
                link = _Link(self, None, self._addresses)
                try:
                    link.run()
                finally:
                    self._every_link.remove(link)
                return
            self._run_registered()
        except KeyboardInterrupt:
            self.stop()
            log.info(
                "%s/%s: stopped by Ctrl-C; updates not acknowledged are delivered again",
                self.app,
                self.instance,
            )

    def _addresses(self) -> list[str]:
        if self._publishers is not None:
            self.publishers = self._publishers() or self.publishers
        return self.publishers

    # ---------------------------------------------------------- registry
    def _run_registered(self) -> None:
        from wormhole.plugins.engine import open_registry

        assert self.dataset is not None
        try:
            registry = open_registry(self.registry, self.dataset, self._stop)
        except Stopped as exc:
            log.info("%s/%s: %s", self.app, self.instance, exc)
            return  # stopped before it subscribed: nothing to leave
        publishers = _KnownPublishers()

        def changed(found: list[PublisherEntry]) -> None:
            for node in publishers.replace(found):
                # Registered again (back after a partition or a restart) or moved: a link
                # waiting out its backoff tries it now.
                link = self._links.get(node)
                if link is not None:
                    link.retry.set()
            self._wake.set()

        threads: dict[str, threading.Thread] = {}
        try:
            if not self._join(registry, changed):
                return
            self._follow(publishers, threads)
        finally:
            self._leave(registry, threads)
        if self._failure is not None:
            raise self._failure

    def _join(self, registry: Any, changed: Callable[[list[PublisherEntry]], None]) -> bool:
        """Wait for the application in the registry's store (if it has one), register this
        subscriber and watch the publishers; False when stopped while waiting."""
        from wormhole.plugins.components import SubscriberEntry
        from wormhole.plugins.engine import wait_for_application

        assert self.dataset is not None
        if registry.application_store() is not None:
            found = wait_for_application(registry, self.dataset, self.app, self._stop.is_set)
            if found is None:
                return False
        registry.register_subscriber(
            self.app,
            SubscriberEntry(instance=self.instance, host=socket.gethostname(), pid=os.getpid()),
        )
        registry.watch_publishers(changed)
        log.info(
            "%s/%s: subscribing to dataset %s through %s",
            self.app,
            self.instance,
            self.dataset,
            registry.describe(),
        )
        return True

    def _follow(self, publishers: _KnownPublishers, threads: dict[str, threading.Thread]) -> None:
        """Until stopped or failed: a link (and its thread) per registered publisher, forgotten
        when its thread ends (its publisher left; started again if it returns)."""
        while not self._stop.is_set() and self._failure is None:
            self._wake.wait(1.0)
            self._wake.clear()
            known = publishers.datastores()
            for node in sorted(set(known) - set(threads)):
                link = _Link(self, known[node], publishers.addresses(node))
                self._links[node] = link
                thread = threading.Thread(
                    target=self._run_link,
                    args=(link,),
                    name=f"subscriber link {node}",
                    daemon=True,
                )
                threads[node] = thread
                thread.start()
            for node, thread in list(threads.items()):
                if not thread.is_alive():
                    del threads[node]  # its publisher left; started again if it returns
                    self._links.pop(node, None)

    def _leave(self, registry: Any, threads: dict[str, threading.Thread]) -> None:
        """Stop every link, wait for their threads, unregister and close the registry."""
        self._stop.set()
        for link in list(self._every_link):
            link.retry.set()
        for thread in threads.values():
            thread.join(self.heartbeat_timeout + 5.0)
        with contextlib.suppress(Exception):
            registry.unregister_subscriber(self.app, self.instance)
        registry.close()

    def _run_link(self, link: _Link) -> None:
        try:
            link.run()
        except BaseException as exc:  # a fatal refusal ends the subscriber
            self._failure = exc
            self._wake.set()
        finally:
            self._every_link.remove(link)

    # --------------------------------------------------------- handlers
    def _flows_changed(self, assigned: list[Any], revoked: list[Any]) -> None:
        # Caller holds _handling. A flow can be held by two links for a moment (copies of
        # a datastore handing it over): it is reported assigned once, revoked once no link
        # holds it.
        held = set().union(*(link.flows() for link in self._links.values()))
        if not self._links:
            held = set(self.assigned) | set(assigned)
            held.difference_update(revoked)
        new = [f for f in assigned if f not in self.assigned]
        gone = [f for f in revoked if f not in held]
        self.assigned = held
        if new or gone:
            for fn in self._notice_handlers:
                fn(new, gone)

    def _handle_for(self, datastore: str | None, updates: list[Any]) -> None:
        if datastore is None:
            self._handle(updates)
            return
        self.batch_datastore = datastore
        run_handlers(
            self.app,
            updates,
            self._batch_handlers,
            self._updates_handlers,
            lambda application, shard: Flow(application, shard, datastore),
            self._stop,
            self._stopped_while_retrying,
            self.handler_max_backoff,
            self.handler_first_backoff,
        )

    def _stopped_while_retrying(self, exc: Exception) -> BaseException:
        return _Closed("stopped while retrying a batch")

    def latency(self) -> float:
        """Seconds since the batch being handled reached the publisher log.

        Meaningful when subscriber and publisher share a machine (one monotonic clock).
        """
        return (time.monotonic_ns() - self.frame_appended_ns) / 1e9


class _Link:
    """One connection of a subscriber: to one publisher (trying each address in turn)."""

    def __init__(
        self, owner: Subscriber, datastore: str | None, addresses: Callable[[], list[str]]
    ) -> None:
        self.owner = owner
        self.datastore = datastore
        """The publisher's datastore, with a registry (flows are then (datastore, shard))."""
        self.addresses = addresses
        self.retry = threading.Event()
        """Set to end a wait between attempts at once: the publisher registered again (or
        the subscriber stops)."""
        owner._every_link.append(self)
        if owner._stop.is_set():
            self.retry.set()
        self.assigned: set[int] = set()
        self.epochs: dict[int, int] = {}
        """The epoch each of its shards was assigned under."""
        self._beat_interval = owner.heartbeat
        self._silence = owner.heartbeat_timeout
        self._connected = False
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()

    def _flow(self, shard: int) -> Any:
        return shard if self.datastore is None else (self.datastore, shard)

    def flows(self) -> set[Any]:
        return {self._flow(s) for s in self.assigned}

    def run(self) -> None:
        owner = self.owner
        stop = owner._stop
        backoff = Backoff(log, first=0.2, cap=owner.max_backoff, stop=self.retry)
        attempt = 0
        since = time.monotonic()
        """When this link last had a session (or began)."""
        while not stop.is_set():
            addresses = self.addresses()
            if not addresses:
                if self.datastore is not None:
                    return  # the publisher left the registry
                raise ValueError("publishers: give at least one host:port")
            address = addresses[attempt % len(addresses)]
            attempt += 1
            self._connected = False
            try:
                self._serve(address)
                backoff.reset()
            except SubscriberRefused:
                raise
            except (OSError, p.PeerClosed, p.ProtocolError, _Closed) as exc:
                self._lose_shards()
                if stop.is_set():
                    return
                if not owner.reconnect:
                    raise
                if self._connected:
                    backoff.reset()  # it worked until now: retry soon
                    since = time.monotonic()
                # Through a registry, publishers come and go: only a fixed address gives up.
                give_up = owner.give_up_s if self.datastore is None else None
                if give_up is not None and time.monotonic() - since >= give_up:
                    raise SubscriberGaveUp(
                        f"publisher {address}: no session for {give_up:g}s ({_why(exc)}); "
                        f"giving up (give_up_s)"
                    ) from None
                reconnecting(log.name)
                if not backoff.wait("publisher %s: %s; reconnecting in %.1fs", address, _why(exc)):
                    if stop.is_set():
                        return
                    backoff.reset()  # its publisher registered again: try it now
                self.retry.clear()

    def _lose_shards(self) -> None:
        if self.assigned:
            with self.owner._handling:
                revoked = sorted(self.assigned)
                self.assigned.clear()
                self.owner._flows_changed([], [self._flow(s) for s in revoked])

    # ------------------------------------------------------------ session
    def _connect(self, address: str) -> socket.socket:
        owner = self.owner
        host, port = p.parse_address(address)
        raw = socket.create_connection((host, port), timeout=owner.heartbeat_timeout)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock: socket.socket = raw
        if owner.tls is not None:
            sock = owner.tls.wrap_socket(raw, server_hostname=owner.server_name or host)
        try:
            body = self._hello(sock, address)
        except BaseException:
            # Closed now, not whenever the exception (which a log handler may keep) is freed.
            p.close_socket(sock)
            raise
        owner.publisher = address
        # Beat at least as often as the publisher asks, whatever this side was told,
        # and give it at least three of its own intervals before calling it silent.
        self._beat_interval = min(owner.heartbeat, body.heartbeat_ms / 1000.0)
        self._silence = max(owner.heartbeat_timeout, 3 * body.heartbeat_ms / 1000.0)
        self._connected = True
        log.info(
            "connected to publisher %s (%s%s) as %s/%s",
            address,
            body.publisher,
            f", datastore {body.datastore}" if body.datastore else "",
            owner.app,
            owner.instance,
        )
        return sock

    def _hello(self, sock: socket.socket, address: str) -> p.Welcome:
        """Say hello; the publisher's welcome (a refusal raises)."""
        owner = self.owner
        sock.sendall(p.preamble())
        sock.sendall(
            p.encode(
                p.HELLO,
                p.Hello(
                    version=p.SUBSCRIBE_VERSION,
                    application=owner.app,
                    instance=owner.instance,
                    token=owner.token,
                    credits=owner.credits,
                ),
            )
        )
        try:
            kind, body = p.read_frame(sock, 1 << 20)
        except p.ProtocolError as exc:
            raise p.ProtocolError(
                f"not a Wormhole publisher: its answer to the handshake is no Wormhole frame "
                f"({exc}); check the address"
            ) from None
        except p.PeerClosed:
            raise p.PeerClosed(
                "the connection was closed during the handshake: not a Wormhole publisher, or "
                "one that is stopping"
            ) from None
        if kind == p.REFUSE:
            sock.close()
            if body.fatal:
                raise SubscriberRefused(f"publisher {address} refused {owner.app}: {body.reason}")
            raise _Closed(f"refused: {body.reason}")
        if kind != p.WELCOME:
            raise p.ProtocolError(
                f"not a Wormhole publisher: it answered the handshake with "
                f"{p.NAMES.get(kind, kind)}, not a welcome"
            )
        welcome: p.Welcome = body
        return welcome

    def _send(self, data: bytes) -> None:
        sock = self._sock
        if sock is None:
            raise _Closed("not connected")
        with self._send_lock:
            sock.sendall(data)

    def _serve(self, address: str) -> None:
        owner = self.owner
        sock = self._connect(address)
        self._sock = sock
        inbox: queue.Queue[tuple[int, Any]] = queue.Queue()
        closed = threading.Event()
        lost = threading.Event()
        reader = threading.Thread(
            target=self._read,
            args=(sock, inbox, closed, lost),
            name="subscriber reader",
            daemon=True,
        )
        beater = threading.Thread(
            target=self._beat, args=(closed,), name="subscriber heartbeat", daemon=True
        )
        reader.start()
        beater.start()
        try:
            while True:
                if owner._stop.is_set():
                    # The batch in hand was acknowledged; frames not yet handled are
                    # sent again to the flows' next owner.
                    self._leave("subscriber stopping")
                    return
                try:
                    kind, body = inbox.get(timeout=0.1)
                except queue.Empty:
                    continue
                if kind in (p.BATCH, p.NOTICE) and lost.is_set():
                    # They can no longer be acknowledged: the publisher sends them
                    # again to whoever owns the flow next. Writing them now could
                    # interleave with that owner. Dropped: the reader's reason for the loss
                    # follows them.
                    continue
                if kind == p.BATCH:
                    self._batch(body)
                elif kind == p.NOTICE:
                    self._notice(body)
                elif kind == p.REFUSE:
                    if body.fatal:
                        raise SubscriberRefused(f"publisher {address}: {body.reason}")
                    raise _Closed(f"publisher closed the connection: {body.reason}")
                elif kind == p.BYE:
                    raise _Closed(f"publisher said goodbye: {body.reason}")
                elif kind == -1:
                    raise body
        finally:
            closed.set()
            self._sock = None
            self._lose_shards()
            p.close_socket(sock)

    def _leave(self, reason: str) -> None:
        with contextlib.suppress(OSError, _Closed):
            self._send(p.encode(p.BYE, p.Bye(reason=reason)))

    def _read(
        self,
        sock: socket.socket,
        inbox: queue.Queue[tuple[int, Any]],
        closed: threading.Event,
        lost: threading.Event,
    ) -> None:
        sock.settimeout(self._silence)
        try:
            while not closed.is_set():
                kind, body = p.read_frame(sock, self.owner.max_frame)
                if kind != p.HEARTBEAT:
                    inbox.put((kind, body))
        except TimeoutError:
            lost.set()
            silent = f"{self._silence:.1f}s"
            inbox.put((-1, _Closed(f"missed heartbeats: nothing from the publisher for {silent}")))
        except (OSError, p.PeerClosed, p.ProtocolError) as exc:
            lost.set()
            if not closed.is_set():
                inbox.put((-1, exc if isinstance(exc, Exception) else _Closed(str(exc))))

    def _beat(self, closed: threading.Event) -> None:
        frame = p.encode(p.HEARTBEAT)
        while not closed.wait(self._beat_interval):
            try:
                self._send(frame)
            except (OSError, _Closed):
                return

    # -------------------------------------------------------- processing
    def _notice(self, notice: p.Notice) -> None:
        owner = self.owner
        with owner._handling:
            self.assigned.update(notice.assigned)
            self.assigned.difference_update(notice.revoked)
            for shard in notice.assigned:
                self.epochs[shard] = notice.epoch
                flow = self._flow(shard)
                if notice.epoch > owner._flow_epochs.get(flow, 0):
                    owner._flow_epochs[flow] = notice.epoch
            owner._flows_changed(
                [self._flow(s) for s in notice.assigned], [self._flow(s) for s in notice.revoked]
            )
        # Frames are handled in order, so every batch sent before this notice is done.
        self._send(p.encode(p.NOTICE_ACK, p.NoticeAck(id=notice.id)))

    def _batch(self, frame: p.BatchFrame) -> None:
        owner = self.owner
        with owner._handling:
            assigned = self.assigned
            if self.epochs and owner._flow_epochs:
                # A flow another copy now serves under a newer epoch: this copy's frames
                # of it are dropped (fenced), so they cannot interleave with the new ones.
                epochs, newest = self.epochs, owner._flow_epochs
                assigned = {s for s in assigned if epochs.get(s, 0) >= newest.get(self._flow(s), 0)}
            updates = frame.updates
            if updates and any(u.shard not in assigned for u in updates):
                # Only flows this subscriber owns: others are re-sent to their owner.
                updates = [u for u in updates if u.shard in assigned]
            if updates:
                owner.frame_appended_ns = frame.appended_ns
                owner._handle_for(self.datastore, updates)
                owner.processed += len(updates)
        datamarkers = {s: pos for s, pos in frame.datamarkers.items() if s in assigned}
        self._send(p.encode(p.ACK, p.Ack(id=frame.id, datamarkers=datamarkers, credits=1)))


class _KnownPublishers:
    """The publishers the registry last listed, by node (copies of one datastore, in
    multiple-copy delivery, are separate publishers)."""

    def __init__(self) -> None:
        self._entries: dict[str, PublisherEntry] = {}
        self._lock = threading.Lock()

    def replace(self, found: list[PublisherEntry]) -> list[str]:
        """Keep ``found`` (those with an address); the nodes that are new or changed."""
        with self._lock:
            before = dict(self._entries)
            self._entries.clear()
            self._entries.update({e.node: e for e in found if e.address})
            return [node for node, e in self._entries.items() if before.get(node) != e]

    def datastores(self) -> dict[str, str]:
        with self._lock:
            return {node: e.datastore for node, e in self._entries.items()}

    def addresses(self, node: str) -> Callable[[], list[str]]:
        """The current address of ``node``, for its link to read at each connection."""

        def current() -> list[str]:
            with self._lock:
                entry = self._entries.get(node)
            return [entry.address] if entry is not None else []

        return current
