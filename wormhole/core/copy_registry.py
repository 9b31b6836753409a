"""What one copy of a datastore uses of its registry (multiple-copy delivery): the serving
claims, and of the membership the connection, the publishers and their statuses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from wormhole.core.errors import ConfigError
from wormhole.plugins.components import DatasetRegistry, PublisherEntry, ServingClaims


class CopyRegistry(ServingClaims, Protocol):
    """What a copy uses of its registry: the serving claims, and of the membership the
    connection, the publishers and their statuses."""

    def watch_connection(self, fn: Callable[[bool], None]) -> None: ...

    def watch_publishers(self, fn: Callable[[list[PublisherEntry]], None]) -> None: ...

    def statuses(self) -> dict[str, dict[str, Any]]: ...


class _Parts:
    """A registry's membership and its serving claims part, as one :class:`CopyRegistry`."""

    def __init__(self, registry: DatasetRegistry, claims: ServingClaims) -> None:
        self.watch_connection = registry.watch_connection
        self.watch_publishers = registry.watch_publishers
        self.statuses = registry.statuses
        self.claim_serving = claims.claim_serving
        self.release_serving = claims.release_serving
        self.watch_serving = claims.watch_serving
        self.load_datamarkers = claims.load_datamarkers
        self.save_datamarkers = claims.save_datamarkers


def copy_registry(registry: DatasetRegistry) -> CopyRegistry:
    """The registry as the copies of a datastore use it; ConfigError if it offers no
    serving claims (``delivery.mode: multiple-copy`` needs them)."""
    claims = registry.serving_claims()
    if claims is None:
        raise ConfigError(
            f"delivery.mode: multiple-copy needs a registry with serving claims, where the "
            f"copies of a datastore find each other and keep their datamarkers "
            f"({registry.describe()} has none): set registry: "
            f"{{type: zookeeper, hosts: ..., root: ...}}"
        )
    return _Parts(registry, claims)


__all__ = ["CopyRegistry", "copy_registry"]
