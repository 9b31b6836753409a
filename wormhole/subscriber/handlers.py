"""The handler loop of a subscriber library: handlers registered, each batch handed to them
with retries, and ``wormhole subscribe``'s sink served through them.

A transport's subscriber library (the ``tcp`` client, which is ``wormhole.Subscriber``, and
the ``kafka`` consumer) derives from :class:`Handlers` for its handler registration, retries
and ``serve_sink`` (``wormhole subscribe``: the application's sink under its ``on_error``
policy). The publisher's in-process subscriber is :mod:`wormhole.subscriber.local`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from wormhole.core.backoff import Backoff
from wormhole.core.errors import WormholeError
from wormhole.core.update import Update
from wormhole.plugins.components import Flow, Sink, SinkContext
from wormhole.plugins.events import timed_sink

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

        from wormhole.subscriber.dead_letters import guard_sink

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
