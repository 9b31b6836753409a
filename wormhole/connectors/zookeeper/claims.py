"""Serving claims (multiple-copy delivery): which copy of a datastore serves an
application, under which epoch.

A claim is one transaction that bumps the epochs counter ``epochs/<datastore>/<app>``
(compare-and-set on its version) and creates the ephemeral serving node
``serving/<datastore>/<app>``, so the counter moves only with a claim made, and its
version after the bump fences every later write made under the claim
(:mod:`wormhole.connectors.zookeeper.datamarkers`).

Claims are never made again behind the caller's back: when the session expires the
process forgets them (the copy learns it from ``watch_connection(False)`` and from
``watch_serving``) and may claim again, under a new epoch. A claim that cannot be checked
(ZooKeeper unreachable) or whose creation was not confirmed is *abandoned*: the session's
thread deletes its node once ZooKeeper answers, if this session still holds it under that
epoch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from wormhole.connectors.zookeeper.nodes import (
    Layout,
    SkippedNodes,
    check_name,
    claim_epoch,
    decode_object,
    encode,
    serving_claim,
)
from wormhole.connectors.zookeeper.session import Session
from wormhole.core.errors import StateError
from wormhole.plugins.components import ServingClaim

log = logging.getLogger("wormhole.zookeeper")


@dataclasses.dataclass(frozen=True)
class Claim:
    """A serving claim this process made (:meth:`Claims.claim`)."""

    path: str
    epoch: int
    session: int
    """The session that created the serving node: the claim goes with it."""
    version: int
    """The serving node's version when created (it is never changed)."""
    epochs_version: int
    """The epochs counter's version after this claim's bump: any later claim changes it."""


class Claims:
    """The serving claims this process holds, made and given up in ZooKeeper."""

    def __init__(self, session: Session, layout: Layout, skipped: SkippedNodes) -> None:
        self.session = session
        self.layout = layout
        self.skipped = skipped
        self.lock = threading.Lock()
        self._held: dict[tuple[str, str], Claim] = {}
        """The claims this process holds, by (application, datastore)."""
        self._abandoned: list[tuple[str, int, int]] = []
        """Serving nodes (path, epoch, session) to delete once ZooKeeper answers."""
        self._parents: set[str] = set()
        """Parent paths of claims known to exist."""

    @property
    def quick(self) -> float:
        """How long a claim operation waits for ZooKeeper: the publisher calls them about
        every second from its loop, which must not stall."""
        return min(2.0, self.session.options.session_timeout_ms / 2000)

    def held(self, application: str, datastore: str) -> Claim | None:
        with self.lock:
            return self._held.get((application, datastore))

    def ensure_parent(self, path: str) -> None:
        parent = path.rsplit("/", 1)[0]
        if parent not in self._parents:
            self.session.do("ensure_path", parent, timeout=self.quick)
            self._parents.add(parent)

    def parent_gone(self, path: str) -> None:
        """``path``'s parent was removed meanwhile: create it again next time."""
        self._parents.discard(path.rsplit("/", 1)[0])

    def _epoch_value(self, path: str, data: bytes | None) -> int:
        try:
            value = json.loads(data or b"")
        except (ValueError, UnicodeDecodeError):
            value = None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise StateError(
                f"the epochs counter znode {path} holds {data!r}, not a JSON integer: fix or "
                f"delete it (in {self.session.describe()})"
            )
        return value

    # ----------------------------------------------------------------- claim
    def claim(self, application: str, datastore: str, copy: str) -> int | None:
        """The serving node is created in one transaction with the bump of the epochs
        counter (a compare-and-set on its version): the counter moves only with a claim
        made, so its version after the bump fences every later write of the claim."""
        check_name("application", application)
        check_name("datastore", datastore)
        check_name("copy", copy)
        serving = self.layout.serving(application, datastore)
        sid = self.session.session_id()
        if not self.session.connected.is_set() or sid is None:
            return None
        attempt: list[int] = []  # the epoch tried, if any
        try:
            for _ in range(10):
                done, epoch = self._try_claim(application, datastore, copy, sid, attempt)
                if done:
                    return epoch
        except self.session.errors() as exc:
            # The claim may have been made without this process hearing so: give it up.
            log.debug("claim of %s interrupted: %r", serving, exc)
            if attempt:
                self.abandon(None, serving, attempt[-1], sid)
            return None
        epochs = self.layout.epochs(application, datastore)
        raise StateError(f"cannot claim {serving}: the epochs counter {epochs} keeps changing")

    def _try_claim(
        self, application: str, datastore: str, copy: str, sid: int, attempt: list[int]
    ) -> tuple[bool, int | None]:
        """One try: (True, epoch) when claimed, (True, None) when held by another, (False,
        None) when the counter or a parent changed meanwhile (try again)."""
        from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError, RolledBackError

        do, quick = self.session.do, self.quick
        serving = self.layout.serving(application, datastore)
        epochs = self.layout.epochs(application, datastore)
        if do("exists", serving, timeout=quick) is not None:
            return True, None  # held (perhaps by this process, under another epoch)
        self.ensure_parent(serving)
        self.ensure_parent(epochs)
        try:
            data, stat = do("get", epochs, timeout=quick)
            last, version = self._epoch_value(epochs, data), stat.version
        except NoNodeError:
            last, version = 0, None
        epoch = last + 1
        attempt.append(epoch)
        node = encode(
            {"copy": copy, "epoch": epoch, "host": socket.gethostname(), "pid": os.getpid()}
        )
        transaction = self.session.client.transaction()
        if version is None:
            transaction.create(epochs, encode(epoch))
        else:
            transaction.set_data(epochs, encode(epoch), version=version)
        transaction.create(serving, node, ephemeral=True)
        results = self.session.commit(transaction, timeout=quick)
        counter, created = results
        if not isinstance(counter, Exception) and not isinstance(created, Exception):
            claim = Claim(serving, epoch, sid, 0, 0 if version is None else version + 1)
            with self.lock:
                self._held[(application, datastore)] = claim
            return True, epoch
        if isinstance(created, NodeExistsError):
            return True, None
        if isinstance(counter, NoNodeError) and version is None:
            self.parent_gone(epochs)  # removed meanwhile
            return False, None
        if isinstance(counter, BadVersionError | NodeExistsError | NoNodeError):
            return False, None  # another claim moved the counter meanwhile: read it again
        if isinstance(created, NoNodeError):
            self.parent_gone(serving)  # removed meanwhile
            return False, None
        failed = [r for r in results if not isinstance(r, RolledBackError)]
        raise StateError(f"cannot claim {serving}: {failed}")

    def release(self, application: str, datastore: str, epoch: int) -> None:
        from kazoo.exceptions import BadVersionError, NoNodeError

        check_name("application", application)
        check_name("datastore", datastore)
        key = (application, datastore)
        path = self.layout.serving(application, datastore)
        with self.lock:
            claim = self._held.get(key)
            if claim is not None and claim.epoch == epoch:
                del self._held[key]
            else:
                claim = None
        sid = self.session.session_id()  # None while disconnected
        if sid is None or not self.session.connected.is_set():
            if claim is not None:
                self.abandon(None, path, epoch, claim.session)
            return
        try:
            self._delete(path, epoch, sid)
        except self.session.errors():
            self.abandon(None, path, epoch, sid)
        except (NoNodeError, BadVersionError):
            pass

    def _delete(self, path: str, epoch: int, sid: int) -> bool:
        """Delete serving node ``path`` if session ``sid`` holds it under ``epoch``; whether
        it did."""
        from kazoo.exceptions import BadVersionError, NoNodeError

        do, quick = self.session.do, self.quick
        try:
            data, stat = do("get", path, timeout=quick)
            if stat.ephemeralOwner != sid or claim_epoch(data) != epoch:
                return False
            do("delete", path, version=stat.version, timeout=quick)
            return True
        except (NoNodeError, BadVersionError):
            return False

    # ------------------------------------------------------ losing a claim
    def abandon(self, key: tuple[str, str] | None, path: str, epoch: int, sid: int) -> None:
        """Give up a claim that cannot be checked or deleted now: the session's thread
        deletes its node once ZooKeeper answers (if this session still holds it under
        ``epoch``)."""
        with self.lock:
            if key is not None:
                claim = self._held.get(key)
                if claim is not None and claim.epoch == epoch:
                    del self._held[key]
            if (path, epoch, sid) not in self._abandoned:
                self._abandoned.append((path, epoch, sid))
        self.session.dispatcher.resync_later()

    def fenced(self, key: tuple[str, str], claim: Claim, why: str) -> None:
        """The claim is lost (another claim, or its node changed): forget it."""
        log.warning("the serving claim %s (epoch %d) is lost: %s", claim.path, claim.epoch, why)
        with self.lock:
            if self._held.get(key) == claim:
                del self._held[key]

    def forget(self, keep: int | None) -> None:
        """Forget the claims of every session but ``keep`` (gone with their session)."""
        with self.lock:
            for key, claim in list(self._held.items()):
                if claim.session != keep:
                    log.warning(
                        "the serving claim %s (epoch %d) went with its ZooKeeper session",
                        claim.path,
                        claim.epoch,
                    )
                    del self._held[key]
            self._abandoned = [a for a in self._abandoned if a[2] == keep]

    def resync(self, sid: int | None) -> None:
        """After a reconnect: forget the claims of earlier sessions, delete the abandoned
        nodes of this one."""
        if sid is None:
            return
        self.forget(keep=sid)
        with self.lock:
            abandoned = list(self._abandoned)
        for path, epoch, session in abandoned:
            if session == sid and self._delete(path, epoch, sid):
                log.info("gave up the serving claim %s (epoch %d)", path, epoch)
            with self.lock:
                if (path, epoch, session) in self._abandoned:
                    self._abandoned.remove((path, epoch, session))

    def drain(self, sid: int | None) -> list[str]:
        """Forget every claim (closing): the serving nodes session ``sid`` holds."""
        with self.lock:
            paths = [c.path for c in self._held.values() if c.session == sid]
            paths += [path for path, _, session in self._abandoned if session == sid]
            self._held.clear()
            self._abandoned = []
        return paths

    # ---------------------------------------------------------------- watch
    def _read(self, path: str, watcher: Callable[[Any], None] | None) -> ServingClaim | None:
        from kazoo.exceptions import NoNodeError

        do = self.session.do
        for _ in range(10):
            try:
                data, stat = do("get", path, watch=watcher)
            except NoNodeError:
                if do("exists", path, watch=watcher) is None:
                    return None
                continue  # created meanwhile
            try:
                return serving_claim(decode_object(data))
            except ValueError as exc:
                self.skipped.warn(path, stat.mzxid, str(exc))
                return ServingClaim(copy="", epoch=0)  # held, by something unreadable
        raise StateError(f"node {path} keeps appearing and disappearing")

    def watch(
        self, application: str, datastore: str, fn: Callable[[ServingClaim | None], None]
    ) -> Callable[[], None]:
        check_name("application", application)
        check_name("datastore", datastore)
        path = self.layout.serving(application, datastore)
        return self.session.dispatcher.watch(
            f"the serving claim of {application} on {datastore}",
            lambda watcher: self._read(path, watcher),
            fn,
        )
