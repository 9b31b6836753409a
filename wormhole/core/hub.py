"""Applications, flows and subscriber sessions on the publisher side.

A *flow* is the stream of one shard's updates to one application: the unit of
ordering and of acknowledgement. Its *datamarker* is the publisher-log seq
before which every update was processed by a subscriber (or filtered out). The
hub divides each application's shards among its attached subscriber sessions,
routes frames from the caravan to them, and takes their acknowledgements.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from wormhole.core.flows import FlowState
from wormhole.core.pipeline import Application, Pipeline
from wormhole.core.publisher_log import LogReader, PublisherLog
from wormhole.core.update import Update
from wormhole.plugins.assignment import spread
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


def _instance(session: SubscriberSession) -> str:
    return getattr(session, "instance", "") or session.name


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
        self.datastore = pipeline.datastore or pipeline.name
        self.datastores: dict[str, int] = {self.datastore: self.shards}
        """Every live datastore of the dataset and its shards (from the registry)."""
        self.registered: dict[str, list[str]] = {}
        """Each application's subscribers as the registry lists them, in registration order."""
        for app in applications.values():
            app.owner = [None] * self.shards

    # ------------------------------------------------------ multiple copies
    def activate(self, application: str, epoch: int, datamarkers: dict[int, int]) -> None:
        """Serve ``application`` from ``datamarkers`` (shard -> seq of this publisher log)
        under the claim ``epoch``: its flows go to its subscribers."""
        with self.lock:
            app = self.applications[application]
            for shard, position in datamarkers.items():
                flow = app.flows[shard]
                flow.datamarker = flow.delivered = position
            app.epoch = epoch
            app.active = True
            app.rewind += 1
            self._assign(app)
            self.changed.notify_all()

    def deactivate(self, application: str) -> None:
        """Stop serving ``application`` (its claim is gone or being given up): its flows are
        revoked from its subscribers and nothing more is delivered."""
        with self.lock:
            app = self.applications.get(application)
            if app is None or not app.active:
                return
            app.active = False
            self._assign(app)
            self.changed.notify_all()

    def settled(self, application: str) -> bool:
        """Whether no subscriber holds any of ``application``'s flows any more."""
        with self.lock:
            app = self.applications.get(application)
            return app is None or (not app.revoking and all(owner is None for owner in app.owner))

    def epoch(self, application: str) -> int:
        app = self.applications.get(application)
        return app.epoch if app is not None else 0

    # ---------------------------------------------------------- membership
    def set_datastores(self, datastores: dict[str, int]) -> None:
        """The registry's live datastores changed: flows may move between subscribers."""
        with self.lock:
            datastores = dict(datastores)
            datastores.setdefault(self.datastore, self.shards)
            if datastores == self.datastores:
                return
            self.datastores = datastores
            for app in self.applications.values():
                self._assign(app)
            self.changed.notify_all()

    def set_registered(self, application: str, instances: list[str]) -> None:
        """The registry's subscribers of ``application`` changed."""
        with self.lock:
            if self.registered.get(application) == instances:
                return
            self.registered[application] = list(instances)
            app = self.applications.get(application)
            if app is not None:
                self._assign(app)
            self.changed.notify_all()

    # ------------------------------------------------------------ sessions
    def local_subscriber(
        self, app: ApplicationRuntime, index: int, max_frames: int
    ) -> LocalSubscriberSession:
        """A subscriber of ``app`` on a thread of this process (see the PublisherView)."""
        from wormhole.subscriber.local import local_subscriber

        return local_subscriber(self, app, index, max_frames)

    def attach(self, application: str, session: SubscriberSession) -> None:
        app = self.applications[application]
        with self.lock:
            app.sessions.append(session)
            self._assign(app)
            self.changed.notify_all()
        log.info(
            "%s joined application %s (%d subscribers)",
            session.name,
            application,
            len(app.sessions),
        )

    def detach(self, session: SubscriberSession, reason: str = "") -> None:
        """A session is gone (clean leave, lost connection, missed heartbeats)."""
        with self.lock:
            for app in self.applications.values():
                if session not in app.sessions:
                    continue
                app.sessions.remove(session)
                moved = False
                for shard, owner in enumerate(app.owner):
                    if owner is session:
                        app.owner[shard] = None
                        moved = True
                for shard, giver in list(app.revoking.items()):
                    if giver is session:
                        del app.revoking[shard]
                if moved:
                    self._reset_unowned(app)
                self._assign(app)
                log.info(
                    "%s left application %s%s (%d subscribers)",
                    session.name,
                    app.name,
                    f": {reason}" if reason else "",
                    len(app.sessions),
                )
            self.changed.notify_all()

    def revoked(self, application: str, session: SubscriberSession, shards: list[int]) -> None:
        """The session finished every frame it held for ``shards`` and let them go."""
        app = self.applications.get(application)
        if app is None:
            return
        with self.lock:
            for shard in shards:
                if app.revoking.get(shard) is session:
                    del app.revoking[shard]
            self._assign(app)
            self.changed.notify_all()

    def _reset_unowned(self, app: ApplicationRuntime) -> None:
        # Frames in flight to a lost owner are gone: its flows restart from the
        # datamarker at their next owner, which means re-reading from there.
        for shard, owner in enumerate(app.owner):
            flow = app.flows[shard]
            if owner is None and shard not in app.revoking and flow.delivered != flow.datamarker:
                flow.delivered = flow.datamarker
                app.rewind += 1

    def _assign(self, app: ApplicationRuntime) -> None:
        # Caller holds the lock. Owners come from the assignment (an even split of the
        # dataset's flows over the subscribers, see `spread`). A shard changes hands in two
        # steps: the old owner is told to let go, and only once it confirms does the new
        # owner get it, from the flow's datamarker -- so two subscribers never hold one
        # flow at once.
        sessions = app.sessions
        assigned: dict[int, list[int]] = {}
        revoked: dict[int, list[int]] = {}
        by_id = {id(s): s for s in sessions}
        wanted_owners = spread(
            self.datastore,
            self.shards,
            self.datastores,
            self.registered.get(app.name, ()),
            sessions if app.active else [],
            _instance,
        )
        for shard, wanted in enumerate(wanted_owners):
            current = app.owner[shard]
            if current is wanted or shard in app.revoking:
                continue
            if current is not None:
                app.owner[shard] = None
                app.revoking[shard] = current
                revoked.setdefault(id(current), []).append(shard)
                by_id[id(current)] = current
            elif wanted is not None:
                # The caravan may have read past this flow while nobody owned it:
                # its new owner starts at the datamarker, re-read from there.
                flow = app.flows[shard]
                flow.delivered = flow.datamarker
                app.rewind += 1
                app.owner[shard] = wanted
                assigned.setdefault(id(wanted), []).append(shard)
        for key in set(assigned) | set(revoked):
            session = by_id[key]
            datamarkers = {s: app.flows[s].datamarker for s in assigned.get(key, [])}
            session.notice(assigned.get(key, []), revoked.get(key, []), datamarkers)

    # ---------------------------------------------------------------- acks
    def acknowledge(
        self,
        application: str,
        session: SubscriberSession,
        datamarkers: dict[int, int],
        updates: int,
    ) -> None:
        """A subscriber processed a frame: move its flows' datamarkers forward.

        Only flows the session holds (owns, or is still letting go of) move: a
        late acknowledgement from a former owner never speaks for the new one.
        """
        app = self.applications.get(application)
        if app is None:
            return  # removed from the pipeline meanwhile; its datamarkers were saved
        flows = app.flows
        with self.lock:
            for shard, position in datamarkers.items():
                if not 0 <= shard < self.shards:
                    continue
                if app.owner[shard] is not session and app.revoking.get(shard) is not session:
                    continue
                flow = flows[shard]
                # Never past what was delivered: an acknowledgement cannot invent data.
                position = min(position, flow.delivered)
                if position > flow.datamarker:
                    flow.datamarker = position
            app.acknowledged_updates += updates
            self.changed.notify_all()

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

    # ---------------------------------------- for a transport that reads the log
    def _log(self) -> PublisherLog:
        assert self.publisher_log is not None, (
            "the publisher sets the log before the transport starts"
        )
        return self.publisher_log

    def _store(self) -> DatamarkerStore:
        assert self.store is not None, "the publisher sets the store before the transport starts"
        return self.store

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
