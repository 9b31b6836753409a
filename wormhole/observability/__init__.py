"""Observability, a built-in plugin: what a running publisher shows of itself.

The engine carries no presentation: it takes a snapshot of a run (see
:mod:`wormhole.core.snapshot`) and calls the publisher hooks of
:mod:`wormhole.plugins.hookspecs`; this plugin, registered like the other built-ins,

* serves Prometheus metrics (``metrics.listen``): the figures read from the publisher at
  scrape time (:mod:`wormhole.observability.prometheus`) next to the event counters of the
  plugin contract (:mod:`wormhole.plugins.events`);
* writes the snapshot to ``<state_dir>/live.json`` (:mod:`wormhole.observability.status`),
  what ``wormhole status`` and ``wormhole top`` (:mod:`wormhole.observability.top`) read.

Progress of long work is reported through the contract's :mod:`wormhole.plugins.progress`.
"""

from __future__ import annotations

import threading
from typing import Any

from wormhole.observability import status
from wormhole.observability.prometheus import PublisherCollector
from wormhole.plugins.events import REGISTRY
from wormhole.plugins.hookspecs import hookimpl
from wormhole.plugins.metrics_endpoint import MetricsServer, serve

_serving: dict[int, tuple[PublisherCollector, MetricsServer]] = {}
"""Each running publisher's collector and endpoint, by the publisher's id."""
_lock = threading.Lock()


@hookimpl
def wormhole_publisher_opened(publisher: Any) -> None:
    """With ``metrics``: this publisher's figures in the process's registry, served."""
    config = publisher.pipeline.metrics
    if config is None:
        return
    collector = PublisherCollector(publisher, flows=config.flows)
    REGISTRY.register(collector)
    try:
        server = serve(config.listen)
    except BaseException:
        REGISTRY.unregister(collector)
        raise
    with _lock:
        _serving[id(publisher)] = (collector, server)
    publisher.snapshot.metrics = server.address


@hookimpl
def wormhole_publisher_snapshot(publisher: Any, snapshot: dict[str, Any]) -> None:
    status.save(publisher.pipeline.state_dir, snapshot)


@hookimpl
def wormhole_publisher_closed(publisher: Any) -> None:
    with _lock:
        serving = _serving.pop(id(publisher), None)
    if serving is None:
        return
    collector, server = serving
    try:
        server.close()
    finally:
        REGISTRY.unregister(collector)
