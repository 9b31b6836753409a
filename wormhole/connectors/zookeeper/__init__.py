"""The built-in ``zookeeper`` registry: publishers, applications and subscribers of a
dataset in ZooKeeper (needs kazoo, the ``zookeeper`` extra). One concept per module;
:mod:`wormhole.connectors.zookeeper.registry` puts them together and lists them."""

from __future__ import annotations

from typing import Any

from wormhole.connectors.zookeeper.options import ZooKeeperOptions
from wormhole.plugins.components import Capabilities, ComponentSpec
from wormhole.plugins.hookspecs import hookimpl


def _create(options: ZooKeeperOptions) -> Any:
    from wormhole.connectors.zookeeper.registry import ZooKeeperRegistry

    return ZooKeeperRegistry(options)


@hookimpl
def wormhole_registries() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            kind="registry",
            name="zookeeper",
            factory=_create,
            options=ZooKeeperOptions,
            description="Publishers, applications and subscribers of a dataset in ZooKeeper "
            "(several publishers; applications added and removed at run time). Needs kazoo.",
            capabilities=Capabilities(shared_registry=True),
        )
    ]
