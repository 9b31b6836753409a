"""The ranges a Spark task reads: a flow's updates between two offsets, from the publisher log
files (file mode) or from the publisher over a transport (network mode), as Arrow batches."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from pyspark.sql.datasource import InputPartition

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
    remote, columnar = _remote_log(
        partition.transport, partition.address, partition.application, partition.options
    )
    shard, start, end = partition.shard, partition.start, partition.end
    try:
        if columnar:
            chunks = remote.read_columns(shard, start, end)
        else:
            chunks = (columns_of(seqs, ups) for seqs, ups in remote.read(shard, start, end))
        where = f"publisher {partition.address}, flow {shard} of [{start}, {end})"
        yield from _arrow_batches(chunks, shard, partition.datastore, where)
    finally:
        remote.close()


def _remote_log(
    transport: str, address: str, application: str, options: dict[str, str]
) -> tuple[Any, bool]:
    """The transport's remote log, and whether it reads a range a column at a time (its
    record's ``remote_columns``; a spec without a record: what the instance is)."""
    from wormhole.core.errors import ConfigError
    from wormhole.plugins.components import RemoteLogRequest, capabilities_of
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
    remote = spec.remote_log(RemoteLogRequest(address, application, options))
    if spec.capabilities is None:  # deprecated: a plugin written before the record
        return remote, isinstance(remote, ColumnarRemoteLog)
    return remote, capabilities_of(spec).remote_columns


def _read(partition: InputPartition) -> Iterator[Any]:
    if isinstance(partition, FlowRange):
        return _read_flow(partition)
    if not isinstance(partition, ShardRange):
        return iter(())  # nothing to read: a batch read with no ranges gets one of Spark's
    return _read_shard(partition)
