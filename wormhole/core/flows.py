"""Flows: the stream of one shard's updates to one application.

A flow is the unit of ordering and of acknowledgement. Its *datamarker* is the
publisher-log seq before which every update was processed by a subscriber (or
filtered out). This module says where each flow starts (its stored datamarker,
or the application's ``start``) and compiles an application's publisher-side
filter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wormhole.core.errors import StartError, StateError
from wormhole.core.offline_log import position_at_time
from wormhole.core.pipeline import Application
from wormhole.core.publisher_log import PublisherLog
from wormhole.plugins.components import Datamarker


@dataclass(slots=True)
class FlowState:
    """The publisher's state of one flow."""

    application: str
    shard: int
    datamarker: int
    """Acknowledged: every update before this seq was handled."""
    persisted: int
    """The datamarker last written to the datamarker store."""
    delivered: int
    """End seq of the last frame handed to a subscriber (>= datamarker)."""


class AheadOfLog(StateError):
    """A stored datamarker past the end of the publisher log. After a torn tail was cut
    off, the source sends those updates again (they were never confirmed to it) and the
    log grows back to it: the application can start then."""

    def __init__(self, message: str, position: int) -> None:
        super().__init__(message)
        self.position = position


def start_flows(
    config: Application,
    shards: int,
    stored: dict[tuple[str, int], Datamarker],
    publisher_log: PublisherLog,
    pipeline_file: str,
) -> tuple[list[FlowState], list[Datamarker]]:
    """Each of the application's flows, from its stored datamarker or the application's
    ``start``, and the datamarkers to store for flows that had none.

    Raises StartError when ``start`` is outside the publisher log (the application can
    start elsewhere) and StateError when stored datamarkers are (the log was damaged).
    """
    name = config.name
    first, end = publisher_log.first_seq, publisher_log.next_seq
    flows: list[FlowState] = []
    fresh: list[Datamarker] = []
    time_position: int | None = None
    for shard in range(shards):
        marker = stored.get((name, shard))
        if marker is not None:
            position = marker.position
            where = f"the datamarker of application {name} shard {shard}"
        elif isinstance(config.start, dict) and "time" in config.start:
            if time_position is None:
                time_position = position_at_time(publisher_log.directory, config.start["time"])
            if time_position is None:
                raise StartError(
                    f"applications.{name}.start: the updates in the publisher log carry no "
                    f"source time (ts_ms), so a start time cannot be placed; start at "
                    f"earliest, latest or a position"
                )
            position = max(time_position, first)
            fresh.append(Datamarker(name, shard, position))
            where = f"applications.{name}.start"
        else:
            position = _start_position(config.start, first, end)
            fresh.append(Datamarker(name, shard, position))
            where = f"applications.{name}.start"
        if position > end:
            if marker is not None:
                raise AheadOfLog(
                    f"{where} is position {position}, past the end of the publisher log "
                    f"({end}) in {publisher_log.directory}: updates that were acknowledged are "
                    f"missing from the log (was the state_dir replaced or damaged?). "
                    f"Restore it, or start over with a new state_dir",
                    position,
                )
            raise StartError(
                f"{where} is position {position}, past the end of the publisher log "
                f"({end}): start the application at earliest, latest or a position in "
                f"{first} to {end}"
            )
        if position < first:
            if marker is not None:
                raise StateError(
                    f"{where} is position {position}, but the publisher log in "
                    f"{publisher_log.directory} starts at {first}: updates it never acknowledged "
                    f"were deleted (was the log pruned by hand?). Restore the log, or run "
                    f"`wormhole forget {pipeline_file} {name}` to drop its datamarkers "
                    f"so that it starts again from applications.{name}.start"
                )
            raise StartError(
                f"{where} is position {position}, outside the retained publisher log "
                f"({first} to {end}): the oldest retained position is {first}. Start the "
                f"application at earliest, latest or a position in that range"
            )
        flows.append(FlowState(name, shard, position, position, position))
    return flows, fresh


def _start_position(start: Any, first: int, end: int) -> int:
    if start == "earliest":
        return first
    if start == "latest" or "backfill" in start:
        return end  # a backfill brings what was before
    return int(start["position"])
