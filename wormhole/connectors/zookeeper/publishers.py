"""Publishers in the registry: each one's registration (``publishers/<node>``, which claims
its datastore, or its copy of it) and its live status (``status/<node>``), both ephemeral.

A registration held by another session is refused with :class:`DatastoreHeld`, naming the
holder. A status published before the session expired is not created again with the other
nodes: it describes the process before the loss (a copy that was serving, so ready to
serve), and comes back at the next :meth:`Publishers.publish_status`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

from wormhole.connectors.zookeeper.ephemeral import OwnedNode, OwnedNodes, Registrations
from wormhole.connectors.zookeeper.nodes import (
    Layout,
    SkippedNodes,
    check_name,
    check_node,
    datastore_of,
    decode_object,
    encode,
    field_values,
)
from wormhole.connectors.zookeeper.session import Session
from wormhole.core.errors import StateError
from wormhole.plugins.components import DatastoreHeld, PublisherEntry

log = logging.getLogger("wormhole.zookeeper")


class Publishers(Registrations):
    """This process's publisher registrations and statuses, and everyone's, read."""

    def __init__(
        self, session: Session, layout: Layout, owned: OwnedNodes, skipped: SkippedNodes
    ) -> None:
        super().__init__(session, layout, owned, skipped)
        self._publishers: dict[str, OwnedNode] = {}
        self._statuses: dict[str, OwnedNode] = {}

    # ---------------------------------------------------------- registration
    def register(self, entry: PublisherEntry) -> None:
        check_node(entry.datastore, entry.copy)
        node = entry.node
        data = encode(dataclasses.asdict(entry))
        session = self.session
        with self.owned.lock:
            owned = self._publishers.get(node)
            if owned is None:
                owned = OwnedNode(self.layout.publisher(node), data)
                self._publishers[node] = owned
                new = True
            else:
                owned.data, owned.synced, new = data, False, False
            try:
                if not session.connected.is_set():
                    raise session.unreachable_error("not connected")
                self._hold(owned, session.session_id())
            except StateError:
                if new:
                    del self._publishers[node]
                raise
            except session.errors() as exc:
                log.warning(
                    "cannot register publisher %s in ZooKeeper at %s now (%s); it is "
                    "registered once the registry is back",
                    node,
                    session.options.hosts,
                    type(exc).__name__,
                )
                session.dispatcher.resync_later()

    def release(self, datastore: str, holder: PublisherEntry) -> bool:
        """Remove ``holder``'s registration: its publisher and status nodes, named by
        ``holder.node`` (``datastore`` or ``datastore@copy``)."""
        from kazoo.exceptions import BadVersionError, NoNodeError

        check_name("datastore", datastore)
        node = holder.node
        released = False
        publisher = self.layout.publisher(node)
        for path in (publisher, self.layout.status(node)):
            try:
                data, stat = self.session.do("get", path)
            except NoNodeError:
                continue
            found = _entry_of(data) if path == publisher else None
            if found is not None and (found.host, found.pid) != (holder.host, holder.pid):
                return False  # someone else's now
            if stat.ephemeralOwner == self.session.session_id():
                continue
            try:
                self.session.do("delete", path, version=stat.version)
                released = True
            except (NoNodeError, BadVersionError):
                pass
        return released

    def publish_status(self, datastore: str, status: dict[str, Any]) -> None:
        check_name("datastore", datastore)
        data = encode(status)
        session = self.session
        with self.owned.lock:
            owned = self._statuses.get(datastore)
            if owned is None:
                owned = OwnedNode(self.layout.status(datastore), data)
                self._statuses[datastore] = owned
            else:
                owned.data, owned.synced = data, False
            owned.expiries = session.expiries
            if not session.connected.is_set():
                return  # written once connected again
            try:
                self._hold(owned, session.session_id())
            except StateError as exc:
                del self._statuses[datastore]
                log.error("status not shared: %s", exc)
            except session.errors() as exc:
                log.debug("status of %s not shared now: %r", datastore, exc)
                session.dispatcher.resync_later()

    def _hold(self, owned: OwnedNode, sid: int | None) -> None:
        """Create ``owned``'s ephemeral node, or update it if this session holds it.
        DatastoreHeld if another session holds it."""
        from kazoo.exceptions import NodeExistsError, NoNodeError

        do = self.session.do
        for _ in range(5):
            try:
                do("create", owned.path, owned.data, ephemeral=True, makepath=True)
            except NodeExistsError:
                try:
                    data, stat = do("get", owned.path)
                except NoNodeError:
                    continue  # gone meanwhile: create it again
                if sid is None or stat.ephemeralOwner != sid:
                    raise DatastoreHeld(
                        self._held_message(owned.path, data),
                        _entry_of(data),
                        owned.path,
                        self.session.options.session_timeout_ms / 1000.0,
                    ) from None
                try:
                    do("set", owned.path, owned.data, version=stat.version)
                except NoNodeError:
                    continue
            owned.created(sid)
            return
        raise StateError(f"node {owned.path} keeps appearing and disappearing; try again")

    def _held_message(self, path: str, data: bytes | None) -> str:
        kind = path.rsplit("/", 2)[-2]
        datastore, _, copy_ = path.rsplit("/", 1)[-1].partition("@")
        if copy_:
            datastore = f"{datastore} (copy {copy_})"
        what = "published" if kind == "publishers" else "reporting status"
        return (
            f"datastore {datastore} of dataset {self.layout.dataset} is already {what} by "
            f"{_holder(path, data)} — node {path}; stop that publisher or give this "
            f"one another datastore"
        )

    def reregister(self, sid: int | None) -> None:
        """Create again the registrations that are missing (a new session) or stale.
        Called from the session's thread, holding :attr:`OwnedNodes.lock`."""
        for kind, table in (("publisher", self._publishers), ("status", self._statuses)):
            for datastore, owned in table.items():
                if owned.session == sid and owned.synced:
                    continue
                if kind == "status" and owned.expiries != self.session.expiries:
                    continue  # from before the session expired: created once published
                try:
                    self._hold(owned, sid)
                    log.info("registered %s %s again as %s", kind, datastore, owned.path)
                except StateError as exc:
                    log.error("could not register %s again: %s", kind, exc)

    def drain(self, sid: int | None) -> list[str]:
        """Forget every registration (closing): the paths of those session ``sid`` holds."""
        owned = [*self._publishers.values(), *self._statuses.values()]
        self._publishers.clear()
        self._statuses.clear()
        return [o.path for o in owned if o.session == sid]

    # ---------------------------------------------------------------- reads
    def read(self, watcher: Callable[[Any], None] | None) -> list[PublisherEntry]:
        entries: list[PublisherEntry] = []
        for child, path, data, stat in self.session.children(self.layout.publishers, watcher):
            node = (path, data, stat.mzxid)
            entry = self.decoded(PublisherEntry, node, functools.partial(_named, child))
            if entry is not None:
                entries.append(entry)
        return entries

    def watch(self, fn: Callable[[list[PublisherEntry]], None]) -> None:
        self.session.dispatcher.watch(f"the publishers of {self.layout.dataset}", self.read, fn)

    def statuses(self) -> dict[str, dict[str, Any]]:
        def read() -> dict[str, dict[str, Any]]:
            out: dict[str, dict[str, Any]] = {}
            for child, path, data, stat in self.session.children(self.layout.statuses):
                try:
                    out[child] = decode_object(data)
                except ValueError as exc:
                    self.skipped.warn(path, stat.mzxid, str(exc))
            return out

        return self.session.retrying("read the publishers' status", read)


def _holder(path: str, data: bytes | None) -> str:
    try:
        raw = decode_object(data)
    except ValueError:
        return f"another process (node {path})"
    host = raw.get("host") or "?"
    pid = raw.get("pid") or "?"
    address = raw.get("address") or "none"
    return f"{host}:{pid} (address {address})"


def _entry_of(data: bytes | None) -> PublisherEntry | None:
    try:
        raw = decode_object(data)
        return PublisherEntry(**field_values(PublisherEntry, raw))
    except (ValueError, TypeError):
        return None


def _named(child: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The fields of a publisher's entry its node's name gives."""
    return {"datastore": datastore_of(child, raw)}
