"""The znodes of a dataset: where each one is (:class:`Layout`), how names become znode
names, and how values are written and read (JSON objects, checked field by field).

The layout (docs/registry.md, "Znode layout")::

    <root>/datasets/<dataset>/publishers/<node>                      ephemeral, JSON PublisherEntry fields
    <root>/datasets/<dataset>/status/<node>                          ephemeral, JSON status dict
    <root>/datasets/<dataset>/applications/<app>                     persistent, JSON mapping of the app
    <root>/datasets/<dataset>/applications/<app>/subscribers/<instance>-<seq>   ephemeral sequential
    <root>/datasets/<dataset>/seeded                                 persistent marker: seeded once
    <root>/datasets/<dataset>/serving/<datastore>/<app>              ephemeral, JSON ServingClaim
    <root>/datasets/<dataset>/epochs/<datastore>/<app>               persistent counter (JSON int)
    <root>/datasets/<dataset>/datamarkers/<datastore>/<app>          persistent, JSON {shard: ...}

``<node>`` is a publisher's :attr:`PublisherEntry.node`: ``<datastore>``, or
``<datastore>@<copy>`` for one copy of the datastore (multiple-copy delivery).
"""  # noqa: E501

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from wormhole.core.errors import ConfigError
from wormhole.plugins.components import ServingClaim

log = logging.getLogger("wormhole.zookeeper")


@dataclasses.dataclass
class Layout:
    """The paths of one dataset's znodes under the registry's root (``dataset`` is set
    when the registry opens)."""

    root: str
    dataset: str

    @property
    def base(self) -> str:
        return f"{self.root}/datasets/{self.dataset}"

    @property
    def publishers(self) -> str:
        return f"{self.base}/publishers"

    @property
    def statuses(self) -> str:
        return f"{self.base}/status"

    @property
    def applications(self) -> str:
        return f"{self.base}/applications"

    @property
    def seeded(self) -> str:
        return f"{self.base}/seeded"

    def publisher(self, node: str) -> str:
        return f"{self.publishers}/{node}"

    def status(self, node: str) -> str:
        return f"{self.statuses}/{node}"

    def application(self, app: str) -> str:
        return f"{self.applications}/{app}"

    def subscribers(self, app: str) -> str:
        return f"{self.application(app)}/subscribers"

    def serving(self, app: str, datastore: str) -> str:
        return f"{self.base}/serving/{datastore}/{app}"

    def epochs(self, app: str, datastore: str) -> str:
        return f"{self.base}/epochs/{datastore}/{app}"

    def datamarkers(self, app: str, datastore: str) -> str:
        return f"{self.base}/datamarkers/{datastore}/{app}"


# ------------------------------------------------------------------ names
def check_name(what: str, name: str) -> None:
    """ConfigError unless ``name`` can be one znode name."""
    if not name or "/" in name or name in (".", "..") or any(ord(c) < 32 for c in name):
        raise ConfigError(f"{what} {name!r} cannot be a znode name (no '/', not empty)")


def check_node(datastore: str, copy_: str) -> None:
    """A publisher's node name ``datastore`` or ``datastore@copy`` must be unambiguous."""
    check_name("datastore", datastore)
    if copy_:
        check_name("copy", copy_)
    for what, name in (("datastore", datastore), ("copy", copy_)):
        if "@" in name:
            raise ConfigError(f"{what} {name!r} cannot hold '@' (it names a copy: datastore@copy)")


def datastore_of(node: str, raw: dict[str, Any]) -> str:
    """The datastore of publisher node ``node`` (``datastore`` or ``datastore@copy``, the
    copy as the node's JSON says); ValueError if the name and the copy disagree."""
    copy_ = raw.get("copy", "")
    if not isinstance(copy_, str):
        raise ValueError(f"copy is {copy_!r}, not a str")
    if not copy_:
        return node
    datastore, at, named = node.rpartition("@")
    if not at or named != copy_ or not datastore:
        raise ValueError(f"copy {copy_!r} does not match the node's name {node!r}")
    return datastore


# ----------------------------------------------------------------- values
def encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def decode_object(data: bytes | None) -> dict[str, Any]:
    """The JSON object in ``data``; ValueError saying what is wrong otherwise."""
    try:
        value = json.loads(data or b"")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object (a {type(value).__name__})")
    return value


def field_values(cls: Any, raw: dict[str, Any], **fixed: Any) -> dict[str, Any]:
    """The fields of dataclass ``cls`` found in ``raw`` (unknown keys ignored), type-checked
    against the fields' defaults; ValueError naming a field of the wrong type."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in fixed:
            values[f.name] = fixed[f.name]
            continue
        if f.name not in raw:
            continue
        value = raw[f.name]
        default = f.default
        expected: type = type(default) if default is not dataclasses.MISSING else str
        if expected is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, expected)
        if not ok:
            raise ValueError(f"{f.name} is {value!r}, not a {expected.__name__}")
        values[f.name] = value
    return values


def serving_claim(raw: dict[str, Any]) -> ServingClaim:
    """A serving node's JSON as a claim; ValueError naming a field of the wrong type."""
    copy_, epoch = raw.get("copy"), raw.get("epoch")
    if not isinstance(copy_, str):
        raise ValueError(f"copy is {copy_!r}, not a str")
    if not isinstance(epoch, int) or isinstance(epoch, bool):
        raise ValueError(f"epoch is {epoch!r}, not an int")
    return ServingClaim(**field_values(ServingClaim, raw, copy=copy_, epoch=epoch))


def claim_epoch(data: bytes | None) -> int | None:
    """The epoch in a serving node's data (None if it holds none)."""
    try:
        epoch = decode_object(data).get("epoch")
    except ValueError:
        return None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


class SkippedNodes:
    """Warns once per node version about registry data that cannot be read."""

    def __init__(self) -> None:
        self._warned: set[tuple[str, int]] = set()

    def warn(self, path: str, version: int, reason: str) -> None:
        if (path, version) not in self._warned:
            self._warned.add((path, version))
            log.warning("registry node %s skipped: %s", path, reason)
