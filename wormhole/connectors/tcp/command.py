"""``wormhole subscribe`` with the tcp transport: one subscriber process running an
application's sink, connected to the publisher."""

from __future__ import annotations

import os
import socket
from typing import Any

from wormhole.connectors.tcp.client import Subscriber
from wormhole.connectors.tcp.options import TcpOptions
from wormhole.connectors.tcp.protocol import parse_address
from wormhole.connectors.tcp.server import read_address
from wormhole.core.errors import ConfigError
from wormhole.plugins.components import SubscribeRequest


def subscribe(request: SubscribeRequest) -> None:
    pipeline = request.pipeline
    options = pipeline.transport.options
    assert isinstance(options, TcpOptions)
    registry = pipeline.dataset_registry
    if not request.publishers and registry is not None and registry.capabilities.shared_registry:
        _subscribe_through_registry(request)
        return
    # The registry's application when the registry holds them (else the file's).
    app = request.sink_application("wormhole.Subscriber")
    assert app.sink is not None
    sink_component = app.sink
    publishers: Any = request.publishers
    if not publishers:
        host, port = parse_address(options.listen)
        if port:
            publishers = [f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"]
        elif (address := read_address(pipeline.state_dir)) is not None:
            # Read again before every connection: a restarted publisher gets a new port.
            state_dir = pipeline.state_dir
            last = [address]

            def publishers() -> list[str]:
                found = read_address(state_dir)
                if found:
                    last[0] = found
                return [last[0]]
        else:
            raise ConfigError(
                "--publisher: the publisher listens on a port chosen at start "
                f"(transport.listen {options.listen}) and no running publisher left its address "
                f"in {pipeline.state_dir}; pass --publisher HOST:PORT or set a fixed port",
                pipeline.file,
            )
    tls = options.tls.client_context() if options.tls is not None else None
    subscriber = Subscriber(
        app.name,
        publishers,
        options.token,
        instance=str(request.instance),
        tls=tls,
        server_name=options.tls.server_name if options.tls else None,
        credits=options.credits,
        heartbeat_ms=options.heartbeat_ms,
        heartbeat_timeout_ms=options.heartbeat_timeout_ms,
        give_up_s=options.give_up_s,
    )
    subscriber.serve_sink(sink_component, pipeline, app, request.instance)


def _subscribe_through_registry(request: SubscribeRequest) -> None:
    """Every publisher of the dataset, found through the pipeline's registry."""
    pipeline = request.pipeline
    options = pipeline.transport.options
    app = request.sink_application("wormhole.Subscriber")
    assert app.sink is not None
    tls = options.tls.client_context() if options.tls is not None else None
    subscriber = Subscriber(
        app.name,
        registry=pipeline.dataset_registry,
        dataset=pipeline.name,
        token=options.token,
        # Unique across machines and restarts: publishers match sessions to registrations
        # by it (the registry orders subscribers by when they registered).
        instance=f"{socket.gethostname()}-{request.instance}-{os.getpid()}",
        tls=tls,
        server_name=options.tls.server_name if options.tls else None,
        credits=options.credits,
        heartbeat_ms=options.heartbeat_ms,
        heartbeat_timeout_ms=options.heartbeat_timeout_ms,
        give_up_s=options.give_up_s,
    )
    subscriber.serve_sink(app.sink, pipeline, app, request.instance)
