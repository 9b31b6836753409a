"""The subscriber library: an application's end of the TCP transport.

::

    import wormhole

    sub = wormhole.Subscriber(app="search", publishers=["10.0.0.5:7070"], token="...")
    # or every publisher of a dataset, found through its registry:
    sub = wormhole.Subscriber(app="search", registry="zookeeper://zk1:2181/wormhole",
                              dataset="shop")

    @sub.on_shard_notice
    def notice(assigned, revoked): ...

    @sub.on_updates
    def handle(flow, batch): ...   # returning acknowledges; raising retries the batch

    sub.run()                      # or: await sub.run_async()

One connection carries all of the subscriber's flows. A reader thread keeps the
socket drained and answers heartbeats while handlers run; the publisher sends at
most ``credits`` batches ahead of the acknowledgements, so memory stays bounded
however slow the handlers are. A handler that raises gets the same batch again
(with backoff) until it returns. Per flow (shard), batches arrive in order. If
the connection drops, the subscriber reconnects (trying each publisher in turn)
and resumes from its datamarkers; a refusal the publisher calls fatal (wrong
token, unknown application, version mismatch) raises :class:`SubscriberRefused`.

With a registry, the subscriber registers itself under its application, keeps one
connection per live publisher of the dataset (publishers that appear or leave are
picked up from the registry's watches), and is given its share of the dataset's flows,
(datastore, shard) pairs: ``on_shard_notice`` then receives ``(datastore, shard)``
tuples and ``on_updates`` a :class:`wormhole.Flow` with its ``datastore``. Handlers are
called one at a time, whichever connection the batch came from.
"""

from __future__ import annotations

import os
import socket
import ssl
import uuid
from collections.abc import Callable
from typing import Any

from wormhole.connectors.tcp import protocol as p
from wormhole.connectors.tcp.link import TcpLink
from wormhole.subscriber.connected import ConnectedSubscriber
from wormhole.subscriber.link import SubscriberGaveUp, SubscriberRefused


class Subscriber(ConnectedSubscriber):
    def __init__(
        self,
        app: str,
        publishers: list[str] | str | Callable[[], list[str]] | None = None,
        token: str = "",
        *,
        registry: str | Any = None,
        dataset: str | None = None,
        instance: str | None = None,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
        credits: int = 8,
        heartbeat_ms: int = 1000,
        heartbeat_timeout_ms: int = 3000,
        reconnect: bool = True,
        max_backoff: float = 10.0,
        max_frame: int = 1 << 30,
        give_up_s: float | None = None,
    ) -> None:
        self.app = app
        self.give_up_s = give_up_s
        """Stop retrying after this many seconds without a session (``run`` raises
        SubscriberGaveUp); None: retry for as long as it runs (a publisher restarts)."""
        self.registry = registry
        """A registry URL (``zookeeper://HOSTS/ROOT``) or component: every publisher of
        ``dataset`` is found there, instead of ``publishers``."""
        self.dataset = dataset
        if registry is not None:
            if not dataset:
                raise ValueError("dataset: give the dataset (pipeline) name with a registry")
            if publishers:
                raise ValueError("give publishers or a registry, not both")
            publishers = []
        elif publishers is None:
            raise ValueError("publishers: give at least one host:port (or a registry)")
        # A callable is asked again before every connection attempt (an address
        # that changes when the publisher restarts).
        self._publishers = publishers if callable(publishers) else None
        self.publishers = (
            publishers()
            if callable(publishers)
            else [publishers]
            if isinstance(publishers, str)
            else list(publishers)
        )
        if not self.publishers and registry is None:
            raise ValueError("publishers: give at least one host:port")
        for address in self.publishers:
            p.parse_address(address)
        self.token = token
        self.instance = instance or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.tls = tls
        self.server_name = server_name
        self.credits = credits
        self.heartbeat = heartbeat_ms / 1000.0
        self.heartbeat_timeout = heartbeat_timeout_ms / 1000.0
        self.reconnect = reconnect
        self.max_backoff = max_backoff
        self.max_frame = max_frame
        self._init_connected()

    def _link(self, datastore: str | None, addresses: Callable[[], list[str]]) -> TcpLink:
        return TcpLink(self, datastore, addresses)


__all__ = ["Subscriber", "SubscriberGaveUp", "SubscriberRefused"]
