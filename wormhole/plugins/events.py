"""Recording events: the part of the plugin contract that counts what leaves no state behind.

Sources, sinks, transports and the engine call these where an event happens, once per event
or per batch: retries (every :class:`wormhole.core.backoff.Backoff` wait), reconnects,
errors (log records at ERROR and above, in processes the ``wormhole`` command runs), dead
letters (:func:`dead_lettered`), values that could not be decoded, rejected records, and the
sink's write latency on the subscriber side (one observation per batch).

Each process has one :data:`REGISTRY` (not prometheus-client's global one); the built-in
observability plugin (:mod:`wormhole.observability`) serves it with the figures it reads
from a running publisher. This module imports nothing of the engine.
``docs/operations.md`` lists every metric.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector

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


__all__ = [
    "DEAD_LETTERS",
    "ERRORS",
    "PARKED",
    "RECONNECTS",
    "REGISTRY",
    "REJECTED",
    "RETRIES",
    "SERVING_CLAIMS",
    "SINK_UPDATES",
    "SINK_WRITE_SECONDS",
    "UNDECODED",
    "count_errors",
    "dead_lettered",
    "parked",
    "reconnecting",
    "rejected_record",
    "retried",
    "timed_sink",
    "undecoded_value",
]
