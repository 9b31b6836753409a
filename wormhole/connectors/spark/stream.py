"""``spark.readStream.format("wormhole")``: the publisher log as a Spark streaming source.

Built on PySpark's Python Data Source API (PySpark 4). An *external*
application of a pipeline (``external: true`` in the pipeline file) is read by
Spark straight from the publisher log:

- **offsets are datamarkers**: ``{"<shard>": <publisher log position>, ...}``;
  the initial offset is the application's stored datamarkers;
- **partitions are shards**: a micro-batch has one input partition per shard
  with new updates, reading that shard's updates between two offsets;
- **commit** stores the end offset as the application's datamarkers, so the
  publisher may garbage-collect the log behind it.

Spark's checkpoint records the offsets of every micro-batch and replays a
batch from the same offsets after a failure, and the publisher log holds the
same updates at the same positions until the datamarkers pass them: together
that gives exactly-once into Spark's own sinks (Parquet, Delta, ...).

Options: ``pipeline`` (path of the pipeline file, required), ``application``
(the external application, required), ``stateDir`` (overrides the pipeline's
``state_dir``, e.g. when the driver sees it under another path).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)

SCHEMA = (
    "seq LONG, shard INT, op STRING, `table` STRING, key STRING, before STRING, after STRING, "
    "position STRING, logical STRING, ts_ms LONG"
)


class ShardRange(InputPartition):
    """One shard's updates in ``[start, end)`` of the publisher log at ``log_dir``."""

    def __init__(self, log_dir: str, shard: int, start: int, end: int) -> None:
        super().__init__((shard, start, end))
        self.log_dir = log_dir
        self.shard = shard
        self.start = start
        self.end = end


def _read_shard(partition: ShardRange) -> Iterator[tuple[Any, ...]]:
    from wormhole.core.publisher_log import read_log_range

    shard = partition.shard
    for seq, u in read_log_range(partition.log_dir, partition.start, partition.end):
        if u.shard != shard:
            continue
        yield (
            seq,
            shard,
            u.op,
            u.table,
            _json(u.key),
            None if bytes(u.before) == b"null" else bytes(u.before).decode(),
            None if bytes(u.after) == b"null" else bytes(u.after).decode(),
            u.position,
            u.logical,
            u.ts_ms,
        )


def _json(value: Any) -> str:
    import msgspec

    return msgspec.json.encode(value).decode()


class _Flows:
    """The external application's datamarkers, through the pipeline's datamarker store."""

    def __init__(self, options: dict[str, str]) -> None:
        from wormhole.core.errors import ConfigError
        from wormhole.core.pipeline import load_pipeline

        path = options.get("pipeline")
        self.application = options.get("application", "")
        if not path or not self.application:
            raise ValueError(
                'the wormhole source needs .option("pipeline", PATH) and '
                '.option("application", NAME) naming an external application of that pipeline'
            )
        try:
            pipeline = load_pipeline(path)
        except ConfigError as exc:
            raise ValueError(str(exc)) from exc
        app = pipeline.applications.get(self.application)
        if app is None or not app.external:
            known = [n for n, a in pipeline.applications.items() if a.external]
            raise ValueError(
                f"{path}: applications.{self.application} is not an external application "
                f"(external ones: {', '.join(known) or 'none'}); declare it with "
                f"'external: true' so the publisher keeps the log for it"
            )
        self.pipeline = pipeline
        # Spark hands a data source its options with lower-cased names.
        state_dir = options.get("stateDir") or options.get("statedir")
        self.state_dir = Path(state_dir or pipeline.state_dir)
        self.log_dir = str(self.state_dir / "log")
        self.shards = pipeline.shards

    def _store(self) -> Any:
        store = self.pipeline.datamarker_store.create()
        store.open(self.pipeline.name, self.state_dir)
        return store

    def stored(self) -> dict[str, int]:
        from wormhole.core.publisher_log import inspect_log

        store = self._store()
        try:
            markers = store.load()
        finally:
            store.close()
        first = inspect_log(self.log_dir).first_seq
        out = {}
        for shard in range(self.shards):
            marker = markers.get((self.application, shard))
            out[str(shard)] = marker.position if marker is not None else first
        return out

    def end(self) -> int:
        from wormhole.core.publisher_log import inspect_log

        return inspect_log(self.log_dir).next_seq

    def save(self, offsets: dict[str, int]) -> None:
        from wormhole.plugins.components import Datamarker

        store = self._store()
        try:
            store.save([Datamarker(self.application, int(s), int(p)) for s, p in offsets.items()])
        finally:
            store.close()

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[ShardRange]:
        return [
            ShardRange(self.log_dir, int(shard), int(start.get(shard, 0)), int(stop))
            for shard, stop in sorted(end.items(), key=lambda kv: int(kv[0]))
            if int(start.get(shard, 0)) < int(stop)
        ]


class WormholeStreamReader(DataSourceStreamReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.flows = _Flows(options)

    def initialOffset(self) -> dict[str, int]:
        return self.flows.stored()

    def latestOffset(
        self, start: dict[str, int] | None = None, limit: Any = None
    ) -> dict[str, int]:
        end = self.flows.end()
        base = start or self.flows.stored()
        return {shard: max(int(position), end) for shard, position in base.items()}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
        return list(self.flows.partitions(start, end))

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, ShardRange)
        return _read_shard(partition)

    def commit(self, end: dict[str, int]) -> None:
        # Spark committed the micro-batch: these are the application's datamarkers now.
        self.flows.save(end)


class WormholeBatchReader(DataSourceReader):
    """``spark.read.format("wormhole")``: the retained log from the application's
    datamarkers to its end (nothing is committed)."""

    def __init__(self, options: dict[str, str]) -> None:
        flows = _Flows(options)
        start = flows.stored()
        end = flows.end()
        self.ranges = flows.partitions(start, {s: max(p, end) for s, p in start.items()})

    def partitions(self) -> list[InputPartition]:
        return list(self.ranges)

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        if not isinstance(partition, ShardRange):
            return iter(())  # nothing to read: Spark reads one partition of its own
        return _read_shard(partition)


class WormholeDataSource(DataSource):
    """The ``wormhole`` format."""

    @classmethod
    def name(cls) -> str:
        return "wormhole"

    def schema(self) -> str:
        return SCHEMA

    def streamReader(self, schema: Any) -> WormholeStreamReader:
        return WormholeStreamReader(dict(self.options))

    def reader(self, schema: Any) -> WormholeBatchReader:
        return WormholeBatchReader(dict(self.options))


def register(spark: Any) -> None:
    """Make ``spark.readStream.format("wormhole")`` (and ``spark.read``) available."""
    spark.dataSource.register(WormholeDataSource)
