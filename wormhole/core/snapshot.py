"""A running publisher's snapshot: what it is doing now, as plain data.

The publisher takes one every datamarker interval (:meth:`RunSnapshot.take`): caravans, their
positions and read rates, the applications served and those that failed, each application's
counts, rates and lag, each flow's datamarker and owner, the progress of long work. It hands
it to the ``wormhole_publisher_snapshot`` hook (the built-in observability plugin writes it
to ``<state_dir>/live.json`` for ``wormhole status`` and ``top``) and publishes it in the
registry (the deployment view).
"""

from __future__ import annotations

import os
import time
from typing import Any

from wormhole.core.caravan import Caravan
from wormhole.core.hub import Hub
from wormhole.core.lag import behind
from wormhole.core.publisher_log import PublisherLog


class RunSnapshot:
    """Takes the snapshot; keeps each caravan's, application's and the source's last
    counts to report rates (updates/s between two snapshots)."""

    def __init__(self) -> None:
        self._rates: dict[int, tuple[Caravan, float, int]] = {}
        self._counts: dict[str, tuple[float, int]] = {}
        self.metrics: str | None = None
        """The publisher's metrics address (``HOST:PORT``) while it serves them."""
        self.progress: Any = None
        """The publisher's :class:`wormhole.plugins.progress.Progress`, if any (its tasks)."""

    def _rate(self, key: str, now: float, count: int) -> float:
        last = self._counts.get(key)
        self._counts[key] = (now, count)
        if last is None or now <= last[0] or count < last[1]:
            return 0.0
        return round((count - last[1]) / (now - last[0]), 1)

    def take(
        self,
        publisher_log: PublisherLog,
        hub: Hub,
        caravans: list[Caravan],
        source_updates: int | None = None,
    ) -> dict[str, Any]:
        now = time.monotonic()
        listed = self._caravan_figures(caravans, now)
        applications = self._application_figures(publisher_log, hub, now)
        source: dict[str, Any] = {}
        if source_updates is not None:
            source = {
                "updates": source_updates,
                "read_rate": self._rate("source", now, source_updates),
            }
        status = {
            "pid": os.getpid(),
            "updated_ms": int(time.time() * 1000),
            "log": {"first": publisher_log.first_seq, "end": publisher_log.next_seq},
            "caravans": listed,
            "applications": sorted(hub.applications),
            "application_figures": applications,
            "source": source,
            "metrics": self.metrics,
            "progress": self.progress.tasks() if self.progress is not None else [],
            "failed": {name: str(error) for name, error in hub.failed.items()},
            "datastore": hub.datastore,
            "flows": _flows(hub),
        }
        return status

    def _caravan_figures(self, caravans: list[Caravan], now: float) -> list[dict[str, Any]]:
        """Each caravan's applications, position and reads, with its read rate since the last
        write."""
        listed = []
        rates: dict[int, tuple[Caravan, float, int]] = {}
        for caravan in caravans:
            last = self._rates.get(id(caravan))
            rate = 0.0
            # The caravan itself is kept with its figures: an id can be reused by a new one.
            if last is not None and last[0] is caravan and now > last[1]:
                rate = (caravan.updates_read - last[2]) / (now - last[1])
            rates[id(caravan)] = (caravan, now, caravan.updates_read)
            listed.append(
                {
                    "applications": [a.name for a in caravan.applications],
                    "position": caravan.position,
                    "batches": caravan.batches,
                    "updates_read": caravan.updates_read,
                    "bytes_read_from_disk": caravan.bytes_read,
                    "read_rate": round(rate, 1),
                }
            )
        self._rates = rates  # caravans that are gone are forgotten
        return listed

    def _application_figures(
        self, publisher_log: PublisherLog, hub: Hub, now: float
    ) -> dict[str, dict[str, Any]]:
        """Each application's counts, rates, subscribers, oldest datamarker and lag."""
        end = publisher_log.next_seq
        now_ns = time.monotonic_ns()
        applications = {}
        with hub.lock:
            apps = [
                (
                    name,
                    app.delivered_updates,
                    app.acknowledged_updates,
                    len(app.sessions),
                    app.min_datamarker() if app.flows else end,
                )
                for name, app in hub.applications.items()
            ]
        for name, delivered, acknowledged, sessions, oldest in apps:
            applications[name] = {
                "delivered": delivered,
                "acknowledged": acknowledged,
                "delivered_rate": self._rate(f"d:{name}", now, delivered),
                "acknowledged_rate": self._rate(f"a:{name}", now, acknowledged),
                "subscribers": sessions,
                "datamarker": oldest,
                "lag_updates": behind(end, oldest),
                "lag_seconds": (
                    round(max(0.0, (now_ns - publisher_log.appended_at(oldest)) / 1e9), 3)
                    if oldest < end
                    else 0.0
                ),
            }
        return applications


def _flows(hub: Hub) -> dict[str, list[dict[str, Any]]]:
    """Each application's flows: shard, datamarker and the subscriber instance owning it."""
    return {
        name: [
            {
                "shard": shard,
                "datamarker": flow.datamarker,
                "owner": getattr(owner, "instance", None) if owner else None,
            }
            for shard, (flow, owner) in enumerate(zip(app.flows, app.owner, strict=False))
        ]
        for name, app in hub.applications.items()
    }
