"""Typed, read-only views of a validated pipeline: what a plugin may read of it.

The engine's pipeline (``wormhole.core.pipeline.Pipeline``) has more than this and changes
without notice; these protocols are the part of it the contract promises. They are what
:func:`wormhole.plugins.engine.load_pipeline` and the ``cli.load_pipeline`` of a plugin's
command return. Every attribute is a property: a plugin reads the pipeline, never changes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from wormhole.plugins.components.capabilities import Capabilities


class ComponentView(Protocol):
    """A component named in the pipeline file (``source``, ``transport``, an application's
    ``sink``, ...), with its validated options."""

    @property
    def type(self) -> str:
        """The component's name in its kind (``postgres``, ``kafka``, ``jsonl``, ...)."""

    @property
    def options(self) -> Any:
        """Its options, validated: an instance of the options model its spec declares."""

    @property
    def path(self) -> str:
        """Where the file names it, for messages: ``applications.search.sink``."""

    @property
    def capabilities(self) -> Capabilities:
        """What its spec declares it offers (:class:`wormhole.plugins.components.Capabilities`)."""

    def create(self) -> Any:
        """A new instance, built by its spec's factory from ``options``."""


class ApplicationView(Protocol):
    """One application of the pipeline file."""

    @property
    def name(self) -> str: ...

    @property
    def start(self) -> str | dict[str, Any]:
        """``earliest``, ``latest``, ``{"position": SEQ}``, ``{"time": MS}`` or
        ``{"backfill": [TABLE, ...]}``."""

    @property
    def tables(self) -> Sequence[str] | None:
        """The filter's tables (names or globs); None keeps every table."""

    @property
    def ops(self) -> Sequence[str] | None:
        """The filter's ops; None keeps every op."""

    @property
    def where(self) -> str | dict[str, str] | None:
        """The filter's row predicate (one, or one per table)."""

    @property
    def columns(self) -> Sequence[str] | dict[str, list[str]] | None:
        """The columns the filter keeps (one list, or one per table)."""

    @property
    def filters(self) -> Sequence[ComponentView]:
        """The filter's plugins, applied after the rest of the filter."""

    @property
    def sink(self) -> ComponentView | None:
        """Its sink; None when its subscribers are programs using a subscriber library."""

    @property
    def subscribers(self) -> int: ...

    @property
    def external(self) -> bool:
        """Whether it reads the publisher log itself (the Spark data source)."""

    @property
    def on_error(self) -> Any:
        """What its subscribers do with a batch the sink rejects: ``policy``, ``retries``,
        ``backoff_ms``, ``max_backoff_ms``."""


class PipelineView(Protocol):
    """A pipeline file, read and validated."""

    @property
    def name(self) -> str:
        """The pipeline's (the dataset's) name: the ``pipeline`` key."""

    @property
    def file(self) -> str:
        """The file it was read from, for messages."""

    @property
    def state_dir(self) -> Path:
        """Where the publisher keeps its log and state (``state_dir``)."""

    @property
    def shards(self) -> int: ...

    @property
    def datastore(self) -> str:
        """This publisher's part of the dataset (``datastore``; default: ``name``)."""

    @property
    def copy(self) -> str:
        """Which copy of the datastore this publisher reads ("" for the only one)."""

    @property
    def mode(self) -> str:
        """The delivery mode: ``single-copy`` or ``multiple-copy``."""

    @property
    def datamarker_interval(self) -> float:
        """Seconds between two saves of the datamarkers (``delivery.datamarker_interval_ms``)."""

    @property
    def source(self) -> ComponentView: ...

    @property
    def transport(self) -> ComponentView: ...

    @property
    def datamarker_store(self) -> ComponentView: ...

    @property
    def dataset_registry(self) -> ComponentView | None:
        """The ``registry`` component: where the dataset's publishers, applications and
        subscribers meet (the built-in ``file`` registry when the file names none)."""

    @property
    def applications(self) -> Mapping[str, ApplicationView]: ...
