"""The publisher: tailer -> publisher log -> caravan -> flows -> transport.

``Publisher(pipeline).run()`` owns one run of a pipeline: it recovers the state
dir, resumes the source from the checkpoint stored in the publisher log, resumes
every flow from its datamarker, and keeps persisting datamarkers and collecting
rolled segments that every flow has passed, until stopped (or, with ``once``,
until everything the source held at start has been acknowledged).

Its collaborators: the state dir (:mod:`wormhole.core.publisher_state`), the applications
of the run (:mod:`wormhole.core.publisher_apps`), what the run reports
(:mod:`wormhole.core.publisher_summary`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from typing import Any, cast

from wormhole.core.backfill import Backfiller, BackfillStore
from wormhole.core.caravan import CaravanManager
from wormhole.core.copies import CopyCoordinator, copy_registry
from wormhole.core.errors import (
    ConfigError,
    StateError,
    Stopped,
    WormholeError,
)
from wormhole.core.flows import AheadOfLog
from wormhole.core.hub import Hub
from wormhole.core.pipeline import Pipeline
from wormhole.core.publisher_apps import Applications
from wormhole.core.publisher_log import PublisherLog
from wormhole.core.publisher_state import check_meta, open_state
from wormhole.core.publisher_summary import ApplicationSummary, RunSummary, once_progress, summarize
from wormhole.core.registry import PublisherMembership
from wormhole.core.retention import Retention
from wormhole.core.snapshot import RunSnapshot
from wormhole.core.subscriber_launch import SubscriberLaunch
from wormhole.core.tailer import Tailer
from wormhole.plugins.components import (
    DatamarkerStore,
    Source,
    SourceBackfill,
    SourceContext,
    Transport,
)
from wormhole.plugins.progress import Progress

log = logging.getLogger("wormhole.publisher")


DRAIN_AFTER_FAILURE_S = 30.0
"""How long a run whose source failed waits for applications to take what was read."""


class Publisher:
    def __init__(
        self, pipeline: Pipeline, once: bool = False, local_subscribers: bool = True
    ) -> None:
        self.pipeline = pipeline
        self.once = once
        self.local_subscribers = local_subscribers
        self.stop_requested = threading.Event()
        self.source_failed = threading.Event()
        """The tailer failed: what the publisher log holds is delivered (for at most
        :data:`DRAIN_AFTER_FAILURE_S`), then the run stops with the failure."""
        self.reload_requested = threading.Event()
        self.transport: Transport | None = None
        self.tail_stop = threading.Event()
        self.delivery_stop = threading.Event()
        self.failure: BaseException | None = None
        self.hub: Hub | None = None
        self.publisher_log: PublisherLog | None = None
        self.tailer: Tailer | None = None
        self.retention: Retention | None = None
        self.snapshot = RunSnapshot()
        """What the run is doing now, taken every datamarker interval for the plugins
        (``wormhole_publisher_snapshot``) and the registry."""
        self.progress = Progress.for_stderr(None, pipeline.progress_interval)
        """Where long work (a source's snapshot, ``--once``) reports how far it is."""
        self.snapshot.progress = self.progress
        self.transport_reads_log = pipeline.transport.capabilities.reads_log
        self.start_failures: dict[str, Exception] = {}
        self.caravans: CaravanManager | None = None
        self.membership: PublisherMembership | None = None
        self.copies: CopyCoordinator | None = None
        """Multiple-copy delivery: this publisher as one copy of its datastore."""
        self.source: Source | None = None
        self.backfills: BackfillStore | None = None
        """The backfill queue (``<state_dir>/backfills.sqlite``), while running."""
        self.backfiller: Backfiller | None = None
        """Runs the queue, when the source can backfill."""
        self.reached_end = False
        """``run --once``: every application acknowledged the end position."""
        self.truncated: list[str] = []
        """Torn tails this run cut off the publisher log."""
        self.snapshot_pending: set[str] = set()
        """While the applications start: the tables the source's initial snapshot is about to
        read in full (``snapshot_pending``, optional for a source)."""
        self.refilling: dict[str, AheadOfLog] = {}
        """Applications whose datamarkers are past the end of the log a torn tail was cut
        from: they start once the source has sent those updates again."""
        self.applications = Applications(self)
        """Starts, adds, removes and changes the applications of this run."""

    def request_reload(self) -> None:
        """Re-read the pipeline file (SIGHUP): add and remove applications."""
        self.reload_requested.set()

    def request_stop(self) -> None:
        """Stop gracefully: stop reading, drain what subscribers hold, persist datamarkers."""
        self.stop_requested.set()

    # ------------------------------------------------------------------ run
    def run(self) -> RunSummary:
        pipeline = self.pipeline
        started = time.monotonic()
        with contextlib.ExitStack() as cleanup:
            self._observe(cleanup)
            cleanup.callback(self.progress.close)
            store = open_state(self.pipeline, cleanup)
            check_meta(self.pipeline, store)
            self._join_registry(cleanup)
            publisher_log = self.publisher_log = PublisherLog(
                pipeline.state_dir / "log",
                roll_size=int(pipeline.log.roll_size),
                fsync=pipeline.log.fsync,
                tail_updates=pipeline.log.tail_updates,
            )
            recovery = publisher_log.open()
            self.truncated = recovery.truncated
            cleanup.callback(publisher_log.close)
            source = self.source = pipeline.source.create()
            source.open(self._source_context(), recovery.checkpoint)
            cleanup.callback(source.close)
            offers = pipeline.source.capabilities_of(source)
            pending = source.snapshot_pending() if offers.snapshot_pending else []
            self.snapshot_pending = set(pending)
            end = source.capture_end() if self.once else None
            backfills = self.backfills = BackfillStore(pipeline.state_dir)
            cleanup.callback(backfills.close)
            hub = self._start_delivery(cleanup, store, publisher_log)
            self.snapshot_pending = set()  # applications added later come after its start
            backfiller = self.backfiller = self._open_backfills(source)
            tailer = self.tailer = Tailer(
                source,
                publisher_log,
                pipeline.shards,
                self.tail_stop,
                end=end,
                once=self.once,
                on_failure=self.source_failed.set,
                count_tables=pipeline.metrics is not None,
                backfiller=backfiller,
            )
            tailer.start()
            cleanup.callback(tailer.join, 10)
            # Runs first on the way out: nothing more is read or delivered.
            cleanup.callback(self.delivery_stop.set)
            cleanup.callback(self.tail_stop.set)
            self._supervise(store, publisher_log, hub)
            self._stop_gracefully(publisher_log, hub)
            if self.failure is not None:
                raise self.failure
            summary = summarize(self, started, publisher_log, hub, recovery.truncated)
            pipeline.registry.pm.hook.wormhole_pipeline_stopped(pipeline=pipeline, summary=summary)
            return summary
        raise AssertionError("unreachable")  # pragma: no cover - mypy: the with returns

    def _observe(self, cleanup: contextlib.ExitStack) -> None:
        """The plugins that observe a run (the built-in one serves metrics) see it start and,
        however it ends, end."""
        hook = self.pipeline.registry.pm.hook
        cleanup.callback(hook.wormhole_publisher_closed, publisher=self)
        hook.wormhole_publisher_opened(publisher=self)

    def _join_registry(self, cleanup: contextlib.ExitStack) -> None:
        """Claim this publisher's datastore in the registry; take the applications from it
        when it holds them."""
        membership = self.membership = PublisherMembership(self.pipeline, self.stop_requested)
        membership.claim(self.stop_requested)
        cleanup.callback(membership.close)
        try:
            found = membership.applications()
        except StateError as exc:
            if self.stop_requested.is_set():  # ZooKeeper went away as a stop came: a stop
                raise Stopped(f"stopped while reading the registry's applications ({exc})") from exc
            raise
        if found is None:
            return
        apps, problems = found
        for name, problem in problems.items():
            log.error("application %s does not start: %s", name, problem)
            self.start_failures[name] = ConfigError(problem)
        self.pipeline.applications = apps

    def _source_context(self) -> SourceContext:
        pipeline = self.pipeline
        return SourceContext(
            pipeline=pipeline.name,
            state_dir=pipeline.state_dir,
            shards=pipeline.shards,
            stop=self.tail_stop,
            log=logging.getLogger(f"wormhole.source.{pipeline.source.type}"),
            progress=self.progress,
            describe_updates=self._outputs_ask("describes_updates"),
            transaction_metadata=self._outputs_ask("marks_transactions"),
        )

    def _outputs_ask(self, question: str) -> bool:
        """Whether the transport's or a sink's options answer yes to ``question`` (an
        :class:`~wormhole.plugins.components.Options` method: ``describes_updates``,
        ``marks_transactions``)."""
        pipeline = self.pipeline
        uses = [pipeline.transport]
        uses += [app.sink for app in pipeline.applications.values() if app.sink is not None]
        return any(
            callable(getattr(use.options, question, None)) and getattr(use.options, question)()
            for use in uses
        )

    def _start_delivery(
        self, cleanup: contextlib.ExitStack, store: DatamarkerStore, publisher_log: PublisherLog
    ) -> Hub:
        """The hub with every application's flows, the transport and the caravans."""
        pipeline = self.pipeline
        transport = self.transport = pipeline.transport.create()
        # A transport that reads the publisher log itself (spec `reads_log`) takes over
        # delivery: every application is then external to the hub, and the transport
        # stores their datamarkers as its destination confirms updates.
        self.retention = Retention(pipeline, store, publisher_log, self.transport_reads_log)
        hub = self.hub = Hub(pipeline, self.applications.initial(store, publisher_log))
        hub.failed.update(self.start_failures)
        hub.local_subscribers = self.local_subscribers
        hub.once = self.once
        hub.publisher_log = publisher_log
        hub.store = store
        transport.start(hub)
        cleanup.callback(self._abort_transport)
        offers = pipeline.transport.capabilities_of(transport)
        hub.launch = SubscriberLaunch(hub, transport, offers)
        hub.launch.start()
        assert self.membership is not None
        self.membership.attach(hub, transport.address if offers.listens else "", offers.protocol)
        if pipeline.mode == "multiple-copy":
            registry = copy_registry(self.membership.registry)
            self.copies = CopyCoordinator(pipeline, registry, hub, publisher_log)
            # Never collect the updates the shared datamarkers name (see Retention).
            self.retention.floor = self.copies.retained
            self.copies.start()
        pipeline.registry.pm.hook.wormhole_pipeline_started(pipeline=pipeline)
        caravans = self.caravans = CaravanManager(
            hub,
            publisher_log,
            self.delivery_stop,
            max_caravans=pipeline.caravans.max_caravans,
            merge_distance=pipeline.caravans.merge_distance,
            slow_flow_s=pipeline.caravans.slow_flow_s,
        )
        caravans.start()
        cleanup.callback(caravans.join, 10)
        return hub

    def _abort_transport(self) -> None:
        if self.transport is None:
            return  # stopped gracefully
        try:
            self.transport.stop(drain=False)
        except Exception:  # pragma: no cover - already failing
            log.exception("transport did not stop cleanly")
        finally:
            if self.hub is not None and self.hub.launch is not None:
                self.hub.launch.stop_rest(drain=False)

    def _stop_gracefully(self, publisher_log: PublisherLog, hub: Hub) -> None:
        """No more reading; subscribers finish what they hold; datamarkers are persisted.
        Sets ``failure`` to what ended the run badly, if anything did."""
        assert self.tailer is not None and self.caravans is not None
        assert self.transport is not None
        self.tail_stop.set()
        self.tailer.join()
        self.delivery_stop.set()
        self.caravans.join()
        transport, self.transport = self.transport, None
        try:
            transport.stop()
        finally:
            if hub.launch is not None:
                hub.launch.stop_rest(drain=True)
        self.persist(publisher_log, hub)
        if self.copies is not None:
            # Share the final datamarkers and let another copy take the applications now.
            self.copies.finish()
        if self.failure is None and self.tailer.failure is not None:
            self.failure = self.tailer.failure
        if self.failure is None and hub.failure is not None:
            self.failure = hub.failure
        if self.failure is None and hub.failed:
            # The other applications were served; the run still reports the error.
            self.failure = next(iter(hub.failed.values()))

    def _open_backfills(self, source: Source) -> Backfiller | None:
        """The backfill queue, and its runner when the source can backfill."""
        store = self.backfills
        if store is None:
            return None
        if self.pipeline.source.capabilities_of(source).backfill:
            return Backfiller(
                cast(SourceBackfill, source),
                store,
                self.pipeline.name,
                self.progress,
                lambda: set(self.pipeline.applications),
            )
        for request in store.active():
            store.finish(
                request.id,
                "failed",
                f"source type {self.pipeline.source.type} cannot backfill tables",
            )
            log.error("%s failed: the source cannot backfill", request.describe())
        return None

    # ------------------------------------------------------------ supervise
    def _supervise(self, store: Any, publisher_log: PublisherLog, hub: Hub) -> None:
        interval = self.pipeline.datamarker_interval
        next_persist = time.monotonic() + interval
        next_tick = 0.0
        target: int | None = None
        overall = once_progress(self, hub) if self.once else None
        drain_until: float | None = None
        drain_target = 0
        while True:
            if self.stop_requested.is_set() or hub.failure is not None or self.failure:
                return
            assert self.tailer is not None
            if self.refilling:
                self.applications.start_refilled(store, publisher_log, hub)
            if self.source_failed.is_set() and self.tailer.done.is_set():
                # What was read before the failure is durable: deliver it before stopping.
                if drain_until is None:
                    drain_until = time.monotonic() + DRAIN_AFTER_FAILURE_S
                    drain_target = publisher_log.next_seq
                if hub.all_acknowledged(drain_target) or time.monotonic() > drain_until:
                    self.stop_requested.set()
                    return
            if self.once and self.tailer.done.is_set() and not self.refilling:
                if target is None:
                    target = publisher_log.next_seq
                if hub.all_acknowledged(target):
                    if overall is not None:
                        overall(target, True)
                    self.reached_end = True
                    return
            if overall is not None:
                overall(target, False)
            with hub.lock:
                hub.changed.wait(min(interval, 0.05 if self.once else interval))
            if self.reload_requested.is_set():
                self.reload_requested.clear()
                self.applications.reload(store, publisher_log, hub)
            assert self.membership is not None
            if (changes := self.membership.take_changes()) is not None:
                apps, problems = changes
                for name, problem in problems.items():
                    if name not in hub.applications:
                        log.error("application %s does not start: %s", name, problem)
                    else:
                        log.error(
                            "application %s: its registry entry is invalid (%s); it runs as it was",
                            name,
                            problem,
                        )
                self.applications.apply(store, publisher_log, hub, apps, problems)
            if self.copies is not None and (
                time.monotonic() >= next_tick or self.copies.dirty.is_set()
            ):
                self.copies.tick()
                next_tick = time.monotonic() + min(interval, 0.5)
            if time.monotonic() >= next_persist:
                self.persist(publisher_log, hub)
                next_persist = time.monotonic() + interval

    def persist(self, publisher_log: PublisherLog, hub: Hub) -> None:
        assert self.retention is not None
        self.retention.persist(hub)
        status = self.snapshot.take(
            publisher_log,
            hub,
            list(self.caravans.caravans if self.caravans else []),
            self.tailer.updates if self.tailer else None,
        )
        self.pipeline.registry.pm.hook.wormhole_publisher_snapshot(publisher=self, snapshot=status)
        if self.copies is not None:
            status["copies"] = self.copies.status()
        if self.membership is not None:
            self.membership.publish_status(status)


def tune_gc() -> None:
    """The hot path allocates many short-lived objects: collect the youngest generation
    less often. The older generations keep CPython's pace (every 10 collections of the one
    below), so cycles that plugin or sink code leaves behind do not pile up in a process
    that runs for months; what exists at start is frozen out of every collection."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 10, 10)


__all__ = ["ApplicationSummary", "Publisher", "RunSummary", "WormholeError", "tune_gc"]
