"""The ``outbox`` transport: frames as files in a directory, acknowledgements as files back.

Publisher side: one session per application owns every shard; each frame becomes
``<path>/<application>/<end_seq>.frame`` (written atomically), at most ``window``
unacknowledged at a time. A subscriber (``wormhole subscribe``, through this
transport's ``subscribe``) hands each frame to the application's sink, in order,
then writes ``<end_seq>.ack``; the publisher acknowledges the frame's datamarkers
and removes both files. Slow, but every promise of the transport contract holds:
backpressure, acknowledgement after the sink made a frame durable, and a frame
that was not acknowledged is delivered again after a restart.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
from pydantic import Field

from wormhole.core.update import Update
from wormhole.plugins.components import (
    Frame,
    Options,
    PublisherView,
    SinkContext,
    SubscribeRequest,
)

log = logging.getLogger("wormhole.outbox")


class OutboxOptions(Options):
    """Frames as files under ``path``."""

    path: str = Field(description="directory shared by the publisher and its subscribers")
    window: int = Field(4, ge=1, description="frames written ahead of acknowledgements")
    drain_timeout_s: float = Field(10.0, ge=0, description="idle time allowed at a stop")


class _FrameFile(msgspec.Struct):
    datamarkers: dict[int, int]
    updates: list[Update]


_encode = msgspec.json.encode
_decode = msgspec.json.Decoder(_FrameFile).decode


class OutboxSession:
    timed_delivery = False

    def __init__(self, transport: OutboxTransport, application: str) -> None:
        self.transport = transport
        self.application = application
        self.name = f"outbox:{application}"
        self.instance = "outbox"
        self.directory = Path(transport.options.path) / application
        self.directory.mkdir(parents=True, exist_ok=True)
        self.cond = threading.Condition()
        self.unacknowledged: dict[int, tuple[dict[int, int], int]] = {}

    def notice(self, assigned: list[int], revoked: list[int], datamarkers: dict[int, int]) -> None:
        # The only session of its application: nothing is ever revoked from it. Frames
        # written earlier and not acknowledged are replaced by the caravan's re-reads.
        for old in self.directory.glob("*.frame"):
            old.unlink()

    def deliver(
        self, frame: Frame, stop: threading.Event, deadline: float | None = None
    ) -> bool | None:
        with self.cond:
            while len(self.unacknowledged) >= self.transport.options.window:
                if stop.is_set():
                    return False
                self.cond.wait(0.05)
            self.unacknowledged[frame.end_seq] = (frame.datamarkers, len(frame.updates))
        path = self.directory / f"{frame.end_seq:020d}.frame"
        temporary = path.with_suffix(".tmp")
        temporary.write_bytes(_encode(_FrameFile(frame.datamarkers, frame.updates)))
        os.replace(temporary, path)
        return True

    def poll_acknowledgements(self) -> None:
        for ack in sorted(self.directory.glob("*.ack")):
            end = int(ack.stem)
            with self.cond:
                entry = self.unacknowledged.pop(end, None)
                self.cond.notify_all()
            if entry is not None:
                self.transport.hub.acknowledge(self.application, self, entry[0], entry[1])
            (self.directory / f"{ack.stem}.frame").unlink(missing_ok=True)
            ack.unlink()

    def idle(self) -> bool:
        with self.cond:
            return not self.unacknowledged


class OutboxTransport:
    def __init__(self, options: OutboxOptions) -> None:
        self.options = options
        self.hub: PublisherView | None = None
        self.sessions: dict[str, OutboxSession] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._poll, name="outbox acks", daemon=True)

    def start(self, hub: PublisherView) -> None:
        self.hub = hub
        for app in list(hub.applications.values()):
            self.add_application(app)
        self.thread.start()

    def add_application(self, app: Any) -> None:
        assert self.hub is not None
        session = self.sessions[app.name] = OutboxSession(self, app.name)
        self.hub.attach(app.name, session)

    def subscriber_args(self) -> list[str]:
        """Its spec declares ``subscriber_processes``: ``wormhole run`` starts a ``wormhole
        subscribe`` per instance once ``start`` returned; they need nothing more."""
        return []

    def remove_application(self, name: str) -> None:
        session = self.sessions.pop(name, None)
        if session is not None and self.hub is not None:
            self.hub.detach(session, "application removed from the pipeline")
        if self.hub is not None:
            stall = self.options.drain_timeout_s
            self.hub.stop_subscribers(time.monotonic() + stall, stall, name)

    def _poll(self) -> None:
        while not self.stopping.wait(0.02):
            for session in list(self.sessions.values()):
                session.poll_acknowledgements()

    def stop(self, drain: bool = True) -> None:
        stall = self.options.drain_timeout_s if drain else 1.0
        deadline = time.monotonic() + stall
        while drain and time.monotonic() < deadline:
            if all(s.idle() for s in self.sessions.values()):
                break
            time.sleep(0.02)
        self.stopping.set()
        if self.hub is not None:
            # Its subscribers leave before the last acknowledgements are read.
            self.hub.stop_subscribers(time.monotonic() + stall, stall)
        for session in list(self.sessions.values()):
            session.poll_acknowledgements()


def subscribe(request: SubscribeRequest) -> None:
    """``wormhole subscribe`` with the outbox transport: frames in order into the sink."""
    pipeline = request.pipeline
    app = request.sink_application("the outbox")
    sink_component = app.sink
    directory = Path(pipeline.transport.options.path) / app.name
    directory.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: stop.set())
    sink = sink_component.create()
    sink.open(
        SinkContext(
            pipeline=pipeline.name,
            application=app.name,
            subscriber=request.instance,
            subscribers=1,
            state_dir=pipeline.state_dir,
            log=logging.getLogger(f"wormhole.sink.{app.name}"),
        )
    )
    try:
        while not stop.is_set():
            frames = sorted(directory.glob("*.frame"))
            for path in frames:
                if (done := path.with_suffix(".ack")).exists():
                    continue
                try:
                    content = _decode(path.read_bytes())
                except FileNotFoundError:
                    break  # replaced by a re-read from the publisher: list again
                if content.updates:
                    sink.write(content.updates)
                temporary = done.with_suffix(".acktmp")
                temporary.write_bytes(b"")
                os.replace(temporary, done)
            if not frames:
                stop.wait(0.02)
    finally:
        sink.close()
