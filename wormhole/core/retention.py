"""Retention: persisting datamarkers, and collecting the publisher log they have passed.

Acknowledged datamarkers are written to the datamarker store every
``delivery.datamarker_interval_ms`` and at the end of a run. A rolled segment of
the publisher log is deleted only once every *stored* datamarker is past it, so
that after a crash every flow can resume from what is on disk: those of the
applications the publisher serves, of applications read by an outside reader, of
applications taken out of the pipeline file (until ``wormhole forget``), and of
applications that could not start. ``log.keep_rolled`` keeps more for replay.

In multiple-copy delivery the copies add a *floor* (:meth:`CopyCoordinator.retained`):
the update each shared datamarker names is never collected, on the serving copy (whose
own datamarkers run ahead of the shared ones) and on the standbys alike, and nothing is
collected for an application whose shared datamarkers this copy has not mapped yet.
"""

from __future__ import annotations

from collections.abc import Callable

from wormhole.core.hub import Hub
from wormhole.core.pipeline import Pipeline
from wormhole.core.publisher_log import PublisherLog
from wormhole.plugins.components import DatamarkerStore


class Retention:
    def __init__(
        self,
        pipeline: Pipeline,
        store: DatamarkerStore,
        publisher_log: PublisherLog,
        outside_readers: bool = False,
    ) -> None:
        self.pipeline = pipeline
        self.store = store
        self.publisher_log = publisher_log
        self.outside_readers = outside_readers
        """Every application is read outside the hub (a transport with ``reads_log``)."""
        self.removed: list[str] = []
        """Segments collected so far."""
        self.floor: Callable[[], int | None] | None = None
        """The lowest seq something outside the flows needs (multiple-copy delivery: the
        updates the shared datamarkers name), or None when it needs nothing."""

    def persist(self, hub: Hub) -> None:
        """Save the datamarkers that moved, then collect the segments every stored one has
        passed."""
        publisher_log, store = self.publisher_log, self.store
        changed = hub.unpersisted()
        if changed:
            if not publisher_log.fsync:
                # Datamarkers must never be on disk ahead of the data they point past.
                publisher_log.sync()
            store.save(changed)
            hub.mark_persisted(changed)
        upto = self.collectable(hub)
        if upto is not None:
            self.removed += publisher_log.collect_garbage(upto, self.pipeline.log.keep_rolled)

    def collectable(self, hub: Hub) -> int | None:
        """The lowest position any flow may still need, from datamarkers on disk only
        (after a crash, flows resume from the persisted ones); None if there are none."""
        upto = hub.min_persisted()
        stored = self.store.load()
        with hub.lock:
            served = set(hub.applications)
        positions = [m.position for (name, _), m in stored.items() if name not in served]
        for name, config in self.pipeline.applications.items():
            if config.external or self.outside_readers:
                # An outside reader that has stored nothing yet needs the whole log.
                positions += [
                    self.publisher_log.first_seq
                    for shard in range(self.pipeline.shards)
                    if (name, shard) not in stored
                ]
        floor = self.floor() if self.floor is not None else None
        if floor is not None:
            positions.append(floor)
        if positions:
            upto = min(positions) if upto is None else min(upto, *positions)
        return upto
