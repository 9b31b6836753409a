"""Component protocols: what a source, sink, filter, transport, position mapper or
datamarker store must provide, and :class:`ComponentSpec`, the declaration a
plugin returns from its hook.

Every component declares an options model (a pydantic model, usually a subclass
of :class:`Options`). The pipeline file's mapping for the component, minus its
``type``, is validated against that model; validation errors name the key by its
path in the file; ``wormhole plugins`` and the docs read the same model.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from wormhole.core.errors import StateError
from wormhole.core.update import Update, UpdateColumns
from wormhole.plugins.progress import Progress

Kind = Literal[
    "source", "sink", "filter", "transport", "position_mapper", "datamarker_store", "registry"
]
KINDS: tuple[Kind, ...] = (
    "source",
    "sink",
    "filter",
    "transport",
    "position_mapper",
    "datamarker_store",
    "registry",
)


MAX_DURATION_S = 365 * 86_400
"""The longest duration an option may hold: one year."""


class Options(BaseModel):
    """Base for component options: unknown keys are errors, so typos never pass silently.

    Numbers must be finite, and a duration (an option named ``*_s``, in seconds, or ``*_ms``,
    in milliseconds) at most a year: longer ones do not fit the timeouts they feed.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    def describes_updates(self) -> bool:
        """Whether this use of the component needs updates that describe themselves:
        ``Update.columns`` and ``Update.details`` (Debezium's format does). The publisher
        asks its source for them (``SourceContext.describe_updates``) when the transport's
        options or any application's sink options say so at the start of a run."""
        return False

    def marks_transactions(self) -> bool:
        """Whether this use of the component needs each update marked with its
        transaction (``Update.transaction``: Debezium's transaction metadata). The
        publisher asks its source for them (``SourceContext.transaction_metadata``) as for
        :meth:`describes_updates`."""
        return False

    @field_validator("*")
    @classmethod
    def _duration_fits(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name or ""
        unit = 1.0 if name.endswith("_s") else 0.001 if name.endswith("_ms") else None
        if (
            unit is not None
            and isinstance(value, int | float)
            and not isinstance(value, bool)
            and value * unit > MAX_DURATION_S
        ):
            raise ValueError(f"must be at most {round(MAX_DURATION_S / unit):,} (a year)")
        return value


class NoOptions(Options):
    """For components that take no options."""


@dataclass(frozen=True)
class ComponentSpec:
    """A component a plugin provides.

    ``factory(options)`` builds one instance from validated options; it is called
    once per use (a sink once per subscriber). The capability fields after
    ``description`` tell the engine how to treat the component, so that it never
    has to know a component by name.
    """

    kind: Kind
    name: str
    factory: Callable[[Any], Any]
    options: type[BaseModel] = NoOptions
    description: str = ""
    default: bool = False
    """The component of its kind that a pipeline file naming none gets (the built-in
    ``tcp`` transport and ``sqlite`` datamarker store); at most one per kind."""
    requires_sink: bool = False
    """Transport: it runs every application's sink itself (so each must name one)."""
    reads_log: bool = False
    """Transport: it reads the publisher log and stores the applications' datamarkers itself,
    instead of taking frames from caravans (every application is then outside the hub)."""
    shared: bool = False
    """Datamarker store: shared by publishers on several machines (multiple-copy delivery).
    Registry: shared by processes on several machines, so ``wormhole subscribe`` finds the
    dataset's publishers through it rather than from the pipeline file or state dir."""
    subscribe: Callable[[SubscribeRequest], None] | None = None
    """Transport: run one subscriber of an application with its sink until stopped
    (``wormhole subscribe``, and the processes ``wormhole run`` starts)."""
    remote_log: Callable[[RemoteLogRequest], RemoteLog] | None = None
    """Transport: open a publisher's log from another machine, as an external application
    (``spark.readStream.format("wormhole").option("publishers", ...)`` reads flows with it)."""
    lag: Callable[[Any, Any], DestinationLag] | None = None
    """Transport that reads the log (``reads_log``): ``lag(options, pipeline)``, each
    application's lag as its destination counts it (Kafka: the consumer group's committed
    offsets against the topics' ends), for ``wormhole status`` and ``top``; the stored
    datamarkers only say what the transport handed over."""
    check: Callable[[Any, ComponentUse], list[str]] | None = None
    """``check(options, use)``: problems with this use of the component that need no outside
    service (each naming its key, e.g. ``applications.search.subscribers: ...``), found when
    the pipeline file is read, so that ``wormhole validate`` rejects what ``run`` would."""


@dataclass(frozen=True)
class DestinationLag:
    """Applications' lag as a transport's destination counts it (see ``ComponentSpec.lag``)."""

    what: str
    """What the number counts, for the column's heading (``Kafka records ...``)."""
    shards: dict[str, dict[int, int]] = field(default_factory=dict)
    """Application -> shard -> lag."""
    error: str = ""
    """Why it could not be measured (the broker did not answer, say); then ``shards`` is
    empty."""


@dataclass(frozen=True)
class ComponentUse:
    """Where a pipeline file uses a component, for its spec's ``check``."""

    path: str
    """The component's key, e.g. ``applications.search.sink``."""
    application: str | None = None
    """For a sink or a filter: its application."""
    subscribers: int = 1
    """For a sink: how many subscribers the application runs (each opens the sink)."""


@dataclass(frozen=True)
class RemoteLogRequest:
    """What a reader on another machine asks of a transport's ``remote_log``."""

    address: str
    """Where the publisher listens (``host:port``)."""
    application: str
    """The external application to read as (its datamarkers are the ones committed)."""
    options: dict[str, str] = field(default_factory=dict)
    """Connection settings as strings: ``token``, ``tls.ca``, ``tls.serverName``,
    ``tls.cert``, ``tls.key``, ``timeoutMs`` (a transport ignores what it does not use)."""


@dataclass(frozen=True)
class LogPositions:
    """A publisher log's extent and an external application's datamarkers in it."""

    first: int
    """The oldest retained seq."""
    end: int
    """The seq after the last update."""
    datamarkers: dict[int, int]
    """The application's stored datamarkers, by shard (a shard without one: ``first``)."""
    shards: int
    datastore: str


class RemoteLog(Protocol):
    """A publisher's log, read from another machine by an external application."""

    def positions(self) -> LogPositions: ...

    def read(self, shard: int, start: int, end: int) -> Iterator[tuple[list[int], list[Update]]]:
        """Every update of ``shard`` with ``start <= seq < end``, in order, in chunks as they
        arrive: ``(seqs, updates)``, ``seqs[i]`` the seq of ``updates[i]``. A range no
        longer retained raises :class:`RemoteLogError` naming it."""

    def commit(self, datamarkers: dict[int, int]) -> dict[int, int]:
        """Store the application's datamarkers durably at the publisher (it keeps the log
        from them on); returns them as stored (a datamarker never moves back)."""

    def close(self) -> None: ...


@runtime_checkable
class ColumnarRemoteLog(RemoteLog, Protocol):
    """A remote log that can also hand a range over a column at a time: a reader that
    builds columns (the Spark source builds Arrow record batches) then does not decode
    each update. Optional: readers fall back to :meth:`RemoteLog.read`."""

    def read_columns(self, shard: int, start: int, end: int) -> Iterator[UpdateColumns]:
        """What :meth:`RemoteLog.read` returns, as :class:`UpdateColumns` chunks."""


class RemoteLogError(StateError):
    """A remote log refused a request, or could not be reached; the message says why."""


@dataclass(frozen=True)
class SubscribeRequest:
    """What ``wormhole subscribe`` asks of a transport's ``subscribe``."""

    pipeline: Any
    """The validated :class:`wormhole.core.pipeline.Pipeline`."""
    application: str
    """The application to subscribe as (``--app``); ``sink_application`` finds it."""
    instance: int
    """This subscriber's number, 0 .. subscribers - 1."""
    publishers: list[str]
    """``--publisher HOST:PORT`` values given on the command line (may be empty)."""
    sink_application: Callable[[str], Any]
    """``sink_application(library)``: the application to run
    (:class:`wormhole.core.pipeline.Application`), from the registry when the pipeline's
    registry holds the applications, else from the file; a ConfigError when it is unknown or
    has no sink (``library`` names what its subscribers are then, e.g. ``wormhole.Subscriber``)."""


# --------------------------------------------------------------------- sources
@dataclass
class SourceContext:
    """What the publisher tells a source when it opens it."""

    pipeline: str
    state_dir: Path
    shards: int
    stop: threading.Event
    log: logging.Logger
    progress: Progress = field(default_factory=Progress)
    """Where long work (an initial snapshot) reports how far it is: ``progress.task(name,
    total, unit)``, then ``advance(n)`` and ``finish()`` on the task. The publisher shows it
    as a progress bar on a terminal and as log lines otherwise."""
    describe_updates: bool = False
    """Fill ``Update.columns`` and ``Update.details`` where the source can: some consumer
    of this run asked for them (see ``Options.describes_updates``). Off, a source skips
    that work and the publisher log stays smaller."""
    transaction_metadata: bool = False
    """Mark each update with its transaction (``Update.transaction``) where the source can,
    with :class:`wormhole.plugins.transactions.TransactionMarker`: some consumer of this
    run asked for it (see ``Options.marks_transactions``). Off, a source skips that work."""


@dataclass
class SourceBatch:
    """Updates read from the datastore log, transaction-aligned.

    ``checkpoint`` is where the source would resume after these updates: any
    value msgspec can encode (JSON types). It is stored with the batch in the
    publisher log, and handed back to :meth:`Source.open` after a restart.
    """

    updates: list[Update]
    checkpoint: Any
    watermark: Watermark | None = None
    """Set when the stream passed a backfill watermark (:class:`SourceBackfill`) right after
    these updates: the batch ends there, and nothing after the watermark is in it."""


@dataclass(frozen=True)
class Watermark:
    """A backfill watermark, as the stream met it: the ``token`` written by
    :meth:`SourceBackfill.backfill_watermark`, and where it is in the datastore's log.

    Backfilled rows emitted at it get the native position ``<position>:<n>`` and the
    logical position ``logical``; the source's position mapper must give an op ``r`` there
    a version above every change before the watermark and below every change after it."""

    token: str
    position: str
    logical: str


@dataclass(frozen=True)
class BackfillPlan:
    """A table a source can backfill, checked: what :meth:`SourceBackfill.backfill_plan`
    returns and :meth:`SourceBackfill.backfill_chunk` is given back."""

    table: str
    """``schema.table``, as the stream's updates name it."""
    keys: list[str]
    """The key columns, in the order chunks are read (the stream's key of the table)."""
    where: str | None = None
    """The SQL condition rows must meet (``--where``), checked by the source."""
    estimate: int | None = None
    """About how many rows the backfill reads (statistics), for progress; None: unknown."""
    detail: Any = None
    """Whatever the source keeps for reading chunks (columns, types)."""


@runtime_checkable
class SourceBackfill(Protocol):
    """Optional: a database source that can backfill tables while it streams
    (``wormhole backfill``; docs/backfill.md). The engine runs the DBLog watermark
    algorithm with these three methods, in the thread that calls ``read``:
    a low watermark, one chunk, a high watermark; then it reads the stream on, drops
    the chunk's rows whose keys change between the two watermarks, and emits the rest at
    the high one. The stream's ``read`` reports each watermark it passes as
    :attr:`SourceBatch.watermark` (watermarks it did not write are its own to skip).
    """

    def backfill_ready(self) -> bool:
        """Whether a backfill can run now (not while an initial snapshot is read, say); the
        engine asks again a moment later."""

    def backfill_plan(self, pipeline: str, table: str, where: str | None) -> BackfillPlan:
        """Check that ``table`` can be backfilled with ``where``; raise
        :class:`wormhole.core.errors.BackfillError` saying why not (no primary key, not
        captured, a condition that does not parse). Also called by ``wormhole backfill``
        on a source that was never opened: connect for it, and let ``close`` release it."""

    def backfill_watermark(self, token: str) -> None:
        """Write a watermark carrying ``token`` into the datastore's log, durably (the
        stream meets it later, in commit order with the changes)."""

    def backfill_chunk(
        self, plan: BackfillPlan, after: list[Any] | None, limit: int
    ) -> list[Update]:
        """Up to ``limit`` rows of the table meeting ``plan.where`` whose key comes after
        ``after`` (key values in ``plan.keys`` order; None: from the first), in key order,
        as op ``r`` updates with ``key``, ``after``, ``table``, ``connector`` and ``ts_ms``
        (positions are set when they are emitted). Read as of now, not in a snapshot.

        Raise :class:`wormhole.core.errors.BackfillError` for what reading again cannot fix
        (the backfill fails with the message); any other error is taken as passing (the
        chunk is read again a moment later). The read must see every transaction that is
        in the log before the low watermark (PostgreSQL: one whose commit record is written
        is not visible until a moment later; the source waits for it), or name those it
        did not see through :meth:`backfill_unseen`."""

    def backfill_unseen(self, update: Update) -> bool:
        """Whether a change the stream returns after the last :meth:`backfill_chunk` and
        before that chunk's low watermark belongs to a transaction the chunk's read did
        not see. The engine then drops the chunk's row of that key, as for a change
        between the watermarks (the stream's version is the newer one). A source whose
        chunk reads see every transaction before the low watermark returns False
        (:class:`wormhole.plugins.database_source.DatabaseSource` does).

        PostgreSQL needs it: a transaction's commit record is in the WAL (so before the
        low watermark) a moment before the transaction is marked committed and becomes
        visible, and a chunk's snapshot taken in that moment does not see it."""


@runtime_checkable
class Source(Protocol):
    """A tailer: the one reader of a datastore log.

    Optionally, a source also reports how far behind its datastore it is (see
    :class:`SourceLag`): ``lag()``, which metrics read at scrape time.
    """

    def open(self, context: SourceContext, checkpoint: Any) -> None:
        """Prepare to read after ``checkpoint`` (None: from the source's beginning)."""

    def read(self, timeout: float) -> SourceBatch | None:
        """The next batch, or None if nothing arrived within ``timeout`` seconds.

        Updates need op, key, table, before/after and positions; the publisher
        sets ``shard``. Raise :class:`wormhole.core.errors.SourceError` for input
        that cannot be read (it stops the pipeline with the message).
        """

    def capture_end(self) -> Any:
        """The source's current end position (for ``wormhole run --once``): it covers every
        change committed before the call (even one the datastore acknowledged before writing
        it where ``read`` looks), and ``read`` reaches it even if nothing is written after."""

    def reached(self, end: Any) -> bool:
        """Whether everything up to ``end`` (from capture_end) has been returned by read."""

    def confirm(self, checkpoint: Any) -> None:
        """Everything up to ``checkpoint`` is durable in the publisher log.

        A database source tells the database it may discard its log up to here
        (PostgreSQL ``confirmed_flush_lsn``).
        """

    def close(self) -> None:
        """Release connections and files."""


@runtime_checkable
class SourceLag(Protocol):
    """The optional ``lag()`` of a source, read by the metrics endpoint at scrape time."""

    def lag(self) -> dict[str, float]:
        """Named gauges of how far the source is behind its datastore, measured against what
        the publisher log holds (the positions given to :meth:`Source.confirm`).

        Each name becomes the gauge ``wormhole_source_<name>{source="<type>"}`` and must
        match ``[a-z][a-z0-9_]*_(bytes|seconds|updates)`` (a unit last): ``lag_bytes``,
        ``lag_seconds``, ``retained_bytes``. Return ``{}`` when there is nothing to tell
        yet. It is called from another thread than ``read``: use a connection of its own
        (not the reading one) and keep it short; an exception leaves the gauges out of that
        scrape.
        """


# ----------------------------------------------------------------------- sinks
@dataclass
class SinkContext:
    """Where a sink instance runs: one per subscriber of an application."""

    pipeline: str
    application: str
    subscriber: int
    subscribers: int
    state_dir: Path
    log: logging.Logger


@runtime_checkable
class Sink(Protocol):
    """The subscriber-side writer of one application."""

    def open(self, context: SinkContext) -> None:
        """Open files or connections. Raise SinkError for a problem retrying cannot fix."""

    def write(self, updates: list[Update]) -> None:
        """Make ``updates`` durable, in order; the batch is acknowledged when this returns.

        Raising retries the same batch (with backoff); raising
        :class:`wormhole.core.errors.SinkError` stops the pipeline with its message.
        Updates may repeat after a crash (at-least-once): write idempotently by key.
        """

    def close(self) -> None:
        """Flush and release."""


# --------------------------------------------------------------------- filters
@runtime_checkable
class Filter(Protocol):
    """A publisher-side filter: updates it drops never leave the publisher."""

    def __call__(self, updates: list[Update]) -> list[Update]:
        """The updates to keep, in their order. Datamarkers advance past dropped ones."""


# ------------------------------------------------------------ position mappers
Version = tuple[int, ...]
"""A per-key version: integers compared element by element, growing along each key's history."""


@runtime_checkable
class PositionMapper(Protocol):
    """What Wormhole knows about one kind of datastore's positions (the spec's ``name`` is
    the ``update.connector`` it serves): native <-> logical positions, and per-key versions.

    The registry creates one with the options model's defaults for :meth:`version`, so a
    mapper whose options need values (a server to ask) must still build without them and
    fail only in the methods that need them.
    """

    def to_logical(self, native: str) -> str:
        """The position comparable across copies of the dataset for a native position."""

    def to_native(self, logical: str) -> str:
        """This copy's native position for a logical one (before the first change there)."""

    def version(self, update: Update) -> Version | None:
        """The update's per-key version, from its ``position`` and ``logical``, or ``None``
        if its positions give none. Replay-safe sinks (search, Spark) skip an update older
        than what they hold for its key. May raise ValueError or IndexError on positions
        that do not parse (taken as ``None``)."""


# ----------------------------------------------------------- datamarker stores
@dataclass(frozen=True, slots=True)
class Datamarker:
    """Every update of flow (application, shard) before ``position`` was processed."""

    application: str
    shard: int
    position: int
    logical: str = ""


@runtime_checkable
class DatamarkerStore(Protocol):
    """Durable storage of datamarkers (the built-in one: SQLite in the state dir)."""

    def open(self, pipeline: str, state_dir: Path) -> None: ...

    def load(self) -> dict[tuple[str, int], Datamarker]:
        """Every stored datamarker, by (application, shard)."""

    def save(self, datamarkers: Iterable[Datamarker]) -> None:
        """Persist durably before returning."""

    def forget(self, application: str) -> int:
        """Delete every datamarker of ``application`` durably (``wormhole forget``); return
        how many there were. Called only for an application that is not running."""

    def get_meta(self, key: str) -> str | None: ...

    def set_meta(self, key: str, value: str) -> None: ...

    def close(self) -> None: ...


# ------------------------------------------------------------------ transports
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

    pipeline: Any
    """The validated :class:`wormhole.core.pipeline.Pipeline`."""
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


# -------------------------------------------------------------------- registry
@dataclass(frozen=True)
class PublisherEntry:
    """One live publisher of a dataset, as registered."""

    datastore: str
    """Which part of the dataset it publishes (the pipeline file's ``datastore``)."""
    address: str = ""
    """Where subscribers reach it (``host:port``; empty until its transport listens, or
    when its transport has no address: subscribers then read elsewhere)."""
    shards: int = 16
    protocol: int = 0
    """The subscriber protocol version it speaks (0: not applicable)."""
    transport: str = ""
    host: str = ""
    pid: int = 0
    started_ms: int = 0
    copy: str = ""
    """Which copy of the datastore it reads (multiple-copy delivery; "" for the only one)."""

    @property
    def node(self) -> str:
        """Its name among the dataset's publishers: ``datastore`` or ``datastore@copy``."""
        return f"{self.datastore}@{self.copy}" if self.copy else self.datastore


@dataclass(frozen=True)
class SubscriberEntry:
    """One live subscriber of an application, as registered."""

    instance: str
    order: int = 0
    """Registration order: the assignment spreads flows over subscribers in this order."""
    host: str = ""
    pid: int = 0


@dataclass(frozen=True)
class ServingClaim:
    """Which copy serves an application's flows of one datastore (multiple-copy delivery)."""

    copy: str
    epoch: int
    """Grows with every claim of (application, datastore): a fencing token."""
    host: str = ""
    pid: int = 0


@dataclass(frozen=True)
class SharedDatamarker:
    """A flow's datamarker as every copy of its datastore understands it: every update of
    the flow at or before ``version`` (the mapper's version of the update at ``logical``)
    was handled. Written by the serving copy under its claim's ``epoch``."""

    logical: str
    version: tuple[int, ...]
    epoch: int = 0


@dataclass(frozen=True)
class InvalidEntry:
    """Registry data that could not be read: where it is and what is wrong with it."""

    path: str
    reason: str


class DatastoreHeld(StateError):
    """Another publisher's registration holds the datastore (``register_publisher``)."""

    def __init__(
        self, message: str, holder: PublisherEntry | None, path: str, expiry_s: float
    ) -> None:
        super().__init__(message)
        self.holder = holder
        """The registration found (None if unreadable)."""
        self.path = path
        self.expiry_s = expiry_s
        """How long a dead holder's registration can outlive it (a session timeout)."""


class ApplicationStore(Protocol):
    """A dataset's applications as registry data, shared by all its publishers (a part of
    :class:`DatasetRegistry`: :meth:`DatasetRegistry.application_store`)."""

    def seed_applications(self, raw: dict[str, Any]) -> bool:
        """Store the pipeline file's applications if the dataset has none registered yet
        and was never seeded (its first publisher); True if it did."""

    def applications(self) -> dict[str, dict[str, Any] | InvalidEntry]:
        """The registered applications: name -> the application's mapping, as in the file."""

    def watch_applications(
        self, fn: Callable[[dict[str, dict[str, Any] | InvalidEntry]], None]
    ) -> None:
        """``fn(applications)`` with the registered applications, now and on every change."""

    def put_application(self, name: str, raw: dict[str, Any]) -> None:
        """Register (or replace) one application."""

    def remove_application(self, name: str) -> bool:
        """Remove an application and its subscribers' registrations; False if there was no
        such application."""

    def application_path(self, name: str) -> str:
        """Where an application lives, for messages: ``zookeeper HOSTS node PATH``."""


class ServingClaims(Protocol):
    """Serving claims and shared datamarkers, for multiple-copy delivery (a part of
    :class:`DatasetRegistry`: :meth:`DatasetRegistry.serving_claims`)."""

    def claim_serving(self, application: str, datastore: str, copy: str) -> int | None:
        """Become the copy serving ``application``'s flows of ``datastore``: the claim's
        epoch (greater than every earlier claim's), or None if another copy holds it. The
        claim lasts until released, or until this process's registration lapses (session
        loss): it is never taken again behind the caller's back."""

    def release_serving(self, application: str, datastore: str, epoch: int) -> None:
        """Give up the claim made with ``epoch`` (nothing if it is not held any more)."""

    def watch_serving(
        self, application: str, datastore: str, fn: Callable[[ServingClaim | None], None]
    ) -> Callable[[], None]:
        """``fn(claim)`` with the current claim (None: no copy serves), now and at each
        change; returns what ends the watch (``fn`` is not called after it returns)."""

    def load_datamarkers(self, application: str, datastore: str) -> dict[int, SharedDatamarker]:
        """The shared datamarkers of ``application``'s flows of ``datastore``, by shard."""

    def save_datamarkers(
        self,
        application: str,
        datastore: str,
        epoch: int,
        datamarkers: dict[int, SharedDatamarker],
    ) -> bool:
        """Store them (merged over the stored ones, by shard) if and only if this process
        still holds the claim made with ``epoch``, atomically with that check. False if it
        does not (fenced): nothing is written."""


class DatasetRegistry(Protocol):
    """Where the publishers, applications and subscribers of a dataset find each other.

    Every registry keeps the dataset's membership: live publishers and their status, live
    subscribers, and the connection itself. Two parts are optional, each offered through a
    method that returns it or None: :class:`ApplicationStore` (applications as registry
    data) and :class:`ServingClaims` (multiple-copy delivery).

    The built-in ``file`` registry is the pipeline file itself: one publisher, applications
    from the file (no store), subscribers not tracked, no serving claims. ``zookeeper``
    keeps everything in ZooKeeper (ephemeral nodes for publishers and subscribers, watches
    for changes) and offers both parts.

    Watch callbacks are called once with the current value when the watch is set, then on
    every change, from a thread of the registry's: they must not block. A registry survives
    losing its connection: entries are registered again and watches fire again once it is
    back; meanwhile the last values stand.
    """

    def open(self, dataset: str, stop: threading.Event) -> None:
        """Connect, retrying with backoff (a clear message naming where it connects) until
        connected or ``stop`` is set; a configuration that can never work raises
        ``ConfigError`` at once. Stopped, it may raise
        :class:`wormhole.core.errors.Stopped` or return (the caller then raises it)."""

    def describe(self) -> str:
        """Where it is, for messages: ``zookeeper 10.0.0.1:2181/wormhole``."""

    def close(self) -> None:
        """Unregister what this process registered and disconnect."""

    def watch_connection(self, fn: Callable[[bool], None]) -> None:
        """``fn(False)`` as soon as the registry connection is interrupted (claims may be
        lost meanwhile), ``fn(True)`` when it is back."""

    # the parts a registry may offer
    def application_store(self) -> ApplicationStore | None:
        """The dataset's applications as registry data; None when they are the pipeline
        file's."""

    def serving_claims(self) -> ServingClaims | None:
        """Serving claims and shared datamarkers; None when the registry cannot offer
        multiple-copy delivery."""

    # publishers
    def register_publisher(self, entry: PublisherEntry) -> None:
        """Claim ``entry.datastore`` for this process, or update the entry it already
        holds. Raises :class:`DatastoreHeld` naming the holder if another registration
        holds it."""

    def release_publisher(self, datastore: str, holder: PublisherEntry) -> bool:
        """Remove ``holder``'s registration of ``datastore`` (if it is still that one):
        for a holder known to be dead. True if it was removed."""

    def watch_publishers(self, fn: Callable[[list[PublisherEntry]], None]) -> None:
        """``fn(entries)`` with the live publishers of the dataset, by datastore."""

    def publish_status(self, datastore: str, status: dict[str, Any]) -> None:
        """Share a publisher's live status (flows, datamarkers, owners) for ``status``.

        A status reports on now: a registry that brings its registrations back after losing
        them (a session expiry) does not bring back a status published before the loss; it
        is shared again at the next call (publishers call this about once a second)."""

    def statuses(self) -> dict[str, dict[str, Any]]:
        """Every live publisher's last shared status, by datastore."""

    # subscribers
    def register_subscriber(self, application: str, entry: SubscriberEntry) -> None:
        """Register one live subscriber of ``application`` (ConfigError if unknown)."""

    def unregister_subscriber(self, application: str, instance: str) -> None: ...

    def watch_subscribers(
        self, application: str, fn: Callable[[list[SubscriberEntry]], None]
    ) -> Callable[[], None]:
        """``fn(entries)`` with the application's live subscribers in registration order,
        now and at each change; returns what ends the watch (``fn`` is not called after it
        returns)."""


@dataclass
class Registered:
    """A component as the registry knows it: its spec and the distribution providing it."""

    spec: ComponentSpec
    distribution: str
    version: str = ""
    plugin: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
