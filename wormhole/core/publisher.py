"""The publisher: tailer -> publisher log -> caravan -> flows -> transport.

``Publisher(pipeline).run()`` owns one run of a pipeline: it recovers the state
dir, resumes the source from the checkpoint stored in the publisher log, resumes
every flow from its datamarker, and keeps persisting datamarkers and collecting
rolled segments that every flow has passed, until stopped (or, with ``once``,
until everything the source held at start has been acknowledged).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, cast

from wormhole.core.backfill import Backfiller, BackfillStore
from wormhole.core.caravan import CaravanManager
from wormhole.core.copies import CopyCoordinator, copy_registry
from wormhole.core.errors import (
    BackfillError,
    ConfigError,
    StateError,
    Stopped,
    WormholeError,
    file_problem,
)
from wormhole.core.flows import AheadOfLog, start_flows
from wormhole.core.hub import ApplicationRuntime, Hub
from wormhole.core.metrics import REGISTRY, MetricsServer, PublisherCollector, serve
from wormhole.core.pipeline import Application, Pipeline, load_pipeline
from wormhole.core.progress import Progress
from wormhole.core.publisher_log import PublisherLog
from wormhole.core.registry import PublisherMembership
from wormhole.core.retention import Retention
from wormhole.core.status import LiveStatus
from wormhole.core.tailer import Tailer
from wormhole.plugins.components import (
    Datamarker,
    DatamarkerStore,
    Source,
    SourceBackfill,
    SourceContext,
    Transport,
)
from wormhole.plugins.filters import application_filter

log = logging.getLogger("wormhole.publisher")


@dataclass
class ApplicationSummary:
    name: str
    updates: int
    datamarker: int
    lag: int


@dataclass
class RunSummary:
    pipeline: str
    elapsed: float
    source_updates: int
    log_end: int
    applications: dict[str, ApplicationSummary] = field(default_factory=dict)
    truncated: list[str] = field(default_factory=list)
    removed_segments: list[str] = field(default_factory=list)
    log_bytes_read: int = 0
    """Bytes of publisher log the caravans read from disk (the tail comes from memory)."""
    caravan_merges: int = 0
    caravan_splits: int = 0
    once: bool = False
    complete: bool | None = None
    """``run --once``: whether every application acknowledged the end position (False
    when a stop came first); None for a run until stopped."""
    source_left: bool = False
    """``run --once`` stopped before the source was read to its end position."""
    applications_left: dict[str, int] = field(default_factory=dict)
    """``run --once`` stopped early: per application, updates of the publisher log it did
    not acknowledge."""

    @property
    def rate(self) -> float:
        return self.source_updates / self.elapsed if self.elapsed > 0 else 0.0


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
        self.live = LiveStatus(pipeline.state_dir)
        self.progress = Progress.for_stderr(None, pipeline.progress_interval)
        """Where long work (a source's snapshot, ``--once``) reports how far it is."""
        self.live.progress = self.progress
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
        self.metrics_server: MetricsServer | None = None
        """The metrics endpoint (``metrics.listen``), while running."""
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
            self._serve_metrics(cleanup)
            cleanup.callback(self.progress.close)
            store = self._open_state(cleanup)
            self._check_meta(store)
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
            summary = self._summary(started, publisher_log, hub, recovery.truncated)
            pipeline.registry.pm.hook.wormhole_pipeline_stopped(pipeline=pipeline, summary=summary)
            return summary
        raise AssertionError("unreachable")  # pragma: no cover - mypy: the with returns

    def _serve_metrics(self, cleanup: contextlib.ExitStack) -> None:
        """With ``metrics``: this publisher's figures in the process's registry, served."""
        config = self.pipeline.metrics
        if config is None:
            return
        collector = PublisherCollector(self, flows=config.flows)
        REGISTRY.register(collector)
        cleanup.callback(REGISTRY.unregister, collector)
        server = self.metrics_server = serve(config.listen)
        cleanup.callback(server.close)
        self.live.metrics = server.address

    def _open_state(self, cleanup: contextlib.ExitStack) -> DatamarkerStore:
        """Create and lock the state dir, open the datamarker store."""
        state_dir = self.pipeline.state_dir
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise file_problem(exc.filename or state_dir, exc, "create the state_dir") from exc
        cleanup.callback(os.close, self._lock_state_dir())
        store: DatamarkerStore = self.pipeline.datamarker_store.create()
        store.open(self.pipeline.name, state_dir)
        cleanup.callback(store.close)
        return store

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
        hub = self.hub = Hub(pipeline, self._applications(store, publisher_log))
        hub.failed.update(self.start_failures)
        hub.local_subscribers = self.local_subscribers
        hub.once = self.once
        hub.publisher_log = publisher_log
        hub.store = store
        transport.start(hub)
        cleanup.callback(self._abort_transport)
        assert self.membership is not None
        offers = pipeline.transport.capabilities_of(transport)
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
        transport.stop()
        self._persist(publisher_log, hub)
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

    def _lock_state_dir(self) -> int:
        """One process per state dir: two would interleave one log and one set of datamarkers."""
        path = self.pipeline.state_dir / "lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise file_problem(path, exc, "lock the state_dir") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StateError(
                f"state_dir {self.pipeline.state_dir} is in use by another wormhole process "
                f"(pid {holder}); stop it, or give this pipeline another state_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _check_meta(self, store: Any) -> None:
        shards = store.get_meta("shards")
        if shards is not None and int(shards) != self.pipeline.shards:
            raise StateError(
                f"dataset.shards is {self.pipeline.shards} but the state in "
                f"{self.pipeline.state_dir} was built with {shards} shards; datamarkers are per "
                f"shard, so the count cannot change in place: set it back to {shards}, or use a "
                f"new state_dir"
            )
        store.set_meta("shards", str(self.pipeline.shards))
        store.set_meta("pipeline", self.pipeline.name)

    def _applications(
        self, store: Any, publisher_log: PublisherLog
    ) -> dict[str, ApplicationRuntime]:
        stored = store.load()
        apps = {}
        new: list[Datamarker] = []
        for name, config in self.pipeline.applications.items():
            try:
                runtime = self._runtime(name, config, stored, publisher_log, new)
            except AheadOfLog as exc:
                if not self._wait_for_refill(name, exc, publisher_log):
                    self.start_failures[name] = exc
                continue
            except StateError as exc:
                # This application's start point or stored datamarkers are unusable: it does
                # not run, the others do, and the run reports it.
                log.error("application %s does not start: %s", name, exc)
                self.start_failures[name] = exc
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
        flows, fresh = start_flows(
            config, self.pipeline.shards, stored, publisher_log, self.pipeline.file
        )
        if fresh and isinstance(config.start, dict) and "backfill" in config.start:
            # Queued before the new datamarkers are stored: a crash in between queues them
            # again, and a request already queued for it is kept.
            self._queue_start_backfills(name, config.start["backfill"])
        new.extend(fresh)
        if config.external or self.transport_reads_log:
            # Read by an outside reader that stores its own datamarkers: no flows here,
            # but the log is kept for it (see Retention).
            return None
        return ApplicationRuntime(
            config=config,
            flows=flows,
            filter=application_filter(config),
            # A copy serves an application only once it holds its claim (CopyCoordinator).
            active=self.pipeline.mode != "multiple-copy",
        )

    def _wait_for_refill(self, name: str, exc: AheadOfLog, publisher_log: PublisherLog) -> bool:
        """An application ahead of a log whose torn tail was cut off this run waits for the
        source to send the cut updates again (True); otherwise its start fails (False)."""
        if not self.truncated or self.transport_reads_log:
            log.error("application %s does not start: %s", name, exc)
            return False
        self.refilling[name] = exc
        log.warning(
            "application %s: its datamarker (position %d) is past the end of the publisher "
            "log (%d) after its torn tail was cut off; it starts once the source has sent "
            "those updates again",
            name,
            exc.position,
            publisher_log.next_seq,
        )
        return True

    def _start_refilled(self, store: Any, publisher_log: PublisherLog, hub: Hub) -> None:
        """Start the applications waiting for the log to grow back to their datamarkers; fail
        them when the source has ended (``--once``) short of them."""
        assert self.tailer is not None
        source_done = self.tailer.done.is_set()
        for name, exc in list(self.refilling.items()):
            if publisher_log.next_seq < exc.position:
                if source_done:
                    del self.refilling[name]
                    hub.failed[name] = StateError(
                        f"{exc} (the source did not send the updates cut off with the log's "
                        f"torn tail again: they are lost from this state_dir)"
                    )
                continue
            del self.refilling[name]
            config = self.pipeline.applications.get(name)
            if config is not None:  # not removed meanwhile
                self._start_application(store, publisher_log, hub, name, config)

    def _queue_start_backfills(self, name: str, tables: list[str]) -> None:
        """``start: {backfill: [...]}``: backfills of those tables for this application."""
        if self.backfills is None:
            return
        defaults = self.pipeline.backfill
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
                request = self.backfills.add(
                    table, None, name, defaults.chunk_size, defaults.pause_ms, origin="start"
                )
            except BackfillError as exc:
                log.info("application %s: its start backfill is not queued again: %s", name, exc)
                continue
            log.info("application %s starts at the log end; %s queued", name, request.describe())

    def _in_snapshot(self, table: str) -> bool:
        pending = self.snapshot_pending
        return table in pending or (
            "." not in table and any(t.endswith(f".{table}") for t in pending)
        )

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
        overall = self._once_progress(hub) if self.once else None
        drain_until: float | None = None
        drain_target = 0
        while True:
            if self.stop_requested.is_set() or hub.failure is not None or self.failure:
                return
            assert self.tailer is not None
            if self.refilling:
                self._start_refilled(store, publisher_log, hub)
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
                self._reload(store, publisher_log, hub)
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
                self._apply_applications(store, publisher_log, hub, apps, problems)
            if self.copies is not None and (
                time.monotonic() >= next_tick or self.copies.dirty.is_set()
            ):
                self.copies.tick()
                next_tick = time.monotonic() + min(interval, 0.5)
            if time.monotonic() >= next_persist:
                self._persist(publisher_log, hub)
                next_persist = time.monotonic() + interval

    def _once_progress(self, hub: Hub) -> Any:
        """``run --once``: progress of every application to the end position, in
        publisher-log positions from the oldest datamarker at start. Until the source has
        reached its end there is no total (the log's end so far is none); then it is exact."""
        assert self.publisher_log is not None
        publisher_log = self.publisher_log
        with hub.lock:
            start = min((a.min_datamarker() for a in hub.applications.values()), default=0)
        task = self.progress.task("run --once", None, "updates", estimate=False)

        def report(target: int | None, finished: bool) -> None:
            with hub.lock:
                oldest = min(
                    (a.min_datamarker() for a in hub.applications.values()),
                    default=publisher_log.next_seq,
                )
            done = max(0, oldest - start)
            if target is None:
                # The source is still being read: how many updates it holds is not known
                # (what the log holds so far is not a total).
                task.update(done=done, detail="reading the source; total not known yet")
            else:
                task.update(done=done, total=max(0, target - start), detail="to the end position")
            if finished:
                task.finish()

        return report

    def _reload(self, store: Any, publisher_log: PublisherLog, hub: Hub) -> None:
        """Apply the pipeline file's applications to the running pipeline.

        New applications start from their ``start`` (or stored datamarkers); removed ones
        stop after their subscribers finish what they hold, and keep their datamarkers.
        Other changes need a restart.
        """
        pipeline = self.pipeline
        assert self.membership is not None
        if self.membership.registry.application_store() is not None:
            log.warning(
                "reload: the applications of %s are in %s: change them with `wormhole apps`",
                pipeline.name,
                self.membership.registry.describe(),
            )
            return
        try:
            fresh = load_pipeline(pipeline.file, registry=pipeline.registry)
        except ConfigError as exc:
            log.error("reload: %s; the running pipeline is unchanged", exc)
            return
        self._apply_applications(store, publisher_log, hub, fresh.applications, {})

    def _apply_applications(
        self,
        store: Any,
        publisher_log: PublisherLog,
        hub: Hub,
        fresh: dict[str, Application],
        invalid: dict[str, str],
    ) -> None:
        """Make the running applications ``fresh``: start new ones, stop removed ones.
        ``invalid`` ones (bad registry data) keep running as they are if they run."""
        pipeline = self.pipeline
        for name in [n for n, e in hub.failed.items() if n in fresh and isinstance(e, ConfigError)]:
            del hub.failed[name]  # its registry entry was fixed: it starts now
        running = set(hub.applications) | set(hub.failed)
        if self.transport_reads_log:
            log.warning(
                "reload: the %s transport does not add applications while running",
                pipeline.transport.type,
            )
            return
        assert self.transport is not None and self.membership is not None
        wanted = {n for n, a in fresh.items() if not a.external} | (set(invalid) & running)
        for name in sorted(set(hub.applications) - wanted):
            app = hub.applications[name]
            if self.caravans is not None:
                self.caravans.remove_application(app)
            if self.copies is not None:
                self.copies.remove(name)
            self.membership.unwatch_subscribers(name)
            self.transport.remove_application(name)
            self._persist(publisher_log, hub)
            hub.remove_application(name)
            pipeline.applications.pop(name, None)
            log.info("application %s removed (its datamarkers are kept)", name)
        for name in sorted(wanted - running - set(self.refilling)):
            self._start_application(store, publisher_log, hub, name, fresh[name])
        self._changed_applications(wanted & running, fresh)

    def _start_application(
        self, store: Any, publisher_log: PublisherLog, hub: Hub, name: str, config: Application
    ) -> None:
        """Add an application to the running pipeline."""
        assert self.transport is not None and self.membership is not None
        new: list[Datamarker] = []
        try:
            runtime = self._runtime(name, config, store.load(), publisher_log, new)
        except AheadOfLog as exc:
            if name in self.pipeline.applications and self.truncated:
                self.refilling[name] = exc  # still short of another of its datamarkers
                return
            log.error("application %s does not start: %s", name, exc)
            return
        except StateError as exc:
            log.error("application %s does not start: %s", name, exc)
            return
        if runtime is None:
            return
        store.save(new)
        self.pipeline.applications[name] = config
        hub.add_application(runtime)
        self.membership.watch_subscribers(name)
        if self.copies is not None:
            self.copies.add(name)
        self.transport.add_application(runtime)
        if self.caravans is not None:
            self.caravans.add_application(runtime)
        log.info("application %s added, from position %d", name, runtime.min_datamarker())

    def _changed_applications(self, kept: set[str], fresh: dict[str, Application]) -> None:
        """Changes to running applications: which copy serves them applies at once, the
        rest at a restart."""
        pipeline = self.pipeline
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

    def _persist(self, publisher_log: PublisherLog, hub: Hub) -> None:
        assert self.retention is not None
        self.retention.persist(hub)
        status = self.live.write(
            publisher_log,
            hub,
            list(self.caravans.caravans if self.caravans else []),
            self.tailer.updates if self.tailer else None,
        )
        if self.copies is not None:
            status["copies"] = self.copies.status()
        if self.membership is not None:
            self.membership.publish_status(status)

    def _summary(
        self, started: float, publisher_log: PublisherLog, hub: Hub, truncated: list[str]
    ) -> RunSummary:
        summary = RunSummary(
            pipeline=self.pipeline.name,
            elapsed=time.monotonic() - started,
            source_updates=self.tailer.updates if self.tailer else 0,
            log_end=publisher_log.next_seq,
            truncated=truncated,
            removed_segments=self.retention.removed if self.retention else [],
            log_bytes_read=publisher_log.bytes_read,
            caravan_merges=self.caravans.merges if self.caravans else 0,
            caravan_splits=self.caravans.splits if self.caravans else 0,
        )
        for name, app in hub.applications.items():
            marker = app.min_datamarker()
            summary.applications[name] = ApplicationSummary(
                name, app.acknowledged_updates, marker, publisher_log.next_seq - marker
            )
        if self.once:
            self._once_outcome(summary, hub)
        return summary

    def _once_outcome(self, summary: RunSummary, hub: Hub) -> None:
        """``run --once``: complete, or what a stop left undone."""
        summary.once = True
        tailer = self.tailer
        summary.source_left = tailer is None or not tailer.finished
        summary.applications_left = {
            name: app.lag for name, app in summary.applications.items() if app.lag > 0
        }
        # A stop that came once all was acknowledged (by the drain, say) left nothing.
        summary.complete = self.reached_end or (
            not summary.source_left
            and not summary.applications_left
            and hub.all_acknowledged(summary.log_end)
        )


def tune_gc() -> None:
    """The hot path allocates many short-lived objects: collect the youngest generation
    less often. The older generations keep CPython's pace (every 10 collections of the one
    below), so cycles that plugin or sink code leaves behind do not pile up in a process
    that runs for months; what exists at start is frozen out of every collection."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 10, 10)


__all__ = ["Publisher", "RunSummary", "WormholeError", "tune_gc"]
