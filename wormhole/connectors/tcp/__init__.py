"""The ``tcp`` transport: subscribers connect to the publisher over TCP (optionally TLS).

Publisher side: :mod:`wormhole.connectors.tcp.server` (with each subscriber's
:mod:`~wormhole.connectors.tcp.session` and the log readers' :mod:`~wormhole.connectors.tcp.reads`).
Subscriber side (the library applications embed): :mod:`wormhole.connectors.tcp.client`, whose
connection is :mod:`~wormhole.connectors.tcp.link` (the rest is :mod:`wormhole.subscriber`'s);
log readers: :mod:`~wormhole.connectors.tcp.remote_log`. The wire protocol:
:mod:`wormhole.connectors.tcp.protocol` and docs/protocol.md.
"""

from __future__ import annotations

from typing import Any

from wormhole.connectors.tcp.options import TcpOptions, TlsOptions
from wormhole.connectors.tcp.protocol import VERSION
from wormhole.plugins.components import (
    Capabilities,
    ComponentSpec,
    RemoteLog,
    RemoteLogRequest,
    SubscribeRequest,
    offer,
)


def _transport(options: TcpOptions) -> Any:
    from wormhole.connectors.tcp.server import TcpTransport

    return TcpTransport(options)


def _remote_log(request: RemoteLogRequest) -> RemoteLog:
    from wormhole.connectors.tcp.remote_log import TcpRemoteLog

    return TcpRemoteLog(request)


def _subscribe(request: SubscribeRequest) -> None:
    from wormhole.connectors.tcp.command import subscribe

    subscribe(request)


wormhole_transports = offer(
    ComponentSpec(
        kind="transport",
        name="tcp",
        factory=_transport,
        options=TcpOptions,
        description="Subscribers connect over TCP/TLS: one connection per subscriber, "
        "credits, heartbeats.",
        default=True,
        capabilities=Capabilities(
            listens=True, protocol=VERSION, remote_columns=True, subscriber_processes=True
        ),
        subscribe=_subscribe,
        remote_log=_remote_log,
    )
)


__all__ = ["TcpOptions", "TlsOptions"]
