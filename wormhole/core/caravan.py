"""Caravans: one reader of the publisher log serving every flow near its position.

A caravan reads from the oldest position its applications' flows still need and
then follows the tail, where the publisher log serves it from memory. For each
batch it fans out to each of its applications: skip what a flow already has,
apply the application's publisher-side filter, split by owning subscriber, and
deliver one frame per subscriber. Datamarkers move past filtered updates too.

The :class:`CaravanManager` decides which applications ride together:

- at start, applications whose flows start within ``merge_distance`` of one
  another share a caravan, at most ``max_caravans`` caravans in all (the
  nearest ones merge until the count fits);
- a caravan that comes within ``merge_distance`` behind another takes over the
  other's applications (at the tail they all end up in one lead caravan);
- an application that keeps its caravan waiting longer than ``slow_flow_s``
  (its subscribers do not take what they are given) leaves for a caravan of its
  own (or, at ``max_caravans``, joins the caravan furthest behind that is not
  blocked): the others never wait for it;
- an application with no subscriber connected leaves its shared caravan and is
  *parked* -- nothing reads for it -- until a subscriber connects. A caravan
  blocked on its only application's first subscriber is never given other
  applications while another caravan can take them, and stops waiting when it
  is given some.

More caravans read more of the log (disk I/O, CPU) and let each application
move at its own pace; fewer read it once and make applications that are
catching up wait for the one furthest behind.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

from wormhole.core.errors import FilterError, WormholeError
from wormhole.core.hub import ApplicationRuntime, Frame, Hub, SubscriberSession
from wormhole.core.publisher_log import Batch, PublisherLog
from wormhole.core.update import Update, for_application

log = logging.getLogger("wormhole.caravan")


class Caravan:
    """A reader of the publisher log serving the flows of some applications.

    The :class:`CaravanManager` decides which applications ride together; one whose
    subscribers are slow is moved off, so it falls behind (reading from disk) without
    holding the others back.
    """

    def __init__(
        self,
        hub: Hub,
        publisher_log: PublisherLog,
        stop: threading.Event,
        applications: list[ApplicationRuntime],
        slow_flow_s: float | None = None,
        on_evict: Any = None,
    ) -> None:
        self.hub = hub
        self.publisher_log = publisher_log
        self.stop = stop
        self.applications = list(applications)
        self.slow_flow_s = slow_flow_s
        self.on_evict = on_evict
        """Called with (caravan, application) when an application leaves this caravan."""
        self.retiring = threading.Event()
        self.merge_into: Caravan | None = None
        self.waiting = False
        """Blocked until its only application has a subscriber: it cannot dispatch, so it
        is neither a merge target nor a place for other applications."""
        self.lock = threading.Lock()
        names = ",".join(a.name for a in applications)
        self.thread = threading.Thread(target=self._run, name=f"caravan {names}", daemon=True)
        self.position = 0
        self.batches = 0
        self.updates_read = 0
        self.bytes_read = 0
        """Bytes of publisher log read from disk (the tail is served from memory)."""
        self.behind = False

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def _run(self) -> None:
        try:
            self._loop()
        except WormholeError as exc:
            self.hub.fail(exc)  # reported once, with its message, by the publisher
        except BaseException as exc:
            log.exception("caravan failed")
            self.hub.fail(exc)

    def _start_position(self) -> tuple[int, int]:
        # From the oldest position an owned flow needs; flows nobody owns wait
        # (they trigger a rewind once they have an owner and are behind).
        with self.lock:
            apps = list(self.applications)
        with self.hub.lock:
            rewinds = sum(a.rewind for a in apps)
            owned = [
                f.delivered
                for a in apps
                for f, o in zip(a.flows, a.owner, strict=True)
                if o is not None
            ]
            start = min(owned or [f.delivered for a in apps for f in a.flows])
        return start, rewinds

    def add(self, applications: list[ApplicationRuntime]) -> None:
        """Take on more applications (a merge); re-read from their position if behind."""
        with self.lock:
            self.applications.extend(applications)
            self.behind = True
        with self.hub.changed:
            self.hub.changed.notify_all()  # a caravan waiting for a subscriber stops waiting

    def _wait_for_sessions(self, app: ApplicationRuntime) -> str:
        """Block until ``app`` has a subscriber: "ready"; the caravan is stopping or the
        application was removed: "stop"; the caravan was given other applications
        meanwhile: "shared" (they must not wait for this one)."""
        hub = self.hub
        self.waiting = True
        try:
            with hub.lock:
                while not app.ready():
                    if self.stop.is_set() or hub.applications.get(app.name) is not app:
                        return "stop"
                    if len(self.applications) > 1:
                        return "shared"
                    hub.changed.wait(0.2)
            return "ready"
        finally:
            self.waiting = False

    def retire(self) -> None:
        """Stop at the next batch boundary; the manager hands the applications on."""
        self.retiring.set()

    def _loop(self) -> None:
        with self.lock:
            apps = list(self.applications)
        if len(apps) == 1 and self._wait_for_sessions(apps[0]) == "stop":
            return
        start, rewinds = self._start_position()
        reader = self.publisher_log.reader(start)
        self.position = start
        try:
            while not self.stop.is_set() and not self.retiring.is_set():
                with self.lock:
                    apps = list(self.applications)
                if not apps:
                    return
                if self.behind or sum(a.rewind for a in apps) != rewinds:
                    self.behind = False
                    start, rewinds = self._start_position()
                    if start < reader.position:
                        reader.close()
                        reader = self.publisher_log.reader(start)
                batch = reader.read()
                if batch is None:
                    self.publisher_log.wait_for(reader.position, 0.2)
                    continue
                for app in apps:
                    if not self._dispatch(app, batch, shared=len(apps) > 1):
                        return
                self.position = batch.end_seq
                self.batches += 1
                self.updates_read += len(batch.updates)
                self.bytes_read = reader.bytes_read
        finally:
            reader.close()

    def _evict(self, app: ApplicationRuntime, why: str) -> None:
        with self.lock:
            if app in self.applications:
                self.applications.remove(app)
        # The thread is named "caravan <applications>". An application without subscribers
        # is routine (they are starting, or restarting): no line at INFO for it.
        level = logging.DEBUG if why == "no subscriber connected" else logging.INFO
        log.log(level, "application %s leaves %s: %s", app.name, self.thread.name, why)
        if self.on_evict is not None:
            self.on_evict(self, app)

    def _dispatch(self, app: ApplicationRuntime, batch: Batch, shared: bool = False) -> bool:
        """Deliver ``batch`` to ``app``'s subscribers: True when done (or the application
        left this caravan), False when stopping."""
        hub = self.hub
        while True:
            with hub.lock:
                sessions = list(app.sessions) if app.active else []
                owner = list(app.owner)
                delivered = [f.delivered for f in app.flows]
            if not sessions:
                if shared and self.on_evict is not None:
                    # Nobody to deliver to: the others do not wait for it.
                    self._evict(app, "no subscriber connected")
                    return True
                waited = self._wait_for_sessions(app)
                if waited == "stop":
                    return False
                if waited == "shared" and self.on_evict is not None:
                    self._evict(app, "no subscriber connected")
                    return True
                shared = waited == "shared"
                continue  # a subscriber came: read its sessions again
            if min(delivered) >= batch.end_seq:
                return True
            updates = self._select(app, batch, owner, delivered)
            if updates is None:
                return True  # the application stopped on its filter
            sent = self._fan_out(app, batch, sessions, owner, delivered, updates, shared)
            if sent != "stale":
                return sent != "stop"
            # Another caravan delivered these flows meanwhile: dispatch again from there.

    def _fan_out(
        self,
        app: ApplicationRuntime,
        batch: Batch,
        sessions: list[SubscriberSession],
        owner: list[Any],
        delivered: list[int],
        updates: list[Update],
        shared: bool,
    ) -> str:
        """Split ``updates`` by owning session and hand each its frame: "sent" (every
        frame, or the application left this caravan: "evicted"), "stale" or "stop", as
        :meth:`_send` says."""
        frames: dict[int, list[Update]] = {id(s): [] for s in sessions}
        if len(sessions) == 1 and all(o is sessions[0] for o in owner):
            frames[id(sessions[0])] = updates
        else:
            for u in updates:
                target = owner[u.shard]
                if target is not None:
                    frames[id(target)].append(u)
        for session in sessions:
            datamarkers = {
                shard: batch.end_seq
                for shard, o in enumerate(owner)
                if o is session and batch.first_seq <= delivered[shard] < batch.end_seq
            }
            if not datamarkers:
                continue
            mine = frames[id(session)]
            frame = Frame(
                app.name, mine, datamarkers, batch.first_seq, batch.end_seq, batch.appended_ns
            )
            sent = self._send(app, session, frame, delivered, shared)
            if sent == "evicted":
                return "sent"
            if sent != "sent":
                return sent
            app.delivered_updates += len(mine)
        return "sent"

    def _select(
        self, app: ApplicationRuntime, batch: Batch, owner: list[Any], delivered: list[int]
    ) -> list[Update] | None:
        """The batch's updates that ``app``'s flows still need, through its filter (None
        if the filter failed: the application stops, the others go on)."""
        first, end = batch.first_seq, batch.end_seq
        updates: list[Update] = batch.updates
        if not all(d == first for d in delivered):
            # A flow takes a batch only if it starts at or before the flow's position:
            # it skips what it already has (acknowledged further before a restart)
            # and never jumps a gap. A flow behind the batch (moved back to its
            # datamarker by a reassignment) makes the caravan re-read from there.
            eligible = [first <= d < end for d in delivered]
            if any(d < first and o is not None for d, o in zip(delivered, owner, strict=True)):
                self.behind = True
            updates = [
                u
                for i, u in enumerate(updates)
                if eligible[u.shard] and first + i >= delivered[u.shard]
            ]
        updates = for_application(updates, app.name)
        if app.filter is not None and updates:
            try:
                updates = app.filter(updates)
            except FilterError as exc:
                # This application stops here (its datamarkers stay before this batch).
                self.hub.app_failed(app, exc)
                with self.lock:
                    if app in self.applications:
                        self.applications.remove(app)
                return None
        return updates

    def _send(
        self,
        app: ApplicationRuntime,
        session: SubscriberSession,
        frame: Frame,
        delivered: list[int],
        shared: bool,
    ) -> str:
        """Hand one frame to one session: "sent", "stale" (another caravan delivered these
        flows meanwhile: dispatch again), "evicted" (not taken in time: the application
        moves off this caravan) or "stop"."""
        hub, flows, end = self.hub, app.flows, frame.end_seq
        moved: dict[int, int] = {}
        with hub.lock:
            # Another caravan may have delivered these flows since they were read
            # (the application was moving between caravans): start again from what
            # they hold now, so nothing goes out twice.
            if any(flows[shard].delivered != delivered[shard] for shard in frame.datamarkers):
                return "stale"
            # Recorded before the hand-over: an acknowledgement can come back at once,
            # and it is never taken past what was delivered. A reassignment that moves
            # the flow back later resets this.
            for shard in frame.datamarkers:
                if app.owner[shard] is session and flows[shard].delivered < end:
                    moved[shard] = flows[shard].delivered
                    flows[shard].delivered = end
        timed = (
            shared
            and self.on_evict is not None
            and self.slow_flow_s is not None
            and session.timed_delivery
        )
        if timed:
            assert self.slow_flow_s is not None
            done = session.deliver(frame, self.stop, time.monotonic() + self.slow_flow_s)
        else:
            done = session.deliver(frame, self.stop)
        if done is None:
            # Not taken in time: the frame was not delivered. Its flows go back to where
            # they were, and the application moves off this caravan.
            with hub.lock:
                for shard, before in moved.items():
                    if flows[shard].delivered == end:
                        flows[shard].delivered = before
            self._evict(app, f"its subscribers kept it waiting over {self.slow_flow_s}s")
            return "evicted"
        return "sent" if done else "stop"


class CaravanManager:
    """Groups applications into caravans, merges caravans that meet, and moves slow
    applications off (see the module docstring)."""

    def __init__(
        self,
        hub: Hub,
        publisher_log: PublisherLog,
        stop: threading.Event,
        max_caravans: int = 8,
        merge_distance: int = 10_000,
        slow_flow_s: float = 2.0,
    ) -> None:
        self.hub = hub
        self.publisher_log = publisher_log
        self.stop = stop
        self.max_caravans = max_caravans
        self.merge_distance = merge_distance
        self.slow_flow_s = slow_flow_s
        self.lock = threading.Lock()
        self.caravans: list[Caravan] = []
        self.evicted: list[tuple[Caravan, ApplicationRuntime]] = []
        self.parked: list[ApplicationRuntime] = []
        """Applications with no subscriber connected: no caravan reads for them until
        one connects (a caravan waiting for them could hold others up)."""
        self.merges = 0
        self.splits = 0
        self.recently_evicted: dict[str, float] = {}
        self.thread = threading.Thread(target=self._run, name="caravans", daemon=True)

    # ------------------------------------------------------------ grouping
    def _start(self, app: ApplicationRuntime) -> int:
        with self.hub.lock:
            return min(f.delivered for f in app.flows)

    def plan(self, applications: list[ApplicationRuntime]) -> list[list[ApplicationRuntime]]:
        """Applications grouped by where their flows start."""
        ordered = sorted(applications, key=self._start)
        groups: list[list[ApplicationRuntime]] = []
        for app in ordered:
            if groups and self._start(app) - self._start(groups[-1][0]) <= self.merge_distance:
                groups[-1].append(app)
            else:
                groups.append([app])
        while len(groups) > self.max_caravans:
            gaps = [
                self._start(groups[i + 1][0]) - self._start(groups[i][-1])
                for i in range(len(groups) - 1)
            ]
            i = gaps.index(min(gaps))
            groups[i : i + 2] = [groups[i] + groups[i + 1]]
        return groups

    def _caravan(self, applications: list[ApplicationRuntime]) -> Caravan:
        caravan = Caravan(
            self.hub,
            self.publisher_log,
            self.stop,
            applications,
            slow_flow_s=self.slow_flow_s,
            on_evict=self._on_evict,
        )
        self.caravans.append(caravan)
        caravan.start()
        return caravan

    def start(self) -> None:
        with self.lock:
            for group in self.plan(list(self.hub.applications.values())):
                self._caravan(group)
        self.thread.start()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)
        for caravan in list(self.caravans):
            caravan.join(timeout)

    # ------------------------------------------------------------- moving
    def _on_evict(self, caravan: Caravan, app: ApplicationRuntime) -> None:
        with self.lock:
            self.evicted.append((caravan, app))

    def _run(self) -> None:
        try:
            while not self.stop.wait(0.05):
                with self.lock:
                    self._rebalance()
        except BaseException as exc:  # pragma: no cover - reported like a caravan's
            log.exception("caravan manager failed")
            self.hub.fail(exc)

    def _rebalance(self) -> None:
        # Caravans that finished (retired, or left with no applications) go.
        for caravan in list(self.caravans):
            if not caravan.thread.is_alive():
                self.caravans.remove(caravan)
                with caravan.lock:
                    orphans = list(caravan.applications)
                if orphans and not self.stop.is_set():
                    target = caravan.merge_into
                    if target is not None and target.thread.is_alive():
                        target.add(orphans)
                    else:
                        self._place(orphans)
        # Applications that left a caravan get one of their own, or the one furthest behind;
        # one that left for want of a subscriber waits, parked, until it has one.
        evicted, self.evicted = self.evicted, []
        now = time.monotonic()
        for source, app in evicted:
            self.splits += 1
            if not self._has_sessions(app):
                self.parked.append(app)
                continue
            self.recently_evicted[app.name] = now
            self._place([app], avoid=source)
        for app in list(self.parked):
            if self.hub.applications.get(app.name) is not app:
                self.parked.remove(app)  # removed from the pipeline
            elif self._has_sessions(app):
                self.parked.remove(app)
                self._place([app])
        # An application moved off for being slow rejoins only after a while (no churn).
        calm = 15 * self.slow_flow_s
        for name, when in list(self.recently_evicted.items()):
            if now - when > calm:
                del self.recently_evicted[name]
        # Caravans that meet merge: the one behind takes the other's applications.
        live = sorted(
            (
                c
                for c in self.caravans
                if c.thread.is_alive()
                and not c.retiring.is_set()
                and not c.waiting
                and not any(a.name in self.recently_evicted for a in c.applications)
            ),
            key=lambda c: c.position,
        )
        for behind, ahead in itertools.pairwise(live):
            if ahead.retiring.is_set() or behind.retiring.is_set():
                continue
            if 0 <= ahead.position - behind.position <= self.merge_distance:
                ahead.merge_into = behind
                ahead.retire()
                self.merges += 1
                log.debug("caravan %s merges into %s", ahead.thread.name, behind.thread.name)
                # Its applications are placed once its thread has stopped (above).

    def add_application(self, app: ApplicationRuntime) -> None:
        """A new application: its own caravan, or the one furthest behind at the limit."""
        with self.lock:
            self._place([app])

    def remove_application(self, app: ApplicationRuntime) -> None:
        """Stop delivering to ``app`` (its caravan carries on with the others)."""
        with self.lock:
            for caravan in self.caravans:
                with caravan.lock:
                    if app in caravan.applications:
                        caravan.applications.remove(app)
            self.evicted = [(c, a) for c, a in self.evicted if a is not app]
            if app in self.parked:
                self.parked.remove(app)

    def _has_sessions(self, app: ApplicationRuntime) -> bool:
        with self.hub.lock:
            return app.ready()

    def _place(self, apps: list[ApplicationRuntime], avoid: Caravan | None = None) -> None:
        if len(self.caravans) < self.max_caravans:
            self._caravan(apps)
            return
        others = [c for c in self.caravans if c is not avoid and not c.retiring.is_set()]
        # A caravan blocked on a subscriber that has not connected cannot dispatch: never
        # the first choice. Given applications anyway (every other caravan is blocked
        # too), it stops waiting and parks the application it was waiting for.
        moving = [c for c in others if not c.waiting]
        if not others:
            self._caravan(apps)
            return
        target = min(moving or others, key=lambda c: c.position)
        target.add(apps)


__all__ = ["Caravan", "CaravanManager", "SubscriberSession"]
