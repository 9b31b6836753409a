"""Shared datamarkers (multiple-copy delivery): ``datamarkers/<datastore>/<app>``, one
persistent node per (application, datastore) holding every shard's datamarker as a logical
position, ``{"<shard>": {"logical": …, "version": […], "epoch": …}}``.

Only the copy holding the serving claim writes them, and the write is fenced: one
transaction checks the serving node's version and the epochs counter's version after this
claim's bump (no claim since) together with the write, so datamarkers are never written
under a lost claim.
"""

from __future__ import annotations

import logging

from wormhole.connectors.zookeeper.claims import Claim, Claims
from wormhole.connectors.zookeeper.nodes import (
    Layout,
    check_name,
    claim_epoch,
    decode_object,
    encode,
)
from wormhole.connectors.zookeeper.session import Session
from wormhole.core.errors import StateError
from wormhole.plugins.components import SharedDatamarker

log = logging.getLogger("wormhole.zookeeper")

Datamarkers = dict[int, SharedDatamarker]


class SharedDatamarkers:
    """The shared datamarkers of a dataset's flows, read by every copy, written under a
    serving claim."""

    def __init__(self, session: Session, layout: Layout, claims: Claims) -> None:
        self.session = session
        self.layout = layout
        self.claims = claims

    def load(self, application: str, datastore: str) -> Datamarkers:
        from kazoo.exceptions import NoNodeError

        check_name("application", application)
        check_name("datastore", datastore)
        path = self.layout.datamarkers(application, datastore)

        def load() -> Datamarkers:
            try:
                data, _stat = self.session.do("get", path)
            except NoNodeError:
                return {}
            return self._decode(path, data)

        return self.session.retrying(f"read the shared datamarkers of {application}", load)

    def save(self, application: str, datastore: str, epoch: int, datamarkers: Datamarkers) -> bool:
        """One transaction checks that the serving node is unchanged and that no claim was
        made since this one (the epochs counter's version), and writes the datamarkers.
        False when the claim is not this session's under ``epoch`` any more; also when
        ZooKeeper cannot be reached now (never waiting long): the claim is then given up,
        its node deleted once ZooKeeper answers."""
        from kazoo.exceptions import NoNodeError

        check_name("application", application)
        check_name("datastore", datastore)
        key = (application, datastore)
        serving = self.layout.serving(application, datastore)
        path = self.layout.datamarkers(application, datastore)
        claim = self.claims.held(application, datastore)
        if claim is None or claim.epoch != epoch:
            return False
        sid = self.session.session_id()  # None while disconnected
        if sid is None or not self.session.connected.is_set():
            self.claims.abandon(key, serving, epoch, claim.session)
            return False
        if claim.session != sid:
            self.claims.fenced(key, claim, "it went with its ZooKeeper session")
            return False
        try:
            data, stat = self.session.do("get", serving, timeout=self.claims.quick)
            if stat.ephemeralOwner != sid or claim_epoch(data) != epoch:
                self.claims.fenced(key, claim, "its serving node is another's now")
                return False
            for _ in range(10):
                written = self._try_write(key, claim, path, datamarkers)
                if written is not None:
                    return written
        except self.session.errors() as exc:
            log.warning(
                "cannot share the datamarkers of %s in ZooKeeper at %s now (%s): its serving "
                "claim (epoch %d) is given up",
                application,
                self.session.options.hosts,
                type(exc).__name__,
                epoch,
            )
            self.claims.abandon(key, serving, epoch, sid)
            return False
        except NoNodeError:
            self.claims.fenced(key, claim, "its serving node is gone")
            return False
        raise StateError(f"cannot write {path}: it keeps changing")

    def _try_write(
        self, key: tuple[str, str], claim: Claim, path: str, datamarkers: Datamarkers
    ) -> bool | None:
        """One fenced write, merged over the stored datamarkers: whether it was written
        (False: fenced), or None when they changed meanwhile (try again)."""
        from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError, RolledBackError

        quick = self.claims.quick
        epochs = self.layout.epochs(*key)
        try:
            data, stat = self.session.do("get", path, timeout=quick)
            stored, version = self._decode(path, data), stat.version
        except NoNodeError:
            stored, version = {}, None
        merged = _encode({**stored, **datamarkers})
        transaction = self.session.client.transaction()
        transaction.check(claim.path, claim.version)
        transaction.check(epochs, claim.epochs_version)
        if version is None:
            transaction.create(path, merged)
        else:
            transaction.set_data(path, merged, version=version)
        results = self.session.commit(transaction, timeout=quick)
        failed = [r for r in results if isinstance(r, Exception)]
        if not failed:
            return True
        held, fence, write = results
        if not isinstance(held, RolledBackError) or not isinstance(fence, RolledBackError):
            self.claims.fenced(key, claim, "its serving node or the epochs counter changed")
            return False
        if isinstance(write, NoNodeError) and version is None:
            self.claims.parent_gone(path)
            self.claims.ensure_parent(path)
            return None
        if isinstance(write, BadVersionError | NodeExistsError | NoNodeError):
            return None  # the datamarkers changed meanwhile: merge again
        raise StateError(f"cannot write {path}: {failed}")

    def _decode(self, path: str, data: bytes | None) -> Datamarkers:
        if not data:
            return {}
        try:
            return _decode(data)
        except ValueError as exc:
            raise StateError(
                f"the shared datamarkers in znode {path} ({self.session.describe()}) cannot "
                f"be read: {exc}"
            ) from None


def _decode(data: bytes) -> Datamarkers:
    out: Datamarkers = {}
    for shard, value in decode_object(data).items():
        try:
            number = int(shard)
        except ValueError:
            raise ValueError(f"shard {shard!r} is not a number") from None
        if not isinstance(value, dict):
            raise ValueError(f"shard {shard}: not a JSON object")
        logical = value.get("logical", "")
        version = value.get("version")
        epoch = value.get("epoch", 0)
        if not isinstance(logical, str):
            raise ValueError(f"shard {shard}: logical is {logical!r}, not a string")
        if not isinstance(version, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in version
        ):
            raise ValueError(f"shard {shard}: version is {version!r}, not a list of ints")
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            raise ValueError(f"shard {shard}: epoch is {epoch!r}, not an int")
        out[number] = SharedDatamarker(logical, tuple(version), epoch)
    return out


def _encode(datamarkers: Datamarkers) -> bytes:
    return encode(
        {
            str(shard): {"logical": d.logical, "version": list(d.version), "epoch": d.epoch}
            for shard, d in sorted(datamarkers.items())
        }
    )
