"""Multiple-copy delivery: one copy of a datastore serves each application, another takes over.

Several publishers read copies of one datastore (a MariaDB primary and its GTID replica; two
hosts writing the same ``LogWriter`` stream), each into its own publisher log. For every
application exactly one of them -- the copy holding the application's *serving claim* in the
registry -- delivers its flows; the others stand by. The claim carries an *epoch* that grows
with every claim: subscribers drop what a copy with an older epoch still sends, and the
registry refuses datamarkers written under a lost claim (fencing).

The serving copy shares each flow's datamarker as a logical position: the position mapper's
*version* of the last update before the datamarker, which is the same on every copy. A copy
taking over finds, in its own publisher log, the first update with a greater version, and
serves from there: nothing handled before is lost, and what is delivered again is at most
what was handled since the last shared datamarker (one datamarker interval).

A standby copy follows the shared datamarkers, so that its publisher log keeps what a
takeover would need (and no more), and so that a takeover does not scan its whole log.

The :class:`CopyCoordinator` owns what this copy knows of each application
(:class:`~wormhole.core.copy_state.CopyState`, under its lock) and the registry's watches;
its collaborators act on it: :class:`~wormhole.core.copy_election.CopyElection` (standing by,
claiming, taking over), :class:`~wormhole.core.copy_serving.CopyServing` (sharing the
datamarkers, handing over) and :class:`~wormhole.core.copy_positions.CopyPositions` (where
the shared datamarkers map into this copy's publisher log).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from wormhole.core.copy_election import CopyElection
from wormhole.core.copy_positions import STATUS_AGE_S, Behind, CopyPositions, Gone, locate
from wormhole.core.copy_registry import CopyRegistry, copy_registry
from wormhole.core.copy_serving import HANDOVER_READY_S, HANDOVER_TIMEOUT_S, CopyServing
from wormhole.core.copy_state import CopyState
from wormhole.core.errors import StateError
from wormhole.core.hub import Hub
from wormhole.core.pipeline import Pipeline
from wormhole.core.publisher_log import PublisherLog
from wormhole.plugins.components import PublisherEntry, ServingClaim

log = logging.getLogger("wormhole.copies")


class CopyCoordinator:
    """This publisher as one copy of its datastore."""

    def __init__(
        self,
        pipeline: Pipeline,
        registry: CopyRegistry,
        hub: Hub,
        publisher_log: PublisherLog,
    ) -> None:
        self.pipeline = pipeline
        self.registry = registry
        self.hub = hub
        self.publisher_log = publisher_log
        self.datastore = pipeline.datastore
        self.copy = pipeline.copy
        self.lock = threading.Lock()
        self.apps: dict[str, CopyState] = {}
        self.copies: list[PublisherEntry] = []
        """The live copies of this datastore, in registration order."""
        self.connected = True
        self.lost: list[tuple[str, int]] = []
        """Claims the registry connection was interrupted under: released once it is back."""
        self.statuses: dict[str, dict[str, Any]] = {}
        self.dirty = threading.Event()
        """Set when the registry changed since the last tick."""
        self.watching: dict[str, Callable[[], None] | None] = {}
        """What ends the watch of each application's serving claim (None: being set up);
        ended when the application is removed."""
        self.generation = 0
        """Registry connection interruptions so far: a claim made before one is not served."""
        self.positions = CopyPositions(publisher_log, hub)
        self.election = CopyElection(self)
        self.serving = CopyServing(self)

    # ------------------------------------------------------------- start
    def start(self) -> None:
        self.registry.watch_connection(self._connection)
        self.registry.watch_publishers(self._publishers)
        for name in list(self.hub.applications):
            self.add(name)

    def add(self, name: str) -> None:
        with self.lock:
            if name in self.apps:
                return
            self.apps[name] = CopyState(name)
            watched = name in self.watching
            if not watched:
                self.watching[name] = None
        self.hub.deactivate(name)
        if watched:
            return

        def changed(claim: ServingClaim | None) -> None:
            self._serving(name, claim)

        unwatch = self.registry.watch_serving(name, self.datastore, changed)
        with self.lock:
            if name in self.watching:
                self.watching[name] = unwatch
                return
        unwatch()  # removed meanwhile

    def remove(self, name: str) -> None:
        with self.lock:
            state = self.apps.pop(name, None)
            unwatch = self.watching.pop(name, None)
        if unwatch is not None:
            unwatch()
        if state is not None and state.epoch:
            self.serving.save(state)
            self.registry.release_serving(name, self.datastore, state.epoch)

    # ----------------------------------------------------------- watches
    def _wake(self) -> None:
        """The registry changed: the publisher ticks now rather than at its next interval."""
        self.dirty.set()
        with self.hub.changed:
            self.hub.changed.notify_all()

    def _connection(self, connected: bool) -> None:
        with self.lock:
            self.connected = connected
            if not connected:
                self.generation += 1
            for state in self.apps.values():
                # Whether this copy could take over is found again once connected: what
                # it was before (serving, so ready) says nothing of the shared datamarkers
                # written meanwhile.
                state.ready = False
            if not connected:
                # The claims may be gone already: deliver nothing more under them.
                for state in self.apps.values():
                    if state.epoch:
                        self.lost.append((state.name, state.epoch))
                        log.warning(
                            "application %s: registry connection interrupted; this copy (%s) "
                            "stops serving it (epoch %d)",
                            state.name,
                            self.copy,
                            state.epoch,
                        )
                        self.stop_serving(state)
        self._wake()

    def _publishers(self, entries: list[PublisherEntry]) -> None:
        copies = [e for e in entries if e.datastore == self.datastore and e.copy]
        copies.sort(key=lambda e: (e.started_ms, e.copy))
        with self.lock:
            self.copies = copies
        self._wake()

    def _serving(self, name: str, claim: ServingClaim | None) -> None:
        with self.lock:
            state = self.apps.get(name)
            if state is None:
                return
            state.claim = claim
            state.free(claim, time.monotonic())
            if state.epoch and (
                claim is None or claim.copy != self.copy or claim.epoch != state.epoch
            ):
                log.warning(
                    "application %s: this copy (%s) lost its claim (epoch %d); it stops serving it",
                    name,
                    self.copy,
                    state.epoch,
                )
                self.stop_serving(state)
        self._wake()

    # -------------------------------------------------------------- tick
    def preference(self, name: str) -> list[str]:
        """The live copies that may serve ``name``, most preferred first."""
        live = [e.copy for e in self.copies]
        app = self.hub.applications.get(name)
        wanted = list(app.config.copies or []) if app is not None else []
        return [c for c in wanted if c in live] + [c for c in live if c not in wanted]

    def tick(self) -> None:
        """Claim, serve, hand over or follow each application (the publisher calls this
        about every datamarker interval, and when the registry changes)."""
        self.dirty.clear()
        with self.lock:
            if not self.connected:
                return
            lost, self.lost = self.lost, []
            states = list(self.apps.values())
        for name, epoch in lost:
            self.registry.release_serving(name, self.datastore, epoch)
        now = time.monotonic()
        for state in states:
            try:
                if state.epoch:
                    self.serving.serve(state, now)
                else:
                    self.election.stand_by(state, now)
            except StateError as exc:
                self.report(state, str(exc))

    def report(self, state: CopyState, message: str) -> None:
        if message != state.reported:
            state.reported = message
            log.error("application %s (copy %s): %s", state.name, self.copy, message)

    def holds(self, state: CopyState, epoch: int) -> bool:
        """Whether ``state`` still serves under the claim ``epoch`` (under ``self.lock``)."""
        return bool(epoch) and state.epoch == epoch

    def stop_serving(self, state: CopyState) -> None:
        """Serve ``state``'s application no more: its flows are revoked from its subscribers."""
        state.epoch = 0
        state.handing_over = state.settled_at = None
        self.hub.deactivate(state.name)

    def retained(self) -> int | None:
        """The lowest seq of this publisher log that multiple-copy delivery needs (see
        :meth:`CopyPositions.retained`)."""
        with self.lock:
            states = list(self.apps.values())
        return self.positions.retained(states)

    # ------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """What this copy shares in its live status: which applications it serves, under
        which epoch, and which it could take over now."""
        with self.lock:
            states = list(self.apps.values())
        return {
            "copy": self.copy,
            "newest": self.positions.newest(),
            "serving": {s.name: s.epoch for s in states if s.epoch},
            "copies_ready": {s.name: s.ready or bool(s.epoch) for s in states},
            "shared_datamarkers": {
                s.name: {str(k): [v.logical, list(v.version)] for k, v in s.saved.items()}
                for s in states
                if s.epoch
            },
        }

    def finish(self) -> None:
        """A graceful stop: share the final datamarkers and give every claim up."""
        with self.lock:
            states = list(self.apps.values())
        for state in states:
            if state.epoch:
                self.serving.save(state)
                epoch, state.epoch = state.epoch, 0
                self.registry.release_serving(state.name, self.datastore, epoch)


__all__ = [
    "HANDOVER_READY_S",
    "HANDOVER_TIMEOUT_S",
    "STATUS_AGE_S",
    "Behind",
    "CopyCoordinator",
    "CopyRegistry",
    "Gone",
    "copy_registry",
    "locate",
]
