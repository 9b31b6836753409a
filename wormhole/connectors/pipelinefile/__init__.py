"""The built-in ``file`` registry: the pipeline file is the registry.

A dataset then has one publisher (this one), its applications are the file's (changed
with a SIGHUP reload), and subscribers are not tracked: the publisher spreads flows
over the sessions connected to it, in joining order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from wormhole.core.errors import ConfigError
from wormhole.plugins.components import (
    ComponentSpec,
    InvalidEntry,
    NoOptions,
    PublisherEntry,
    ServingClaim,
    SharedDatamarker,
    SubscriberEntry,
)
from wormhole.plugins.hookspecs import hookimpl


class FileRegistry:
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

    def holds_applications(self) -> bool:
        return False

    def seed_applications(self, raw: dict[str, Any]) -> bool:
        return False

    def applications(self) -> dict[str, dict[str, Any] | InvalidEntry]:
        return {}

    def watch_applications(
        self, fn: Callable[[dict[str, dict[str, Any] | InvalidEntry]], None]
    ) -> None:
        pass

    def put_application(self, name: str, raw: dict[str, Any]) -> None:
        raise ConfigError(
            "the pipeline's applications are in its file (no registry configured): edit the "
            "file and send the publisher SIGHUP, or configure registry: {type: zookeeper, ...}"
        )

    def remove_application(self, name: str) -> bool:
        self.put_application(name, {})
        return False

    def register_subscriber(self, application: str, entry: SubscriberEntry) -> None:
        pass

    def unregister_subscriber(self, application: str, instance: str) -> None:
        pass

    def watch_subscribers(
        self, application: str, fn: Callable[[list[SubscriberEntry]], None]
    ) -> None:
        fn([])

    def _multiple_copy(self) -> ConfigError:
        return ConfigError(
            "delivery.mode: multiple-copy needs a shared registry, where the copies of a "
            "datastore find each other and keep their datamarkers: set registry: "
            "{type: zookeeper, hosts: ..., root: ...}"
        )

    def claim_serving(self, application: str, datastore: str, copy: str) -> int | None:
        raise self._multiple_copy()

    def release_serving(self, application: str, datastore: str, epoch: int) -> None:
        raise self._multiple_copy()

    def watch_serving(
        self, application: str, datastore: str, fn: Callable[[ServingClaim | None], None]
    ) -> None:
        raise self._multiple_copy()

    def load_datamarkers(self, application: str, datastore: str) -> dict[int, SharedDatamarker]:
        raise self._multiple_copy()

    def save_datamarkers(
        self,
        application: str,
        datastore: str,
        epoch: int,
        datamarkers: dict[int, SharedDatamarker],
    ) -> bool:
        raise self._multiple_copy()

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
        )
    ]
