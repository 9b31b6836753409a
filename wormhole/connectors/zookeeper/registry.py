"""The ``zookeeper`` registry: the publishers, applications and subscribers of a dataset,
kept in ZooKeeper (through kazoo).

:class:`ZooKeeperRegistry` is the :class:`wormhole.plugins.components.DatasetRegistry`;
it only puts together the parts, each in a module of its own, and keeps the membership
(publishers, subscribers); its optional parts are objects of their own (``parts``):

=================  ===========================================================
``session``        the kazoo client, its operations and retries
``dispatch``       the registry's thread: connection changes, re-registration, watches
``watches``        watches that survive reconnects, called off kazoo's thread
``nodes``          the znode layout, names, JSON values
``ephemeral``      this process's ephemeral nodes, registered again after a loss
``publishers``     publisher registrations and statuses (membership)
``subscribers``    subscriber registrations (membership)
``applications``   the application store
``claims``         serving claims (multiple-copy delivery)
``datamarkers``    shared datamarkers, written fenced by the claim
``parts``          the application store and serving claims, as the contract names them
=================  ===========================================================

The znode layout is in :mod:`wormhole.connectors.zookeeper.nodes` and docs/registry.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from wormhole.connectors.zookeeper.applications import Applications
from wormhole.connectors.zookeeper.claims import Claims
from wormhole.connectors.zookeeper.datamarkers import SharedDatamarkers
from wormhole.connectors.zookeeper.ephemeral import OwnedNodes
from wormhole.connectors.zookeeper.nodes import Layout, SkippedNodes, check_name
from wormhole.connectors.zookeeper.options import ZooKeeperOptions
from wormhole.connectors.zookeeper.parts import ZooKeeperApplicationStore, ZooKeeperServingClaims
from wormhole.connectors.zookeeper.publishers import Publishers
from wormhole.connectors.zookeeper.session import Session
from wormhole.connectors.zookeeper.subscribers import Subscribers
from wormhole.plugins.components import (
    PublisherEntry,
    SubscriberEntry,
)

__all__ = ["ZooKeeperOptions", "ZooKeeperRegistry"]

log = logging.getLogger("wormhole.zookeeper")


class ZooKeeperRegistry:
    """A :class:`wormhole.plugins.components.DatasetRegistry` in ZooKeeper."""

    def __init__(self, options: ZooKeeperOptions) -> None:
        self.options = options
        self.root = options.root.rstrip("/")
        self.session = session = Session(options)
        self.layout = layout = Layout(self.root, "")
        self.skipped = SkippedNodes()
        self.owned = OwnedNodes()
        self.publishers = Publishers(session, layout, self.owned, self.skipped)
        self.subscribers = Subscribers(session, layout, self.owned, self.skipped)
        self.apps = Applications(session, layout)
        self.claims = Claims(session, layout, self.skipped)
        self.datamarkers = SharedDatamarkers(session, layout, self.claims)
        self.store = ZooKeeperApplicationStore(self.apps, self.subscribers)
        self.serving = ZooKeeperServingClaims(self.claims, self.datamarkers)
        session.dispatcher.resync_hooks = [self.claims.resync, self._reregister]
        # Serving claims went with an expired session: they are not made again.
        session.expiry_hooks = [lambda: self.claims.forget(keep=None)]

    @property
    def dataset(self) -> str:
        return self.layout.dataset

    @dataset.setter
    def dataset(self, dataset: str) -> None:
        self.layout.dataset = dataset

    # ------------------------------------------------------------- lifecycle
    def describe(self) -> str:
        return self.session.describe()

    def open(self, dataset: str, stop: threading.Event) -> None:
        check_name("dataset", dataset)
        self.dataset = dataset
        self.session.connect(stop)
        layout, session = self.layout, self.session
        try:
            session.retrying(
                "create the registry's nodes",
                lambda: [
                    session.do("ensure_path", path)
                    for path in (layout.publishers, layout.statuses, layout.applications)
                ],
                stop,
            )
        except BaseException:
            self.close()
            raise
        session.dispatcher.start(f"wormhole-zookeeper-{dataset}")

    def close(self) -> None:
        session = self.session
        if not session.begin_close():
            return
        if session.client is None:
            return
        with self.owned.lock:
            sid = session.session_id()
            paths = [
                *self.publishers.drain(sid),
                *self.subscribers.drain(sid),
                *self.owned.orphans,
                *self.claims.drain(sid),
            ]
            self.owned.orphans = []
            if session.connected.is_set():
                for path in paths:
                    try:
                        session.delete_own(path, sid, timeout=2.0)
                    except Exception as exc:  # goes with the session anyway
                        log.debug("could not delete %s: %r", path, exc)
        session.finish_close()

    def _reregister(self, sid: int | None) -> None:
        """Create again the nodes of ours that are missing (a new session) or stale."""
        with self.owned.lock:
            if self.session.closed:
                return
            for path in list(self.owned.orphans):
                self.session.delete_own(path, sid)
                self.owned.orphans.remove(path)
            self.publishers.reregister(sid)
            self.subscribers.reregister(sid)

    def watch_connection(self, fn: Callable[[bool], None]) -> None:
        self.session.dispatcher.watch_connection(fn)

    # ------------------------------------------------------------ publishers
    def register_publisher(self, entry: PublisherEntry) -> None:
        self.publishers.register(entry)

    def release_publisher(self, datastore: str, holder: PublisherEntry) -> bool:
        return self.publishers.release(datastore, holder)

    def watch_publishers(self, fn: Callable[[list[PublisherEntry]], None]) -> None:
        self.publishers.watch(fn)

    def publish_status(self, datastore: str, status: dict[str, Any]) -> None:
        self.publishers.publish_status(datastore, status)

    def statuses(self) -> dict[str, dict[str, Any]]:
        return self.publishers.statuses()

    # ----------------------------------------------------------- subscribers
    def register_subscriber(self, application: str, entry: SubscriberEntry) -> None:
        self.subscribers.register(application, entry)

    def unregister_subscriber(self, application: str, instance: str) -> None:
        self.subscribers.unregister(application, instance)

    def watch_subscribers(
        self, application: str, fn: Callable[[list[SubscriberEntry]], None]
    ) -> Callable[[], None]:
        return self.subscribers.watch(application, fn)

    # ------------------------------------------------------ the optional parts
    def application_store(self) -> ZooKeeperApplicationStore:
        return self.store

    def serving_claims(self) -> ZooKeeperServingClaims:
        return self.serving
