"""A serving copy's side of multiple-copy delivery: share the application's datamarkers under
its claim (the registry refuses them once the claim is lost: fencing), and hand the
application over to another copy when a move or ``failback: auto`` asks, once that copy's
log has reached what was shared.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from wormhole.core.copy_positions import STATUS_AGE_S
from wormhole.core.copy_state import CopyState

if TYPE_CHECKING:
    from wormhole.core.copies import CopyCoordinator

log = logging.getLogger("wormhole.copies")

HANDOVER_TIMEOUT_S = 10.0
"""How long a copy giving an application back waits for its subscribers to let go."""
HANDOVER_READY_S = 5.0
"""Then how long it waits for the other copy to be ready for the final datamarkers."""


class CopyServing:
    """What a copy does for the applications it serves (for a
    :class:`~wormhole.core.copies.CopyCoordinator`, whose lock guards the states)."""

    def __init__(self, coordinator: CopyCoordinator) -> None:
        self.coordinator = coordinator
        self.copy = coordinator.copy
        self.datastore = coordinator.datastore

    def serve(self, state: CopyState, now: float) -> None:
        c = self.coordinator
        epoch = state.epoch
        if not self.save(state):
            return
        app = c.hub.applications.get(state.name)
        if app is None:
            return
        if state.handing_over is None and c.election.give_up_unreached(state, epoch, now):
            return
        target = self.hand_over_to(state, app)
        if state.handing_over is None:
            if target is not None and self._ready(state, target):
                self._start_hand_over(state, epoch, target, now)
            return
        if state.settled_at is None:
            if not c.hub.settled(state.name) and now - state.handing_over <= HANDOVER_TIMEOUT_S:
                return
            state.settled_at = now
        if not self.save(state):
            return  # the claim is lost meanwhile: nothing to hand over
        # Checked again at the moment of handing over, with the final datamarkers: the other
        # copy's log must have reached them (it may take a status interval to say so).
        ready = target is not None and self._ready(state, target, final=True)
        with c.lock:
            if not c.holds(state, epoch) or state.settled_at is None:
                return  # an interruption took the claim and reset the hand-over meanwhile
            if ready:
                state.epoch = 0
                state.handing_over = state.settled_at = None
            elif target is None or now - state.settled_at > HANDOVER_READY_S:
                state.handing_over = state.settled_at = None
                c.hub.activate(state.name, epoch, {})
                log.info(
                    "application %s: copy %s keeps serving it: copy %s did not become ready "
                    "to take it over within %.0fs; the hand-over is called off",
                    state.name,
                    self.copy,
                    target or "(none)",
                    HANDOVER_READY_S,
                )
                return
            else:
                return
        # Outside the lock: the registry's own thread takes it to report an interruption.
        c.registry.release_serving(state.name, self.datastore, epoch)

    def _start_hand_over(self, state: CopyState, epoch: int, target: str, now: float) -> None:
        """Revoke the application's flows from its subscribers, to hand it to ``target``."""
        c = self.coordinator
        with c.lock:
            # Reading the other copy's status may have waited out a registry
            # interruption, which took the claim: nothing is ours to hand over.
            if not c.holds(state, epoch):
                return
            log.info(
                "application %s: copy %s hands it over to copy %s",
                state.name,
                self.copy,
                target,
            )
            state.handing_over = now
            c.hub.deactivate(state.name)

    def hand_over_to(self, state: CopyState, app: Any) -> str | None:
        """The copy this serving copy should give the application to, if any: the one a
        move requested since it claimed the application (``wormhole apps move``), else, with
        ``failback: auto``, the most preferred live copy when it is more preferred than this."""
        c = self.coordinator
        live = [e.copy for e in c.copies]
        move = app.config.move
        if move is not None and move.requested > state.claimed_ms:
            return move.to if move.to != self.copy and move.to in live else None
        if app.config.failback != "auto":
            return None
        preference = c.preference(state.name)
        if self.copy not in preference or preference[0] == self.copy:
            return None
        return preference[0]

    def _ready(self, state: CopyState, copy: str, final: bool = False) -> bool:
        """Whether the other copy ``copy`` can take ``state``'s application over now: its
        status, read now, says it is ready (it mapped every shared datamarker since it last
        connected) and that its publisher log reached every datamarker this copy shared."""
        why = self.unable(state, copy, final)
        if not why:
            state.waiting_for = ""
            return True
        if state.waiting_for != copy:
            state.waiting_for = copy
            log.info(
                "application %s: copy %s is preferred but cannot take over yet: %s; copy %s "
                "keeps serving it",
                state.name,
                copy,
                why,
                self.copy,
            )
        return False

    def unable(self, state: CopyState, copy: str, final: bool = False) -> str:
        """Why the other copy ``copy`` cannot take ``state``'s application over now, from its
        status read now ("" if it can): its log must have reached the shared datamarkers
        (``final``: as they are now; else as they were ``STATUS_AGE_S`` ago)."""
        c = self.coordinator
        c.statuses = c.registry.statuses()
        status = c.statuses.get(f"{self.datastore}@{copy}", {})
        # The publisher shares the coordinator's status under "copies".
        shared: dict[str, Any] = status.get("copies", {})
        newest = shared.get("newest")
        needed = c.positions.needed(state, 0.0 if final else STATUS_AGE_S)
        if not shared.get("copies_ready", {}).get(state.name):
            return "it is not ready (it has not mapped every shared datamarker)"
        if needed is not None and (newest is None or tuple(newest) < needed):
            return f"its publisher log reached version {newest}, the shared datamarkers {needed}"
        return ""

    def save(self, state: CopyState) -> bool:
        """Share the serving application's datamarkers; False if fenced (claim lost)."""
        c = self.coordinator
        app = c.hub.applications.get(state.name)
        if app is None or not state.epoch:
            return False
        with c.hub.lock:
            positions = {f.shard: f.datamarker for f in app.flows}
        changed = c.positions.shared(state, positions)
        if not changed:
            return True
        if not c.registry.save_datamarkers(state.name, self.datastore, state.epoch, changed):
            log.warning(
                "application %s: the registry refused this copy's datamarkers (epoch %d: the "
                "claim is lost); it stops serving it",
                state.name,
                state.epoch,
            )
            c.stop_serving(state)
            return False
        state.saved.update(changed)
        c.positions.remember_shared(state)
        for shard, marker in changed.items():
            state.mapped[shard] = (tuple(marker.version), positions[shard])
        return True


__all__ = ["HANDOVER_READY_S", "HANDOVER_TIMEOUT_S", "CopyServing"]
