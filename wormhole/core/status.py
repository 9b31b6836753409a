"""The live status of a running publisher: ``<state_dir>/live.json``.

The publisher rewrites it every datamarker interval; ``wormhole status`` (and
``wormhole forget``) read it to show caravans, their positions and read rates,
the applications served and those that failed.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from wormhole.core.caravan import Caravan
from wormhole.core.hub import Hub
from wormhole.core.publisher_log import PublisherLog

log = logging.getLogger("wormhole.publisher")

FILENAME = "live.json"


class LiveStatus:
    """Writes ``live.json``; keeps each caravan's last count to report a read rate."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / FILENAME
        self._rates: dict[int, tuple[Caravan, float, int]] = {}

    def write(
        self, publisher_log: PublisherLog, hub: Hub, caravans: list[Caravan]
    ) -> dict[str, Any]:
        now = time.monotonic()
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
        status = {
            "pid": os.getpid(),
            "updated_ms": int(time.time() * 1000),
            "log": {"first": publisher_log.first_seq, "end": publisher_log.next_seq},
            "caravans": listed,
            "applications": sorted(hub.applications),
            "failed": {name: str(error) for name, error in hub.failed.items()},
            "datastore": hub.datastore,
            "flows": {
                name: [
                    {
                        "shard": shard,
                        "datamarker": flow.datamarker,
                        "owner": getattr(owner, "instance", None) if owner else None,
                    }
                    for shard, (flow, owner) in enumerate(zip(app.flows, app.owner, strict=False))
                ]
                for name, app in hub.applications.items()
            },
        }
        temporary = self.path.with_name(f".{FILENAME}.tmp")
        try:
            temporary.write_text(json.dumps(status))
            os.replace(temporary, self.path)
        except OSError as exc:  # status only: never fatal
            log.debug("cannot write %s: %s", self.path, exc)
        return status


def read_live_status(state_dir: Path) -> dict[str, Any] | None:
    """The running publisher's live status, or None if no publisher is running there."""
    try:
        live = json.loads((state_dir / FILENAME).read_text())
        os.kill(int(live["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return dict(live)
