"""Applications, flows and subscriber sessions on the publisher side.

A *flow* is the stream of one shard's updates to one application: the unit of
ordering and of acknowledgement. Its *datamarker* is the publisher-log seq
before which every update was processed by a subscriber (or filtered out). The
hub divides each application's shards among its attached subscriber sessions,
routes frames from the caravan to them, and takes their acknowledgements.

The :class:`Hub` is what a transport sees of the publisher (the
:class:`~wormhole.plugins.components.PublisherView`). Its parts keep the rest:
:class:`~wormhole.core.subscriptions.Subscriptions` which session holds each flow, and
:class:`~wormhole.core.hub_log.LogAccess` the publisher log and datamarker store for a
transport that reads the log itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from wormhole.core.flows import FlowState
from wormhole.core.hub_log import LogAccess
from wormhole.core.pipeline import Application, Pipeline
from wormhole.core.publisher_log import PublisherLog
from wormhole.core.subscriber_launch import SubscriberLaunch
from wormhole.core.subscriptions import Subscriptions
from wormhole.core.update import Update
from wormhole.plugins.components import (
    Datamarker,
    DatamarkerStore,
    Frame,
    LocalSubscriberSession,
    SubscriberSession,
)

log = logging.getLogger("wormhole.hub")

BatchFilter = Callable[[list[Update]], list[Update]]


@dataclass
class ApplicationRuntime:
    config: Application
    flows: list[FlowState]
    filter: BatchFilter | None
    sessions: list[SubscriberSession] = field(default_factory=list)
    owner: list[SubscriberSession | None] = field(default_factory=list)
    # Shards a live session is giving up: they get their new owner once it confirms.
    revoking: dict[int, SubscriberSession] = field(default_factory=dict)
    rewind: int = 0
    """Bumped when flows move back to their datamarkers: the caravan re-reads from there."""
    delivered_updates: int = 0
    acknowledged_updates: int = 0
    active: bool = True
    """Whether this publisher serves the application's flows: a standby copy of a datastore
    (multiple-copy delivery) has them without serving them."""
    epoch: int = 0
    """The serving claim's fencing epoch (multiple-copy delivery; 0 otherwise)."""

    def ready(self) -> bool:
        """Served here and with a subscriber connected: caravans read for it."""
        return self.active and bool(self.sessions)

    @property
    def name(self) -> str:
        return self.config.name

    def min_datamarker(self) -> int:
        return min(f.datamarker for f in self.flows)

    def owned(self, session: SubscriberSession) -> list[int]:
        return [shard for shard, owner in enumerate(self.owner) if owner is session]


class Hub:
    def __init__(self, pipeline: Pipeline, applications: dict[str, ApplicationRuntime]) -> None:
        self.pipeline = pipeline
        self.shards = pipeline.shards
        self.applications = applications
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.failure: BaseException | None = None
        self.local_subscribers = True
        """Whether the transport runs the applications' sinks here (`wormhole run`)."""
        self.once = False
        """``--once``: a graceful stop must leave every application with everything; a
        transport that cannot tell that it did fails the run instead of exiting 0."""
        self.failed: dict[str, BaseException] = {}
        """Applications stopped by an error of their own (a filter naming a missing column)."""
        self.publisher_log: PublisherLog | None = None
        """The publisher log (set by the publisher before the transport starts)."""
        self.store: DatamarkerStore | None = None
        """The datamarker store (set by the publisher before the transport starts)."""
        self.launch: SubscriberLaunch | None = None
        """The subscriber processes the engine started (set by the publisher)."""
        self.datastore = pipeline.datastore or pipeline.name
        for app in applications.values():
            app.owner = [None] * self.shards
        self.subscriptions = Subscriptions(self)
        """Which session holds each flow (the registry's datastores and subscribers with it)."""
        self.log_access = LogAccess(self)
        """The publisher log and the datamarker store, for a transport that reads the log."""
        # The calls a transport makes (the PublisherView) and those of the registry and of
        # the copies of a datastore, answered by the part that keeps what they change.
        subscriptions, log_access = self.subscriptions, self.log_access
        self.attach = subscriptions.attach
        self.detach = subscriptions.detach
        self.revoked = subscriptions.revoked
        self.acknowledge = subscriptions.acknowledge
        self.set_datastores = subscriptions.set_datastores
        self.set_registered = subscriptions.set_registered
        self.activate = subscriptions.activate
        self.deactivate = subscriptions.deactivate
        self.settled = subscriptions.settled
        self.log_range = log_access.log_range
        self.read_log = log_access.read_log
        self.wait_for_log = log_access.wait_for_log
        self.stored_datamarkers = log_access.stored_datamarkers
        self.store_datamarkers = log_access.store_datamarkers
        self.stored_meta = log_access.stored_meta

    def stop_subscribers(
        self, deadline: float, stall: float, application: str | None = None
    ) -> None:
        """See the PublisherView: the subscriber processes the engine started leave."""
        if self.launch is not None:
            self.launch.stop(deadline, stall, application)

    def subscriber_applications(self) -> list[str]:
        return self.launch.applications() if self.launch is not None else []

    def epoch(self, application: str) -> int:
        app = self.applications.get(application)
        return app.epoch if app is not None else 0

    def local_subscriber(
        self, app: ApplicationRuntime, index: int, max_frames: int
    ) -> LocalSubscriberSession:
        """A subscriber of ``app`` on a thread of this process (see the PublisherView)."""
        from wormhole.subscriber.local import local_subscriber

        return local_subscriber(self, app, index, max_frames)

    def add_application(self, app: ApplicationRuntime) -> None:
        """An application added to a running pipeline (its flows are set up)."""
        with self.lock:
            app.owner = [None] * self.shards
            self.applications[app.name] = app
            self.changed.notify_all()

    def remove_application(self, name: str) -> ApplicationRuntime | None:
        """An application taken out of a running pipeline; its datamarkers stay stored."""
        with self.lock:
            app = self.applications.pop(name, None)
            self.changed.notify_all()
        return app

    def app_failed(self, app: ApplicationRuntime, error: BaseException) -> None:
        """Stop delivering to one application; the others go on."""
        log.error("application %s stopped: %s", app.name, error)
        with self.lock:
            self.failed.setdefault(app.name, error)
            self.changed.notify_all()

    def fail(self, error: BaseException) -> None:
        """A component hit an error that retrying cannot fix: stop the pipeline."""
        with self.lock:
            if self.failure is None:
                self.failure = error
            self.changed.notify_all()

    # ------------------------------------------------------------ persisting
    def unpersisted(self) -> list[Datamarker]:
        with self.lock:
            return [
                Datamarker(f.application, f.shard, f.datamarker)
                for app in self.applications.values()
                for f in app.flows
                if f.datamarker != f.persisted
            ]

    def mark_persisted(self, datamarkers: list[Datamarker]) -> None:
        """``datamarkers`` are in the store now. A datamarker may have moved back (a copy
        following or taking over from the shared datamarkers): what is persisted follows it,
        so retention keeps what the flow may resume from."""
        with self.lock:
            for d in datamarkers:
                app = self.applications.get(d.application)
                if app is not None:
                    app.flows[d.shard].persisted = d.position

    def min_persisted(self) -> int | None:
        with self.lock:
            values = [f.persisted for app in self.applications.values() for f in app.flows]
        return min(values) if values else None

    def all_acknowledged(self, position: int) -> bool:
        with self.lock:
            return all(
                f.datamarker >= position
                for app in self.applications.values()
                if app.name not in self.failed
                for f in app.flows
            )


__all__ = ["ApplicationRuntime", "FlowState", "Frame", "Hub", "SubscriberSession"]
