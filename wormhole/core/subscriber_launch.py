"""The subscriber processes ``wormhole run`` starts: the engine's part.

A transport that declares the ``subscriber_processes`` capability gets, once its ``start``
has returned (a listening socket bound, a topic checked), one ``wormhole subscribe``
process per instance of each application with a sink, restarted with backoff when it
exits (:class:`~wormhole.subscriber.processes.SubscriberProcesses`). The transport says
what else those processes need on their command line (``subscriber_args()``: the
publisher's address; ``None`` when this run starts none, ``spawn: false``).

The processes leave when the transport's stop lets them: a transport calls
``hub.stop_subscribers`` at the point of its stop (or of ``remove_application``) where
its subscribers hold nothing more (the tcp transport after its sessions drained, kafka
after the consumer groups caught up). Whatever it left running, the engine stops after
the transport's ``stop`` returns.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from wormhole.subscriber.processes import SubscriberProcesses

if TYPE_CHECKING:
    from wormhole.core.hub import Hub
    from wormhole.plugins.components import Capabilities

STOP_STALL_S = 10.0
"""How long a stopping subscriber may sit idle when the transport did not stop it itself."""


class SubscriberLaunch:
    """The subscriber processes of one run (none where the transport runs its sinks
    another way, or ``--once``'s caller asked for no local subscribers)."""

    def __init__(self, hub: Hub, transport: Any, offers: Capabilities) -> None:
        self.hub = hub
        self.reads_log = offers.reads_log
        args = transport.subscriber_args() if offers.subscriber_processes else None
        self.processes: SubscriberProcesses | None = None
        if args is not None and hub.local_subscribers:
            label = hub.pipeline.transport.type
            self.processes = SubscriberProcesses(hub, label, lambda: list(args))

    def start(self) -> None:
        """Every application's subscribers: those the hub serves, or, for a transport that
        reads the log itself, every application of the pipeline that is not external."""
        if self.processes is None:
            return
        if self.reads_log:
            configs = [a for a in self.hub.pipeline.applications.values() if not a.external]
        else:
            configs = [app.config for app in self.hub.applications.values()]
        for config in configs:
            self._spawn(config)

    def add(self, app: Any) -> None:
        """An application added to the running pipeline (an ``ApplicationRuntime``)."""
        if self.processes is not None:
            self._spawn(app.config)

    def _spawn(self, config: Any) -> None:
        assert self.processes is not None
        if config.sink is None:
            return
        for index in range(config.subscribers):
            self.processes.spawn(config.name, index)

    def applications(self) -> list[str]:
        """The applications this run started subscriber processes for."""
        return self.processes.applications() if self.processes is not None else []

    def stop(self, deadline: float, stall: float, application: str | None = None) -> None:
        """SIGTERM the subscribers (of ``application``, or all) and wait for them (see
        :meth:`SubscriberProcesses.stop`)."""
        if self.processes is not None:
            self.processes.stop(deadline, application=application, stall=stall)

    def stop_rest(self, drain: bool) -> None:
        """After the transport's stop: those it did not stop itself."""
        stall = STOP_STALL_S if drain else 1.0
        self.stop(time.monotonic() + stall, stall)
