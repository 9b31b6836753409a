"""The options of the ``zookeeper`` registry (``registry: {type: zookeeper, ...}``)."""

from __future__ import annotations

from pydantic import Field, field_validator

from wormhole.plugins.components import Options


class ZooKeeperOptions(Options):
    """Where the registry's ZooKeeper ensemble is, and how long to wait for it."""

    hosts: str = Field(min_length=1, description="The ensemble: ``zk1:2181,zk2:2181``.")
    root: str = Field("/wormhole", description="The znode under which Wormhole keeps its data.")
    session_timeout_ms: int = Field(
        10_000,
        ge=2_000,
        description="ZooKeeper session timeout: how long after losing its connection a "
        "process's publishers and subscribers are dropped.",
    )
    connect_timeout_s: float = Field(
        15,
        gt=0,
        description="How long opening the registry (and an operation while ZooKeeper is "
        "unreachable) keeps retrying before giving up.",
    )

    @field_validator("root")
    @classmethod
    def _root_is_a_path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"must be an absolute znode path starting with '/' (not {value!r})")
        parts = value.strip("/").split("/") if value.strip("/") else []
        if any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"{value!r} is not a valid znode path")
        return value
