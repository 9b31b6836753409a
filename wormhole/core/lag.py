"""Datamarker lag: how far each flow is behind, measured once for whoever shows it.

A flow's lag is the publisher-log updates after its datamarker (the log's positions are one
sequence for every shard). A transport that counts lag at its destination (Kafka: the
consumer groups' committed offsets, ``ComponentSpec.lag``) replaces it with what it counts.
``wormhole status`` shows it per flow, ``wormhole top`` per application, the deployment view
per flow of every publisher: all from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, overload

from wormhole.core.datamarkers import load_stored
from wormhole.core.pipeline import Pipeline

PUBLISHER_LAG = "publisher-log updates after the datamarker"
"""What the lag counts when the transport does not count it at its destination."""


@overload
def behind(end: int, position: int) -> int: ...
@overload
def behind(end: int, position: int | None) -> int | None: ...
def behind(end: int, position: int | None) -> int | None:
    """Publisher-log updates from ``position`` to ``end`` (None without a position)."""
    return None if position is None else max(0, end - position)


def stored_datamarkers(pipeline: Pipeline) -> dict[tuple[str, int], Any]:
    """The pipeline's stored datamarkers by (application, shard), read-only from its own
    datamarker store, whichever it is; none when the state dir does not exist yet."""
    if not pipeline.state_dir.is_dir():
        return {}
    return load_stored(pipeline.datamarker_store, pipeline.name, pipeline.state_dir)


@dataclass
class FlowLag:
    """One flow's datamarker and lag (None: unknown)."""

    application: str
    shard: int
    datamarker: int | None
    lag: int | None


@dataclass
class Lag:
    """Every flow's datamarker and lag, with what the lag counts."""

    end: int
    """The publisher log's end when measured."""
    flows: list[FlowLag] = field(default_factory=list)
    what: str = PUBLISHER_LAG
    error: str = ""
    """Why the destination's lag is unknown ("" if it is known or not asked)."""
    destination: dict[str, dict[int, int]] | None = None
    """With a transport that counts lag at its destination: application -> shard -> lag."""

    def oldest(self, application: str) -> int | None:
        """The application's oldest datamarker (None: it has none)."""
        found = [f.datamarker for f in self.flows if f.application == application]
        positions = [p for p in found if p is not None]
        return min(positions) if positions else None

    def behind(self, application: str) -> int | None:
        """Publisher-log updates after the application's oldest datamarker."""
        return behind(self.end, self.oldest(application))

    def at_destination(self, application: str) -> int | None:
        """The application's lag as its destination counts it: the sum over its shards."""
        shards = (self.destination or {}).get(application)
        return None if shards is None else sum(shards.values())


def measure(pipeline: Pipeline, markers: dict[tuple[str, int], Any], end: int) -> Lag:
    """Each flow of every application of ``pipeline`` at its stored datamarker against the
    log's ``end``; asks the transport once for the lag at its destination, if it counts one."""
    lag = Lag(end)
    for name in sorted(pipeline.applications):
        for shard in range(pipeline.shards):
            marker = markers.get((name, shard))
            position = marker.position if marker else None
            lag.flows.append(FlowLag(name, shard, position, behind(end, position)))
    count = pipeline.transport.registered.spec.lag
    if count is None:
        return lag
    found = count(pipeline.transport.options, pipeline)
    lag.what, lag.error, lag.destination = found.what, found.error, found.shards
    for flow in lag.flows:
        flow.lag = found.shards.get(flow.application, {}).get(flow.shard)
    return lag


def removed_applications(
    names: set[str], markers: dict[tuple[str, int], Any], end: int
) -> list[dict[str, Any]]:
    """Applications with stored datamarkers that the dataset no longer has (not in
    ``names``): they hold the publisher log back until added again or forgotten."""
    lowest: dict[str, int] = {}
    for (name, _), marker in markers.items():
        if name not in names:
            lowest[name] = min(lowest.get(name, marker.position), marker.position)
    return [
        {"application": name, "datamarker": position, "lag": behind(end, position)}
        for name, position in sorted(lowest.items())
    ]
