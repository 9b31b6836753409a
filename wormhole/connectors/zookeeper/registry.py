"""The ``zookeeper`` registry: the publishers, applications and subscribers of a dataset,
kept in ZooKeeper (through kazoo).

:class:`ZooKeeperRegistry` is the :class:`wormhole.plugins.components.DatasetRegistry`;
it only puts together the parts, each in a module of its own:

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
=================  ===========================================================

The znode layout is in :mod:`wormhole.connectors.zookeeper.nodes` and docs/registry.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from wormhole.connectors.zookeeper.applications import Applications, RawApplications
from wormhole.connectors.zookeeper.claims import Claims
from wormhole.connectors.zookeeper.datamarkers import SharedDatamarkers
from wormhole.connectors.zookeeper.ephemeral import OwnedNodes
from wormhole.connectors.zookeeper.nodes import Layout, SkippedNodes, check_name
from wormhole.connectors.zookeeper.options import ZooKeeperOptions
from wormhole.connectors.zookeeper.publishers import Publishers
from wormhole.connectors.zookeeper.session import Session
from wormhole.connectors.zookeeper.subscribers import Subscribers
from wormhole.plugins.components import (
    ApplicationStore,
    PublisherEntry,
    ServingClaim,
    ServingClaims,
    SharedDatamarker,
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
        session.dispatcher.resync_hooks = [self.claims.resync, self._reregister]
        # Serving claims went with an expired session: they are not made again.
        session.expiry_hooks = [lambda: self.claims.forget(keep=None)]

    @property
    def dataset(self) -> str:
        return self.layout.dataset

    @dataset.setter
    def dataset(self, dataset: str) -> None:
        self.layout.dataset = dataset

    # What the tests and tools look at: the session's state.
    @property
    def _client(self) -> Any:
        return self.session.client

    @property
    def _connected(self) -> threading.Event:
        return self.session.connected

    def _session_id(self) -> int | None:
        return self.session.session_id()

    # ------------------------------------------------------------- lifecycle
    def describe(self) -> str:
        return self.session.describe()

    def application_path(self, name: str) -> str:
        """Where an application lives, for messages: ``zookeeper HOSTS node PATH``."""
        return self.apps.path(name)

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

    # ---------------------------------------------------------- applications
    def application_store(self) -> ApplicationStore:
        return self

    def holds_applications(self) -> bool:
        """Always: the applications are registry data (``application_store()`` is this)."""
        return True

    def seed_applications(self, raw: dict[str, Any]) -> bool:
        return self.apps.seed(raw)

    def applications(self) -> RawApplications:
        return self.apps.all()

    def watch_applications(self, fn: Callable[[RawApplications], None]) -> None:
        self.apps.watch(fn)

    def put_application(self, name: str, raw: dict[str, Any]) -> None:
        self.apps.put(name, raw)

    def remove_application(self, name: str) -> bool:
        check_name("application", name)
        self.subscribers.forget_application(name)
        return self.apps.remove(name)

    # ----------------------------------- serving claims + shared datamarkers
    def serving_claims(self) -> ServingClaims:
        return self

    def claim_serving(self, application: str, datastore: str, copy: str) -> int | None:
        return self.claims.claim(application, datastore, copy)

    def release_serving(self, application: str, datastore: str, epoch: int) -> None:
        self.claims.release(application, datastore, epoch)

    def watch_serving(
        self, application: str, datastore: str, fn: Callable[[ServingClaim | None], None]
    ) -> Callable[[], None]:
        return self.claims.watch(application, datastore, fn)

    def load_datamarkers(self, application: str, datastore: str) -> dict[int, SharedDatamarker]:
        return self.datamarkers.load(application, datastore)

    def save_datamarkers(
        self,
        application: str,
        datastore: str,
        epoch: int,
        datamarkers: dict[int, SharedDatamarker],
    ) -> bool:
        return self.datamarkers.save(application, datastore, epoch, datamarkers)
