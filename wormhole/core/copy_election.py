"""A standby copy's side of multiple-copy delivery: follow the shared datamarkers, claim a
free application in its turn (the most preferred live copy first, each less preferred one
after its grace period), and take it over from the shared datamarkers; a serving copy that
none of the application's subscribers reaches gives its claim up to one they do.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from wormhole.core.copy_state import CLAIM_GRACE_S, UNREACHED_S, CopyState
from wormhole.core.errors import StateError
from wormhole.plugins.events import SERVING_CLAIMS

if TYPE_CHECKING:
    from wormhole.core.copies import CopyCoordinator

log = logging.getLogger("wormhole.copies")


class CopyElection:
    """Which copy claims an application, and how one takes it over (for a
    :class:`~wormhole.core.copies.CopyCoordinator`, whose lock guards the states)."""

    def __init__(self, coordinator: CopyCoordinator) -> None:
        self.coordinator = coordinator
        self.copy = coordinator.copy
        self.datastore = coordinator.datastore

    def stand_by(self, state: CopyState, now: float) -> None:
        c = self.coordinator
        shared = c.registry.load_datamarkers(state.name, self.datastore)
        why = c.positions.follow(state, shared)
        if why:
            c.report(state, why)
        unreached = self.unreached(state, now)
        if unreached and state.ready:
            state.ready, state.why, state.behind = False, unreached, False
        if state.claim is not None:
            state.behind_since, state.warned = None, False
            return
        if not self._my_turn(state, now):
            state.behind_since = None
            return
        if not state.ready:
            self._cannot_serve(state, now)
            return
        state.behind_since, state.warned = None, False
        if now < state.refused_until:
            return  # it refused lately: the less preferred copies get their turn first
        with c.lock:
            generation = c.generation
        epoch = c.registry.claim_serving(state.name, self.datastore, self.copy)
        if epoch is None:
            return
        try:
            self.take_over(state, epoch, generation)
        except StateError as exc:
            c.registry.release_serving(state.name, self.datastore, epoch)
            self._refused(state, now, str(exc))
            raise

    def unreached(self, state: CopyState, now: float) -> str:
        """Why the application's subscribers cannot be served from this copy: the registry
        has listed some for ``UNREACHED_S`` while none was connected here (a partition
        between them and this copy); "" when one is connected or none is listed."""
        hub = self.coordinator.hub
        app = hub.applications.get(state.name)
        with hub.lock:
            registered = len(hub.subscriptions.registered.get(state.name, []))
            connected = app is not None and bool(app.sessions)
        if connected or not registered:
            state.unreached_since = None
            return ""
        if state.unreached_since is None:
            state.unreached_since = now
        if now - state.unreached_since < UNREACHED_S:
            return ""
        return (
            f"none of its subscribers ({registered} registered) has been connected to this "
            f"copy for {now - state.unreached_since:.0f}s"
        )

    def give_up_unreached(self, state: CopyState, epoch: int, now: float) -> bool:
        """Serving, but none of the application's subscribers reaches this copy while
        another live copy is ready for it (it reaches them): give the claim up, so that the
        other copy serves them. True if it did."""
        c = self.coordinator
        why = self.unreached(state, now)
        if not why:
            return False
        others = [copy for copy in c.preference(state.name) if copy != self.copy]
        able = next((copy for copy in others if not c.serving.unable(state, copy)), None)
        if able is None:
            return False  # nobody else could serve them either: keep the claim
        with c.lock:
            if not c.holds(state, epoch):
                return True
            # Stays away past the other copies' grace period, as after a refusal.
            state.refused_until = now + len(c.preference(state.name)) * CLAIM_GRACE_S
            c.stop_serving(state)
        SERVING_CLAIMS.labels(state.name, "unreached").inc()
        log.warning(
            "application %s: copy %s gives it up (epoch %d): %s, and copy %s is ready for it",
            state.name,
            self.copy,
            epoch,
            why,
            able,
        )
        c.registry.release_serving(state.name, self.datastore, epoch)
        return True

    def _my_turn(self, state: CopyState, now: float) -> bool:
        """Whether this copy may claim the free application now: it is the most preferred
        live copy, or the ones before it had their grace period (2 s per rank)."""
        preference = self.coordinator.preference(state.name)
        if self.copy not in preference:
            return False
        rank = preference.index(self.copy)
        waited = now - (state.free_since or now)
        return rank == 0 or waited >= rank * CLAIM_GRACE_S

    def _cannot_serve(self, state: CopyState, now: float) -> None:
        """Its turn, but this copy cannot serve the application (its log is behind the shared
        datamarkers, or no longer holds them): it does not claim it, says why once, and
        after ``delivery.catch_up_ms`` behind reports it as an error."""
        if state.behind_since is None:
            state.behind_since, state.overdue = now, False
        if not state.warned:
            state.warned = True
            log.warning(
                "application %s: copy %s cannot serve it: %s; it does not claim it (a less "
                "preferred ready copy takes it over after its grace period)",
                state.name,
                self.copy,
                state.why or "it has not mapped the shared datamarkers",
            )
        waited = now - state.behind_since
        catch_up_s = self.coordinator.pipeline.catch_up_s
        if state.behind and not state.overdue and waited >= catch_up_s:
            state.overdue = True  # reported once: the message changes as the log grows
            raise StateError(
                f"{state.why}; waited {catch_up_s:.0f}s (delivery.catch_up_ms) "
                f"for it to catch up: this copy does not serve the application"
            )

    def _refused(self, state: CopyState, now: float, why: str) -> None:
        """A claim given back without serving: it stays away past the grace period of every
        less preferred copy, so that one of them serves meanwhile."""
        SERVING_CLAIMS.labels(state.name, "refused").inc()
        backoff = len(self.coordinator.preference(state.name)) * CLAIM_GRACE_S
        state.refused_until = now + backoff
        log.warning(
            "application %s: copy %s claimed it but cannot serve it: %s; it gave the claim "
            "back and does not claim it again for %.0fs",
            state.name,
            self.copy,
            why,
            backoff,
        )

    def take_over(self, state: CopyState, epoch: int, generation: int) -> None:
        """Serve from the shared datamarkers under the claim ``epoch``, made when the registry
        connection had been interrupted ``generation`` times."""
        c = self.coordinator
        shared = c.registry.load_datamarkers(state.name, self.datastore)
        positions = c.positions.take_over(state, shared)
        with c.lock:
            # Under the lock a connection loss waits for: it finds the claim served and
            # stops serving it. One that came meanwhile (loading the datamarkers retries up
            # to the connect timeout, past the session) may have taken the claim with it.
            if c.generation != generation:
                log.info(
                    "application %s: the registry connection was interrupted while copy %s "
                    "took it over; it gives the claim (epoch %d) back",
                    state.name,
                    self.copy,
                    epoch,
                )
                c.lost.append((state.name, epoch))
                return
            state.epoch = epoch
            state.handing_over = state.settled_at = None
            state.claimed_ms = int(time.time() * 1000)
            state.saved = dict(shared)
            state.shared_at = []
            c.positions.remember_shared(state)
            c.hub.activate(state.name, epoch, positions)
        SERVING_CLAIMS.labels(state.name, "served").inc()
        state.reported = ""
        log.info(
            "application %s: copy %s of %s serves it from epoch %d (%s)",
            state.name,
            self.copy,
            self.datastore,
            epoch,
            "from the shared datamarkers" if shared else "from its start",
        )


__all__ = ["CopyElection"]
