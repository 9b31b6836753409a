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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from wormhole.core.copy_positions import Behind, Gone, Version, locate, version
from wormhole.core.copy_state import CLAIM_GRACE_S, UNREACHED_S, CopyState
from wormhole.core.errors import ConfigError, StateError
from wormhole.core.hub import Hub
from wormhole.core.metrics import SERVING_CLAIMS
from wormhole.core.pipeline import Pipeline
from wormhole.core.publisher_log import PublisherLog
from wormhole.plugins.components import (
    DatasetRegistry,
    PublisherEntry,
    ServingClaim,
    ServingClaims,
    SharedDatamarker,
)

log = logging.getLogger("wormhole.copies")

HANDOVER_TIMEOUT_S = 10.0
"""How long a copy giving an application back waits for its subscribers to let go."""
HANDOVER_READY_S = 5.0
"""Then how long it waits for the other copy to be ready for the final datamarkers."""
STATUS_AGE_S = 1.5
"""How old another copy's status may be (each publisher shares its own about once a second).
Before it starts handing an application over, the serving copy asks that the other copy's log
had reached, when it last reported, what the serving copy had shared this long ago: writes
going on, the datamarkers shared now are always past a report a second old. The final check,
once the flows are revoked and the final datamarkers shared, asks for those exactly."""


class CopyRegistry(ServingClaims, Protocol):
    """What a copy uses of its registry: the serving claims, and of the membership the
    connection, the publishers and their statuses."""

    def watch_connection(self, fn: Callable[[bool], None]) -> None: ...

    def watch_publishers(self, fn: Callable[[list[PublisherEntry]], None]) -> None: ...

    def statuses(self) -> dict[str, dict[str, Any]]: ...


class _Parts:
    """A registry's membership and its serving claims part, as one :class:`CopyRegistry`."""

    def __init__(self, registry: DatasetRegistry, claims: ServingClaims) -> None:
        self.watch_connection = registry.watch_connection
        self.watch_publishers = registry.watch_publishers
        self.statuses = registry.statuses
        self.claim_serving = claims.claim_serving
        self.release_serving = claims.release_serving
        self.watch_serving = claims.watch_serving
        self.load_datamarkers = claims.load_datamarkers
        self.save_datamarkers = claims.save_datamarkers


def copy_registry(registry: DatasetRegistry) -> CopyRegistry:
    """The registry as the copies of a datastore use it; ConfigError if it offers no
    serving claims (``delivery.mode: multiple-copy`` needs them)."""
    claims = registry.serving_claims()
    if claims is None:
        raise ConfigError(
            f"delivery.mode: multiple-copy needs a registry with serving claims, where the "
            f"copies of a datastore find each other and keep their datamarkers "
            f"({registry.describe()} has none): set registry: "
            f"{{type: zookeeper, hosts: ..., root: ...}}"
        )
    return _Parts(registry, claims)


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
            self._save(state)
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
                        state.epoch = 0
                        state.handing_over = state.settled_at = None
                        self.hub.deactivate(state.name)
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
                state.epoch = 0
                state.handing_over = state.settled_at = None
                self.hub.deactivate(name)
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
                    self._serve(state, now)
                else:
                    self._stand_by(state, now)
            except StateError as exc:
                self._report(state, str(exc))

    def _report(self, state: CopyState, message: str) -> None:
        if message != state.reported:
            state.reported = message
            log.error("application %s (copy %s): %s", state.name, self.copy, message)

    def _stand_by(self, state: CopyState, now: float) -> None:
        self._follow(state)
        unreached = self._unreached(state, now)
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
        with self.lock:
            generation = self.generation
        epoch = self.registry.claim_serving(state.name, self.datastore, self.copy)
        if epoch is None:
            return
        try:
            self._take_over(state, epoch, generation)
        except StateError as exc:
            self.registry.release_serving(state.name, self.datastore, epoch)
            self._refused(state, now, str(exc))
            raise

    def _unreached(self, state: CopyState, now: float) -> str:
        """Why the application's subscribers cannot be served from this copy: the registry
        has listed some for ``UNREACHED_S`` while none was connected here (a partition
        between them and this copy); "" when one is connected or none is listed."""
        app = self.hub.applications.get(state.name)
        with self.hub.lock:
            registered = len(self.hub.registered.get(state.name, []))
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

    def _give_up_unreached(self, state: CopyState, epoch: int, now: float) -> bool:
        """Serving, but none of the application's subscribers reaches this copy while
        another live copy is ready for it (it reaches them): give the claim up, so that the
        other copy serves them. True if it did."""
        why = self._unreached(state, now)
        if not why:
            return False
        others = [c for c in self.preference(state.name) if c != self.copy]
        able = next((c for c in others if not self._unable(state, c)), None)
        if able is None:
            return False  # nobody else could serve them either: keep the claim
        with self.lock:
            if not self._holds(state, epoch):
                return True
            state.epoch = 0
            state.handing_over = state.settled_at = None
            # Stays away past the other copies' grace period, as after a refusal.
            state.refused_until = now + len(self.preference(state.name)) * CLAIM_GRACE_S
            self.hub.deactivate(state.name)
        SERVING_CLAIMS.labels(state.name, "unreached").inc()
        log.warning(
            "application %s: copy %s gives it up (epoch %d): %s, and copy %s is ready for it",
            state.name,
            self.copy,
            epoch,
            why,
            able,
        )
        self.registry.release_serving(state.name, self.datastore, epoch)
        return True

    def _my_turn(self, state: CopyState, now: float) -> bool:
        """Whether this copy may claim the free application now: it is the most preferred
        live copy, or the ones before it had their grace period (2 s per rank)."""
        preference = self.preference(state.name)
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
        if state.behind and not state.overdue and waited >= self.pipeline.catch_up_s:
            state.overdue = True  # reported once: the message changes as the log grows
            raise StateError(
                f"{state.why}; waited {self.pipeline.catch_up_s:.0f}s (delivery.catch_up_ms) "
                f"for it to catch up: this copy does not serve the application"
            )

    def _refused(self, state: CopyState, now: float, why: str) -> None:
        """A claim given back without serving: it stays away past the grace period of every
        less preferred copy, so that one of them serves meanwhile."""
        SERVING_CLAIMS.labels(state.name, "refused").inc()
        backoff = len(self.preference(state.name)) * CLAIM_GRACE_S
        state.refused_until = now + backoff
        log.warning(
            "application %s: copy %s claimed it but cannot serve it: %s; it gave the claim "
            "back and does not claim it again for %.0fs",
            state.name,
            self.copy,
            why,
            backoff,
        )

    def _take_over(self, state: CopyState, epoch: int, generation: int) -> None:
        """Serve from the shared datamarkers under the claim ``epoch``, made when the registry
        connection had been interrupted ``generation`` times."""
        shared = self.registry.load_datamarkers(state.name, self.datastore)
        hints = [seq for _, seq in state.mapped.values()]
        start = min(hints) - 1 if hints else self.publisher_log.first_seq
        targets = {s: tuple(d.version) for s, d in shared.items() if s < self.hub.shards}
        positions = locate(self.publisher_log, targets, max(0, start))
        state.loaded = True
        state.mapped.update({s: (targets[s], seq) for s, seq in positions.items()})
        with self.lock:
            # Under the lock a connection loss waits for: it finds the claim served and
            # stops serving it. One that came meanwhile (loading the datamarkers retries up
            # to the connect timeout, past the session) may have taken the claim with it.
            if self.generation != generation:
                log.info(
                    "application %s: the registry connection was interrupted while copy %s "
                    "took it over; it gives the claim (epoch %d) back",
                    state.name,
                    self.copy,
                    epoch,
                )
                self.lost.append((state.name, epoch))
                return
            state.epoch = epoch
            state.handing_over = state.settled_at = None
            state.claimed_ms = int(time.time() * 1000)
            state.saved = dict(shared)
            state.shared_at = []
            self._remember_shared(state)
            self.hub.activate(state.name, epoch, positions)
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

    def _follow(self, state: CopyState) -> None:
        """Standby: map the shared datamarkers into this log; keep the log from them on."""
        shared = self.registry.load_datamarkers(state.name, self.datastore)
        state.loaded = True
        self._forget_collected(state)
        targets = {
            s: tuple(d.version)
            for s, d in shared.items()
            if s < self.hub.shards and state.mapped.get(s, ((), 0))[0] != tuple(d.version)
        }
        if not targets:
            state.ready = True
            return
        try:
            positions = locate(self.publisher_log, targets, max(0, self._scan_from(state, targets)))
        except Behind as exc:
            state.ready, state.why, state.behind = False, str(exc), True
            # Keep what was found, and where the scan ended: the next tick reads on from
            # there rather than the whole log again.
            state.mapped.update({s: (targets[s], seq) for s, seq in exc.found.items()})
            state.scanned = exc.scanned
            return
        except Gone as exc:
            state.ready, state.why, state.behind = False, str(exc), False
            self._report(state, f"cannot stand by: {exc}")
            return
        for shard, seq in positions.items():
            state.mapped[shard] = (targets[shard], seq)
        state.ready = all(s in state.mapped for s in shared if s < self.hub.shards)
        # Keep the update each shared datamarker names, so a takeover after a restart finds it.
        app = self.hub.applications.get(state.name)
        if app is not None:
            with self.hub.lock:
                for shard, (_, seq) in state.mapped.items():
                    flow = app.flows[shard]
                    flow.datamarker = flow.delivered = max(0, seq - 1)

    def _scan_from(self, state: CopyState, targets: dict[int, Version]) -> int:
        """Where a scan for ``targets`` may start: each target's previous mapping (the new
        version is not older), or where a scan that left it pending ended."""
        starts = []
        for shard, target in targets.items():
            if shard in state.mapped:
                starts.append(state.mapped[shard][1] - 1)
            elif state.scanned is not None and target >= state.scanned[1]:
                starts.append(state.scanned[0] - 1)
            else:
                return self.publisher_log.first_seq
        return min(starts, default=self.publisher_log.first_seq)

    def _forget_collected(self, state: CopyState) -> None:
        """Drop the mappings whose named update this log no longer holds: they are looked
        up again (and refused as Gone), never reported ready from memory."""
        first = self.publisher_log.first_seq
        for shard, (_, seq) in list(state.mapped.items()):
            if seq - 1 < first:
                del state.mapped[shard]

    def retained(self) -> int | None:
        """The lowest seq of this publisher log that multiple-copy delivery needs: the
        update each shared datamarker names, wherever this copy serves or stands by (0,
        the whole log, for an application whose shared datamarkers it has not read yet).
        None when no shared datamarker needs anything."""
        with self.lock:
            states = list(self.apps.values())
        floor: int | None = None
        for state in states:
            if not state.loaded:
                return 0
            for _, seq in list(state.mapped.values()):
                floor = seq - 1 if floor is None else min(floor, seq - 1)
        return floor

    def _serve(self, state: CopyState, now: float) -> None:
        epoch = state.epoch
        if not self._save(state):
            return
        app = self.hub.applications.get(state.name)
        if app is None:
            return
        if state.handing_over is None and self._give_up_unreached(state, epoch, now):
            return
        target = self._hand_over_to(state, app)
        if state.handing_over is None:
            if target is not None and self._ready(state, target):
                with self.lock:
                    # Reading the other copy's status may have waited out a registry
                    # interruption, which took the claim: nothing is ours to hand over.
                    if not self._holds(state, epoch):
                        return
                    log.info(
                        "application %s: copy %s hands it over to copy %s",
                        state.name,
                        self.copy,
                        target,
                    )
                    state.handing_over = now
                    self.hub.deactivate(state.name)
            return
        if state.settled_at is None:
            if not self.hub.settled(state.name) and now - state.handing_over <= HANDOVER_TIMEOUT_S:
                return
            state.settled_at = now
        if not self._save(state):
            return  # the claim is lost meanwhile: nothing to hand over
        # Checked again at the moment of handing over, with the final datamarkers: the other
        # copy's log must have reached them (it may take a status interval to say so).
        ready = target is not None and self._ready(state, target, final=True)
        with self.lock:
            if not self._holds(state, epoch) or state.settled_at is None:
                return  # an interruption took the claim and reset the hand-over meanwhile
            if ready:
                state.epoch = 0
                state.handing_over = state.settled_at = None
            elif target is None or now - state.settled_at > HANDOVER_READY_S:
                state.handing_over = state.settled_at = None
                self.hub.activate(state.name, epoch, {})
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
        self.registry.release_serving(state.name, self.datastore, epoch)

    def _holds(self, state: CopyState, epoch: int) -> bool:
        """Whether ``state`` still serves under the claim ``epoch`` (under ``self.lock``)."""
        return bool(epoch) and state.epoch == epoch

    def _hand_over_to(self, state: CopyState, app: Any) -> str | None:
        """The copy this serving copy should give the application to, if any: the one a
        move requested since it claimed the application (``wormhole apps move``), else, with
        ``failback: auto``, the most preferred live copy when it is more preferred than this."""
        live = [e.copy for e in self.copies]
        move = app.config.move
        if move is not None and move.requested > state.claimed_ms:
            return move.to if move.to != self.copy and move.to in live else None
        if app.config.failback != "auto":
            return None
        preference = self.preference(state.name)
        if self.copy not in preference or preference[0] == self.copy:
            return None
        return preference[0]

    def _ready(self, state: CopyState, copy: str, final: bool = False) -> bool:
        """Whether the other copy ``copy`` can take ``state``'s application over now: its
        status, read now, says it is ready (it mapped every shared datamarker since it last
        connected) and that its publisher log reached every datamarker this copy shared."""
        why = self._unable(state, copy, final)
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

    def _unable(self, state: CopyState, copy: str, final: bool = False) -> str:
        """Why the other copy ``copy`` cannot take ``state``'s application over now, from its
        status read now ("" if it can): its log must have reached the shared datamarkers
        (``final``: as they are now; else as they were ``STATUS_AGE_S`` ago)."""
        self.statuses = self.registry.statuses()
        status = self.statuses.get(f"{self.datastore}@{copy}", {})
        # The publisher shares this coordinator's status under "copies".
        shared: dict[str, Any] = status.get("copies", {})
        newest = shared.get("newest")
        needed = self._needed(state, 0.0 if final else STATUS_AGE_S)
        if not shared.get("copies_ready", {}).get(state.name):
            return "it is not ready (it has not mapped every shared datamarker)"
        if needed is not None and (newest is None or tuple(newest) < needed):
            return f"its publisher log reached version {newest}, the shared datamarkers {needed}"
        return ""

    @staticmethod
    def _needed(state: CopyState, age: float) -> Version | None:
        """The newest version this serving copy's shared datamarkers had reached ``age``
        seconds ago (the oldest it remembers, if it has served less long)."""
        if age <= 0 or not state.shared_at:
            return max((tuple(d.version) for d in state.saved.values()), default=None)
        cutoff = time.monotonic() - age
        older = [version for at, version in state.shared_at if at <= cutoff]
        return older[-1] if older else state.shared_at[0][1]

    def _remember_shared(self, state: CopyState) -> None:
        """Record the newest version shared now; forget what is older than needed."""
        newest = max((tuple(d.version) for d in state.saved.values()), default=None)
        if newest is None:
            return
        now = time.monotonic()
        state.shared_at.append((now, newest))
        keep = [i for i, (at, _) in enumerate(state.shared_at) if at <= now - STATUS_AGE_S]
        if keep:
            del state.shared_at[: keep[-1]]

    def _save(self, state: CopyState) -> bool:
        """Share the serving application's datamarkers; False if fenced (claim lost)."""
        app = self.hub.applications.get(state.name)
        if app is None or not state.epoch:
            return False
        with self.hub.lock:
            positions = {f.shard: f.datamarker for f in app.flows}
        changed: dict[int, SharedDatamarker] = {}
        for shard, position in positions.items():
            if position <= 0:
                continue
            known = self._at(position - 1)
            if known is None:
                continue
            logical, found = known
            previous = state.saved.get(shard)
            if previous is not None and tuple(previous.version) >= found:
                continue
            changed[shard] = SharedDatamarker(logical, found, state.epoch)
        if not changed:
            return True
        if not self.registry.save_datamarkers(state.name, self.datastore, state.epoch, changed):
            log.warning(
                "application %s: the registry refused this copy's datamarkers (epoch %d: the "
                "claim is lost); it stops serving it",
                state.name,
                state.epoch,
            )
            state.epoch = 0
            state.handing_over = state.settled_at = None
            self.hub.deactivate(state.name)
            return False
        state.saved.update(changed)
        self._remember_shared(state)
        for shard, marker in changed.items():
            state.mapped[shard] = (tuple(marker.version), positions[shard])
        return True

    def _at(self, seq: int) -> tuple[str, Version] | None:
        """The logical position and version of the update at ``seq`` (None if not held)."""
        try:
            reader = self.publisher_log.reader(seq)
        except LookupError:
            return None
        try:
            batch = reader.read()
        except LookupError:
            return None
        finally:
            reader.close()
        if batch is None or not batch.updates:
            return None
        update = batch.updates[0]
        return update.logical, version(update)

    # ------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """What this copy shares in its live status: which applications it serves, under
        which epoch, and which it could take over now."""
        with self.lock:
            states = list(self.apps.values())
        return {
            "copy": self.copy,
            "newest": self._newest(),
            "serving": {s.name: s.epoch for s in states if s.epoch},
            "copies_ready": {s.name: s.ready or bool(s.epoch) for s in states},
            "shared_datamarkers": {
                s.name: {str(k): [v.logical, list(v.version)] for k, v in s.saved.items()}
                for s in states
                if s.epoch
            },
        }

    def _newest(self) -> list[int] | None:
        """The version of the newest update in this copy's publisher log (None if empty)."""
        if self.publisher_log.next_seq <= self.publisher_log.first_seq:
            return None
        try:
            newest = self._at(self.publisher_log.next_seq - 1)
        except StateError:  # a source without versions: reported where it is used
            return None
        return list(newest[1]) if newest is not None else None

    def finish(self) -> None:
        """A graceful stop: share the final datamarkers and give every claim up."""
        with self.lock:
            states = list(self.apps.values())
        for state in states:
            if state.epoch:
                self._save(state)
                epoch, state.epoch = state.epoch, 0
                self.registry.release_serving(state.name, self.datastore, epoch)


__all__ = ["Behind", "CopyCoordinator", "CopyRegistry", "Gone", "copy_registry", "locate"]
