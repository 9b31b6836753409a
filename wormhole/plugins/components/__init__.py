"""The plugin contract's components: what a source, sink, filter, transport, position
mapper, datamarker store or registry must provide, and :class:`ComponentSpec`, the
declaration a plugin returns from its hook, with its :class:`Capabilities`.

This module is the stable entry: import every name from here. The definitions live in a
module per kind:

================  ==================================================================
``options``       :class:`Options` (the base of every options model), the kinds
``spec``          :class:`ComponentSpec` and what its callables take and return
``capabilities``  :class:`Capabilities`, the record of a component's optional features
``declare``       hook implementations made from specs (:func:`offer`), shared checks
``sources``       :class:`Source` and its optional parts (backfills, lag)
``sinks``         :class:`Sink`, :class:`Filter`
``transports``    :class:`Transport`, what it sees of the publisher, subscriber sessions
``remote_log``    a publisher's log read from another machine (``remote_log``)
``positions``     :class:`PositionMapper`
``datamarkers``   :class:`Datamarker`, :class:`DatamarkerStore`
``registries``    :class:`DatasetRegistry` and its optional parts
================  ==================================================================

Every component declares an options model (a pydantic model, usually a subclass
of :class:`Options`). The pipeline file's mapping for the component, minus its
``type``, is validated against that model; validation errors name the key by its
path in the file; ``wormhole plugins`` and the docs read the same model.
"""

from __future__ import annotations

from wormhole.plugins.components.capabilities import Capabilities, capabilities_of
from wormhole.plugins.components.datamarkers import Datamarker, DatamarkerStore
from wormhole.plugins.components.declare import Hook, log_reader, offer, template_problems
from wormhole.plugins.components.options import KINDS, MAX_DURATION_S, Kind, NoOptions, Options
from wormhole.plugins.components.positions import PositionMapper, Version
from wormhole.plugins.components.registries import (
    ApplicationStore,
    DatasetRegistry,
    DatastoreHeld,
    InvalidEntry,
    PublisherEntry,
    ServingClaim,
    ServingClaims,
    SharedDatamarker,
    SubscriberEntry,
)
from wormhole.plugins.components.remote_log import (
    ColumnarRemoteLog,
    LogPositions,
    RemoteLog,
    RemoteLogError,
)
from wormhole.plugins.components.sinks import Filter, Sink, SinkContext
from wormhole.plugins.components.sources import (
    BackfillPlan,
    Source,
    SourceBackfill,
    SourceBatch,
    SourceContext,
    SourceLag,
    Watermark,
)
from wormhole.plugins.components.spec import (
    ComponentSpec,
    ComponentUse,
    DestinationLag,
    Registered,
    RemoteLogRequest,
    SubscribeRequest,
)
from wormhole.plugins.components.transports import (
    Flow,
    Frame,
    LocalSubscriberSession,
    LogBatch,
    LogCursor,
    PublisherView,
    SubscriberSession,
    Transport,
)

__all__ = [
    "KINDS",
    "MAX_DURATION_S",
    "ApplicationStore",
    "BackfillPlan",
    "Capabilities",
    "ColumnarRemoteLog",
    "ComponentSpec",
    "ComponentUse",
    "Datamarker",
    "DatamarkerStore",
    "DatasetRegistry",
    "DatastoreHeld",
    "DestinationLag",
    "Filter",
    "Flow",
    "Frame",
    "Hook",
    "InvalidEntry",
    "Kind",
    "LocalSubscriberSession",
    "LogBatch",
    "LogCursor",
    "LogPositions",
    "NoOptions",
    "Options",
    "PositionMapper",
    "PublisherEntry",
    "PublisherView",
    "Registered",
    "RemoteLog",
    "RemoteLogError",
    "RemoteLogRequest",
    "ServingClaim",
    "ServingClaims",
    "SharedDatamarker",
    "Sink",
    "SinkContext",
    "Source",
    "SourceBackfill",
    "SourceBatch",
    "SourceContext",
    "SourceLag",
    "SubscribeRequest",
    "SubscriberEntry",
    "SubscriberSession",
    "Transport",
    "Version",
    "Watermark",
    "capabilities_of",
    "log_reader",
    "offer",
    "template_problems",
]
