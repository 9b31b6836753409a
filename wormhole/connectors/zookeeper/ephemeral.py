"""The ephemeral nodes this process registers, and what it keeps to register them again.

Ephemeral nodes go with the ZooKeeper session that created them. The registry remembers
every one it created (an :class:`OwnedNode`); when the session expires and the client
reconnects with a new session, the session's thread creates them again. Writes by callers
and by that thread take :attr:`OwnedNodes.lock`, so a node is never written twice at once.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from wormhole.connectors.zookeeper.nodes import decode_object, field_values

if TYPE_CHECKING:
    from wormhole.connectors.zookeeper.nodes import Layout, SkippedNodes
    from wormhole.connectors.zookeeper.session import Session


E = TypeVar("E")


@dataclasses.dataclass
class OwnedNode:
    """An ephemeral node this process registered (or means to)."""

    path: str
    """The node's path; for a sequential node, the prefix until it is created."""
    data: bytes
    sequential: bool = False
    session: int | None = None
    """The session that created the node (None: not created yet, or gone with a session)."""
    synced: bool = False
    """Whether the node holds ``data``."""
    expiries: int = 0
    """How many sessions had expired when ``data`` was given (a status is not created
    again from before an expiry: it reports on a time before the loss)."""

    def created(self, sid: int | None) -> None:
        self.session = sid
        self.synced = True


class OwnedNodes:
    """What the publishers' and subscribers' registrations share: the write lock, and the
    nodes that could not be deleted when unregistered (ZooKeeper was away)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.orphans: list[str] = []


class Registrations:
    """Base of the publishers' and subscribers' registrations: the session and layout they
    write with, the nodes they share, and the warnings about nodes they cannot read."""

    def __init__(
        self, session: Session, layout: Layout, owned: OwnedNodes, skipped: SkippedNodes
    ) -> None:
        self.session = session
        self.layout = layout
        self.owned = owned
        self.skipped = skipped

    def decoded(
        self,
        cls: type[E],
        node: tuple[str, bytes | None, int],
        fixed: dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]],
        **defaults: Any,
    ) -> E | None:
        """The entry of dataclass ``cls`` a registration node holds (``node``: its path, data
        and mzxid): its JSON over ``defaults``, with the fields ``fixed`` gives from the
        node's name (or ``fixed(raw)``, from the name and the JSON). None, with a warning
        about the node, when it does not decode."""
        path, data, mzxid = node
        try:
            raw = {**defaults, **decode_object(data)}
            values = fixed(raw) if callable(fixed) else fixed
            return cls(**field_values(cls, raw, **values))
        except (ValueError, TypeError) as exc:
            self.skipped.warn(path, mzxid, str(exc))
            return None
