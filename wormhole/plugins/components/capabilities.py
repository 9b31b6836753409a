"""What a component offers beyond what its kind requires: one typed, frozen record,
declared on its :class:`~wormhole.plugins.components.ComponentSpec`.

The engine reads this record, and only it, to know how to treat a component: whether a
transport reads the publisher log itself, whether a source can backfill, where a transport
listens... It never probes an instance for optional methods. A component that declares a
capability must provide what it stands for (the methods named with each field); the engine
checks this once, when it creates the instance (:func:`capabilities_of`), and names what is
missing.

A spec that declares no record (``capabilities=None``, a plugin written before it) still
works as it did: its record is made from the spec's deprecated flags (``requires_sink``,
``reads_log``, ``shared``) and from what its instance has. That fallback will go.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wormhole.plugins.components.spec import ComponentSpec


@dataclass(frozen=True)
class Capabilities:
    """The optional features of one component, by kind (a field of another kind stays
    False)."""

    # -------------------------------------------------------------- transport
    requires_sink: bool = False
    """It runs every application's sink itself (so each must name one): ``inprocess``."""
    reads_log: bool = False
    """It reads the publisher log and stores the applications' datamarkers itself, instead
    of taking frames from caravans (every application is then outside the hub): ``kafka``.
    Its instance has the publisher's ``read_log`` & co. through :class:`PublisherView`."""
    listens: bool = False
    """Once started, the instance has ``address`` (``host:port`` where subscribers connect,
    registered in the dataset's registry): ``tcp``."""
    protocol: int = 0
    """The subscriber protocol version it speaks, registered with its address (0: none)."""
    remote_columns: bool = False
    """What its spec's ``remote_log`` returns also hands a range over a column at a time
    (a :class:`~wormhole.plugins.components.ColumnarRemoteLog`, ``read_columns``), so a
    reader that builds columns (the Spark source) does not decode each update: ``tcp``."""
    subscriber_processes: bool = False
    """``wormhole run`` starts each application's subscribers as processes once the
    instance's ``start`` returned (``wormhole subscribe PIPELINE --app NAME --instance N``
    and what the instance's ``subscriber_args()`` adds; ``None`` from it: none this run),
    restarts them, and stops them where the transport's stop calls
    ``hub.stop_subscribers`` (or after the stop): ``tcp``, ``kafka``."""

    # ----------------------------------------------------------------- source
    backfill: bool = False
    """The instance is a :class:`~wormhole.plugins.components.SourceBackfill`
    (``wormhole backfill``)."""
    snapshot_pending: bool = False
    """The instance has ``snapshot_pending()``: the tables whose initial snapshot is not
    read in full yet (an application that starts ``latest`` waits for them)."""
    lag: bool = False
    """The instance is a :class:`~wormhole.plugins.components.SourceLag` (``lag()``, read
    by the metrics endpoint)."""

    # ------------------------------------------------------- datamarker store
    shared_datamarkers: bool = False
    """The store is shared by publishers on several machines (multiple-copy delivery)."""

    # --------------------------------------------------------------- registry
    shared_registry: bool = False
    """The registry is shared by processes on several machines: ``wormhole subscribe``
    finds the dataset's publishers (and applications) through it rather than from the
    pipeline file or state dir: ``zookeeper``."""


REQUIRES: dict[str, tuple[str, ...]] = {
    "listens": ("address",),
    "subscriber_processes": ("subscriber_args",),
    "backfill": (
        "backfill_ready",
        "backfill_plan",
        "backfill_watermark",
        "backfill_chunk",
        "backfill_unseen",
    ),
    "snapshot_pending": ("snapshot_pending",),
    "lag": ("lag",),
}
"""What an instance declaring each capability must have (checked when it is created)."""


def capabilities_of(spec: ComponentSpec, instance: Any = None) -> Capabilities:
    """The capabilities of ``spec``'s components; with ``instance`` (one the spec's factory
    built), checked against it: a capability it lacks the methods of is a TypeError naming
    them. For a spec that declares none, made from its deprecated flags and ``instance``."""
    declared = spec.capabilities
    if declared is None:
        return _undeclared(spec, instance)
    if instance is not None:
        missing = [
            f"{name} ({', '.join(m for m in methods if not hasattr(instance, m))})"
            for name, methods in REQUIRES.items()
            if getattr(declared, name) and not all(hasattr(instance, m) for m in methods)
        ]
        if missing:
            raise TypeError(
                f"{spec.kind} {spec.name!r} declares capabilities its instance "
                f"({type(instance).__name__}) lacks: {'; '.join(missing)}"
            )
    return declared


def _undeclared(spec: ComponentSpec, instance: Any) -> Capabilities:
    """The record of a spec written before capabilities were declared (deprecated): its
    flags, and the optional methods its instance has."""
    values: dict[str, Any] = {
        "requires_sink": spec.requires_sink,
        "reads_log": spec.reads_log,
        "shared_datamarkers": spec.shared and spec.kind == "datamarker_store",
        "shared_registry": spec.shared and spec.kind == "registry",
    }
    if instance is not None:
        values.update(
            (name, all(callable(getattr(instance, m, None)) for m in methods))
            for name, methods in REQUIRES.items()
            if name not in ("listens", "subscriber_processes")
        )
        values["listens"] = bool(getattr(instance, "address", ""))
        values["protocol"] = int(getattr(instance, "protocol_version", 0) or 0)
    return Capabilities(**values)


__all__ = ["REQUIRES", "Capabilities", "capabilities_of"]
