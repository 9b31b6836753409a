"""Moved: recording events (retries, reconnects, dead letters ...) to
:mod:`wormhole.plugins.events`, the metrics endpoint to :mod:`wormhole.plugins.metrics_endpoint`
(both the plugin contract), the publisher's Prometheus figures to
:mod:`wormhole.observability.prometheus`. The contract's names stay importable from here."""

from wormhole.plugins.events import (
    DEAD_LETTERS,
    ERRORS,
    PARKED,
    RECONNECTS,
    REGISTRY,
    REJECTED,
    RETRIES,
    SERVING_CLAIMS,
    SINK_UPDATES,
    SINK_WRITE_SECONDS,
    UNDECODED,
    count_errors,
    dead_lettered,
    parked,
    reconnecting,
    rejected_record,
    retried,
    timed_sink,
    undecoded_value,
)
from wormhole.plugins.metrics_endpoint import (
    DEFAULT_LISTEN,
    Listen,
    MetricsServer,
    SubscriberPorts,
    parse_listen,
    serve,
)

__all__ = [
    "DEAD_LETTERS",
    "DEFAULT_LISTEN",
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
    "Listen",
    "MetricsServer",
    "SubscriberPorts",
    "count_errors",
    "dead_lettered",
    "parked",
    "parse_listen",
    "reconnecting",
    "rejected_record",
    "retried",
    "serve",
    "timed_sink",
    "undecoded_value",
]
