"""Prometheus figures of a running publisher, read at scrape time.

:class:`PublisherCollector` reads the state the process keeps anyway: the hub's flows, the
caravans, the publisher log, the tailer's counts and the source's own lag (its optional
``lag()`` method, see :class:`wormhole.plugins.components.SourceLag`). Nothing is added to
the path of an update except, with metrics on, one count per batch of updates by table and
op. It reads the publisher's objects by duck typing. ``docs/operations.md`` lists every
metric; the event counters are in :mod:`wormhole.plugins.events`.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("wormhole.metrics")

SOURCE_GAUGE = re.compile(r"^[a-z][a-z0-9_]*_(bytes|seconds|updates|files)$")
"""What a source's ``lag()`` may name a gauge (``lag_bytes``, ``retained_bytes`` ...)."""


class PublisherCollector(Collector):
    """Reads a running :class:`wormhole.core.publisher.Publisher` at scrape time.

    ``flows``: per-flow (per shard) series; off, only per-application ones.
    """

    def __init__(self, publisher: Any, flows: bool = True) -> None:
        self.publisher = publisher
        self.flows = flows
        self._warned: set[str] = set()

    def describe(self) -> Iterator[Metric]:
        return iter(())  # the series change as applications and caravans come and go

    def collect(self) -> Iterator[Metric]:
        publisher = self.publisher
        pipeline = publisher.pipeline.name
        yield from self._source(publisher, pipeline)
        yield from self._backfills(publisher.backfiller)
        publisher_log = publisher.publisher_log
        if publisher_log is None or not publisher_log.segments:
            return
        yield from self._log(publisher_log, pipeline)
        hub, caravans = publisher.hub, publisher.caravans
        if hub is not None:
            yield from self._applications(hub, publisher_log, caravans)
        if caravans is not None:
            yield from self._caravans(caravans, publisher_log)

    # -------------------------------------------------------------- source
    def _source(self, publisher: Any, pipeline: str) -> Iterator[Metric]:
        tailer = publisher.tailer
        read = CounterMetricFamily(
            "wormhole_source_updates",
            "Updates read from the source and appended to the publisher log, by table and op.",
            labels=["table", "op"],
        )
        if tailer is not None:
            for (table, op), count in list(tailer.read_counts.items()):
                read.add_metric([table, op], count)
        yield read
        source = publisher.source
        if source is None or not publisher.pipeline.source.capabilities_of(source).lag:
            return
        lag = source.lag
        try:
            values = lag()
        except Exception as exc:  # the datastore is away: no figures this time
            log.debug("source lag unavailable: %s", exc)
            return
        kind = publisher.pipeline.source.type
        for name, value in sorted((values or {}).items()):
            if not SOURCE_GAUGE.match(name):
                if name not in self._warned:
                    self._warned.add(name)
                    log.warning(
                        "source %s: lag() names a gauge %r; names must match %s",
                        kind,
                        name,
                        SOURCE_GAUGE.pattern,
                    )
                continue
            if value is None:
                continue
            gauge = GaugeMetricFamily(
                f"wormhole_source_{name}",
                f"Source lag reported by the {kind} source ({name}; see docs/operations.md).",
                labels=["source"],
            )
            gauge.add_metric([kind], float(value))
            yield gauge

    # ------------------------------------------------------------ backfills
    def _backfills(self, backfiller: Any) -> Iterator[Metric]:
        if backfiller is None:
            return
        counters, active = backfiller.counters, backfiller.active
        with backfiller.lock:
            rows, dropped, chunks = dict(counters.rows), dict(counters.dropped), counters.chunks
        emitted = CounterMetricFamily(
            "wormhole_backfill_rows",
            "Rows backfilled into the publisher log, by table and application (* for every "
            "application).",
            labels=["table", "application"],
        )
        stale = CounterMetricFamily(
            "wormhole_backfill_dropped_rows",
            "Rows a backfill read but left to the stream, which changed them meanwhile.",
            labels=["table", "application"],
        )
        for (table, application), count in sorted(rows.items()):
            emitted.add_metric([table, application or "*"], count)
            stale.add_metric([table, application or "*"], dropped.get((table, application), 0))
        yield emitted
        yield stale
        done = CounterMetricFamily("wormhole_backfill_chunks", "Backfill chunks made durable.")
        done.add_metric([], chunks)
        yield done
        yield _gauge(
            "wormhole_backfill_running", "1 while a backfill runs, else 0.", int(active is not None)
        )
        if active is not None and active.task.total is not None:
            yield _gauge(
                "wormhole_backfill_remaining_rows",
                "About how many rows the running backfill has left to read (statistics).",
                max(0, active.task.total - active.task.done),
            )

    # ---------------------------------------------------------- publisher log
    def _log(self, publisher_log: Any, pipeline: str) -> Iterator[Metric]:
        segments = list(publisher_log.segments)
        yield _gauge(
            "wormhole_log_bytes",
            "Bytes of the publisher log on disk (every retained segment).",
            sum(s.size for s in segments),
        )
        yield _gauge("wormhole_log_segments", "Segments of the publisher log.", len(segments))
        yield _gauge(
            "wormhole_log_first_position",
            "The oldest retained position of the publisher log.",
            publisher_log.first_seq,
        )
        yield _gauge(
            "wormhole_log_end_position",
            "The position after the newest update of the publisher log.",
            publisher_log.next_seq,
        )
        written = CounterMetricFamily(
            "wormhole_log_written_bytes", "Bytes appended to the publisher log by this process."
        )
        written.add_metric([], publisher_log.bytes_written)
        yield written

    # ---------------------------------------------------------- applications
    def _applications(self, hub: Any, publisher_log: Any, caravans: Any) -> Iterator[Metric]:
        end = publisher_log.next_seq
        age = _age_of(end, time.monotonic_ns(), publisher_log.appended_at)
        apps, failures = _read_applications(hub)
        delivered, acknowledged, app_lag, app_lag_s, subscribers, failed = _application_families()
        flow_delivered, flow_acked, flow_lag, flow_lag_s = _flow_families()
        for name, app_delivered, app_acked, sessions, flows in apps:
            delivered.add_metric([name], app_delivered)
            acknowledged.add_metric([name], app_acked)
            oldest = min((marker for _, _, marker in flows), default=end)
            app_lag.add_metric([name], max(0, end - oldest))
            app_lag_s.add_metric([name], age(oldest))
            subscribers.add_metric([name], sessions)
            failed.add_metric([name], 1 if name in failures else 0)
            if self.flows:
                for shard, flow_pos, marker in flows:
                    labels = [name, str(shard)]
                    flow_delivered.add_metric(labels, flow_pos)
                    flow_acked.add_metric(labels, marker)
                    flow_lag.add_metric(labels, max(0, end - marker))
                    flow_lag_s.add_metric(labels, age(marker))
        for name in sorted(failures - {a[0] for a in apps}):
            failed.add_metric([name], 1)
        yield from (delivered, acknowledged, app_lag, app_lag_s, subscribers, failed)
        if self.flows:
            yield from (flow_delivered, flow_acked, flow_lag, flow_lag_s)
        if caravans is not None:
            yield _caravan_lag(caravans, end)

    # ------------------------------------------------------------- caravans
    def _caravans(self, caravans: Any, publisher_log: Any) -> Iterator[Metric]:
        end = publisher_log.next_seq
        live = [c for c in list(caravans.caravans) if c.thread.is_alive()]
        yield _gauge("wormhole_caravans", "Caravans reading the publisher log.", len(live))
        yield _gauge(
            "wormhole_caravan_max_lag_updates",
            "Publisher-log positions between the log's end and the caravan furthest behind.",
            max((max(0, end - c.position) for c in live), default=0),
        )
        for name, value, text in (
            ("merges", caravans.merges, "Caravans that merged into the one behind them."),
            ("splits", caravans.splits, "Applications moved off a caravan (slow or idle)."),
        ):
            counter = CounterMetricFamily(f"wormhole_caravan_{name}", text)
            counter.add_metric([], value)
            yield counter
        read = CounterMetricFamily(
            "wormhole_caravan_read_bytes",
            "Bytes of publisher log caravans read from disk (the tail is served from memory).",
        )
        read.add_metric([], publisher_log.bytes_read)
        yield read


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, text)
    gauge.add_metric([], value)
    return gauge


# ------------------------------------------------------- applications' parts
_ApplicationRow = tuple[str, int, int, int, list[tuple[int, int, int]]]


def _read_applications(hub: Any) -> tuple[list[_ApplicationRow], set[str]]:
    """Each application's counts, sessions and flows, and the failed ones, under the hub's lock."""
    with hub.lock:
        apps = [
            (
                name,
                app.delivered_updates,
                app.acknowledged_updates,
                len(app.sessions),
                [(f.shard, f.delivered, f.datamarker) for f in app.flows],
            )
            for name, app in hub.applications.items()
        ]
        failures = set(hub.failed)
    return apps, failures


def _age_of(end: int, now: int, appended_at: Callable[[int], int]) -> Callable[[int], float]:
    """Seconds since the update at a position was appended (0 at the log's end), each
    position looked up once per scrape."""
    ages: dict[int, float] = {}

    def age(position: int) -> float:
        if position >= end:
            return 0.0
        seconds = ages.get(position)
        if seconds is None:
            seconds = ages[position] = max(0.0, (now - appended_at(position)) / 1e9)
        return seconds

    return age


def _application_families() -> tuple[
    CounterMetricFamily,
    CounterMetricFamily,
    GaugeMetricFamily,
    GaugeMetricFamily,
    GaugeMetricFamily,
    GaugeMetricFamily,
]:
    """The per-application families: delivered, acknowledged, lag in updates and in seconds,
    subscribers, failed."""
    labels = ["application"]
    return (
        CounterMetricFamily(
            "wormhole_application_delivered_updates",
            "Updates handed to the application's subscribers (after its filter).",
            labels=labels,
        ),
        CounterMetricFamily(
            "wormhole_application_acknowledged_updates",
            "Updates the application's subscribers acknowledged.",
            labels=labels,
        ),
        GaugeMetricFamily(
            "wormhole_application_lag_updates",
            "Publisher-log positions between the log's end and the application's oldest "
            "datamarker (filtered-out updates included).",
            labels=labels,
        ),
        GaugeMetricFamily(
            "wormhole_application_lag_seconds",
            "Age of the oldest update the application has not acknowledged (0 when caught up).",
            labels=labels,
        ),
        GaugeMetricFamily(
            "wormhole_application_subscribers",
            "Subscribers connected to this publisher for the application.",
            labels=labels,
        ),
        GaugeMetricFamily(
            "wormhole_application_failed",
            "1 if the application was stopped by an error of its own, else 0.",
            labels=labels,
        ),
    )


def _flow_families() -> tuple[
    GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily
]:
    """The per-flow families: delivered position, datamarker, lag in updates and in seconds."""
    labels = ["application", "shard"]
    return (
        GaugeMetricFamily(
            "wormhole_flow_delivered_position",
            "Publisher-log position up to which the flow was handed to its subscriber.",
            labels=labels,
        ),
        GaugeMetricFamily(
            "wormhole_flow_acknowledged_position",
            "The flow's datamarker: the position before which its subscriber acknowledged "
            "everything.",
            labels=labels,
        ),
        GaugeMetricFamily(
            "wormhole_flow_lag_updates",
            "Publisher-log positions between the log's end and the flow's datamarker.",
            labels=labels,
        ),
        GaugeMetricFamily(
            "wormhole_flow_lag_seconds",
            "Age of the flow's oldest unacknowledged update (0 when caught up).",
            labels=labels,
        ),
    )


def _caravan_lag(caravans: Any, end: int) -> GaugeMetricFamily:
    """How far behind the log's end the caravan carrying each application is."""
    carried = GaugeMetricFamily(
        "wormhole_application_caravan_lag_updates",
        "Publisher-log positions between the log's end and the position of the "
        "caravan carrying the application (absent while no caravan carries it).",
        labels=["application"],
    )
    for caravan in list(caravans.caravans):
        for app in list(caravan.applications):
            carried.add_metric([app.name], max(0, end - caravan.position))
    return carried
