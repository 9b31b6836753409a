"""The ephemeral nodes this process registers, and what it keeps to register them again.

Ephemeral nodes go with the ZooKeeper session that created them. The registry remembers
every one it created (an :class:`OwnedNode`); when the session expires and the client
reconnects with a new session, the session's thread creates them again. Writes by callers
and by that thread take :attr:`OwnedNodes.lock`, so a node is never written twice at once.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wormhole.connectors.zookeeper.nodes import Layout, SkippedNodes
    from wormhole.connectors.zookeeper.session import Session


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
