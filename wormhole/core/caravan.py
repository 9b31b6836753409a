"""Caravans: one reader of the publisher log serving every flow near its position.

The lead caravan reads from the oldest position any flow still needs (after a
restart, some flows may be behind others) and then follows the tail, where the
publisher log serves it from memory. For each batch it fans out to every
application: skip what a flow already has, apply the application's
publisher-side filter, split by owning subscriber, and deliver one frame per
subscriber. Datamarkers move past filtered updates too.
"""

from __future__ import annotations

import logging
import threading

from wormhole.core.errors import WormholeError
from wormhole.core.hub import ApplicationRuntime, Frame, Hub, SubscriberSession
from wormhole.core.publisher_log import Batch, PublisherLog
from wormhole.core.update import Update

log = logging.getLogger("wormhole.caravan")


class Caravan:
    """A reader of the publisher log serving the flows of some applications.

    Each application currently gets its own caravan, so one whose subscribers
    are slow falls behind (reading from disk) without holding the others back.
    """

    def __init__(
        self,
        hub: Hub,
        plog: PublisherLog,
        stop: threading.Event,
        applications: list[ApplicationRuntime],
    ) -> None:
        self.hub = hub
        self.log = plog
        self.stop = stop
        self.applications = applications
        names = ",".join(a.name for a in applications)
        self.thread = threading.Thread(target=self._run, name=f"caravan {names}", daemon=True)
        self.position = 0
        self.batches = 0
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
        with self.hub.lock:
            rewinds = sum(a.rewind for a in self.applications)
            owned = [
                f.delivered
                for a in self.applications
                for f, o in zip(a.flows, a.owner, strict=True)
                if o is not None
            ]
            start = min(owned or [f.delivered for a in self.applications for f in a.flows])
        return start, rewinds

    def _loop(self) -> None:
        apps = self.applications
        for app in apps:
            if not self.hub.wait_for_sessions(app, self.stop):
                return
        start, rewinds = self._start_position()
        reader = self.log.reader(start)
        self.position = start
        try:
            while not self.stop.is_set():
                if self.behind or sum(a.rewind for a in apps) != rewinds:
                    self.behind = False
                    start, rewinds = self._start_position()
                    if start < reader.position:
                        reader.close()
                        reader = self.log.reader(start)
                batch = reader.read()
                if batch is None:
                    self.log.wait_for(reader.position, 0.2)
                    continue
                for app in apps:
                    if not self._dispatch(app, batch):
                        return
                self.position = batch.end_seq
                self.batches += 1
        finally:
            reader.close()

    def _dispatch(self, app: ApplicationRuntime, batch: Batch) -> bool:
        flows = app.flows
        end = batch.end_seq
        first = batch.first_seq
        updates: list[Update] = batch.updates
        hub = self.hub
        with hub.lock:
            sessions = list(app.sessions)
            owner = list(app.owner)
            delivered = [f.delivered for f in flows]
        if not sessions:
            if not hub.wait_for_sessions(app, self.stop):
                return False
            return self._dispatch(app, batch)
        if min(delivered) >= end:
            return True
        exact = all(d == first for d in delivered)
        if not exact:
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
        if app.filter is not None and updates:
            updates = app.filter(updates)
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
                shard: end
                for shard, o in enumerate(owner)
                if o is session and first <= delivered[shard] < end
            }
            if not datamarkers:
                continue
            mine = frames[id(session)]
            frame = Frame(app.name, mine, datamarkers, first, end, batch.appended_ns)
            with hub.lock:
                # Recorded before the hand-over: an acknowledgement can come back at
                # once, and it is never taken past what was delivered. A reassignment
                # that moves the flow back later resets this.
                for shard in datamarkers:
                    if app.owner[shard] is session and flows[shard].delivered < end:
                        flows[shard].delivered = end
            if not session.deliver(frame, self.stop):
                return False
            app.delivered_updates += len(mine)
        return True


__all__ = ["Caravan", "SubscriberSession"]
