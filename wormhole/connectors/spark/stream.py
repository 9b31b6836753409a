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

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow

from wormhole.core.update import COLUMN_STRINGS, NO_TS, UpdateColumns, columns_of
from wormhole.plugins.components import ColumnarRemoteLog

SCHEMA = (
    "seq LONG, shard INT, op STRING, `table` STRING, key STRING, before STRING, after STRING, "
    "position STRING, logical STRING, ts_ms LONG, datastore STRING"
)


class ShardRange(InputPartition):
    """One shard's updates in ``[start, end)`` of the publisher log at ``log_dir``."""

    def __init__(
        self,
        log_dir: str,
        shard: int,
        start: int,
        end: int,
        datastore: str = "",
        application: str = "",
    ) -> None:
        super().__init__((shard, start, end))
        self.log_dir = log_dir
        self.application = application
        self.datastore = datastore
        self.shard = shard
        self.start = start
        self.end = end


class FlowRange(InputPartition):
    """One flow's updates in ``[start, end)``, read from its publisher over the network."""

    def __init__(
        self,
        transport: str,
        address: str,
        application: str,
        options: dict[str, str],
        datastore: str,
        shard: int,
        start: int,
        end: int,
    ) -> None:
        super().__init__((datastore, shard, start, end))
        self.transport = transport
        self.address = address
        self.application = application
        self.options = options
        self.datastore = datastore
        self.shard = shard
        self.start = start
        self.end = end


ARROW_ROWS = 8192
"""Rows per Arrow record batch a task builds from the log files (columns, not one tuple per
row); a network read hands over the publisher's ``columns`` frames, up to 8,192 rows each."""


def _arrow_batches(
    chunks: Iterator[UpdateColumns], shard: int, datastore: str, where: str = ""
) -> Iterator[Any]:
    """One flow's updates, as :class:`UpdateColumns` chunks, as Arrow record batches of the
    source's schema. The chunks' buffers become the arrays' buffers: no Python object per
    row or per value (the value offsets are the lengths' running sums, computed by Arrow,
    and every batch is validated in full, UTF-8 included, before Spark sees it)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    schema = _arrow_schema()
    string, int32, int64 = pa.string(), pa.int32(), pa.int64()
    shard_value, datastore_value = pa.scalar(shard, int32), pa.scalar(datastore, string)
    zero = pa.array([0], int32)
    no_ts = pa.scalar(NO_TS, int64)

    def numbers(kind: Any, n: int, data: Any) -> Any:
        return pa.Array.from_buffers(kind, n, [None, pa.py_buffer(_native(data, kind))])

    def batch_of(columns: UpdateColumns) -> Any:
        n = columns.rows
        strings = {}
        for name, lengths, data in zip(COLUMN_STRINGS, columns.lengths, columns.data, strict=True):
            sizes = numbers(int32, n, lengths)
            offsets = pa.concat_arrays([zero, pc.cumulative_sum_checked(sizes)])
            # Absent row images are empty (a row's JSON never is): null in Spark.
            valid = pc.not_equal(sizes, 0).buffers()[1] if name in ("before", "after") else None
            strings[name] = pa.Array.from_buffers(
                string, n, [valid, offsets.buffers()[1], pa.py_buffer(data)]
            )
        ts_ms = numbers(int64, n, columns.ts_ms)
        ts_ms = pa.Array.from_buffers(
            int64, n, [pc.not_equal(ts_ms, no_ts).buffers()[1], ts_ms.buffers()[1]]
        )
        batch = pa.RecordBatch.from_arrays(
            [
                numbers(int64, n, columns.seq),
                pa.repeat(shard_value, n),
                strings["op"],
                strings["table"],
                strings["key"],
                strings["before"],
                strings["after"],
                strings["position"],
                strings["logical"],
                ts_ms,
                pa.repeat(datastore_value, n),
            ],
            schema=schema,
        )
        batch.validate(full=True)
        return batch

    for columns in chunks:
        if not columns.rows:
            continue
        try:
            batch = batch_of(columns)
        except (pa.ArrowInvalid, ValueError) as exc:
            raise ValueError(
                f"wormhole source: {where or f'flow {shard}'}: the columns received are not "
                f"valid ({exc}); the publisher sent a malformed columns frame"
            ) from None
        yield batch


def _native(data: Any, kind: Any) -> Any:
    """Little-endian numbers in this machine's order (Arrow's buffers are native)."""
    if sys.byteorder == "little":
        return data
    from array import array

    values = array("i" if kind.bit_width == 32 else "q")
    values.frombytes(data)
    values.byteswap()
    return values.tobytes()


def _chunked(pairs: Iterator[tuple[int, Any]], size: int = ARROW_ROWS) -> Iterator[UpdateColumns]:
    seqs: list[int] = []
    updates: list[Any] = []
    for seq, update in pairs:
        seqs.append(seq)
        updates.append(update)
        if len(seqs) >= size:
            yield columns_of(seqs, updates)
            seqs, updates = [], []
    if seqs:
        yield columns_of(seqs, updates)


def _arrow_schema() -> Any:
    import pyarrow as pa

    return pa.schema(
        [
            ("seq", pa.int64()),
            ("shard", pa.int32()),
            ("op", pa.string()),
            ("table", pa.string()),
            ("key", pa.string()),
            ("before", pa.string()),
            ("after", pa.string()),
            ("position", pa.string()),
            ("logical", pa.string()),
            ("ts_ms", pa.int64()),
            ("datastore", pa.string()),
        ]
    )


def _read_shard(partition: ShardRange) -> Iterator[Any]:
    from wormhole.plugins.engine import read_log_range

    shard = partition.shard
    application = getattr(partition, "application", "")
    updates = (
        (seq, u)
        for seq, u in read_log_range(partition.log_dir, partition.start, partition.end)
        # A backfill for another application is not this one's.
        if u.shard == shard and (not u.audience or u.audience == application)
    )
    return _arrow_batches(_chunked(updates), shard, getattr(partition, "datastore", ""))


def _read_flow(partition: FlowRange) -> Iterator[Any]:
    remote = _remote_log(
        partition.transport, partition.address, partition.application, partition.options
    )
    shard, start, end = partition.shard, partition.start, partition.end
    try:
        if isinstance(remote, ColumnarRemoteLog):
            chunks = remote.read_columns(shard, start, end)
        else:
            chunks = (columns_of(seqs, ups) for seqs, ups in remote.read(shard, start, end))
        where = f"publisher {partition.address}, flow {shard} of [{start}, {end})"
        yield from _arrow_batches(chunks, shard, partition.datastore, where)
    finally:
        remote.close()


def _remote_log(transport: str, address: str, application: str, options: dict[str, str]) -> Any:
    from wormhole.core.errors import ConfigError
    from wormhole.plugins.components import RemoteLogRequest
    from wormhole.plugins.manager import default_registry

    try:
        spec = default_registry().get("transport", transport, "option transport").spec
    except ConfigError as exc:
        raise ValueError(f"wormhole source: {exc}") from exc
    if spec.remote_log is None:
        raise ValueError(
            f"wormhole source: option transport: the {transport!r} transport cannot be read "
            f"from another machine; use tcp, or the file mode (option pipeline)"
        )
    return spec.remote_log(RemoteLogRequest(address, application, options))


def _read(partition: InputPartition) -> Iterator[Any]:
    if isinstance(partition, FlowRange):
        return _read_flow(partition)
    if not isinstance(partition, ShardRange):
        return iter(())  # nothing to read: a batch read with no ranges gets one of Spark's
    return _read_shard(partition)


def _limit(options: dict[str, str]) -> int | None:
    """Option ``maxUpdatesPerTrigger``: at most this many log positions a micro-batch."""
    limit = options.get("maxUpdatesPerTrigger", "")
    if limit and (not limit.isdigit() or int(limit) < 1):
        raise ValueError(
            f"wormhole source: option maxUpdatesPerTrigger: {limit!r} is not a positive number"
        )
    return int(limit) if limit else None


class _Flows:
    """The external application's datamarkers, through the pipeline's datamarker store."""

    def __init__(self, options: dict[str, str]) -> None:
        from wormhole.core.errors import ConfigError
        from wormhole.plugins.engine import load_pipeline

        path = options.get("pipeline", "")
        self.application = options.get("application", "")
        if not self.application:
            raise ValueError(
                'the wormhole source needs .option("application", NAME) naming an external '
                "application of the pipeline"
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
        self.state_dir = Path(options.get("stateDir") or pipeline.state_dir)
        self.log_dir = str(self.state_dir / "log")
        self.shards = pipeline.shards
        self.limit = _limit(options)

    def _store(self) -> Any:
        store = self.pipeline.datamarker_store.create()
        store.open(self.pipeline.name, self.state_dir)
        return store

    def stored(self) -> dict[str, int]:
        from wormhole.plugins.engine import log_range

        store = self._store()
        try:
            markers = store.load()
        finally:
            store.close()
        first, _ = log_range(self.log_dir)
        out = {}
        for shard in range(self.shards):
            marker = markers.get((self.application, shard))
            out[str(shard)] = marker.position if marker is not None else first
        return out

    def end(self) -> int:
        from wormhole.plugins.engine import log_range

        return log_range(self.log_dir)[1]

    def save(self, offsets: dict[str, int]) -> None:
        from wormhole.plugins.components import Datamarker

        store = self._store()
        try:
            store.save([Datamarker(self.application, int(s), int(p)) for s, p in offsets.items()])
        finally:
            store.close()

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[ShardRange]:
        return [
            ShardRange(
                self.log_dir,
                int(shard),
                int(start.get(shard, 0)),
                int(stop),
                self.pipeline.datastore,
                self.application,
            )
            for shard, stop in sorted(end.items(), key=lambda kv: int(kv[0]))
            if int(start.get(shard, 0)) < int(stop)
        ]


CONNECTION_OPTIONS = ("token", "tls.ca", "tls.serverName", "tls.cert", "tls.key", "timeoutMs")


class _NetworkFlows:
    """The external application's flows at its publishers, over the network.

    Built lazily: Spark also creates a reader to plan each batch and pickles it to the
    executors, so nothing here connects before it is asked to.
    """

    def __init__(self, options: dict[str, str]) -> None:
        self.application = options.get("application", "")
        if not self.application:
            raise ValueError(
                'the wormhole source needs .option("application", NAME) naming an external '
                "application of the pipeline"
            )
        self.publishers = [a.strip() for a in options.get("publishers", "").split(",") if a]
        self.registry_url = options.get("registry", "")
        self.dataset = options.get("dataset", "")
        if self.publishers and self.registry_url:
            raise ValueError("wormhole source: give option publishers or registry, not both")
        if self.registry_url and not self.dataset:
            raise ValueError(
                'wormhole source: option registry needs .option("dataset", NAME), the '
                "pipeline name its publishers registered under"
            )
        for address in self.publishers:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(
                    f"wormhole source: option publishers: {address!r} is not host:port"
                )
        self.transport = options.get("transport", "tcp")
        self.options = {k: options[k] for k in CONNECTION_OPTIONS if options.get(k)}
        self.limit = _limit(options)
        self.addresses: dict[str, str] = {}
        """Each datastore's publisher, as last seen (driver only)."""
        self.target: dict[str, int] | None = None
        """Trigger.AvailableNow: each datastore's log end when the query started."""
        self._registry: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_registry"] = None
        return state

    def _remote(self, address: str) -> Any:
        return _remote_log(self.transport, address, self.application, self.options)

    def _registered(self) -> list[str]:
        import threading

        from wormhole.core.errors import WormholeError
        from wormhole.plugins.engine import open_registry

        if self._registry is None:
            try:
                registry = open_registry(self.registry_url, self.dataset, threading.Event())
            except WormholeError as exc:
                raise ValueError(f"wormhole source: option registry: {exc}") from exc
            seen = threading.Event()
            entries: list[Any] = []

            def changed(live: list[Any]) -> None:
                entries[:] = live
                seen.set()

            registry.watch_publishers(changed)
            if not seen.wait(30):
                registry.close()
                raise ValueError(
                    f"wormhole source: option registry: no answer from {registry.describe()} "
                    f"about the publishers of {self.dataset}"
                )
            self._registry = (registry, entries)
        _, entries = self._registry
        addresses = [e.address for e in entries if e.address and not e.copy]
        if not addresses:
            raise ValueError(
                f"wormhole source: no publisher of dataset {self.dataset!r} is registered at "
                f"{self.registry_url} (or none has an address yet): start its publishers, or "
                f"check options registry and dataset"
            )
        return addresses

    def positions(self) -> dict[str, Any]:
        """Each datastore's log positions, and where its publisher is."""
        addresses = self._registered() if self.registry_url else self.publishers
        out: dict[str, Any] = {}
        for address in addresses:
            remote = self._remote(address)
            try:
                positions = remote.positions()
            finally:
                remote.close()
            datastore = positions.datastore or address
            if datastore in out:
                raise ValueError(
                    f"wormhole source: publishers {self.addresses[datastore]} and {address} "
                    f"both publish datastore {datastore!r}; give one publisher per datastore"
                )
            self.addresses[datastore] = address
            out[datastore] = positions
        return out

    def stored(self) -> dict[str, dict[str, int]]:
        return {ds: _stored(pos) for ds, pos in self.positions().items()}

    def prepare_available_now(self) -> None:
        """Trigger.AvailableNow: read up to the end of each log as it is now, no further."""
        self.target = {ds: pos.end for ds, pos in self.positions().items()}

    def latest(
        self, start: dict[str, dict[str, int]] | None, limit: int | None = None
    ) -> dict[str, dict[str, int]]:
        """The end of the next micro-batch: each flow up to the end of its log (or of the
        Trigger.AvailableNow target), at most ``limit`` positions past the lowest of its
        datastore's flows."""
        out: dict[str, dict[str, int]] = {}
        for datastore, pos in self.positions().items():
            base = (start or {}).get(datastore) or _stored(pos)
            end = pos.end
            if self.target is not None:
                end = min(end, self.target.get(datastore, 0))
            for cap in (limit, self.limit):
                if cap is not None:
                    end = min(end, min(int(v) for v in base.values()) + cap)
            out[datastore] = {shard: max(int(v), end) for shard, v in base.items()}
        # A datastore whose publisher is away keeps its offsets: nothing new from it.
        for datastore, flows in (start or {}).items():
            out.setdefault(datastore, dict(flows))
        return out

    def address(self, datastore: str) -> str | None:
        """Where ``datastore``'s publisher is. A reader that has not asked yet asks now: after
        a restart Spark may first replay a planned batch (``partitions``) or commit one,
        before it asks for any offset."""
        if datastore not in self.addresses:
            self.positions()
        return self.addresses.get(datastore)

    def partitions(
        self, start: dict[str, dict[str, int]], end: dict[str, dict[str, int]]
    ) -> list[FlowRange]:
        ranges = []
        for datastore, flows in sorted(end.items()):
            begin = start.get(datastore)
            if begin is None:
                begin = self.stored().get(datastore, {})
            address = self.address(datastore)
            for shard, stop in sorted(flows.items(), key=lambda kv: int(kv[0])):
                first = int(begin.get(shard, stop))
                if first >= int(stop):
                    continue
                if address is None:
                    raise ValueError(
                        f"wormhole source: no publisher of datastore {datastore!r} is reachable "
                        f"to read flow {shard} from {first} to {stop}"
                    )
                ranges.append(
                    FlowRange(
                        self.transport,
                        address,
                        self.application,
                        self.options,
                        datastore,
                        int(shard),
                        first,
                        int(stop),
                    )
                )
        return ranges

    def save(self, end: dict[str, dict[str, int]]) -> None:
        for datastore, flows in end.items():
            address = self.address(datastore)
            if address is None:
                continue  # committed again with a later batch, once it is back
            remote = self._remote(address)
            try:
                remote.commit({int(s): int(v) for s, v in flows.items()})
            finally:
                remote.close()

    def close(self) -> None:
        if self._registry is not None:
            self._registry[0].close()
            self._registry = None


def _stored(positions: Any) -> dict[str, int]:
    return {
        str(shard): positions.datamarkers.get(shard, positions.first)
        for shard in range(positions.shards)
    }


def _flows(options: dict[str, str]) -> _Flows | _NetworkFlows:
    if options.get("publishers") or options.get("registry"):
        if options.get("pipeline"):
            raise ValueError(
                "wormhole source: give option pipeline (file mode, on the publisher's machine) "
                "or publishers / registry (network mode), not both"
            )
        return _NetworkFlows(options)
    if not options.get("pipeline"):
        raise ValueError(
            'the wormhole source needs .option("publishers", "HOST:PORT,...") or '
            '.option("registry", URL) with .option("dataset", NAME) to read over the network, '
            'or .option("pipeline", PATH) to read the publisher log files on this machine; '
            'and .option("application", NAME) naming an external application'
        )
    return _Flows(options)


class WormholeStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: dict[str, str]) -> None:
        self.flows = _flows(options)
        self.target: int | None = None
        """File mode, Trigger.AvailableNow: the log's end when the query started."""

    def prepareForTriggerAvailableNow(self) -> None:
        if isinstance(self.flows, _NetworkFlows):
            self.flows.prepare_available_now()
        else:
            self.target = self.flows.end()

    def initialOffset(self) -> dict[str, Any]:
        return self.flows.stored()

    def latestOffset(
        self, start: dict[str, Any] | None = None, limit: Any = None
    ) -> dict[str, Any]:
        if isinstance(self.flows, _NetworkFlows):
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
        if isinstance(self.flows, _NetworkFlows):
            self.flows.close()


class WormholeBatchReader(DataSourceReader):
    """``spark.read.format("wormhole")``: the retained log from the application's
    datamarkers to its end (nothing is committed)."""

    def __init__(self, options: dict[str, str]) -> None:
        flows = _flows(options)
        if isinstance(flows, _NetworkFlows):
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
