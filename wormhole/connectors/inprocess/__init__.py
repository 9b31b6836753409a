"""The ``inprocess`` transport: subscribers run as threads of the publisher's process.

Each application gets ``subscribers`` instances, each with its own sink and a
bounded frame queue; shards are divided among them as they would be among
remote subscribers.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from wormhole.core.errors import ConfigError
from wormhole.plugins.components import (
    Capabilities,
    ComponentSpec,
    LocalSubscriberSession,
    Options,
    PublisherView,
)
from wormhole.plugins.hookspecs import hookimpl


class InprocessOptions(Options):
    """Run subscribers inside the publisher process."""

    queue_frames: int = Field(8, ge=1, description="frames buffered per subscriber")
    drain_timeout_s: float = Field(
        10.0, ge=0, description="on stop, how long subscribers may take to finish queued frames"
    )


class InprocessTransport:
    def __init__(self, options: InprocessOptions) -> None:
        self.options = options
        self.subscribers: list[LocalSubscriberSession] = []
        self.context: dict[str, Any] = {}
        self.hub: PublisherView | None = None

    def start(self, hub: PublisherView) -> None:
        if not hub.local_subscribers:
            raise ConfigError(
                "transport.type: inprocess runs subscribers inside the publisher; to run the "
                "publisher alone (wormhole publish), use a network transport such as tcp"
            )
        self.hub = hub
        for app in hub.applications.values():
            self.add_application(app)

    def add_application(self, app: Any) -> None:
        """Start an application's subscribers (at start, or added to a running pipeline)."""
        hub = self.hub
        assert hub is not None, "started"
        assert app.config.sink is not None, "validation requires a sink with this transport"
        for index in range(app.config.subscribers):
            # Its sink, under the application's on_error policy (retries; dead letters, or stop).
            subscriber = hub.local_subscriber(app, index, self.options.queue_frames)
            self.subscribers.append(subscriber)
            hub.attach(app.name, subscriber)
            subscriber.start()

    def remove_application(self, name: str) -> None:
        """Stop an application's subscribers after they finish what they hold."""
        leaving = [s for s in self.subscribers if s.application == name]
        for subscriber in leaving:
            subscriber.stop(drain=True, timeout=self.options.drain_timeout_s)
            if not subscriber.thread.is_alive():
                subscriber.sink.close()
            if self.hub is not None:
                self.hub.detach(subscriber, "application removed from the pipeline")
            self.subscribers.remove(subscriber)

    def stop(self, drain: bool = True) -> None:
        for subscriber in self.subscribers:
            subscriber.stop(drain=drain, timeout=self.options.drain_timeout_s if drain else 1.0)
        for subscriber in self.subscribers:
            # A sink still inside write() (it missed the drain deadline) is left
            # open: closing it under the write could send the write elsewhere.
            if not subscriber.thread.is_alive():
                subscriber.sink.close()
        self.subscribers.clear()


@hookimpl
def wormhole_transports() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            kind="transport",
            name="inprocess",
            factory=InprocessTransport,
            options=InprocessOptions,
            description="Subscribers as threads of the publisher process.",
            capabilities=Capabilities(requires_sink=True),
        )
    ]
