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

from wormhole.core.hub import ApplicationRuntime, Frame, Hub, SubscriberSession
from wormhole.core.publisher_log import Batch, PublisherLog
from wormhole.core.update import Update

log = logging.getLogger("wormhole.caravan")


class Caravan:
    def __init__(self, hub: Hub, plog: PublisherLog, stop: threading.Event) -> None:
        self.hub = hub
        self.log = plog
        self.stop = stop
        self.thread = threading.Thread(target=self._run, name="caravan", daemon=True)
        self.position = 0
        self.batches = 0

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            log.exception("caravan failed")
            self.hub.fail(exc)

    def _loop(self) -> None:
        apps = list(self.hub.applications.values())
        for app in apps:
            if not self.hub.wait_for_sessions(app, self.stop):
                return
        start = min((f.delivered for app in apps for f in app.flows), default=self.log.next_seq)
        reader = self.log.reader(start)
        self.position = start
        try:
            while not self.stop.is_set():
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
        lowest = min(f.delivered for f in flows)
        if lowest >= end:
            return True
        if max(f.delivered for f in flows) > first:
            # Some flows already have part of this batch (they were acknowledged
            # further before a restart): drop what each one has.
            delivered = [f.delivered for f in flows]
            updates = [u for i, u in enumerate(updates) if first + i >= delivered[u.shard]]
        if app.filter is not None and updates:
            updates = app.filter(updates)
        hub = self.hub
        with hub.lock:
            sessions = list(app.sessions)
            owner = list(app.owner)
            owned = {id(s): list(app.owned.get(id(s), [])) for s in sessions}
        if not sessions:
            if not hub.wait_for_sessions(app, self.stop):
                return False
            return self._dispatch(app, batch)
        frames: dict[int, list[Update]]
        if len(sessions) == 1:
            frames = {id(sessions[0]): updates}
        else:
            frames = {id(s): [] for s in sessions}
            for u in updates:
                target = owner[u.shard]
                if target is not None:
                    frames[id(target)].append(u)
        for session in sessions:
            mine = frames[id(session)]
            datamarkers = {
                shard: end for shard in owned[id(session)] if flows[shard].delivered < end
            }
            if not datamarkers:
                continue
            frame = Frame(app.name, mine, datamarkers, first, end)
            if not session.deliver(frame, self.stop):
                return False
            for shard in datamarkers:
                flows[shard].delivered = end
            app.delivered_updates += len(mine)
        return True


__all__ = ["Caravan", "SubscriberSession"]
