"""A running publisher's applications: started with the run (from stored datamarkers or
their start point, queueing start backfills), waiting for a log whose torn tail was cut to
grow back to them, and added, removed or changed while running (SIGHUP, the registry)."""

from __future__ import annotations

import dataclasses
import logging
import time
import typing
from typing import Any

from wormhole.core.errors import BackfillError, ConfigError, StateError
from wormhole.core.flows import AheadOfLog, start_flows
from wormhole.core.hub import ApplicationRuntime, Hub
from wormhole.core.pipeline import Application, load_pipeline
from wormhole.core.publisher_log import PublisherLog
from wormhole.core.subscriber_launch import STOP_STALL_S
from wormhole.plugins.components import Datamarker
from wormhole.plugins.filters import application_filter

if typing.TYPE_CHECKING:
    from wormhole.core.publisher import Publisher

log = logging.getLogger("wormhole.publisher")


class Applications:
    """The applications of one publisher's run; the run's state stays on the publisher."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher

    def initial(self, store: Any, publisher_log: PublisherLog) -> dict[str, ApplicationRuntime]:
        """The applications the run starts with; those that cannot start are in the
        publisher's ``start_failures`` (or wait for a refilled log)."""
        stored = store.load()
        apps = {}
        new: list[Datamarker] = []
        for name, config in self.publisher.pipeline.applications.items():
            try:
                runtime = self._runtime(name, config, stored, publisher_log, new)
            except AheadOfLog as exc:
                if not self._wait_for_refill(name, exc, publisher_log):
                    self.publisher.start_failures[name] = exc
                continue
            except StateError as exc:
                # This application's start point or stored datamarkers are unusable: it does
                # not run, the others do, and the run reports it.
                log.error("application %s does not start: %s", name, exc)
                self.publisher.start_failures[name] = exc
                continue
            if runtime is not None:
                apps[name] = runtime
        store.save(new)
        return apps

    def _runtime(
        self,
        name: str,
        config: Application,
        stored: dict[tuple[str, int], Datamarker],
        publisher_log: PublisherLog,
        new: list[Datamarker],
    ) -> ApplicationRuntime | None:
        """One application's flows (None for an external one), from its stored datamarkers
        or its start point; new datamarkers are appended to ``new``."""
        pipeline = self.publisher.pipeline
        flows, fresh = start_flows(config, pipeline.shards, stored, publisher_log, pipeline.file)
        if fresh and isinstance(config.start, dict) and "backfill" in config.start:
            # Queued before the new datamarkers are stored: a crash in between queues them
            # again, and a request already queued for it is kept.
            self._queue_start_backfills(name, config.start["backfill"])
        new.extend(fresh)
        if config.external or self.publisher.transport_reads_log:
            # Read by an outside reader that stores its own datamarkers: no flows here,
            # but the log is kept for it (see Retention).
            return None
        return ApplicationRuntime(
            config=config,
            flows=flows,
            filter=application_filter(config),
            # A copy serves an application only once it holds its claim (CopyCoordinator).
            active=self.publisher.pipeline.mode != "multiple-copy",
        )

    def _wait_for_refill(self, name: str, exc: AheadOfLog, publisher_log: PublisherLog) -> bool:
        """An application ahead of a log whose torn tail was cut off this run waits for the
        source to send the cut updates again (True); otherwise its start fails (False)."""
        if not self.publisher.truncated or self.publisher.transport_reads_log:
            log.error("application %s does not start: %s", name, exc)
            return False
        self.publisher.refilling[name] = exc
        log.warning(
            "application %s: its datamarker (position %d) is past the end of the publisher "
            "log (%d) after its torn tail was cut off; it starts once the source has sent "
            "those updates again",
            name,
            exc.position,
            publisher_log.next_seq,
        )
        return True

    def start_refilled(self, store: Any, publisher_log: PublisherLog, hub: Hub) -> None:
        """Start the applications waiting for the log to grow back to their datamarkers; fail
        them when the source has ended (``--once``) short of them."""
        assert self.publisher.tailer is not None
        source_done = self.publisher.tailer.done.is_set()
        for name, exc in list(self.publisher.refilling.items()):
            if publisher_log.next_seq < exc.position:
                if source_done:
                    del self.publisher.refilling[name]
                    hub.failed[name] = StateError(
                        f"{exc} (the source did not send the updates cut off with the log's "
                        f"torn tail again: they are lost from this state_dir)"
                    )
                continue
            del self.publisher.refilling[name]
            config = self.publisher.pipeline.applications.get(name)
            if config is not None:  # not removed meanwhile
                self._start_application(store, publisher_log, hub, name, config)

    def _queue_start_backfills(self, name: str, tables: list[str]) -> None:
        """``start: {backfill: [...]}``: backfills of those tables for this application."""
        if self.publisher.backfills is None:
            return
        defaults = self.publisher.pipeline.backfill
        for table in tables:
            if self._in_snapshot(table):
                log.info(
                    "application %s: no backfill of %s queued: it starts before the source's "
                    "initial snapshot, which delivers every row of %s to it",
                    name,
                    table,
                    table,
                )
                continue
            try:
                request = self.publisher.backfills.add(
                    table, None, name, defaults.chunk_size, defaults.pause_ms, origin="start"
                )
            except BackfillError as exc:
                log.info("application %s: its start backfill is not queued again: %s", name, exc)
                continue
            log.info("application %s starts at the log end; %s queued", name, request.describe())

    def _in_snapshot(self, table: str) -> bool:
        pending = self.publisher.snapshot_pending
        return table in pending or (
            "." not in table and any(t.endswith(f".{table}") for t in pending)
        )

    def reload(self, store: Any, publisher_log: PublisherLog, hub: Hub) -> None:
        """Apply the pipeline file's applications to the running pipeline.

        New applications start from their ``start`` (or stored datamarkers); removed ones
        stop after their subscribers finish what they hold, and keep their datamarkers.
        Other changes need a restart.
        """
        pipeline = self.publisher.pipeline
        assert self.publisher.membership is not None
        if self.publisher.membership.registry.application_store() is not None:
            log.warning(
                "reload: the applications of %s are in %s: change them with `wormhole apps`",
                pipeline.name,
                self.publisher.membership.registry.describe(),
            )
            return
        try:
            fresh = load_pipeline(pipeline.file, registry=pipeline.registry)
        except ConfigError as exc:
            log.error("reload: %s; the running pipeline is unchanged", exc)
            return
        self.apply(store, publisher_log, hub, fresh.applications, {})

    def apply(
        self,
        store: Any,
        publisher_log: PublisherLog,
        hub: Hub,
        fresh: dict[str, Application],
        invalid: dict[str, str],
    ) -> None:
        """Make the running applications ``fresh``: start new ones, stop removed ones.
        ``invalid`` ones (bad registry data) keep running as they are if they run."""
        pipeline = self.publisher.pipeline
        for name in [n for n, e in hub.failed.items() if n in fresh and isinstance(e, ConfigError)]:
            del hub.failed[name]  # its registry entry was fixed: it starts now
        running = set(hub.applications) | set(hub.failed)
        if self.publisher.transport_reads_log:
            log.warning(
                "reload: the %s transport does not add applications while running",
                pipeline.transport.type,
            )
            return
        assert self.publisher.transport is not None and self.publisher.membership is not None
        wanted = {n for n, a in fresh.items() if not a.external} | (set(invalid) & running)
        for name in sorted(set(hub.applications) - wanted):
            app = hub.applications[name]
            if self.publisher.caravans is not None:
                self.publisher.caravans.remove_application(app)
            if self.publisher.copies is not None:
                self.publisher.copies.remove(name)
            self.publisher.membership.unwatch_subscribers(name)
            self.publisher.transport.remove_application(name)
            if hub.launch is not None:
                hub.launch.stop(time.monotonic() + STOP_STALL_S, STOP_STALL_S, name)
            self.publisher.persist(publisher_log, hub)
            hub.remove_application(name)
            pipeline.applications.pop(name, None)
            log.info("application %s removed (its datamarkers are kept)", name)
        for name in sorted(wanted - running - set(self.publisher.refilling)):
            self._start_application(store, publisher_log, hub, name, fresh[name])
        self._changed_applications(wanted & running, fresh)

    def _start_application(
        self, store: Any, publisher_log: PublisherLog, hub: Hub, name: str, config: Application
    ) -> None:
        """Add an application to the running pipeline."""
        assert self.publisher.transport is not None and self.publisher.membership is not None
        new: list[Datamarker] = []
        try:
            runtime = self._runtime(name, config, store.load(), publisher_log, new)
        except AheadOfLog as exc:
            if name in self.publisher.pipeline.applications and self.publisher.truncated:
                self.publisher.refilling[name] = exc  # still short of another of its datamarkers
                return
            log.error("application %s does not start: %s", name, exc)
            return
        except StateError as exc:
            log.error("application %s does not start: %s", name, exc)
            return
        if runtime is None:
            return
        store.save(new)
        self.publisher.pipeline.applications[name] = config
        hub.add_application(runtime)
        self.publisher.membership.watch_subscribers(name)
        if self.publisher.copies is not None:
            self.publisher.copies.add(name)
        self.publisher.transport.add_application(runtime)
        if hub.launch is not None:
            hub.launch.add(runtime)
        if self.publisher.caravans is not None:
            self.publisher.caravans.add_application(runtime)
        log.info("application %s added, from position %d", name, runtime.min_datamarker())

    def _changed_applications(self, kept: set[str], fresh: dict[str, Application]) -> None:
        """Changes to running applications: which copy serves them applies at once, the
        rest at a restart."""
        pipeline = self.publisher.pipeline
        changed = [
            n
            for n in kept
            if n in pipeline.applications and n in fresh and fresh[n] != pipeline.applications[n]
        ]
        for name in list(changed):
            old, new_config = pipeline.applications[name], fresh[name]
            which_copy = {
                "copies": new_config.copies,
                "failback": new_config.failback,
                "move": new_config.move,
            }
            if dataclasses.replace(old, **which_copy) == new_config:  # type: ignore[arg-type]
                # Which copy serves it: applied at once (`wormhole apps move`).
                old.copies, old.failback = new_config.copies, new_config.failback
                old.move = new_config.move
                changed.remove(name)
                log.info(
                    "application %s: copies %s, failback %s",
                    name,
                    ", ".join(old.copies or []) or "(registration order)",
                    old.failback,
                )
        if changed:
            log.warning(
                "applications %s changed; restart the publisher to apply (they run unchanged)",
                ", ".join(sorted(changed)),
            )
