"""Subscription bookkeeping on the publisher side: which subscriber session holds each flow.

The hub's :class:`Subscriptions` divide each application's shards among its attached sessions
(an even split of the dataset's flows over the subscribers the registry lists, see
:func:`~wormhole.plugins.assignment.spread`), move a flow between sessions in two steps (the
old owner lets go before the new one gets it), and take the sessions' acknowledgements. A
copy of a datastore (multiple-copy delivery) activates and deactivates an application here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from wormhole.plugins.assignment import spread
from wormhole.plugins.components import SubscriberSession

if TYPE_CHECKING:
    from wormhole.core.hub import ApplicationRuntime, Hub

log = logging.getLogger("wormhole.hub")


def _instance(session: SubscriberSession) -> str:
    return getattr(session, "instance", "") or session.name


class Subscriptions:
    """The owners of each application's flows (under the hub's lock)."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.datastore = hub.datastore
        self.datastores: dict[str, int] = {self.datastore: hub.shards}
        """Every live datastore of the dataset and its shards (from the registry)."""
        self.registered: dict[str, list[str]] = {}
        """Each application's subscribers as the registry lists them, in registration order."""

    # ------------------------------------------------------ multiple copies
    def activate(self, application: str, epoch: int, datamarkers: dict[int, int]) -> None:
        """Serve ``application`` from ``datamarkers`` (shard -> seq of this publisher log)
        under the claim ``epoch``: its flows go to its subscribers."""
        with self.hub.lock:
            app = self.hub.applications[application]
            for shard, position in datamarkers.items():
                flow = app.flows[shard]
                flow.datamarker = flow.delivered = position
            app.epoch = epoch
            app.active = True
            app.rewind += 1
            self._assign(app)
            self.hub.changed.notify_all()

    def deactivate(self, application: str) -> None:
        """Stop serving ``application`` (its claim is gone or being given up): its flows are
        revoked from its subscribers and nothing more is delivered."""
        with self.hub.lock:
            app = self.hub.applications.get(application)
            if app is None or not app.active:
                return
            app.active = False
            self._assign(app)
            self.hub.changed.notify_all()

    def settled(self, application: str) -> bool:
        """Whether no subscriber holds any of ``application``'s flows any more."""
        with self.hub.lock:
            app = self.hub.applications.get(application)
            return app is None or (not app.revoking and all(owner is None for owner in app.owner))

    # ---------------------------------------------------------- membership
    def set_datastores(self, datastores: dict[str, int]) -> None:
        """The registry's live datastores changed: flows may move between subscribers."""
        with self.hub.lock:
            datastores = dict(datastores)
            datastores.setdefault(self.datastore, self.hub.shards)
            if datastores == self.datastores:
                return
            self.datastores = datastores
            for app in self.hub.applications.values():
                self._assign(app)
            self.hub.changed.notify_all()

    def set_registered(self, application: str, instances: list[str]) -> None:
        """The registry's subscribers of ``application`` changed."""
        with self.hub.lock:
            if self.registered.get(application) == instances:
                return
            self.registered[application] = list(instances)
            app = self.hub.applications.get(application)
            if app is not None:
                self._assign(app)
            self.hub.changed.notify_all()

    def attach(self, application: str, session: SubscriberSession) -> None:
        app = self.hub.applications[application]
        with self.hub.lock:
            app.sessions.append(session)
            self._assign(app)
            self.hub.changed.notify_all()
        log.info(
            "%s joined application %s (%d subscribers)",
            session.name,
            application,
            len(app.sessions),
        )

    def detach(self, session: SubscriberSession, reason: str = "") -> None:
        """A session is gone (clean leave, lost connection, missed heartbeats)."""
        with self.hub.lock:
            for app in self.hub.applications.values():
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
            self.hub.changed.notify_all()

    def revoked(self, application: str, session: SubscriberSession, shards: list[int]) -> None:
        """The session finished every frame it held for ``shards`` and let them go."""
        app = self.hub.applications.get(application)
        if app is None:
            return
        with self.hub.lock:
            for shard in shards:
                if app.revoking.get(shard) is session:
                    del app.revoking[shard]
            self._assign(app)
            self.hub.changed.notify_all()

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
            self.hub.shards,
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
        app = self.hub.applications.get(application)
        if app is None:
            return  # removed from the pipeline meanwhile; its datamarkers were saved
        flows = app.flows
        with self.hub.lock:
            for shard, position in datamarkers.items():
                if not 0 <= shard < self.hub.shards:
                    continue
                if app.owner[shard] is not session and app.revoking.get(shard) is not session:
                    continue
                flow = flows[shard]
                # Never past what was delivered: an acknowledgement cannot invent data.
                position = min(position, flow.delivered)
                if position > flow.datamarker:
                    flow.datamarker = position
            app.acknowledged_updates += updates
            self.hub.changed.notify_all()


__all__ = ["Subscriptions"]
