"""The publisher: tailer -> publisher log -> caravan -> flows -> transport.

``Publisher(pipeline).run()`` owns one run of a pipeline: it recovers the state
dir, resumes the source from the checkpoint stored in the publisher log, resumes
every flow from its datamarker, and keeps persisting datamarkers and collecting
rolled segments that every flow has passed, until stopped (or, with ``once``,
until everything the source held at start has been acknowledged).
"""

from __future__ import annotations

import errno
import fcntl
import gc
import json
import logging
import os
import queue
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import msgspec

from wormhole.core.caravan import CaravanManager
from wormhole.core.errors import ConfigError, StartError, StateError, WormholeError
from wormhole.core.hub import ApplicationRuntime, Flow, Hub
from wormhole.core.pipeline import Application, Pipeline, load_pipeline
from wormhole.core.publisher_log import PreparedBatch, PublisherLog, position_at_time
from wormhole.core.update import Update
from wormhole.plugins.components import Datamarker, SourceBatch, SourceContext
from wormhole.plugins.filters import compile_filter

log = logging.getLogger("wormhole.publisher")

_canonical = msgspec.json.Encoder(order="sorted").encode


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

    @property
    def rate(self) -> float:
        return self.source_updates / self.elapsed if self.elapsed > 0 else 0.0


class Publisher:
    def __init__(
        self, pipeline: Pipeline, once: bool = False, local_subscribers: bool = True
    ) -> None:
        self.pipeline = pipeline
        self.once = once
        self.local_subscribers = local_subscribers
        self.stop_requested = threading.Event()
        self.reload_requested = threading.Event()
        self.transport: Any = None
        self.tail_stop = threading.Event()
        self.delivery_stop = threading.Event()
        self.tail_done = threading.Event()
        self.source_updates = 0
        self.failure: BaseException | None = None
        self.hub: Hub | None = None
        self.log: PublisherLog | None = None
        self.removed: list[str] = []
        self._appender_alive = True
        self.transport_reads_log = False
        self.start_failures: dict[str, Exception] = {}
        self.caravans: CaravanManager | None = None
        self._rates: dict[int, tuple[Any, float, int]] = {}

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
        state_dir = pipeline.state_dir
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StateError(
                f"state_dir: cannot create {state_dir} ({exc.strerror}); choose a writable "
                f"directory"
            ) from exc
        lock = self._lock_state_dir()
        store = pipeline.datamarker_store.create()
        try:
            store.open(pipeline.name, state_dir)
        except BaseException:
            os.close(lock)
            raise
        plog: PublisherLog | None = None
        source = None
        transport = None
        caravans: CaravanManager | None = None
        tailer = None
        try:
            self._check_meta(store)
            plog = self.log = PublisherLog(
                state_dir / "log",
                roll_size=int(pipeline.log.roll_size),
                fsync=pipeline.log.fsync,
                tail_updates=pipeline.log.tail_updates,
            )
            recovery = plog.open()
            source = pipeline.source.create()
            source.open(
                SourceContext(
                    pipeline=pipeline.name,
                    state_dir=state_dir,
                    shards=pipeline.shards,
                    stop=self.tail_stop,
                    log=logging.getLogger(f"wormhole.source.{pipeline.source.type}"),
                ),
                recovery.checkpoint,
            )
            end = source.capture_end() if self.once else None
            transport = self.transport = pipeline.transport.create()
            # A transport that reads the publisher log itself (Kafka) takes over delivery:
            # every application is then external to the hub, and the transport stores
            # their datamarkers as its destination confirms updates.
            self.transport_reads_log = pipeline.transport.registered.spec.reads_log
            hub = self.hub = Hub(pipeline, self._applications(store, plog))
            hub.failed.update(self.start_failures)
            hub.local_subscribers = self.local_subscribers
            hub.once = self.once
            hub.plog = plog
            hub.store = store
            transport.start(hub)
            pipeline.registry.pm.hook.wormhole_pipeline_started(pipeline=pipeline)
            caravans = self.caravans = CaravanManager(
                hub,
                plog,
                self.delivery_stop,
                max_caravans=pipeline.caravans.max_caravans,
                merge_distance=pipeline.caravans.merge_distance,
                slow_flow_s=pipeline.caravans.slow_flow_s,
            )
            caravans.start()
            tailer = threading.Thread(
                target=self._tail, args=(source, plog, end), name="tailer", daemon=True
            )
            tailer.start()
            self._supervise(store, plog, hub)
            # Graceful stop: no more reading; subscribers finish what they hold.
            self.tail_stop.set()
            tailer.join()
            self.delivery_stop.set()
            caravans.join()
            transport.stop()
            transport = None
            self._persist(store, plog, hub)
            if self.failure is None and hub.failure is not None:
                self.failure = hub.failure
            if self.failure is None and hub.failed:
                # The other applications were served; the run still reports the error.
                self.failure = next(iter(hub.failed.values()))
            if self.failure is not None:
                raise self.failure
            summary = self._summary(started, plog, hub, recovery.truncated)
            pipeline.registry.pm.hook.wormhole_pipeline_stopped(pipeline=pipeline, summary=summary)
            return summary
        finally:
            self.tail_stop.set()
            self.delivery_stop.set()
            if tailer is not None:
                tailer.join(10)
            if caravans is not None:
                caravans.join(10)
            if transport is not None:
                try:
                    transport.stop(drain=False)
                except Exception:  # pragma: no cover - already failing
                    log.exception("transport did not stop cleanly")
            if source is not None:
                source.close()
            if plog is not None:
                plog.close()
            store.close()
            os.close(lock)

    def _lock_state_dir(self) -> int:
        """One process per state dir: two would interleave one log and one set of datamarkers."""
        path = self.pipeline.state_dir / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
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

    def _applications(self, store: Any, plog: PublisherLog) -> dict[str, ApplicationRuntime]:
        stored = store.load()
        apps = {}
        new: list[Datamarker] = []
        for name, config in self.pipeline.applications.items():
            try:
                runtime = self._runtime(name, config, stored, plog, new)
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
        plog: PublisherLog,
        new: list[Datamarker],
    ) -> ApplicationRuntime | None:
        """One application's flows (None for an external one), from its stored datamarkers
        or its start point; new datamarkers are appended to ``new``."""
        first, end = plog.first_seq, plog.next_seq
        flows = []
        fresh: list[Datamarker] = []
        time_position: int | None = None
        for shard in range(self.pipeline.shards):
            marker = stored.get((name, shard))
            if marker is not None:
                position = marker.position
                where = f"the datamarker of application {name} shard {shard}"
            elif isinstance(config.start, dict) and "time" in config.start:
                if time_position is None:
                    time_position = position_at_time(plog.directory, config.start["time"])
                if time_position is None:
                    raise StartError(
                        f"applications.{name}.start: the updates in the publisher log carry no "
                        f"source time (ts_ms), so a start time cannot be placed; start at "
                        f"earliest, latest or a position"
                    )
                position = max(time_position, first)
                fresh.append(Datamarker(name, shard, position))
                where = f"applications.{name}.start"
            else:
                position = self._start_position(config.start, first, end, name)
                fresh.append(Datamarker(name, shard, position))
                where = f"applications.{name}.start"
            if position > end:
                error = StartError if marker is None else StateError
                raise error(
                    f"{where} is position {position}, past the end of the publisher log "
                    f"({end}) in {plog.directory}: updates that were acknowledged are "
                    f"missing from the log (was the state_dir replaced or damaged?). "
                    f"Restore it, or start over with a new state_dir"
                    if marker is not None
                    else f"{where} is position {position}, past the end of the publisher log "
                    f"({end}): start the application at earliest, latest or a position in "
                    f"{first} to {end}"
                )
            if position < first:
                if marker is not None:
                    raise StateError(
                        f"{where} is position {position}, but the publisher log in "
                        f"{plog.directory} starts at {first}: updates it never acknowledged "
                        f"were deleted (was the log pruned by hand?). Restore the log, or run "
                        f"`wormhole forget {self.pipeline.file} {name}` to drop its datamarkers "
                        f"so that it starts again from applications.{name}.start"
                    )
                raise StartError(
                    f"{where} is position {position}, outside the retained publisher log "
                    f"({first} to {end}): the oldest retained position is {first}. Start the "
                    f"application at earliest, latest or a position in that range"
                )
            flows.append(Flow(name, shard, position, position, position))
        new.extend(fresh)
        if config.external or self.transport_reads_log:
            # Read by an outside reader that stores its own datamarkers: no flows here,
            # but the log is kept for it (see _persist).
            return None
        plugins = [component.create() for component in config.filters]
        return ApplicationRuntime(
            config=config,
            flows=flows,
            filter=compile_filter(
                config.tables,
                config.ops,
                plugins,
                where=config.where,
                columns=config.columns,
                application=name,
            ),
        )

    @staticmethod
    def _start_position(start: Any, first: int, end: int, name: str) -> int:
        if start == "earliest":
            return first
        if start == "latest":
            return end
        return int(start["position"])

    # --------------------------------------------------------------- tailer
    # Two threads: the tailer reads, shards and encodes; the appender writes,
    # fsyncs and confirms. Writing and fsync release the GIL, so the next batch
    # is parsed while this one reaches the disk.
    def _tail(self, source: Any, plog: PublisherLog, end: Any) -> None:
        prepared: queue.Queue[PreparedBatch | None] = queue.Queue(maxsize=2)
        appender = threading.Thread(
            target=self._append_loop, args=(source, plog, prepared), name="appender", daemon=True
        )
        appender.start()
        try:
            self._tail_loop(source, plog, end, prepared)
        except BaseException as exc:
            self.failure = exc
            self.stop_requested.set()
        finally:
            self._put(prepared, None, force=True)
            appender.join()
            self.tail_done.set()

    def _put(
        self,
        prepared: queue.Queue[PreparedBatch | None],
        item: PreparedBatch | None,
        force: bool = False,
    ) -> bool:
        while True:
            try:
                prepared.put(item, timeout=0.1)
                return True
            except queue.Full:
                if self.tail_stop.is_set() and not force:
                    return False
                if force and not self._appender_alive:
                    return False

    def _tail_loop(
        self, source: Any, plog: PublisherLog, end: Any, prepared: queue.Queue[Any]
    ) -> None:
        shards = self.pipeline.shards
        crc = zlib.crc32
        canonical = _canonical
        once = self.once
        if once and source.reached(end):
            return
        while not self.tail_stop.is_set() and self._appender_alive:
            batch: SourceBatch | None = source.read(0.2)
            if batch is None:
                if once and source.reached(end):
                    return
                continue
            updates = batch.updates
            truncates = False
            for u in updates:
                u.shard = crc(canonical(u.key)) % shards
                if u.op == "t":
                    truncates = True
            if truncates:
                updates = batch.updates = _broadcast_truncates(updates, shards)
            if not self._put(prepared, plog.prepare(updates, batch.checkpoint)):
                return
            if once and source.reached(end):
                return

    def _append_loop(
        self, source: Any, plog: PublisherLog, prepared: queue.Queue[PreparedBatch | None]
    ) -> None:
        try:
            while (item := prepared.get()) is not None:
                if not self._commit(plog, item):
                    break
                self.source_updates += len(item.updates)
                source.confirm(item.checkpoint)
        except BaseException as exc:
            self.failure = exc
            self.stop_requested.set()
        finally:
            self._appender_alive = False
            plog.discard_prepared()
            # Unblock a tailer waiting to hand over a batch.
            while True:
                try:
                    prepared.get_nowait()
                except queue.Empty:
                    break

    def _commit(self, plog: PublisherLog, prepared: PreparedBatch) -> bool:
        delay = 0.1
        while True:
            try:
                plog.commit(prepared)
                return True
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EAGAIN):
                    raise StateError(
                        f"cannot write the publisher log in {plog.directory}: {exc}"
                    ) from exc
                log.error(
                    "cannot append to the publisher log in %s (%s); nothing was lost, "
                    "retrying in %.1fs: free space on that disk",
                    plog.directory,
                    exc.strerror,
                    delay,
                )
                if self.tail_stop.wait(delay):
                    return False
                delay = min(delay * 2, 30.0)

    # ------------------------------------------------------------ supervise
    def _supervise(self, store: Any, plog: PublisherLog, hub: Hub) -> None:
        interval = self.pipeline.datamarker_interval
        next_persist = time.monotonic() + interval
        target: int | None = None
        while True:
            if self.stop_requested.is_set() or hub.failure is not None or self.failure:
                return
            if self.once and self.tail_done.is_set():
                if target is None:
                    target = plog.next_seq
                if hub.all_acknowledged(target):
                    return
            with hub.lock:
                hub.changed.wait(min(interval, 0.05 if self.once else interval))
            if self.reload_requested.is_set():
                self.reload_requested.clear()
                self._reload(store, plog, hub)
            if time.monotonic() >= next_persist:
                self._persist(store, plog, hub)
                next_persist = time.monotonic() + interval

    def _reload(self, store: Any, plog: PublisherLog, hub: Hub) -> None:
        """Apply the pipeline file's applications to the running pipeline.

        New applications start from their ``start`` (or stored datamarkers); removed ones
        stop after their subscribers finish what they hold, and keep their datamarkers.
        Other changes need a restart.
        """
        pipeline = self.pipeline
        try:
            fresh = load_pipeline(pipeline.file, registry=pipeline.registry)
        except ConfigError as exc:
            log.error("reload: %s; the running pipeline is unchanged", exc)
            return
        running = set(hub.applications) | set(hub.failed)
        if self.transport_reads_log:
            log.warning(
                "reload: the %s transport does not add applications while running",
                pipeline.transport.type,
            )
            return
        wanted = {n for n, a in fresh.applications.items() if not a.external}
        for name in sorted(set(hub.applications) - wanted):
            app = hub.applications[name]
            if self.caravans is not None:
                self.caravans.remove_application(app)
            remove = getattr(self.transport, "remove_application", None)
            if remove is not None:
                remove(name)
            self._persist(store, plog, hub)
            hub.remove_application(name)
            pipeline.applications.pop(name, None)
            log.info("application %s removed (its datamarkers are kept)", name)
        for name in sorted(wanted - running):
            config = fresh.applications[name]
            new: list[Datamarker] = []
            try:
                runtime = self._runtime(name, config, store.load(), plog, new)
            except StateError as exc:
                log.error("application %s does not start: %s", name, exc)
                continue
            if runtime is None:
                continue
            store.save(new)
            pipeline.applications[name] = config
            hub.add_application(runtime)
            add = getattr(self.transport, "add_application", None)
            if add is not None:
                add(runtime)
            if self.caravans is not None:
                self.caravans.add_application(runtime)
            log.info("application %s added, from position %d", name, runtime.min_datamarker())
        changed = [
            n
            for n in wanted & running
            if n in pipeline.applications and fresh.applications[n] != pipeline.applications[n]
        ]
        if changed:
            log.warning(
                "reload: applications %s changed; restart to apply (they run unchanged)",
                ", ".join(sorted(changed)),
            )

    def _persist(self, store: Any, plog: PublisherLog, hub: Hub) -> None:
        changed = hub.unpersisted()
        if changed:
            if not plog.fsync:
                # Datamarkers must never be on disk ahead of the data they point past.
                plog.sync()
            store.save(changed)
            hub.mark_persisted(changed)
        # Only datamarkers already on disk may free segments: after a crash, flows
        # resume from the persisted ones.
        self._write_live_status(plog, hub)
        upto = hub.min_persisted()
        # Every stored datamarker holds the log, not only those of the applications the
        # hub serves: an application read by an outside reader, one taken out of the
        # pipeline file (it resumes from them when added back, until `wormhole forget`),
        # one that could not start.
        stored = store.load()
        with hub.lock:
            served = set(hub.applications)
        positions = [m.position for (name, _), m in stored.items() if name not in served]
        for name, config in self.pipeline.applications.items():
            if config.external or self.transport_reads_log:
                # An outside reader that has stored nothing yet needs the whole log.
                positions += [
                    plog.first_seq
                    for shard in range(self.pipeline.shards)
                    if (name, shard) not in stored
                ]
        if positions:
            upto = min(positions) if upto is None else min(upto, *positions)
        if upto is not None:
            self.removed += plog.collect_garbage(upto, self.pipeline.log.keep_rolled)

    def _write_live_status(self, plog: PublisherLog, hub: Hub) -> None:
        """``<state_dir>/live.json``: what ``wormhole status`` shows of a running publisher
        (caravans, their positions and read rates), rewritten every datamarker interval."""
        now = time.monotonic()
        caravans = []
        rates: dict[int, tuple[Any, float, int]] = {}
        for caravan in list(self.caravans.caravans if self.caravans else []):
            last = self._rates.get(id(caravan))
            rate = 0.0
            # The caravan itself is kept with its figures: an id can be reused by a new one.
            if last is not None and last[0] is caravan and now > last[1]:
                rate = (caravan.updates_read - last[2]) / (now - last[1])
            rates[id(caravan)] = (caravan, now, caravan.updates_read)
            caravans.append(
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
            "log": {"first": plog.first_seq, "end": plog.next_seq},
            "caravans": caravans,
            "applications": sorted(hub.applications),
            "failed": {name: str(error) for name, error in hub.failed.items()},
        }
        path = self.pipeline.state_dir / "live.json"
        temporary = path.with_name(".live.json.tmp")
        try:
            temporary.write_text(json.dumps(status))
            os.replace(temporary, path)
        except OSError as exc:  # status only: never fatal
            log.debug("cannot write %s: %s", path, exc)

    def _summary(
        self, started: float, plog: PublisherLog, hub: Hub, truncated: list[str]
    ) -> RunSummary:
        summary = RunSummary(
            pipeline=self.pipeline.name,
            elapsed=time.monotonic() - started,
            source_updates=self.source_updates,
            log_end=plog.next_seq,
            truncated=truncated,
            removed_segments=self.removed,
            log_bytes_read=plog.bytes_read,
            caravan_merges=self.caravans.merges if self.caravans else 0,
            caravan_splits=self.caravans.splits if self.caravans else 0,
        )
        for name, app in hub.applications.items():
            marker = app.min_datamarker()
            summary.applications[name] = ApplicationSummary(
                name, app.acknowledged_updates, marker, plog.next_seq - marker
            )
        return summary


def _broadcast_truncates(updates: list[Update], shards: int) -> list[Update]:
    """Every flow must see a truncate in order with its own updates: one copy per shard."""
    out: list[Update] = []
    for u in updates:
        if u.op != "t":
            out.append(u)
            continue
        for shard in range(shards):
            copy = msgspec.structs.replace(u, shard=shard)
            out.append(copy)
    return out


def tune_gc() -> None:
    """The hot path allocates many short-lived objects: collect the youngest generation
    less often. The older generations keep CPython's pace (every 10 collections of the one
    below), so cycles that plugin or sink code leaves behind do not pile up in a process
    that runs for months; what exists at start is frozen out of every collection."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 10, 10)


__all__ = ["Publisher", "RunSummary", "WormholeError", "tune_gc"]
