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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from wormhole.core.update import Update

Kind = Literal["source", "sink", "filter", "transport", "position_mapper", "datamarker_store"]
KINDS: tuple[Kind, ...] = (
    "source",
    "sink",
    "filter",
    "transport",
    "position_mapper",
    "datamarker_store",
)


MAX_DURATION_S = 365 * 86_400
"""The longest duration an option may hold: one year."""


class Options(BaseModel):
    """Base for component options: unknown keys are errors, so typos never pass silently.

    Numbers must be finite, and a duration (an option named ``*_s``, in seconds, or ``*_ms``,
    in milliseconds) at most a year: longer ones do not fit the timeouts they feed.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

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
    once per use (a sink once per subscriber).
    """

    kind: Kind
    name: str
    factory: Callable[[Any], Any]
    options: type[BaseModel] = NoOptions
    description: str = ""


# --------------------------------------------------------------------- sources
@dataclass
class SourceContext:
    """What the publisher tells a source when it opens it."""

    pipeline: str
    state_dir: Path
    shards: int
    stop: threading.Event
    log: logging.Logger


@dataclass
class SourceBatch:
    """Updates read from the datastore log, transaction-aligned.

    ``checkpoint`` is where the source would resume after these updates: any
    value msgspec can encode (JSON types). It is stored with the batch in the
    publisher log, and handed back to :meth:`Source.open` after a restart.
    """

    updates: list[Update]
    checkpoint: Any


@runtime_checkable
class Source(Protocol):
    """A tailer: the one reader of a datastore log."""

    def open(self, context: SourceContext, checkpoint: Any) -> None:
        """Prepare to read after ``checkpoint`` (None: from the source's beginning)."""

    def read(self, timeout: float) -> SourceBatch | None:
        """The next batch, or None if nothing arrived within ``timeout`` seconds.

        Updates need op, key, table, before/after and positions; the publisher
        sets ``shard``. Raise :class:`wormhole.core.errors.SourceError` for input
        that cannot be read (it stops the pipeline with the message).
        """

    def capture_end(self) -> Any:
        """The source's current end position (for ``wormhole run --once``)."""

    def reached(self, end: Any) -> bool:
        """Whether everything up to ``end`` (from capture_end) has been returned by read."""

    def confirm(self, checkpoint: Any) -> None:
        """Everything up to ``checkpoint`` is durable in the publisher log.

        A database source tells the database it may discard its log up to here
        (PostgreSQL ``confirmed_flush_lsn``).
        """

    def close(self) -> None:
        """Release connections and files."""


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
@runtime_checkable
class PositionMapper(Protocol):
    """Maps a datastore's native positions to logical positions and back."""

    def to_logical(self, native: str) -> str: ...

    def to_native(self, logical: str) -> str: ...


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
    """Durable storage of datamarkers (SQLite in the state dir, or ZooKeeper)."""

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
@runtime_checkable
class Transport(Protocol):
    """Moves flows from the publisher to subscribers and acknowledgements back.

    ``start`` receives the publisher's :class:`wormhole.core.hub.Hub`; a transport
    attaches subscriber sessions to it (``hub.attach``), whose ``deliver`` the
    caravan calls with frames, and reports acknowledgements with ``hub.acknowledge``.
    """

    def start(self, hub: Any) -> None:
        """Attach subscriber sessions to the hub and start moving frames."""

    def stop(self, drain: bool = True) -> None:
        """Stop. With ``drain``, let subscribers finish (and acknowledge) what they hold;
        without it (the run is failing), stop at once."""


@dataclass
class Registered:
    """A component as the registry knows it: its spec and the distribution providing it."""

    spec: ComponentSpec
    distribution: str
    version: str = ""
    plugin: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
