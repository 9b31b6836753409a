"""The subscriber loop: hand frames to a sink, acknowledge once the sink made them durable.

Part of the plugin contract: a transport's subscriber library (the ``tcp`` client, which is
``wormhole.Subscriber``, and the ``kafka`` consumer) derives from :class:`Handlers` for its
handler registration, retries and ``serve_sink`` (``wormhole subscribe``: the application's
sink under its ``on_error`` policy); the publisher runs :class:`LocalSubscriber` for a
transport that keeps sinks in its own process (``PublisherView.local_subscriber``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from wormhole.core.backoff import Backoff
from wormhole.core.errors import WormholeError
from wormhole.core.metrics import timed_sink
from wormhole.core.update import Update
from wormhole.plugins.components import Flow, Frame, PublisherView, Sink, SinkContext

log = logging.getLogger("wormhole.subscriber")

MAX_BACKOFF = 30.0

stop_signalled = threading.Event()
"""Set by ``wormhole subscribe``'s first signal handler: a SIGTERM or SIGINT that came
before the sink was serving (the subscriber stops as soon as it starts)."""


def catch_stop_signals() -> None:
    """Record SIGTERM / SIGINT from the start of a subscriber process, so that one sent while
    it is still starting ends it gracefully (exit 0, sink closed) rather than by the signal."""
    import signal

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: stop_signalled.set())


class _Revoke:
    __slots__ = ("shards",)

    def __init__(self, shards: list[int]) -> None:
        self.shards = shards


class LocalSubscriber:
    """A subscriber running in the publisher's process, on its own thread.

    At most ``max_frames`` frames wait for it, so a slow sink pushes back on the
    caravan instead of growing memory without bound.
    """

    def __init__(
        self, hub: PublisherView, application: str, index: int, sink: Sink, max_frames: int = 8
    ) -> None:
        self.hub = hub
        self.application = application
        self.index = index
        self.name = f"{application}/{index}"
        self.instance = str(index)
        self.sink = sink
        self.max_frames = max_frames
        self.shards: set[int] = set()
        self.order = threading.Lock()  # frames and revoke markers enter the queue in order
        self.frames: queue.Queue[Frame | _Revoke | None] = queue.Queue()
        self.abort = threading.Event()
        self.written = 0
        self.write = timed_sink(application, sink.write)
        self.first_backoff = 0.05
        self.max_backoff = MAX_BACKOFF
        self.thread = threading.Thread(
            target=self._run, name=f"subscriber {self.name}", daemon=True
        )

    def start(self) -> None:
        # Timed around the sink as it is now: a transport may have wrapped it (dead letters).
        self.write = timed_sink(self.application, self.sink.write)
        self.thread.start()

    # ----------------------------------------------------- SubscriberSession
    def notice(self, assigned: list[int], revoked: list[int], datamarkers: dict[int, int]) -> None:
        with self.order:
            self.shards.update(assigned)
            self.shards.difference_update(revoked)
            if revoked:
                # Confirmed once the frames queued before it are done.
                self.frames.put(_Revoke(revoked))
        log.debug("%s: assigned %s, revoked %s", self.name, assigned, revoked)

    timed_delivery = True
    """``deliver`` takes a ``deadline`` (see ``SubscriberSession.deliver``)."""

    def deliver(
        self, frame: Frame, stop: threading.Event, deadline: float | None = None
    ) -> bool | None:
        while self.frames.qsize() >= self.max_frames:
            if stop.wait(0.005) or self.abort.is_set():
                return False
            if deadline is not None and time.monotonic() >= deadline:
                return None
        with self.order:
            # A revoke may have landed since the caravan routed this frame: never
            # hand this subscriber a flow it has let go of.
            shards = self.shards
            if any(s not in shards for s in frame.datamarkers):
                frame = Frame(
                    frame.application,
                    [u for u in frame.updates if u.shard in shards],
                    {s: p for s, p in frame.datamarkers.items() if s in shards},
                    frame.first_seq,
                    frame.end_seq,
                    frame.appended_ns,
                )
            self.frames.put(frame)
        return True

    # ---------------------------------------------------------------- loop
    def _run(self) -> None:
        while True:
            frame = self.frames.get()
            if frame is None:
                return
            if isinstance(frame, _Revoke):
                self.hub.revoked(self.application, self, frame.shards)
                continue
            if frame.updates and not self._write(frame):
                return
            self.hub.acknowledge(self.application, self, frame.datamarkers, len(frame.updates))

    def _write(self, frame: Frame) -> bool:
        backoff = Backoff(log, first=self.first_backoff, cap=self.max_backoff, stop=self.abort)
        while True:
            try:
                self.write(frame.updates)
                self.written += len(frame.updates)
                return True
            except WormholeError as exc:
                # SinkError and friends: retrying cannot help (a bad path, say).
                self.hub.fail(exc)
                return False
            except Exception as exc:
                if not backoff.wait(
                    "%s: sink failed to write %d updates (%s: %s); retrying in %.2fs",
                    self.name,
                    len(frame.updates),
                    type(exc).__name__,
                    exc,
                ):
                    return False

    def stop(self, drain: bool = True, timeout: float = 10.0) -> bool:
        """Finish queued frames (``drain``) or abandon them, then stop.

        Returns False if the sink did not finish within ``timeout`` seconds: its
        unacknowledged frames are abandoned and will be delivered again after a
        restart (datamarkers never moved past them).
        """
        if not drain:
            self.abort.set()
            while True:
                try:
                    self.frames.get_nowait()
                except queue.Empty:
                    break
        self.frames.put(None)
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.abort.set()
            log.warning(
                "%s: the sink did not finish its queued batches within %gs; stopping "
                "without them (they are delivered again on the next run)",
                self.name,
                timeout,
            )
            return False
        return True


def run_handlers(
    application: str,
    updates: list[Update],
    batch_handlers: list[Callable[[list[Update]], Any]],
    updates_handlers: list[Callable[[Any, list[Update]], Any]],
    flow: Callable[[str, int], Any],
    stop: threading.Event,
    stopped: Callable[[Exception], BaseException],
    max_backoff: float = 30.0,
    first_backoff: float = 0.05,
) -> None:
    """Give a batch to a subscriber library's handlers: every ``on_batch`` handler, then
    every ``on_updates`` handler once per shard. A failure is retried with backoff until
    it passes (a WormholeError is fatal); ``stopped(exc)`` is raised if ``stop`` is set
    meanwhile."""
    backoff = Backoff(log, first=first_backoff, cap=max_backoff, stop=stop)
    while True:
        try:
            for batch_fn in batch_handlers:
                batch_fn(updates)
            if updates_handlers:
                flows: dict[int, list[Update]] = {}
                for u in updates:
                    flows.setdefault(u.shard, []).append(u)
                for shard, flow_updates in flows.items():
                    handle = flow(application, shard)
                    for fn in updates_handlers:
                        fn(handle, flow_updates)
            return
        except WormholeError:
            raise
        except Exception as exc:
            if not backoff.wait(
                "%s: handler failed on %d updates (%s: %s); retrying in %.2fs",
                application,
                len(updates),
                type(exc).__name__,
                exc,
            ):
                raise stopped(exc) from exc


NoticeHandler = Callable[[list[int], list[int]], None]
UpdatesHandler = Callable[[Flow, list[Update]], None]
BatchHandler = Callable[[list[Update]], None]


def open_sink(component: Any, pipeline: Any, app: Any, instance: int) -> Sink:
    """Create and open ``app``'s sink as its subscriber ``instance``."""
    sink: Sink = component.create()
    sink.open(
        SinkContext(
            pipeline=pipeline.name,
            application=app.name,
            subscriber=instance,
            subscribers=app.subscribers,
            state_dir=pipeline.state_dir,
            log=logging.getLogger(f"wormhole.sink.{app.name}"),
        )
    )
    return sink


def local_subscriber(hub: PublisherView, app: Any, index: int, max_frames: int) -> LocalSubscriber:
    """``app``'s sink opened as its subscriber ``index``, served on a thread of this process
    under the application's ``on_error`` policy (retries with backoff; then dead letters, or
    stop). Not started nor attached: the transport does both."""
    from wormhole.plugins.dead_letters import guard_sink

    pipeline = hub.pipeline
    config = app.config
    sink = open_sink(config.sink, pipeline, config, index)
    subscriber = LocalSubscriber(hub, app.name, index, sink, max_frames=max_frames)
    subscriber.sink = guard_sink(sink, config, pipeline.state_dir, subscriber.abort)
    subscriber.first_backoff = config.on_error.backoff_ms / 1000.0
    subscriber.max_backoff = config.on_error.max_backoff_ms / 1000.0
    return subscriber


class Handlers:
    """The handler registration of the subscriber libraries (TCP and Kafka)."""

    _notice_handlers: list[NoticeHandler]
    _updates_handlers: list[UpdatesHandler]
    _batch_handlers: list[BatchHandler]
    app: str
    _stop: threading.Event
    handler_max_backoff = 30.0
    """Longest wait between retries of a failing handler."""
    handler_first_backoff = 0.05
    """First wait before retrying a failing handler (it doubles)."""
    batch_datastore = ""
    """With a registry: the datastore of the batch being handled (its flows' datastore)."""

    def _stopped_while_retrying(self, exc: Exception) -> BaseException:
        """What ``_handle`` raises when the subscriber stops while a handler fails."""
        return WormholeError(f"{self.app}: stopped while retrying a batch")

    def _handle(self, updates: list[Update]) -> None:
        """Give a batch to the handlers, retrying with backoff until they take it."""
        run_handlers(
            self.app,
            updates,
            self._batch_handlers,
            self._updates_handlers,
            Flow,
            self._stop,
            self._stopped_while_retrying,
            self.handler_max_backoff,
            self.handler_first_backoff,
        )

    def _init_handlers(self) -> None:
        self._notice_handlers = []
        self._updates_handlers = []
        self._batch_handlers = []

    def on_shard_notice(self, fn: NoticeHandler) -> NoticeHandler:
        """``fn(assigned, revoked)``: shards this subscriber now owns / no longer owns."""
        self._notice_handlers.append(fn)
        return fn

    def on_updates(self, fn: UpdatesHandler) -> UpdatesHandler:
        """``fn(flow, updates)``: a batch of one flow (shard), in order. Returning
        acknowledges it (TCP) or lets its offsets be committed (Kafka)."""
        self._updates_handlers.append(fn)
        return fn

    def on_batch(self, fn: BatchHandler) -> BatchHandler:
        """``fn(updates)``: everything one frame (TCP) or poll (Kafka) holds for this
        subscriber, in order per shard.

        For sinks that make a whole batch durable at once (one fsync per batch).
        """
        self._batch_handlers.append(fn)
        return fn

    def run(self) -> None:  # pragma: no cover - each subscriber library defines it
        raise NotImplementedError

    def stop(self) -> None:  # pragma: no cover - each subscriber library defines it
        raise NotImplementedError

    async def run_async(self) -> None:
        """``run`` in a worker thread; cancelling the task stops the subscriber."""
        try:
            await asyncio.to_thread(self.run)
        except asyncio.CancelledError:
            self.stop()
            raise

    def serve_sink(self, sink_component: Any, pipeline: Any, app: Any, instance: int) -> None:
        """``wormhole subscribe``: open ``app``'s sink as subscriber ``instance``, hand it
        every batch under the application's ``on_error`` policy, run until SIGINT or
        SIGTERM, close it."""
        import signal

        from wormhole.plugins.dead_letters import guard_sink

        opened = open_sink(sink_component, pipeline, app, instance)
        try:
            sink = guard_sink(
                opened, app, pipeline.state_dir, self._stop, lambda: self.batch_datastore
            )
        except BaseException:
            opened.close()  # the dead-letter log cannot be opened
            raise
        self.handler_first_backoff = app.on_error.backoff_ms / 1000.0
        self.handler_max_backoff = app.on_error.max_backoff_ms / 1000.0
        self.on_batch(timed_sink(app.name, sink.write))

        def on_signal(signum: int, frame: Any) -> None:
            self.stop()

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        if stop_signalled.is_set():
            self.stop()  # asked to stop while starting
        try:
            self.run()
        finally:
            sink.close()
