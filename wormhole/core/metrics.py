"""Metrics: what a publisher or subscriber process tells Prometheus.

Each process has one :data:`REGISTRY` (not prometheus-client's global one), served over
HTTP by :func:`serve` when ``metrics.listen`` (or ``--metrics HOST:PORT``) is set. Most
figures are read from the state the process keeps anyway, at scrape time, by
:class:`PublisherCollector`: the hub's flows, the caravans, the publisher log, the tailer's
counts and the source's own lag (its optional ``lag()`` method, see
:class:`wormhole.plugins.components.SourceLag`). Nothing is added to the path of an update
except, with metrics on, one count per batch of updates by table and op.

Events that leave no state behind are counters here, incremented where they happen, once
per event or per batch: retries (every :class:`wormhole.core.backoff.Backoff` wait),
reconnects, errors (log records at ERROR and above, in processes the ``wormhole`` command
runs), dead letters (:func:`dead_lettered`), and the sink's write latency on the subscriber
side (one observation per batch).

This module sits below the plugin contract, like the data model: it imports nothing of the
engine, so sources and transports may record events on it. The collector reads the
publisher's objects by duck typing. ``docs/operations.md`` lists every metric.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from wormhole.core.errors import ConfigError

log = logging.getLogger("wormhole.metrics")

DEFAULT_LISTEN = "127.0.0.1:9464"

REGISTRY = CollectorRegistry(auto_describe=True)
"""This process's metrics (a registry of its own: nothing registered elsewhere leaks in)."""

ProcessCollector(registry=REGISTRY)

RETRIES = Counter(
    "wormhole_retries",
    "Waits before trying again something that failed for a reason that may pass "
    "(a sink write, a connection, a full disk), by the logger of the component retrying.",
    ["logger"],
    registry=REGISTRY,
)
RECONNECTS = Counter(
    "wormhole_reconnects",
    "Connections lost and tried again: a source's connection to its datastore, a "
    "subscriber's to its publisher.",
    ["logger"],
    registry=REGISTRY,
)
ERRORS = Counter(
    "wormhole_errors",
    "Log records at level ERROR or above, by logger.",
    ["logger"],
    registry=REGISTRY,
)
DEAD_LETTERS = Counter(
    "wormhole_dead_letters",
    "Updates a sink rejected that went to the application's dead-letter log.",
    ["application"],
    registry=REGISTRY,
)
PARKED = Counter(
    "wormhole_dead_letters_parked",
    "Updates parked in the application's dead-letter log behind a dead letter of their key.",
    ["application"],
    registry=REGISTRY,
)
UNDECODED = Counter(
    "wormhole_source_undecoded_values",
    'Values a source could not decode and delivered as their bytes ({"undecoded": hex}), '
    "by table and column.",
    ["table", "column"],
    registry=REGISTRY,
)
REJECTED = Counter(
    "wormhole_source_rejected_records",
    "Source records that were not updates (a file-log line that is not an update object, a "
    "LogWriter record that does not decode), skipped and kept in the state_dir's rejects "
    "file, by table and column (the key at fault, or empty).",
    ["table", "column"],
    registry=REGISTRY,
)
SINK_WRITE_SECONDS = Histogram(
    "wormhole_sink_write_seconds",
    "Time a sink took to make one batch durable (successful writes), subscriber side.",
    ["application"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=REGISTRY,
)
SERVING_CLAIMS = Counter(
    "wormhole_serving_claims",
    "Serving claims this copy made (multiple-copy delivery), by application and outcome: "
    "served, refused (given back without serving: the copy could not take over), or "
    "unreached (given up while serving: none of the application's subscribers reached it).",
    ["application", "outcome"],
    registry=REGISTRY,
)
SINK_UPDATES = Counter(
    "wormhole_sink_updates",
    "Updates a sink wrote, subscriber side.",
    ["application"],
    registry=REGISTRY,
)


# ------------------------------------------------------------------ events
def retried(logger: str) -> None:
    """One wait before a retry (called by ``Backoff.wait``)."""
    RETRIES.labels(logger).inc()


def reconnecting(logger: str) -> None:
    """A lost connection is about to be tried again."""
    RECONNECTS.labels(logger).inc()


def undecoded_value(table: str, column: str) -> None:
    """A source delivered a value of ``table``.``column`` it could not decode as its bytes."""
    UNDECODED.labels(table, column).inc()


def rejected_record(table: str, column: str) -> None:
    """A source skipped a record of ``table`` that was not an update (kept in its rejects
    file); ``column``: the key at fault, or empty."""
    REJECTED.labels(table, column).inc()


def dead_lettered(application: str, updates: int = 1) -> None:
    """``updates`` of ``application`` went to its dead-letter log."""
    DEAD_LETTERS.labels(application).inc(updates)


def parked(application: str, updates: int = 1) -> None:
    """``updates`` of ``application`` were parked behind a dead letter of their key."""
    PARKED.labels(application).inc(updates)


def timed_sink(application: str, write: Callable[[list[Any]], None]) -> Callable[[list[Any]], None]:
    """``write`` (a sink's ``write``), observed: its latency per batch and the updates it wrote."""
    histogram = SINK_WRITE_SECONDS.labels(application)
    written = SINK_UPDATES.labels(application)
    clock = time.perf_counter

    def timed(updates: list[Any]) -> None:
        started = clock()
        write(updates)
        histogram.observe(clock() - started)
        written.inc(len(updates))

    return timed


class _ErrorCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)

    def emit(self, record: logging.LogRecord) -> None:
        ERRORS.labels(record.name).inc()


_error_counter = _ErrorCounter()


def count_errors() -> None:
    """Count the ``wormhole`` loggers' ERROR records in ``wormhole_errors_total``. Called by
    the command line once logging is set up: a handler added where none is configured would
    stop Python's last-resort handler from printing warnings in a program that uses Wormhole
    as a library."""
    logger = logging.getLogger("wormhole")
    if _error_counter not in logger.handlers:
        logger.addHandler(_error_counter)


# ------------------------------------------------------------------ serving
@dataclass(frozen=True)
class Listen:
    """Where metrics are served, and the option that said so (for messages)."""

    host: str
    port: int
    option: str = "metrics.listen"


def parse_listen(text: str, option: str = "metrics.listen") -> Listen:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6; port 0 picks a free one)."""
    host, sep, port = str(text).rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(
            f"{option}: {text!r} is not HOST:PORT; write e.g. {DEFAULT_LISTEN} "
            f"(port 0: a free port)"
        )
    return Listen(host, int(port), option)


class MetricsServer:
    """The HTTP endpoint (``/metrics``) of :data:`REGISTRY`, on a thread of its own."""

    def __init__(self, listen: Listen) -> None:
        from prometheus_client import start_http_server

        try:
            self.server, self.thread = start_http_server(
                listen.port, listen.host, registry=REGISTRY
            )
        except OSError as exc:
            raise ConfigError(
                f"{listen.option}: cannot serve metrics on {listen.host}:{listen.port} "
                f"({exc.strerror or exc}); choose a free port (another process serves there?), "
                f"or port 0 for any free one"
            ) from exc
        self.host = listen.host
        self.port = int(self.server.server_address[1])
        log.info("serving metrics on http://%s:%d/metrics", _url_host(self.host), self.port)

    @property
    def address(self) -> str:
        return f"{_url_host(self.host)}:{self.port}"

    def close(self) -> None:
        """Stop serving, at once: the server's loop looks for a stop request only between
        connections or every half second, so it is woken with connections until it stops
        (a run with metrics would otherwise end up to half a second late)."""
        import socket

        stopper = threading.Thread(target=self.server.shutdown, name="metrics-stop", daemon=True)
        stopper.start()
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        deadline = time.monotonic() + 5.0
        while stopper.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                socket.create_connection((host, self.port), timeout=0.5).close()
            stopper.join(0.02)
        self.server.server_close()
        self.thread.join(5)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def serve(listen: Listen) -> MetricsServer:
    """Serve this process's metrics at ``listen`` until :meth:`MetricsServer.close`."""
    return MetricsServer(listen)


class SubscriberPorts:
    """The metrics address of each subscriber process ``wormhole run`` starts: the ports
    after the publisher's, one per (application, instance) in the order they first start
    (port 0: each picks a free port)."""

    def __init__(self, listen: Listen) -> None:
        self.listen = listen
        self.given: dict[tuple[str, int], int] = {}
        self.lock = threading.Lock()

    def address(self, application: str, instance: int) -> str:
        listen = self.listen
        with self.lock:
            port = self.given.get((application, instance))
            if port is None:
                port = 0 if listen.port == 0 else listen.port + 1 + len(self.given)
                self.given[(application, instance)] = port
        return f"{_url_host(listen.host)}:{port}"


# ---------------------------------------------------------------- collecting
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


class AppendTimes:
    """When positions were appended to the publisher log, for lag in seconds.

    Exact for the batches kept in memory; beyond them, one mark per ``interval_ns``
    (at most ``limit`` marks: when full, every other one goes and the interval doubles).
    A position appended before this process opened the log is given the open time: its
    age is then a lower bound.
    """

    def __init__(self, interval_ns: int = 1_000_000_000, limit: int = 4096) -> None:
        self.interval_ns = interval_ns
        self.limit = limit
        self.opened_ns = time.monotonic_ns()
        self.seqs: list[int] = []
        self.times: list[int] = []

    def mark(self, first_seq: int, now_ns: int) -> None:
        """Batch ``first_seq`` was appended at ``now_ns`` (caller holds the log's lock)."""
        times = self.times
        if times and now_ns - times[-1] < self.interval_ns:
            return
        self.seqs.append(first_seq)
        times.append(now_ns)
        if len(times) > self.limit:
            del self.seqs[1::2]
            del times[1::2]
            self.interval_ns *= 2

    def forget_before(self, seq: int) -> None:
        """Positions before ``seq`` are gone (garbage-collected)."""
        i = bisect.bisect_right(self.seqs, seq) - 1
        if i > 0:
            del self.seqs[:i]
            del self.times[:i]

    def at(self, position: int) -> int:
        i = bisect.bisect_right(self.seqs, position) - 1
        return self.times[i] if i >= 0 else self.opened_ns


__all__ = [
    "DEFAULT_LISTEN",
    "REGISTRY",
    "AppendTimes",
    "Listen",
    "MetricsServer",
    "PublisherCollector",
    "SubscriberPorts",
    "count_errors",
    "dead_lettered",
    "parse_listen",
    "reconnecting",
    "retried",
    "serve",
    "timed_sink",
]


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
