"""A subscriber library connected to publishers: one :class:`~wormhole.subscriber.link.Link`
per publisher, given directly (addresses) or found through a registry (every publisher of a
dataset, followed as they come and go); flows assigned across links, batches handed to the
handlers one at a time, whichever link they came from.

A transport's subscriber library derives from :class:`ConnectedSubscriber`: it sets the
attributes below in its constructor (then calls ``_init_connected``) and makes its links
(``_link``); the ``tcp`` transport's ``wormhole.Subscriber`` does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from wormhole.core.errors import Stopped
from wormhole.plugins.components import Flow, PublisherEntry
from wormhole.subscriber.handlers import Handlers, run_handlers
from wormhole.subscriber.link import ConnectionClosed, Link

log = logging.getLogger("wormhole.subscriber")


class ConnectedSubscriber(Handlers):
    """What a subscriber connected to publishers does beside its transport's connections."""

    instance: str
    registry: Any
    """A registry URL (``zookeeper://HOSTS/ROOT``) or component: every publisher of
    ``dataset`` is found there; None: the addresses ``_addresses`` gives."""
    dataset: str | None
    reconnect: bool
    """Connect again after a connection is lost (else ``run`` raises why)."""
    max_backoff: float
    give_up_s: float | None
    """Stop retrying after this many seconds without a session (``run`` raises
    SubscriberGaveUp); None: retry for as long as it runs (a publisher restarts)."""
    heartbeat_timeout: float
    """Seconds of silence after which a link's connection is lost (links are waited for
    about this long when the subscriber leaves)."""
    publishers: list[str]
    _publishers: Callable[[], list[str]] | None
    """Asked again before every connection attempt (an address that changes when the
    publisher restarts); None: ``publishers`` is fixed."""

    def _init_connected(self) -> None:
        self.assigned: set[Any] = set()
        """The flows this subscriber owns: shards (one publisher) or (datastore, shard)."""
        self.publisher: str | None = None
        self.processed = 0
        self.frame_appended_ns = 0
        """When the batch being handled reached the publisher log (CLOCK_MONOTONIC ns)."""
        self._init_handlers()
        self._stop = threading.Event()
        self._handling = threading.Lock()
        self._links: dict[str, Link] = {}
        self._every_link: list[Link] = []
        """Every link started (a stop ends their waits between attempts)."""
        self._flow_epochs: dict[Any, int] = {}
        """The newest epoch each flow was assigned under (multiple-copy delivery)."""
        self._failure: BaseException | None = None
        self._wake = threading.Event()

    def _link(
        self, datastore: str | None, addresses: Callable[[], list[str]]
    ) -> Link:  # pragma: no cover - each transport defines it
        """A link (not started) to the publisher of ``datastore`` (None: without a
        registry), at the addresses ``addresses()`` gives when it connects."""
        raise NotImplementedError

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
                link = self._link(None, self._addresses)
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
                link = self._link(known[node], publishers.addresses(node))
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

    def _run_link(self, link: Link) -> None:
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
        return ConnectionClosed("stopped while retrying a batch")

    def latency(self) -> float:
        """Seconds since the batch being handled reached the publisher log.

        Meaningful when subscriber and publisher share a machine (one monotonic clock).
        """
        return (time.monotonic_ns() - self.frame_appended_ns) / 1e9


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


__all__ = ["ConnectedSubscriber"]
