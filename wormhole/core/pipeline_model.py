"""The pipeline file's sections as options models: what each key accepts and its defaults.

:func:`wormhole.core.pipeline.parse_pipeline` validates a file against :class:`PipelineModel`
(the first pass), then each component's options against its plugin's model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import ByteSize, Field, field_validator, model_validator

from wormhole.core.errors import ConfigError
from wormhole.plugins.components import Options
from wormhole.plugins.metrics_endpoint import DEFAULT_LISTEN, parse_listen

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
