"""The pipeline file: parsing, environment interpolation and validation.

Validation runs in two passes and reports every problem at once, each named by
its path in the file (``applications.search.sink.index: field required``):
first the pipeline's own structure, then each component's options against the
options model its plugin declares.
"""

from __future__ import annotations

import fnmatch
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, ByteSize, Field, ValidationError, field_validator, model_validator

from wormhole.core.errors import ConfigError
from wormhole.core.metrics import DEFAULT_LISTEN, Listen, parse_listen
from wormhole.plugins.components import (
    Capabilities,
    ComponentUse,
    Kind,
    Options,
    Registered,
    capabilities_of,
)

if typing.TYPE_CHECKING:
    from wormhole.plugins.manager import Registry

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
OPS = Literal["c", "u", "d", "r", "t"]


class DatasetConfig(Options):
    """The dataset the source's changes belong to."""

    shards: int = Field(16, ge=1, le=65536, description="number of shards (flows per application)")


class LogConfig(Options):
    """The publisher log (spool) in ``<state_dir>/log``."""

    roll_size: ByteSize = Field(
        ByteSize(1 << 30), description="roll a segment past this size (e.g. 1GiB, 64MiB)"
    )
    fsync: bool = Field(True, description="fsync every batch before confirming the source")
    keep_rolled: int = Field(
        0, ge=0, description="rolled segments to keep after every flow has passed them"
    )
    tail_updates: int = Field(
        262_144, ge=1, description="recent updates kept in memory for the lead caravan"
    )

    @field_validator("roll_size")
    @classmethod
    def _roll_size_floor(cls, value: ByteSize) -> ByteSize:
        if value < 4096:
            raise ValueError("must be at least 4KiB")
        return value


class MetricsConfig(Options):
    """Prometheus metrics (see docs/operations.md)."""

    listen: str = Field(
        DEFAULT_LISTEN,
        description="HOST:PORT of the publisher's /metrics endpoint (port 0: any free port); "
        "subscriber processes that `wormhole run` starts serve on the ports after it",
    )
    flows: bool = Field(
        True, description="per-flow (per-shard) series; false keeps only per-application ones"
    )

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        try:
            parse_listen(value)
        except ConfigError as exc:
            raise ValueError(str(exc).removeprefix("metrics.listen: ")) from None
        return value


class ProgressConfig(Options):
    """How long work (an initial snapshot, ``run --once``) reports progress."""

    interval_ms: int = Field(
        5000,
        ge=10,
        description="how often a progress line is logged when stderr is not a terminal "
        "(on a terminal, a progress bar is drawn instead)",
    )


class BackfillConfig(Options):
    """Defaults of backfills (``wormhole backfill`` options override them)."""

    chunk_size: int = Field(
        4096, ge=1, le=1_000_000, description="rows read per chunk, between two watermarks"
    )
    pause_ms: int = Field(
        0, ge=0, le=3_600_000, description="pause between chunks, to spare the database"
    )


class DeliveryConfig(Options):
    """How datamarkers are kept."""

    mode: Literal["single-copy", "multiple-copy"] = "single-copy"
    datamarker_interval_ms: int = Field(
        1000, ge=10, description="how often acknowledged datamarkers are persisted"
    )
    store: dict[str, Any] | None = Field(
        None, description="datamarker store component (default: the registry's default store)"
    )
    max_caravans: int = Field(
        8, ge=1, le=1024, description="most readers of the publisher log at once"
    )
    merge_distance: int = Field(
        10_000,
        ge=0,
        description="caravans this many positions apart (or closer) merge into one",
    )
    slow_flow_ms: int = Field(
        2000,
        ge=10,
        description="an application that keeps its caravan waiting this long is moved to a "
        "caravan of its own (the others never wait for it)",
    )
    catch_up_ms: int = Field(
        30_000,
        ge=0,
        description="multiple-copy: how long a copy taking over an application waits for its "
        "datastore to reach the shared datamarkers before it refuses (never skipping)",
    )


class FilterConfig(Options):
    """Publisher-side filter of one application."""

    tables: list[str] | None = Field(None, description="table names or globs to keep")
    ops: list[OPS] | None = Field(None, description="ops to keep: c, u, d, r, t")
    plugins: list[dict[str, Any]] = Field(
        default_factory=list, description="filter plugins, applied after tables and ops"
    )
    where: str | dict[str, str] | None = Field(
        None,
        description="row predicate, e.g. \"status = 'active' and amount > 100\"; one for "
        "every table, or a mapping of table (or glob) to predicate",
    )
    columns: list[str] | dict[str, list[str]] | None = Field(
        None,
        description="columns to keep in before/after: one list for every table, or a mapping "
        "of table (or glob) to list",
    )

    @field_validator("where")
    @classmethod
    def _where(cls, value: str | dict[str, str] | None) -> str | dict[str, str] | None:
        from wormhole.core.expressions import Expression, ExpressionError

        items = value.items() if isinstance(value, dict) else [("", value)]
        for table, text in items:
            if text is None:
                continue
            try:
                Expression(text)
            except ExpressionError as exc:
                where = f" (table {table})" if table else ""
                raise ValueError(f"cannot parse {text!r}{where}: {exc}") from None
        return value


class MoveRequest(Options):
    """``wormhole apps move``: serve the application from copy ``to`` (requested at
    ``requested``, Unix milliseconds)."""

    to: str = Field(pattern=NAME_PATTERN)
    requested: int = Field(ge=0, description="when the move was requested (Unix milliseconds)")


class OnErrorConfig(Options):
    """What a subscriber does with a batch its sink rejects (``applications.<app>.on_error``)."""

    policy: Literal["retry", "dead_letter", "stop"] = Field(
        "retry",
        description="retry: until the sink takes the batch (the flow waits); dead_letter: "
        "after `retries`, isolate the rejected updates, keep them in the application's "
        "dead-letter log and move on; stop: after `retries`, stop the subscriber naming the "
        "rejected update",
    )
    retries: int | None = Field(
        None,
        ge=0,
        le=1_000_000,
        description="dead_letter and stop: attempts after the first before giving up (default 3)",
    )
    backoff_ms: int = Field(
        50, ge=1, le=3_600_000, description="the first wait between attempts; it doubles"
    )
    max_backoff_ms: int = Field(
        30_000, ge=1, le=3_600_000, description="the longest wait between attempts"
    )

    @model_validator(mode="after")
    def _retries(self) -> OnErrorConfig:
        if self.policy == "retry" and self.retries is not None:
            raise ValueError(
                "retries: policy retry retries until the sink takes the batch; set policy "
                "dead_letter or stop to give up after a number of retries"
            )
        if self.max_backoff_ms < self.backoff_ms:
            raise ValueError("max_backoff_ms must be at least backoff_ms")
        return self

    @property
    def attempts_after_first(self) -> int:
        return 3 if self.retries is None else self.retries


class ApplicationConfig(Options):
    """One application: its start point, filter, sink and number of subscribers."""

    start: Any = Field(
        "earliest",
        description="earliest | latest | {position: SEQ} | {time: ISO-8601 or Unix ms} | "
        "{backfill: [TABLE, ...]} (latest, and a backfill of those tables for this "
        "application alone)",
    )
    filter: FilterConfig = Field(default_factory=FilterConfig)
    sink: dict[str, Any] | None = Field(
        None,
        description="sink component: {type: NAME, ...options}; without one, the application's "
        "subscribers are programs using the subscriber library (tcp transport)",
    )
    subscribers: int = Field(1, ge=1, le=1024, description="subscriber instances")
    on_error: OnErrorConfig = Field(
        default_factory=OnErrorConfig,
        description="what the subscribers do with a batch the sink rejects: "
        "{policy: retry | dead_letter | stop, retries: N, backoff_ms: MS}",
    )
    copies: list[str] | None = Field(
        None,
        description="multiple-copy: the copies to serve this application from, most "
        "preferred first (default: the live copies in registration order)",
    )
    failback: Literal["auto", "manual"] = Field(
        "auto",
        description="multiple-copy: when a more preferred copy returns, move the "
        "application back to it (auto) or leave it until `wormhole apps move` (manual)",
    )
    move: MoveRequest | None = Field(
        None,
        description="multiple-copy: set by `wormhole apps move`: the copy serving the "
        "application when the move was requested hands it to this one",
        json_schema_extra={"internal": True},  # not listed as an option to write
    )
    external: bool = Field(
        False,
        description="the application reads the publisher log itself (Spark's wormhole stream "
        "source) and stores its own datamarkers; the publisher delivers nothing to it but "
        "keeps the log until its datamarkers pass",
    )

    @model_validator(mode="after")
    def _external(self) -> ApplicationConfig:
        if self.external:
            if self.sink is not None:
                raise ValueError("an external application has no sink (its reader is outside)")
            if self.filter != FilterConfig():
                raise ValueError("an external application reads the whole log: it has no filter")
        if self.sink is None and self.on_error != OnErrorConfig():
            raise ValueError(
                "on_error: applies to the application's sink, and it has none (its "
                "subscribers are programs using the subscriber library, which handle "
                "errors themselves); add a sink or remove on_error"
            )
        return self

    @field_validator("start")
    @classmethod
    def _start(cls, value: Any) -> Any:
        if value in ("earliest", "latest"):
            return value
        if isinstance(value, Mapping) and set(value) == {"position"}:
            position = value["position"]
            if isinstance(position, str) and position.isdigit():
                position = int(position)
            if isinstance(position, int) and not isinstance(position, bool) and position >= 0:
                return {"position": position}
        if isinstance(value, Mapping) and set(value) == {"time"}:
            return {"time": _time_ms(value["time"])}
        if isinstance(value, Mapping) and set(value) == {"backfill"}:
            tables = value["backfill"]
            if (
                isinstance(tables, list)
                and tables
                and all(isinstance(t, str) and t.strip() for t in tables)
            ):
                return {"backfill": [t.strip() for t in tables]}
        raise ValueError(
            "must be earliest, latest, {position: SEQ} with SEQ >= 0, {time: T} with T an "
            "ISO-8601 time (2026-11-22T10:00:00Z) or Unix milliseconds, or {backfill: [TABLE, "
            "...]} naming the tables to backfill for the application"
        )


def _time_ms(value: Any) -> int:
    """A start time as Unix milliseconds (ISO-8601 text without a zone is UTC)."""
    import datetime

    if isinstance(value, datetime.datetime):
        moment = value
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    elif isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    elif isinstance(value, str):
        try:
            moment = datetime.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(
                f"time {value!r} is not an ISO-8601 time (2026-11-22T10:00:00Z) or Unix "
                f"milliseconds"
            ) from None
    else:
        raise ValueError("time must be an ISO-8601 time or Unix milliseconds")
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return int(moment.timestamp() * 1000)


class PipelineModel(Options):
    """The pipeline file."""

    pipeline: str = Field(pattern=NAME_PATTERN, description="pipeline name")
    state_dir: str | None = Field(None, description="default .wormhole/<pipeline>")
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    source: dict[str, Any] = Field(description="source component: {type: NAME, ...options}")
    transport: dict[str, Any] | None = Field(
        None, description="transport component (default: the registry's default transport)"
    )
    delivery: DeliveryConfig = Field(default_factory=DeliveryConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    registry: dict[str, Any] | None = Field(
        None,
        description="where the dataset's publishers, applications and subscribers find each "
        "other: {type: zookeeper, hosts: ..., root: ...} (default: this file)",
    )
    datastore: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="this publisher's part of the dataset (default: the pipeline name)",
    )
    copy_: str | None = Field(
        None,
        alias="copy",
        pattern=NAME_PATTERN,
        description="multiple-copy: which copy of the datastore this publisher reads",
    )
    applications: dict[str, ApplicationConfig] = Field(min_length=1)
    metrics: MetricsConfig | None = Field(
        None, description="serve Prometheus metrics: {listen: HOST:PORT, flows: true}"
    )
    backfill: BackfillConfig = Field(
        default_factory=BackfillConfig,
        description="backfills: {chunk_size: 4096, pause_ms: 0}",
    )
    progress: ProgressConfig = Field(
        default_factory=ProgressConfig,
        description="progress of long work: {interval_ms: 5000} between log lines",
    )

    @field_validator("applications")
    @classmethod
    def _app_names(cls, value: dict[str, ApplicationConfig]) -> dict[str, ApplicationConfig]:
        for name in value:
            if not re.match(NAME_PATTERN, name):
                raise ValueError(f"application name {name!r} must match {NAME_PATTERN}")
        return value


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


# ---------------------------------------------------------------- interpolation
_VAR = re.compile(r"\$(\$|\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\})")


def interpolate(
    value: Any,
    env: Mapping[str, str],
    path: str,
    problems: list[str],
    unused: tuple[str, ...] = (),
) -> Any:
    """Replace ``${VAR}`` / ``${VAR:-default}`` in every string; ``$$`` is a literal ``$``.

    Under a key matching one of the ``unused`` patterns (``fnmatch``, e.g. ``source.*``: a
    part the command does not use), an unset variable stays as written instead of being an
    error: ``wormhole status`` needs no database password."""
    if isinstance(value, str):
        if "$" not in value:
            return value

        def sub(m: re.Match[str]) -> str:
            if m.group(1) == "$":
                return "$"
            name, default = m.group(2), m.group(3)
            if name in env and (env[name] != "" or default is None):
                return env[name]
            if default is not None:
                return default
            if any(fnmatch.fnmatchcase(path, pattern) for pattern in unused):
                return m.group(0)
            problems.append(
                f"{path or '<root>'}: environment variable {name} is not set "
                f"(set it, or write ${{{name}:-default}})"
            )
            return ""

        return _VAR.sub(sub, value)
    if isinstance(value, dict):
        return {
            k: interpolate(v, env, f"{path}.{k}" if path else str(k), problems, unused)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [interpolate(v, env, f"{path}[{i}]", problems, unused) for i, v in enumerate(value)]
    return value


# ------------------------------------------------------------- error formatting
def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "<root>"


def _unwrap(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _unwrap(args[0]) if len(args) == 1 else annotation
    return annotation


def _known_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    current: Any = model
    i = 0
    while i < len(loc):
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        info = current.model_fields.get(str(loc[i]))
        if info is None:
            return None
        annotation = _unwrap(info.annotation)
        i += 1
        while typing.get_origin(annotation) in (dict, list):
            args = typing.get_args(annotation)
            annotation = _unwrap(args[-1])
            i += 1
        current = annotation
    if isinstance(current, type) and issubclass(current, BaseModel):
        return [
            name
            for name, field in current.model_fields.items()
            if not (
                isinstance(field.json_schema_extra, dict)
                and field.json_schema_extra.get("internal")
            )
        ]
    return None


def format_validation_error(
    exc: ValidationError, model: type[BaseModel], prefix: tuple[Any, ...] = ()
) -> list[str]:
    problems = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        kind = error["type"]
        if kind == "missing":
            message = "field required"
        elif kind == "extra_forbidden":
            known = _known_keys(model, loc[:-1])
            message = "unknown option" + (f" (known: {', '.join(known)})" if known else "")
        else:
            message = str(error["msg"])
            message = message.removeprefix("Value error, ")
            message = message[:1].lower() + message[1:]
        problems.append(f"{_path(prefix + loc)}: {message}")
    return problems


# ------------------------------------------------------------------- loading
MAX_NESTING = 64
"""Mappings and lists nest at most this deep in a pipeline file."""
MAX_VALUES = 100_000
"""Values in a pipeline file, counting each use of a YAML alias again."""


def load_yaml(text: str, source: str) -> Any:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"malformed YAML: {where}{problem}", source) from exc
    except RecursionError:
        # The YAML parser recurses once per level of nesting.
        raise ConfigError(
            f"malformed YAML: nested too deeply (at most {MAX_NESTING} levels)", source
        ) from None
    _check_shape(data, "", [], [MAX_VALUES], source)
    return data


def _check_shape(
    value: Any, path: str, ancestors: list[int], budget: list[int], source: str
) -> None:
    """Refuse what YAML anchors and aliases can build before anything walks it: a mapping or
    list inside itself, nesting deeper than MAX_NESTING, or aliases of aliases that expand
    to more than MAX_VALUES values."""
    if not isinstance(value, dict | list):
        return
    if id(value) in ancestors:
        raise ConfigError(
            f"{path or '<root>'}: contains itself (a YAML alias inside its own anchor); "
            f"write the value out",
            source,
        )
    if len(ancestors) >= MAX_NESTING:
        raise ConfigError(f"{path}: nested more than {MAX_NESTING} levels deep", source)
    ancestors.append(id(value))
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        budget[0] -= 1
        if budget[0] < 0:
            raise ConfigError(
                f"more than {MAX_VALUES:,} values once YAML aliases are expanded (aliases "
                f"inside aliases?); a pipeline file needs far fewer",
                source,
            )
        child = (
            f"{path}[{key}]" if isinstance(value, list) else f"{path}.{key}" if path else str(key)
        )
        _check_shape(item, child, ancestors, budget, source)
    ancestors.pop()


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
