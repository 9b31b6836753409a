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
from typing import Protocol

from wormhole.core.pipeline import Application, Pipeline
from wormhole.core.update import Update
from wormhole.plugins.components import Datamarker

log = logging.getLogger("wormhole.hub")

BatchFilter = Callable[[list[Update]], list[Update]]


@dataclass(slots=True)
class Flow:
    application: str
    shard: int
    datamarker: int
    """Acknowledged: every update before this seq was handled."""
    persisted: int
    """The datamarker last written to the datamarker store."""
    delivered: int
    """End seq of the last frame handed to a subscriber (>= datamarker)."""


@dataclass(slots=True)
class Frame:
    """What a subscriber session receives: its updates of one publisher-log batch.

    ``updates`` are in log order and hold only the session's shards;
    ``datamarkers`` maps each of those shards to the seq the flow reaches once
    this frame is processed (it moves even when no update of the shard passed
    the filter).
    """

    application: str
    updates: list[Update]
    datamarkers: dict[int, int]
    first_seq: int
    end_seq: int


class SubscriberSession(Protocol):
    """A subscriber as the hub sees it (in-process, or the publisher end of a connection)."""

    name: str

    def notice(self, assigned: list[int], revoked: list[int]) -> None:
        """Shards this session now owns / no longer owns."""

    def deliver(self, frame: Frame, stop: threading.Event) -> bool:
        """Queue a frame; block while the subscriber is behind (backpressure).

        Returns False if ``stop`` was set before the frame could be queued.
        """


@dataclass
class ApplicationRuntime:
    config: Application
    flows: list[Flow]
    filter: BatchFilter | None
    sessions: list[SubscriberSession] = field(default_factory=list)
    owner: list[SubscriberSession | None] = field(default_factory=list)
    owned: dict[int, list[int]] = field(default_factory=dict)  # id(session) -> shards
    delivered_updates: int = 0
    acknowledged_updates: int = 0

    @property
    def name(self) -> str:
        return self.config.name

    def min_datamarker(self) -> int:
        return min(f.datamarker for f in self.flows)


class Hub:
    def __init__(self, pipeline: Pipeline, applications: dict[str, ApplicationRuntime]) -> None:
        self.pipeline = pipeline
        self.shards = pipeline.shards
        self.applications = applications
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.failure: BaseException | None = None
        for app in applications.values():
            app.owner = [None] * self.shards

    # ------------------------------------------------------------ sessions
    def attach(self, application: str, session: SubscriberSession) -> None:
        app = self.applications[application]
        with self.lock:
            app.sessions.append(session)
            self._assign(app)
            self.changed.notify_all()

    def detach(self, session: SubscriberSession) -> None:
        with self.lock:
            for app in self.applications.values():
                if session in app.sessions:
                    app.sessions.remove(session)
                    app.owned.pop(id(session), None)
                    self._assign(app)
            self.changed.notify_all()

    def _assign(self, app: ApplicationRuntime) -> None:
        # Caller holds the lock. Shard s goes to session s % n: a stable, even split.
        sessions = app.sessions
        new_owned: dict[int, list[int]] = {id(s): [] for s in sessions}
        for shard in range(self.shards):
            owner = sessions[shard % len(sessions)] if sessions else None
            app.owner[shard] = owner
            if owner is not None:
                new_owned[id(owner)].append(shard)
        for session in sessions:
            before = set(app.owned.get(id(session), []))
            after = new_owned[id(session)]
            assigned = [s for s in after if s not in before]
            revoked = sorted(before - set(after))
            if assigned or revoked:
                session.notice(assigned, revoked)
        app.owned = new_owned

    def wait_for_sessions(self, app: ApplicationRuntime, stop: threading.Event) -> bool:
        with self.lock:
            while not app.sessions:
                if stop.is_set():
                    return False
                self.changed.wait(0.2)
        return True

    # ---------------------------------------------------------------- acks
    def acknowledge(self, application: str, datamarkers: dict[int, int], updates: int) -> None:
        """A subscriber processed a frame: move its flows' datamarkers forward."""
        app = self.applications[application]
        flows = app.flows
        with self.lock:
            for shard, position in datamarkers.items():
                flow = flows[shard]
                if position > flow.datamarker:
                    flow.datamarker = position
            app.acknowledged_updates += updates
            self.changed.notify_all()

    def fail(self, error: BaseException) -> None:
        """A component hit an error that retrying cannot fix: stop the pipeline."""
        with self.lock:
            if self.failure is None:
                self.failure = error
            self.changed.notify_all()

    def unpersisted(self) -> list[Datamarker]:
        with self.lock:
            return [
                Datamarker(f.application, f.shard, f.datamarker)
                for app in self.applications.values()
                for f in app.flows
                if f.datamarker != f.persisted
            ]

    def mark_persisted(self, datamarkers: list[Datamarker]) -> None:
        with self.lock:
            for d in datamarkers:
                flow = self.applications[d.application].flows[d.shard]
                flow.persisted = max(flow.persisted, d.position)

    def min_persisted(self) -> int | None:
        with self.lock:
            values = [f.persisted for app in self.applications.values() for f in app.flows]
        return min(values) if values else None

    def all_acknowledged(self, position: int) -> bool:
        with self.lock:
            return all(
                f.datamarker >= position for app in self.applications.values() for f in app.flows
            )
