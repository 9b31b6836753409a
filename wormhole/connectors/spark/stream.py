"""``spark.readStream.format("wormhole")``: an external application's flows as a Spark
streaming source.

Built on PySpark's Python Data Source API (PySpark 4). An *external* application of a
pipeline (``external: true`` in the pipeline file) is read by Spark:

- **offsets are datamarkers**; the initial offset is the application's stored datamarkers;
- **partitions are flows**: a micro-batch has one input partition per flow with new
  updates, reading that flow's updates between two offsets;
- **commit** stores the end offset as the application's datamarkers, so the publisher
  may garbage-collect the log behind it, and ``wormhole status`` shows them.

Spark's checkpoint records the offsets of every micro-batch and replays a batch from the
same offsets after a failure, and the publisher log holds the same updates at the same
positions until the datamarkers pass them: together that gives exactly-once into Spark's
own sinks (Parquet, Delta, ...).

Two modes:

- **network** (``publishers`` or ``registry``): each task asks the publisher for its
  flow's range over the transport (the ``tcp`` transport's log readers, protocol version
  2), so executors need only reach the publisher's port. Offsets are
  ``{"<datastore>": {"<shard>": seq}}``; commits go through the publisher. Options:
  ``publishers`` (``host:port,...``) or ``registry`` (``zookeeper://HOSTS/ROOT``) with
  ``dataset``; ``application`` (required); ``token``; ``tls.ca``, ``tls.serverName``,
  ``tls.cert``, ``tls.key``; ``timeoutMs``; ``transport`` (default ``tcp``);
  ``maxUpdatesPerTrigger`` (a micro-batch takes at most this many log positions of each
  datastore, with every trigger: ``Trigger.AvailableNow`` then runs several batches up to
  the log's end as it was when the query started).
- **file** (``pipeline``): tasks read the publisher log files themselves, so every
  executor must see the publisher's ``state_dir``. Offsets are ``{"<shard>": seq}``.
  Options: ``pipeline`` (path of the pipeline file), ``application``, ``stateDir``
  (overrides the pipeline's ``state_dir``, e.g. when the driver sees it under another
  path).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow

from wormhole.connectors.spark.offsets import NetworkFlows, flows_of
from wormhole.connectors.spark.ranges import (
    SCHEMA,
    FlowRange,
    ShardRange,
    _read,
)

__all__ = [
    "SCHEMA",
    "FlowRange",
    "ShardRange",
    "WormholeBatchReader",
    "WormholeDataSource",
    "WormholeStreamReader",
    "register",
]


class WormholeStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: dict[str, str]) -> None:
        self.flows = flows_of(options)
        self.target: int | None = None
        """File mode, Trigger.AvailableNow: the log's end when the query started."""

    def prepareForTriggerAvailableNow(self) -> None:
        if isinstance(self.flows, NetworkFlows):
            self.flows.prepare_available_now()
        else:
            self.target = self.flows.end()

    def initialOffset(self) -> dict[str, Any]:
        return self.flows.stored()

    def latestOffset(
        self, start: dict[str, Any] | None = None, limit: Any = None
    ) -> dict[str, Any]:
        if isinstance(self.flows, NetworkFlows):
            # A ReadMaxRows limit of Spark's applies as well as maxUpdatesPerTrigger.
            return self.flows.latest(start, getattr(limit, "max_rows", None))
        end = self.flows.end() if self.target is None else self.target
        base = start or self.flows.stored()
        for cap in (getattr(limit, "max_rows", None), self.flows.limit):
            if cap is not None:
                end = min(end, min(int(v) for v in base.values()) + cap)
        return {shard: max(int(position), end) for shard, position in base.items()}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        return list(self.flows.partitions(start, end))

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        return _read(partition)

    def commit(self, end: dict[str, Any]) -> None:
        # Spark committed the micro-batch: these are the application's datamarkers now.
        self.flows.save(end)

    def stop(self) -> None:
        if isinstance(self.flows, NetworkFlows):
            self.flows.close()


class WormholeBatchReader(DataSourceReader):
    """``spark.read.format("wormhole")``: the retained log from the application's
    datamarkers to its end (nothing is committed)."""

    def __init__(self, options: dict[str, str]) -> None:
        flows = flows_of(options)
        if isinstance(flows, NetworkFlows):
            start_ds = flows.stored()
            end_ds = flows.latest(start_ds)
            self.ranges: list[InputPartition] = list(flows.partitions(start_ds, end_ds))
            flows.close()
            return
        start = flows.stored()
        end = flows.end()
        self.ranges = list(flows.partitions(start, {s: max(p, end) for s, p in start.items()}))

    def partitions(self) -> list[InputPartition]:
        return list(self.ranges)

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        return _read(partition)


class _Options(dict[str, str]):
    """The source's options, by name in any case (Spark hands them over lower-cased)."""

    def __init__(self, options: Any) -> None:
        super().__init__((str(k).lower(), str(v)) for k, v in dict(options).items())

    def get(self, key: str, default: Any = None) -> Any:
        return super().get(key.lower(), default)

    def __getitem__(self, key: str) -> str:
        return super().__getitem__(key.lower())


class WormholeDataSource(DataSource):
    """The ``wormhole`` format."""

    @classmethod
    def name(cls) -> str:
        return "wormhole"

    def schema(self) -> str:
        return SCHEMA

    def streamReader(self, schema: Any) -> WormholeStreamReader:
        return WormholeStreamReader(_Options(self.options))

    def reader(self, schema: Any) -> WormholeBatchReader:
        return WormholeBatchReader(_Options(self.options))


def register(spark: Any) -> None:
    """Make ``spark.readStream.format("wormhole")`` (and ``spark.read``) available."""
    spark.dataSource.register(WormholeDataSource)
