"""What a publisher's run reports when it ends (``RunSummary``), and the progress of
``run --once`` towards its end position."""

from __future__ import annotations

import time
import typing
from dataclasses import dataclass, field
from typing import Any

from wormhole.core.hub import Hub
from wormhole.core.publisher_log import PublisherLog

if typing.TYPE_CHECKING:
    from wormhole.core.publisher import Publisher


@dataclass
class ApplicationSummary:
    name: str
    updates: int
    datamarker: int
    lag: int


@dataclass
class RunSummary:
    pipeline: str
    elapsed: float
    source_updates: int
    log_end: int
    applications: dict[str, ApplicationSummary] = field(default_factory=dict)
    truncated: list[str] = field(default_factory=list)
    removed_segments: list[str] = field(default_factory=list)
    log_bytes_read: int = 0
    """Bytes of publisher log the caravans read from disk (the tail comes from memory)."""
    caravan_merges: int = 0
    caravan_splits: int = 0
    once: bool = False
    complete: bool | None = None
    """``run --once``: whether every application acknowledged the end position (False
    when a stop came first); None for a run until stopped."""
    source_left: bool = False
    """``run --once`` stopped before the source was read to its end position."""
    applications_left: dict[str, int] = field(default_factory=dict)
    """``run --once`` stopped early: per application, updates of the publisher log it did
    not acknowledge."""

    @property
    def rate(self) -> float:
        return self.source_updates / self.elapsed if self.elapsed > 0 else 0.0


def once_progress(publisher: Publisher, hub: Hub) -> Any:
    """``run --once``: progress of every application to the end position, in
    publisher-log positions from the oldest datamarker at start. Until the source has
    reached its end there is no total (the log's end so far is none); then it is exact."""
    assert publisher.publisher_log is not None
    publisher_log = publisher.publisher_log
    with hub.lock:
        start = min((a.min_datamarker() for a in hub.applications.values()), default=0)
    task = publisher.progress.task("run --once", None, "updates", estimate=False)

    def report(target: int | None, finished: bool) -> None:
        with hub.lock:
            oldest = min(
                (a.min_datamarker() for a in hub.applications.values()),
                default=publisher_log.next_seq,
            )
        done = max(0, oldest - start)
        if target is None:
            # The source is still being read: how many updates it holds is not known
            # (what the log holds so far is not a total).
            task.update(done=done, detail="reading the source; total not known yet")
        else:
            task.update(done=done, total=max(0, target - start), detail="to the end position")
        if finished:
            task.finish()

    return report


def summarize(
    publisher: Publisher,
    started: float,
    publisher_log: PublisherLog,
    hub: Hub,
    truncated: list[str],
) -> RunSummary:
    summary = RunSummary(
        pipeline=publisher.pipeline.name,
        elapsed=time.monotonic() - started,
        source_updates=publisher.tailer.updates if publisher.tailer else 0,
        log_end=publisher_log.next_seq,
        truncated=truncated,
        removed_segments=publisher.retention.removed if publisher.retention else [],
        log_bytes_read=publisher_log.bytes_read,
        caravan_merges=publisher.caravans.merges if publisher.caravans else 0,
        caravan_splits=publisher.caravans.splits if publisher.caravans else 0,
    )
    for name, app in hub.applications.items():
        marker = app.min_datamarker()
        summary.applications[name] = ApplicationSummary(
            name, app.acknowledged_updates, marker, publisher_log.next_seq - marker
        )
    if publisher.once:
        once_outcome(publisher, summary, hub)
    return summary


def once_outcome(publisher: Publisher, summary: RunSummary, hub: Hub) -> None:
    """``run --once``: complete, or what a stop left undone."""
    summary.once = True
    tailer = publisher.tailer
    summary.source_left = tailer is None or not tailer.finished
    summary.applications_left = {
        name: app.lag for name, app in summary.applications.items() if app.lag > 0
    }
    # A stop that came once all was acknowledged (by the drain, say) left nothing.
    summary.complete = publisher.reached_end or (
        not summary.source_left
        and not summary.applications_left
        and hub.all_acknowledged(summary.log_end)
    )
