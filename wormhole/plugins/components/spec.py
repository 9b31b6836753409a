"""The declaration a plugin returns from its hook (:class:`ComponentSpec`), and the requests
and answers of the callables it may carry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from wormhole.plugins.components.capabilities import Capabilities
from wormhole.plugins.components.options import Kind, NoOptions

if TYPE_CHECKING:
    from wormhole.plugins.components.remote_log import RemoteLog
    from wormhole.plugins.views import PipelineView


@dataclass(frozen=True)
class ComponentSpec:
    """A component a plugin provides.

    ``factory(options)`` builds one instance from validated options; it is called
    once per use (a sink once per subscriber). ``capabilities`` and the callables after it
    tell the engine how to treat the component, so that it never has to know a component
    by name, nor probe an instance for optional methods.
    """

    kind: Kind
    name: str
    factory: Callable[[Any], Any]
    options: type[BaseModel] = NoOptions
    description: str = ""
    default: bool = False
    """The component of its kind that a pipeline file naming none gets (the built-in
    ``tcp`` transport and ``sqlite`` datamarker store); at most one per kind."""
    capabilities: Capabilities | None = None
    """What the component offers beyond what its kind requires (:class:`Capabilities`), the
    one record the engine reads. None (a plugin written before the record): made from the
    deprecated flags below and from what the instance has (see
    :func:`~wormhole.plugins.components.capabilities_of`)."""
    requires_sink: bool = False
    """Deprecated: ``Capabilities.requires_sink`` (read only when ``capabilities`` is None)."""
    reads_log: bool = False
    """Deprecated: ``Capabilities.reads_log`` (read only when ``capabilities`` is None)."""
    shared: bool = False
    """Deprecated: ``Capabilities.shared_datamarkers`` for a datamarker store,
    ``Capabilities.shared_registry`` for a registry (read only when ``capabilities`` is
    None)."""
    subscribe: Callable[[SubscribeRequest], None] | None = None
    """Transport: run one subscriber of an application with its sink until stopped
    (``wormhole subscribe``, and the processes ``wormhole run`` starts)."""
    remote_log: Callable[[RemoteLogRequest], RemoteLog] | None = None
    """Transport: open a publisher's log from another machine, as an external application
    (``spark.readStream.format("wormhole").option("publishers", ...)`` reads flows with it)."""
    lag: Callable[[Any, PipelineView], DestinationLag] | None = None
    """Transport that reads the log (``reads_log``): ``lag(options, pipeline)``, each
    application's lag as its destination counts it (Kafka: the consumer group's committed
    offsets against the topics' ends), for ``wormhole status`` and ``top``; the stored
    datamarkers only say what the transport handed over."""
    check: Callable[[Any, ComponentUse], list[str]] | None = None
    """``check(options, use)``: problems with this use of the component that need no outside
    service (each naming its key, e.g. ``applications.search.subscribers: ...``), found when
    the pipeline file is read, so that ``wormhole validate`` rejects what ``run`` would."""

    def __post_init__(self) -> None:
        if self.capabilities is not None and (self.requires_sink or self.reads_log or self.shared):
            raise TypeError(
                f"{self.kind} {self.name!r}: declare requires_sink, reads_log and shared in its "
                "capabilities, not also as the deprecated flags"
            )


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
class SubscribeRequest:
    """What ``wormhole subscribe`` asks of a transport's ``subscribe``."""

    pipeline: PipelineView
    """The validated pipeline (:class:`wormhole.core.pipeline.Pipeline`), as the contract
    promises it."""
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


@dataclass
class Registered:
    """A component as the registry knows it: its spec and the distribution providing it."""

    spec: ComponentSpec
    distribution: str
    version: str = ""
    plugin: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
