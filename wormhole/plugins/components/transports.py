"""Transports: what moves flows from the publisher to subscribers, and what they see of it."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from wormhole.core.update import Update
from wormhole.plugins.components.datamarkers import Datamarker
from wormhole.plugins.components.sinks import Sink

if TYPE_CHECKING:
    from wormhole.plugins.views import PipelineView


class Flow(NamedTuple):
    """A flow's identity: one shard of one application (of one datastore, when the
    dataset has several). Subscriber libraries hand it to ``on_updates`` handlers
    (``wormhole.Flow``)."""

    application: str
    shard: int
    datastore: str = ""


@dataclass(slots=True)
class Frame:
    """What a subscriber session receives: its updates of one publisher-log batch.

    ``updates`` are in log order and hold only the session's shards;
    ``datamarkers`` maps each of those shards to the seq the flow reaches once
    this frame is processed (it moves even when no update of the shard passed
    the filter).
    """

    application: str
    updates: list[Update]
    datamarkers: dict[int, int]
    first_seq: int
    end_seq: int
    appended_ns: int = 0
    """CLOCK_MONOTONIC time the batch was appended to the publisher log (0 if unknown)."""


class SubscriberSession(Protocol):
    """A subscriber as the publisher sees it (in-process, or the publisher end of a
    connection)."""

    name: str
    instance: str
    """The subscriber's instance name (what it registered under in a registry that tracks
    subscribers; the hub orders sessions by it when the registry knows it)."""
    timed_delivery: bool
    """Whether ``deliver`` honours ``deadline`` (else it is never passed one)."""

    def notice(self, assigned: list[int], revoked: list[int], datamarkers: dict[int, int]) -> None:
        """Shards this session now owns (starting after ``datamarkers``) / must let go.

        Must not block (the hub calls it holding its lock). A session confirms a
        revoke with ``hub.revoked(application, session, shards)`` once it has
        finished every frame it holds for those shards.
        """

    def deliver(
        self, frame: Frame, stop: threading.Event, deadline: float | None = None
    ) -> bool | None:
        """Queue a frame; block while the subscriber is behind (backpressure).

        Returns False if ``stop`` was set before the frame could be queued. With
        ``timed_delivery``, ``deadline`` (a ``time.monotonic()`` value) may be given:
        return None if the frame could not be queued by then; the caravan then moves
        the application to a caravan of its own.
        """


class LocalSubscriberSession(SubscriberSession, Protocol):
    """A subscriber on a thread of the publisher's process (``PublisherView.local_subscriber``)."""

    application: str
    sink: Sink
    """Its sink, guarded by the application's ``on_error`` policy; close it once ``thread``
    has ended."""
    thread: threading.Thread

    def start(self) -> None: ...

    def stop(self, drain: bool = True, timeout: float = 10.0) -> bool:
        """Stop after the frames it holds (``drain``) or at once; False if its thread was
        still running ``timeout`` seconds later."""


class LogBatch(Protocol):
    """A batch of the publisher log: updates ``first_seq ..``, and the seq after it."""

    first_seq: int
    updates: list[Update]
    end_seq: int


class LogCursor(Protocol):
    """Reads publisher-log batches in order from a position."""

    position: int

    def read(self) -> LogBatch | None:
        """The next batch, or None when the reader is at the end of the log."""

    def close(self) -> None: ...


class PublisherView(Protocol):
    """What a transport sees of the publisher (:class:`wormhole.core.hub.Hub`)."""

    @property
    def pipeline(self) -> PipelineView:
        """The validated pipeline (:class:`wormhole.core.pipeline.Pipeline`), as the contract
        promises it."""

    shards: int
    local_subscribers: bool
    """Whether the transport runs the applications' sinks here (`wormhole run`), or
    subscribers run elsewhere (`wormhole publish`)."""
    once: bool
    """``--once``: a graceful stop must leave every application with everything."""
    applications: dict[str, Any]
    """The applications served through caravans, by name: each has ``name`` and
    ``config`` (:class:`wormhole.core.pipeline.Application`)."""

    def attach(self, application: str, session: SubscriberSession) -> None: ...

    def detach(self, session: SubscriberSession, reason: str = "") -> None: ...

    def local_subscriber(self, app: Any, index: int, max_frames: int) -> LocalSubscriberSession:
        """For a transport that runs sinks in the publisher's process (``inprocess``): the
        sink of ``app`` (one of ``applications``) opened as its subscriber ``index``, served on
        a thread of its own under the application's ``on_error`` policy, with at most
        ``max_frames`` frames waiting for it. The transport attaches it, starts it, and stops
        it (closing its sink once its thread has ended)."""

    def revoked(self, application: str, session: SubscriberSession, shards: list[int]) -> None: ...

    def acknowledge(
        self,
        application: str,
        session: SubscriberSession,
        datamarkers: dict[int, int],
        updates: int,
    ) -> None: ...

    def fail(self, error: BaseException) -> None:
        """An error that retrying cannot fix: the pipeline stops."""

    def epoch(self, application: str) -> int:
        """The fencing epoch under which this publisher serves ``application`` (multiple-copy
        delivery; 0 otherwise). A transport tells subscribers with each assignment, so that
        they drop what an older epoch's publisher still sends."""

    # For a transport whose subscribers the engine starts (``subscriber_processes``).
    def stop_subscribers(
        self, deadline: float, stall: float, application: str | None = None
    ) -> None:
        """The subscriber processes of ``application`` (or all) leave now: SIGTERM, then
        wait while they make progress; until ``deadline`` (monotonic) they may take their
        time, after it one idle for ``stall`` seconds is killed and fails the run. Call it
        from ``stop`` (or ``remove_application``) once they hold nothing more; those left
        are stopped after ``stop`` returns."""

    def subscriber_applications(self) -> list[str]:
        """The applications the engine started subscriber processes for, sorted."""

    # For a transport that reads the publisher log itself (spec ``reads_log``).
    def log_range(self) -> tuple[int, int]:
        """The retained publisher log: (first seq, seq after the last update)."""

    def read_log(self, position: int, row_type: type[Any] = Update) -> LogCursor:
        """A reader of the publisher log from ``position``. ``row_type``: what updates read
        from disk are decoded as, for a reader that needs only some of their fields (such
        as :class:`wormhole.core.update.ColumnRow`); updates still in memory are Updates."""

    def wait_for_log(self, position: int, timeout: float) -> bool:
        """Wait until the log holds updates past ``position``; False on timeout."""

    def stored_datamarkers(self) -> dict[tuple[str, int], Datamarker]:
        """Every stored datamarker, by (application, shard)."""

    def store_datamarkers(
        self, datamarkers: list[Datamarker], meta: dict[str, str] | None = None
    ) -> None:
        """Persist datamarkers (and meta values of the transport's own) durably, never
        ahead of the publisher-log data they point past; the publisher collects the log
        they have all passed."""

    def stored_meta(self, key: str) -> str | None: ...


@runtime_checkable
class Transport(Protocol):
    """Moves flows from the publisher to subscribers and acknowledgements back.

    ``start`` receives the publisher (:class:`PublisherView`); a transport attaches
    subscriber sessions to it (``attach``), whose ``deliver`` the caravans call with
    frames, and reports acknowledgements with ``acknowledge``.

    Optional attributes, read after ``start``: ``address`` (``host:port`` where subscribers
    connect, registered in the dataset's registry) and ``protocol_version`` (the subscriber
    protocol it speaks, registered with it).
    """

    def start(self, hub: PublisherView) -> None:
        """Attach subscriber sessions to the hub and start moving frames."""

    def add_application(self, app: Any) -> None:
        """An application added to the running pipeline (SIGHUP): serve it too."""

    def remove_application(self, name: str) -> None:
        """An application taken out of the running pipeline: its subscribers finish what
        they hold and leave."""

    def stop(self, drain: bool = True) -> None:
        """Stop. With ``drain``, let subscribers finish (and acknowledge) what they hold;
        without it (the run is failing), stop at once."""
