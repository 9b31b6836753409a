"""Subscribers in the registry: ephemeral sequential nodes under their application,
``applications/<app>/subscribers/<instance>-<seq>``. The sequence number is the
registration order the assignment deals flows in; a subscriber registered again after its
session expired gets a new one (it moves to the end of the line).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from wormhole.connectors.zookeeper.ephemeral import OwnedNode, OwnedNodes, Registrations
from wormhole.connectors.zookeeper.nodes import (
    Layout,
    SkippedNodes,
    check_name,
    encode,
)
from wormhole.connectors.zookeeper.session import Session
from wormhole.core.errors import ConfigError
from wormhole.plugins.components import SubscriberEntry

log = logging.getLogger("wormhole.zookeeper")


class Subscribers(Registrations):
    """This process's subscriber registrations, and an application's subscribers, read."""

    def __init__(
        self, session: Session, layout: Layout, owned: OwnedNodes, skipped: SkippedNodes
    ) -> None:
        super().__init__(session, layout, owned, skipped)
        self._subscribers: dict[tuple[str, str], OwnedNode] = {}
        """By (application, instance)."""

    def register(self, application: str, entry: SubscriberEntry) -> None:
        check_name("application", application)
        check_name("subscriber instance", entry.instance)
        data = encode({"instance": entry.instance, "host": entry.host, "pid": entry.pid})
        parent = self.layout.subscribers(application)
        key = (application, entry.instance)
        session = self.session
        with self.owned.lock:
            sid = session.session_id()
            owned = self._subscribers.get(key)
            if owned is not None and owned.session is not None and owned.session == sid:
                return  # registered already, in this session
            if owned is None:
                owned = OwnedNode(f"{parent}/{entry.instance}-", data, sequential=True)
            try:
                if not session.connected.is_set():
                    raise session.unreachable_error("not connected")
                if session.do("exists", self.layout.application(application)) is None:
                    raise ConfigError(self._unknown_app(application))
                self._create(application, owned, sid)
            except session.errors() as exc:
                log.warning(
                    "cannot register subscriber %s of %s in ZooKeeper at %s now (%s); it is "
                    "registered once the registry is back",
                    entry.instance,
                    application,
                    session.options.hosts,
                    type(exc).__name__,
                )
                session.dispatcher.resync_later()
            self._subscribers[key] = owned

    def unregister(self, application: str, instance: str) -> None:
        with self.owned.lock:
            owned = self._subscribers.pop((application, instance), None)
            if owned is None or owned.session is None:
                return
            sid = self.session.session_id()
            if owned.session != sid:
                return  # went with its session
            try:
                self.session.delete_own(owned.path, sid)
            except self.session.errors():
                self.owned.orphans.append(owned.path)
                self.session.dispatcher.resync_later()

    def forget_application(self, application: str) -> None:
        """The application is being removed: its subscribers are not registered again."""
        with self.owned.lock:
            for key in [k for k in self._subscribers if k[0] == application]:
                del self._subscribers[key]

    def _create(self, app: str, owned: OwnedNode, sid: int | None) -> None:
        """Create (or find again) the ephemeral sequential node of a subscriber."""
        from kazoo.exceptions import NodeExistsError, NoNodeError

        do = self.session.do
        parent = self.layout.subscribers(app)
        instance = json.loads(owned.data)["instance"]
        # A create whose answer was lost may have made the node: adopt it.
        try:
            children = do("get_children", parent)
        except NoNodeError:
            children = []
        for child in children:
            if child.rsplit("-", 1)[0] == instance:
                stat = do("exists", f"{parent}/{child}")
                if stat is not None and sid is not None and stat.ephemeralOwner == sid:
                    owned.path = f"{parent}/{child}"
                    owned.created(sid)
                    return
        for _ in range(5):
            try:
                do("create", parent, b"")
            except NodeExistsError:
                pass
            except NoNodeError:
                raise ConfigError(self._unknown_app(app)) from None
            try:
                path = do(
                    "create", f"{parent}/{instance}-", owned.data, ephemeral=True, sequence=True
                )
            except NoNodeError:
                continue  # the application went meanwhile, or its subscribers node
            owned.path = path
            owned.created(sid)
            return
        raise ConfigError(self._unknown_app(app))

    def _unknown_app(self, app: str) -> str:
        return (
            f"unknown application {app!r} of dataset {self.layout.dataset} in "
            f"{self.session.describe()}: add it with `wormhole apps add`"
        )

    def reregister(self, sid: int | None) -> None:
        """Create again the registrations of an earlier session. Called from the session's
        thread, holding :attr:`OwnedNodes.lock`."""
        for (app, instance), owned in self._subscribers.items():
            if owned.session == sid:
                continue
            try:
                self._create(app, owned, sid)
                log.info("registered subscriber %s of %s again", instance, app)
            except ConfigError as exc:
                log.error("could not register subscriber %s again: %s", instance, exc)

    def drain(self, sid: int | None) -> list[str]:
        """Forget every registration (closing): the paths of those session ``sid`` holds."""
        owned = list(self._subscribers.values())
        self._subscribers.clear()
        return [o.path for o in owned if o.session == sid]

    # ---------------------------------------------------------------- reads
    def read(
        self, application: str, watcher: Callable[[Any], None] | None
    ) -> list[SubscriberEntry]:
        from kazoo.exceptions import NoNodeError

        do = self.session.do
        app_path = self.layout.application(application)
        parent = self.layout.subscribers(application)
        if do("exists", app_path, watch=watcher) is None:
            return []
        if do("exists", parent, watch=watcher) is None:
            return []
        try:
            children = do("get_children", parent, watch=watcher)
        except NoNodeError:
            return []
        entries: list[SubscriberEntry] = []
        for child in children:
            path = f"{parent}/{child}"
            name, _, seq = child.rpartition("-")
            try:
                order = int(seq)
                data, stat = do("get", path)
            except ValueError:
                self.skipped.warn(path, 0, "not a sequential node <instance>-<seq>")
                continue
            except NoNodeError:
                continue
            node = (path, data, stat.mzxid)
            entry = self.decoded(SubscriberEntry, node, {"order": order}, instance=name)
            if entry is not None:
                entries.append(entry)
        entries.sort(key=lambda e: e.order)
        return entries

    def watch(
        self, application: str, fn: Callable[[list[SubscriberEntry]], None]
    ) -> Callable[[], None]:
        return self.session.dispatcher.watch(
            f"the subscribers of {application}",
            lambda watcher: self.read(application, watcher),
            fn,
        )
