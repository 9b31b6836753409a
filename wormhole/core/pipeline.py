"""The pipeline file: parsing, environment interpolation and validation.

The sections' options models are in :mod:`wormhole.core.pipeline_model`, reading the text
(YAML, ``${VAR}`` interpolation, error paths) in :mod:`wormhole.core.pipeline_yaml`; their
names are importable from here too.

Validation runs in two passes and reports every problem at once, each named by
its path in the file (``applications.search.sink.index: field required``):
first the pipeline's own structure, then each component's options against the
options model its plugin declares.
"""

from __future__ import annotations

import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from wormhole.core.errors import ConfigError
from wormhole.core.pipeline_model import (
    NAME_PATTERN,
    OPS,
    ApplicationConfig,
    BackfillConfig,
    DatasetConfig,
    DeliveryConfig,
    FilterConfig,
    LogConfig,
    MetricsConfig,
    MoveRequest,
    OnErrorConfig,
    PipelineModel,
    ProgressConfig,
)
from wormhole.core.pipeline_yaml import (
    MAX_NESTING,
    MAX_VALUES,
    format_validation_error,
    interpolate,
    load_yaml,
)
from wormhole.plugins.components import (
    Capabilities,
    ComponentUse,
    Kind,
    Registered,
    capabilities_of,
)
from wormhole.plugins.metrics_endpoint import Listen, parse_listen

if typing.TYPE_CHECKING:
    from wormhole.plugins.manager import Registry

__all__ = [
    "MAX_NESTING",
    "MAX_VALUES",
    "NAME_PATTERN",
    "OPS",
    "ApplicationConfig",
    "BackfillConfig",
    "DatasetConfig",
    "DeliveryConfig",
    "FilterConfig",
    "LogConfig",
    "MetricsConfig",
    "MoveRequest",
    "OnErrorConfig",
    "PipelineModel",
    "ProgressConfig",
    "format_validation_error",
    "interpolate",
    "load_yaml",
]


@dataclass
class Component:
    """A component named in the pipeline file, with its validated options."""

    kind: Kind
    type: str
    options: Any
    path: str
    registered: Registered

    def create(self) -> Any:
        return self.registered.spec.factory(self.options)

    @property
    def capabilities(self) -> Capabilities:
        """What its spec declares it offers."""
        return capabilities_of(self.registered.spec)

    def capabilities_of(self, instance: Any) -> Capabilities:
        """What its spec declares it offers, checked against ``instance`` (one it created)."""
        return capabilities_of(self.registered.spec, instance)


@dataclass
class Application:
    name: str
    start: Any
    tables: list[str] | None
    ops: list[str] | None
    filters: list[Component]
    sink: Component | None
    subscribers: int
    external: bool = False
    where: str | dict[str, str] | None = None
    columns: list[str] | dict[str, list[str]] | None = None
    copies: list[str] | None = None
    failback: str = "auto"
    move: MoveRequest | None = None
    on_error: OnErrorConfig = field(default_factory=OnErrorConfig)


@dataclass(frozen=True)
class CaravanConfig:
    max_caravans: int = 8
    merge_distance: int = 10_000
    slow_flow_s: float = 2.0


@dataclass(frozen=True)
class MetricsSettings:
    """Where this process serves metrics, and whether with per-flow series."""

    listen: Listen
    flows: bool = True


@dataclass
class Pipeline:
    """A validated pipeline, its components resolved through the plugin registry."""

    name: str
    file: str
    state_dir: Path
    shards: int
    source: Component
    transport: Component
    datamarker_store: Component
    mode: str
    datamarker_interval: float
    log: LogConfig
    applications: dict[str, Application]
    registry: Registry
    dataset_registry: Component | None = None
    """The ``registry`` component (where publishers, applications and subscribers meet)."""
    datastore: str = ""
    """This publisher's part of the dataset (the ``datastore`` key; default: the name)."""
    copy: str = ""
    """Which copy of the datastore this publisher reads (multiple-copy delivery)."""
    catch_up_s: float = 30.0
    caravans: CaravanConfig = field(default_factory=CaravanConfig)
    raw: dict[str, Any] = field(default_factory=dict)
    metrics: MetricsSettings | None = None
    """The ``metrics`` key (``--metrics`` replaces its address): None serves none."""
    progress_interval: float = 5.0
    """Seconds between progress log lines (``progress.interval_ms``)."""
    backfill: BackfillConfig = field(default_factory=BackfillConfig)
    """Backfill defaults (the ``backfill`` key)."""


READ_STATE_UNUSED = ("source.*", "transport.*", "applications.*.sink.*")
"""What commands that only read the state dir (``status``, ``top``) do not use: unset
environment variables there (a database password) are not needed."""


def load_pipeline(
    path: str | os.PathLike[str],
    registry: Registry | None = None,
    env: Mapping[str, str] | None = None,
    unused: tuple[str, ...] = (),
) -> Pipeline:
    """Read and validate a pipeline file; raises ConfigError listing every problem.
    ``unused``: see :func:`interpolate`."""
    name = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"file not found: {name}", name) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {name}: {exc}", name) from None
    return parse_pipeline(text, name, registry, env, unused)


def parse_pipeline(
    text: str,
    source: str = "<pipeline>",
    registry: Registry | None = None,
    env: Mapping[str, str] | None = None,
    unused: tuple[str, ...] = (),
) -> Pipeline:
    if registry is None:
        from wormhole.plugins.manager import default_registry

        registry = default_registry()
    env = os.environ if env is None else env
    data = load_yaml(text, source)
    if not isinstance(data, dict):
        raise ConfigError(
            "the pipeline file must be a mapping with at least pipeline, source and applications",
            source,
        )
    problems: list[str] = []
    data = interpolate(data, env, "", problems, unused)
    if problems:
        raise ConfigError(problems, source)
    try:
        model = PipelineModel.model_validate(data)
    except ValidationError as exc:
        problems.extend(format_validation_error(exc, PipelineModel))
        model = None
    # Component options are checked even when the structure has problems, so one
    # run of `wormhole validate` shows everything.
    source_c = _component(registry, "source", data.get("source"), "source", problems)
    delivery = data.get("delivery") if isinstance(data.get("delivery"), dict) else {}
    transport_c = _component_or_default(registry, "transport", data, "transport", "", problems)
    store_c = _component_or_default(
        registry, "datamarker_store", delivery, "store", "delivery.", problems
    )
    registry_c = _component_or_default(registry, "registry", data, "registry", "", problems)
    apps = _applications(registry, data, model, transport_c, problems)
    if model is not None:
        _check_copies(model, registry_c, problems)
    if problems or model is None:
        raise ConfigError(problems, source)
    assert source_c is not None and transport_c is not None and store_c is not None
    state_dir = Path(model.state_dir or f".wormhole/{model.pipeline}")
    return Pipeline(
        name=model.pipeline,
        file=source,
        state_dir=state_dir,
        shards=model.dataset.shards,
        source=source_c,
        transport=transport_c,
        datamarker_store=store_c,
        mode=model.delivery.mode,
        datamarker_interval=model.delivery.datamarker_interval_ms / 1000.0,
        caravans=CaravanConfig(
            model.delivery.max_caravans,
            model.delivery.merge_distance,
            model.delivery.slow_flow_ms / 1000.0,
        ),
        log=model.log,
        applications=apps,
        registry=registry,
        dataset_registry=registry_c,
        datastore=model.datastore or model.pipeline,
        copy=model.copy_ or "",
        catch_up_s=model.delivery.catch_up_ms / 1000.0,
        raw=data,
        metrics=(
            MetricsSettings(parse_listen(model.metrics.listen), model.metrics.flows)
            if model.metrics is not None
            else None
        ),
        progress_interval=model.progress.interval_ms / 1000.0,
        backfill=model.backfill,
    )


def _applications(
    registry: Registry,
    data: dict[str, Any],
    model: PipelineModel | None,
    transport: Component | None,
    problems: list[str],
) -> dict[str, Application]:
    """Each application with its components (sink, plugin filters) resolved; problems are
    appended to ``problems``."""
    requires_sink = transport is not None and transport.capabilities.requires_sink
    apps: dict[str, Application] = {}
    raw_apps = data.get("applications")
    if not isinstance(raw_apps, dict):
        return apps
    for app_name, raw_app in raw_apps.items():
        if not isinstance(raw_app, dict):
            continue
        base = f"applications.{app_name}"
        sink_c = None
        if raw_app.get("sink") is not None:
            sink_c = _component(registry, "sink", raw_app.get("sink"), f"{base}.sink", problems)
            if sink_c is None:
                continue
        elif requires_sink and not raw_app.get("external"):
            problems.append(
                f"{base}.sink: field required (the {transport.type if transport else ''} "
                f"transport runs every application's sink; use a transport with separate "
                f"subscribers for library subscribers)"
            )
        filters = []
        raw_filter = raw_app.get("filter")
        if isinstance(raw_filter, dict) and isinstance(raw_filter.get("plugins"), list):
            for i, raw_plugin in enumerate(raw_filter["plugins"]):
                fc = _component(
                    registry, "filter", raw_plugin, f"{base}.filter.plugins[{i}]", problems
                )
                if fc is not None:
                    filters.append(fc)
        if model is not None:
            app = model.applications[app_name]
            _check_use(sink_c, ComponentUse(f"{base}.sink", app_name, app.subscribers), problems)
            apps[app_name] = Application(
                name=app_name,
                start=app.start,
                tables=app.filter.tables,
                ops=list(app.filter.ops) if app.filter.ops else None,
                where=app.filter.where,
                columns=app.filter.columns,
                filters=filters,
                sink=sink_c,
                subscribers=app.subscribers,
                external=app.external,
                copies=app.copies,
                failback=app.failback,
                move=app.move,
                on_error=app.on_error,
            )
    return apps


def _check_use(component: Component | None, use: ComponentUse, problems: list[str]) -> None:
    """The component's own checks of this use (its spec's ``check``), if it has any."""
    if component is None or component.registered.spec.check is None:
        return
    problems.extend(component.registered.spec.check(component.options, use))


def parse_application(
    pipeline: Pipeline, name: str, raw: Any, where: str
) -> tuple[Application | None, list[str]]:
    """One application's mapping from outside the file (a registry), validated as the file's
    ``applications.<name>`` would be; problems name ``where`` (a znode path) and the key."""
    problems: list[str] = []
    if not re.match(NAME_PATTERN, name):
        return None, [f"{where}: application name {name!r} must match {NAME_PATTERN}"]
    if not isinstance(raw, dict):
        return None, [f"{where}: must be a mapping (start, filter, sink, subscribers)"]
    data = {"applications": {name: raw}}
    try:
        model = PipelineModel.model_validate(
            {"pipeline": pipeline.name, "source": {}, "applications": {name: raw}}
        )
    except ValidationError as exc:
        problems.extend(format_validation_error(exc, PipelineModel))
        model = None
    apps = _applications(pipeline.registry, data, model, pipeline.transport, problems)
    prefix = f"applications.{name}"
    problems = [
        f"{where}: {p[len(prefix) + 1 :] if p.startswith(prefix + '.') else p}" for p in problems
    ]
    if problems:
        return None, problems
    return apps.get(name), []


def _check_copies(model: PipelineModel, registry: Component | None, problems: list[str]) -> None:
    """Multiple-copy delivery needs a shared registry (the copies of a datastore find each
    other, claim applications and keep their shared datamarkers there) and a ``copy``."""
    if model.delivery.mode != "multiple-copy":
        if model.copy_ is not None:
            problems.append(
                "copy: names a copy of the datastore, for delivery.mode: multiple-copy; set "
                "that mode too, or remove copy"
            )
        return
    if registry is not None and not registry.capabilities.shared_registry:
        problems.append(
            "delivery.mode: multiple-copy keeps datamarkers as logical positions in a shared "
            "registry, where the copies of a datastore claim applications: set registry: "
            "{type: zookeeper, hosts: ..., root: ...}"
        )
    if model.copy_ is None:
        problems.append(
            "copy: required with delivery.mode: multiple-copy (which copy of the datastore "
            "this publisher reads, e.g. primary)"
        )


def _component_or_default(
    registry: Registry,
    kind: Kind,
    section: dict[str, Any],
    key: str,
    prefix: str,
    problems: list[str],
) -> Component | None:
    """``section[key]`` (at path ``prefix + key``), or the registry's default component of
    ``kind`` when the key is absent."""
    raw = section.get(key, {"type": registry.default_name(kind)})
    return _component(registry, kind, raw, prefix + key, problems)


def _component(
    registry: Registry, kind: Kind, raw: Any, path: str, problems: list[str]
) -> Component | None:
    if raw is None:
        return None  # reported as "field required" by the structural pass
    if not isinstance(raw, dict):
        problems.append(f"{path}: must be a mapping with a type, e.g. {{type: NAME, ...}}")
        return None
    type_name = raw.get("type")
    if type_name is None:
        if "type" in raw:
            problems.append(
                f"{path}.type: empty (YAML reads an unquoted null or ~ as no value; "
                f'for the null component write type: "null")'
            )
        else:
            problems.append(f"{path}.type: field required")
        return None
    if not isinstance(type_name, str):
        problems.append(f"{path}.type: must be a string")
        return None
    try:
        registered = registry.get(kind, type_name, f"{path}.type")
    except ConfigError as exc:
        problems.extend(exc.problems)
        return None
    options_model = registered.spec.options
    fields = {k: v for k, v in raw.items() if k != "type"}
    try:
        options = options_model.model_validate(fields)
    except ValidationError as exc:
        problems.extend(format_validation_error(exc, options_model, _split_path(path)))
        return None
    return Component(kind, type_name, options, path, registered)


def _split_path(path: str) -> tuple[Any, ...]:
    parts: list[Any] = []
    for piece in path.split("."):
        # re.S: application names are any YAML key until validated, line breaks included.
        m = re.fullmatch(r"(.*?)((?:\[\d+\])*)", piece, re.S)
        assert m is not None
        if m.group(1):
            parts.append(m.group(1))
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", m.group(2)))
    return tuple(parts)


def sink_application(pipeline: Pipeline, name: str, library: str) -> tuple[Application, Component]:
    """The application ``wormhole subscribe --app NAME`` runs, and its sink: it must exist
    and have one (``library`` names what subscribers of an application without one are)."""
    app = pipeline.applications.get(name)
    if app is None:
        known = ", ".join(sorted(pipeline.applications))
        raise ConfigError(f"--app: unknown application {name!r} (known: {known})", pipeline.file)
    if app.sink is None:
        raise ConfigError(
            f"applications.{name}.sink: none configured; this application's subscribers are "
            f"programs using {library}",
            pipeline.file,
        )
    return app, app.sink
