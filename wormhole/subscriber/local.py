"""The in-process subscriber: a sink served on a thread of the publisher's process, for a
transport that keeps sinks there (``PublisherView.local_subscriber``)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from wormhole.core.backoff import Backoff
from wormhole.core.errors import WormholeError
from wormhole.plugins.components import Frame, PublisherView, Sink
from wormhole.plugins.events import timed_sink
from wormhole.subscriber.handlers import MAX_BACKOFF, open_sink

log = logging.getLogger("wormhole.subscriber")


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


def local_subscriber(hub: PublisherView, app: Any, index: int, max_frames: int) -> LocalSubscriber:
    """``app``'s sink opened as its subscriber ``index``, served on a thread of this process
    under the application's ``on_error`` policy (retries with backoff; then dead letters, or
    stop). Not started nor attached: the transport does both."""
    from wormhole.subscriber.dead_letters import guard_sink

    pipeline = hub.pipeline
    config = app.config
    sink = open_sink(config.sink, pipeline, config, index)
    subscriber = LocalSubscriber(hub, app.name, index, sink, max_frames=max_frames)
    subscriber.sink = guard_sink(sink, config, pipeline.state_dir, subscriber.abort)
    subscriber.first_backoff = config.on_error.backoff_ms / 1000.0
    subscriber.max_backoff = config.on_error.max_backoff_ms / 1000.0
    return subscriber


__all__ = ["LocalSubscriber", "local_subscriber"]
