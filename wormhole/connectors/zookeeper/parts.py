"""The two optional parts of the ``zookeeper`` registry, as the contract names them: the
application store (:class:`wormhole.plugins.components.ApplicationStore`) and serving claims
with shared datamarkers (:class:`wormhole.plugins.components.ServingClaims`). Each puts
together the modules that keep its data; :class:`ZooKeeperRegistry` hands them out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from wormhole.connectors.zookeeper.applications import Applications, RawApplications
from wormhole.connectors.zookeeper.claims import Claims
from wormhole.connectors.zookeeper.datamarkers import SharedDatamarkers
from wormhole.connectors.zookeeper.nodes import check_name
from wormhole.connectors.zookeeper.subscribers import Subscribers
from wormhole.plugins.components import ServingClaim, SharedDatamarker


class ZooKeeperApplicationStore:
    """The dataset's applications in ZooKeeper (``applications/<app>``)."""

    def __init__(self, apps: Applications, subscribers: Subscribers) -> None:
        self.apps = apps
        self.subscribers = subscribers

    def application_path(self, name: str) -> str:
        """Where an application lives, for messages: ``zookeeper HOSTS node PATH``."""
        return self.apps.path(name)

    def seed_applications(self, raw: dict[str, Any]) -> bool:
        return self.apps.seed(raw)

    def applications(self) -> RawApplications:
        return self.apps.all()

    def watch_applications(self, fn: Callable[[RawApplications], None]) -> None:
        self.apps.watch(fn)

    def put_application(self, name: str, raw: dict[str, Any]) -> None:
        self.apps.put(name, raw)

    def remove_application(self, name: str) -> bool:
        check_name("application", name)
        self.subscribers.forget_application(name)
        return self.apps.remove(name)


class ZooKeeperServingClaims:
    """Serving claims (``serving/...``) and the shared datamarkers written under them."""

    def __init__(self, claims: Claims, datamarkers: SharedDatamarkers) -> None:
        self.claims = claims
        self.datamarkers = datamarkers

    def claim_serving(self, application: str, datastore: str, copy: str) -> int | None:
        return self.claims.claim(application, datastore, copy)

    def release_serving(self, application: str, datastore: str, epoch: int) -> None:
        self.claims.release(application, datastore, epoch)

    def watch_serving(
        self, application: str, datastore: str, fn: Callable[[ServingClaim | None], None]
    ) -> Callable[[], None]:
        return self.claims.watch(application, datastore, fn)

    def load_datamarkers(self, application: str, datastore: str) -> dict[int, SharedDatamarker]:
        return self.datamarkers.load(application, datastore)

    def save_datamarkers(
        self,
        application: str,
        datastore: str,
        epoch: int,
        datamarkers: dict[int, SharedDatamarker],
    ) -> bool:
        return self.datamarkers.save(application, datastore, epoch, datamarkers)
