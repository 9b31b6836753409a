"""The built-in ``file`` registry: the pipeline file is the registry.

A dataset then has one publisher (this one), its applications are the file's (changed
with a SIGHUP reload), and subscribers are not tracked: the publisher spreads flows
over the sessions connected to it, in joining order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from wormhole.plugins.components import (
    ApplicationStore,
    Capabilities,
    ComponentSpec,
    NoOptions,
    PublisherEntry,
    ServingClaims,
    SubscriberEntry,
)
from wormhole.plugins.hookspecs import hookimpl


class FileRegistry:
    """A :class:`wormhole.plugins.components.DatasetRegistry` of one publisher, without
    an application store or serving claims."""

    def __init__(self) -> None:
        self.dataset = ""
        self.entry: PublisherEntry | None = None
        self._publisher_watches: list[Callable[[list[PublisherEntry]], None]] = []

    def open(self, dataset: str, stop: threading.Event) -> None:
        self.dataset = dataset

    def describe(self) -> str:
        return "the pipeline file"

    def close(self) -> None:
        self.entry = None

    def register_publisher(self, entry: PublisherEntry) -> None:
        self.entry = entry
        for fn in self._publisher_watches:
            fn([entry])

    def release_publisher(self, datastore: str, holder: PublisherEntry) -> bool:
        return False

    def watch_publishers(self, fn: Callable[[list[PublisherEntry]], None]) -> None:
        self._publisher_watches.append(fn)
        fn([self.entry] if self.entry is not None else [])

    def publish_status(self, datastore: str, status: dict[str, Any]) -> None:
        pass  # `wormhole status` reads the state dir

    def statuses(self) -> dict[str, dict[str, Any]]:
        return {}

    def application_store(self) -> ApplicationStore | None:
        return None  # the applications are the file's

    def serving_claims(self) -> ServingClaims | None:
        return None  # one publisher: no copies to coordinate

    def register_subscriber(self, application: str, entry: SubscriberEntry) -> None:
        pass

    def unregister_subscriber(self, application: str, instance: str) -> None:
        pass

    def watch_subscribers(
        self, application: str, fn: Callable[[list[SubscriberEntry]], None]
    ) -> Callable[[], None]:
        fn([])
        return lambda: None  # nothing changes: nothing to end

    def watch_connection(self, fn: Callable[[bool], None]) -> None:
        pass  # always connected


@hookimpl
def wormhole_registries() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            kind="registry",
            name="file",
            factory=lambda options: FileRegistry(),
            options=NoOptions,
            description="The pipeline file is the registry: one publisher, the file's "
            "applications (default).",
            default=True,
            capabilities=Capabilities(),
        )
    ]
