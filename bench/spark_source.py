"""``spark.readStream.format("wormhole")`` into Parquet on local[2]: the network mode
(tasks read their flow's range from the publisher over TCP) next to the file mode (tasks
read the publisher log files), in the same run, on the same log.

Run: ``python bench/spark_source.py`` (``--updates 1000000`` by default). Needs Java 17 and
the ``spark`` extra.

A ``wormhole publish`` process (file-log source, ``tcp`` transport, one external
application) holds the log. Each measurement is one ``Trigger.AvailableNow`` query from
the application's start to the end of the log into an empty Parquet directory, with a new
checkpoint, timed from ``start()`` to its end (the SparkSession is started once, before).
After one warm-up run of each (not counted: the JVM's first queries run interpreted), the
modes alternate, ``--repeat`` times each; the publisher is restarted before each network
run, so that every one reads the log from disk with an empty range cache (a catch-up: the
first flow to reach a batch decodes it, the others take their part of it). Figures: rows per
second; the ratio is network / file (target: network >= 100,000 rows/s and >= 0.5 of file mode).

Three ceilings, measured in the same run with the same number of rows, partitions and row shape:
*stream*, a Python streaming source whose tasks yield prebuilt Arrow record batches, in the same
kind of query as the modes (``Trigger.AvailableNow`` into Parquet: the most any Python streaming
source can reach here); *memory*, the same source in a batch query (no streaming query to start,
no offsets to log); and *jvm*, the same rows made by Spark SQL with no Python at all, in a batch
query.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from filelog_throughput import write_jsonl
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)

from wormhole.connectors.spark import register
from wormhole.connectors.tcp.ranges import TcpRemoteLog
from wormhole.plugins.components import RemoteLogError, RemoteLogRequest
from wormhole.testing.helpers import cli_command, free_port, write_pipeline
from wormhole.testing.spark import start_spark


def _query(spark: Any, options: dict[str, str], out: Path, checkpoint: Path) -> float:
    reader = spark.readStream.format("wormhole")
    for key, value in options.items():
        reader = reader.option(key, value)
    started = time.perf_counter()
    (
        reader.load()
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
        .awaitTermination()
    )
    return time.perf_counter() - started


class _MemoryReader(DataSourceReader):
    def __init__(self, rows: int, partitions: int) -> None:
        self.rows = rows
        self.count = partitions

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(i) for i in range(self.count)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        import pyarrow as pa

        from wormhole.connectors.spark.ranges import _arrow_schema

        schema = _arrow_schema()
        n = self.rows // self.count
        after = '{"rider":%d,"lat":52.52,"lon":13.40,"seq":7,"ts_ms":1700000000000}'
        batches = []
        for start in range(0, n, 8192):
            m = min(8192, n - start)
            batches.append(
                pa.RecordBatch.from_arrays(
                    [
                        pa.array(range(start, start + m), pa.int64()),
                        pa.array([1] * m, pa.int32()),
                        pa.array(["u"] * m),
                        pa.array(["rider_location"] * m),
                        pa.array([f'{{"rider":{i}}}' for i in range(m)]),
                        pa.array([None] * m, pa.string()),
                        pa.array([after % i for i in range(m)]),
                        pa.array(["riders/riders.jsonl:1"] * m),
                        pa.array(["bench:1"] * m),
                        pa.array([0] * m, pa.int64()),
                        pa.array(["bench"] * m),
                    ],
                    schema=schema,
                )
            )
        yield from batches


class _MemoryStreamReader(DataSourceStreamReader):
    """The same prebuilt batches as one micro-batch of a streaming source."""

    def __init__(self, rows: int, partitions: int) -> None:
        self.batch = _MemoryReader(rows, partitions)

    def initialOffset(self) -> dict[str, int]:
        return {"batch": 0}

    def latestOffset(self, start: Any = None, limit: Any = None) -> dict[str, int]:
        return {"batch": 1}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
        return self.batch.partitions() if start["batch"] < end["batch"] else []

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return self.batch.read(partition)

    def commit(self, end: dict[str, int]) -> None:
        pass


class _MemorySource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "wormhole_bench_memory"

    def schema(self) -> str:
        from wormhole.connectors.spark.stream import SCHEMA

        return SCHEMA

    def reader(self, schema: Any) -> DataSourceReader:
        return _MemoryReader(int(self.options["rows"]), int(self.options["partitions"]))

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return _MemoryStreamReader(int(self.options["rows"]), int(self.options["partitions"]))


def _ceilings(spark: Any, rows: int, partitions: int, out: Path) -> dict[str, float]:
    spark.dataSource.register(_MemorySource)
    memory = (
        spark.read.format("wormhole_bench_memory")
        .option("rows", str(rows))
        .option("partitions", str(partitions))
        .load()
    )
    jvm = (
        spark.range(rows)
        .selectExpr(
            "id AS seq",
            "CAST(1 AS INT) AS shard",
            "'u' AS op",
            "'rider_location' AS table",
            "concat('{\"rider\":', id, '}') AS key",
            "CAST(NULL AS STRING) AS before",
            'concat(\'{"rider":\', id, \',"lat":52.52,"lon":13.40,"seq":7,'
            '"ts_ms":1700000000000}\') AS after',
            "'riders/riders.jsonl:1' AS position",
            "'bench:1' AS logical",
            "0L AS ts_ms",
            "'bench' AS datastore",
        )
        .repartition(partitions)
    )
    rates = {}
    for name, frame in (("memory", memory), ("jvm", jvm)):
        started = time.perf_counter()
        frame.write.mode("overwrite").parquet(str(out / name))
        rates[name] = rows / (time.perf_counter() - started)
        shutil.rmtree(out / name)
    # The same batches through a streaming query like the modes' (query start, offsets,
    # the file sink's commit), timed the same way.
    stream = (
        spark.readStream.format("wormhole_bench_memory")
        .option("rows", str(rows))
        .option("partitions", str(partitions))
        .load()
    )
    checkpoint = out / "stream-checkpoint"
    started = time.perf_counter()
    (
        stream.writeStream.format("parquet")
        .option("path", str(out / "stream"))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
        .awaitTermination()
    )
    rates["stream"] = rows / (time.perf_counter() - started)
    shutil.rmtree(out / "stream")
    shutil.rmtree(checkpoint)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--updates", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="wormhole-bench-spark-source-"))
    port = free_port()
    data = root / "data" / "riders.jsonl"
    write_jsonl(data, args.updates)
    pipeline = write_pipeline(
        root / "bench.yml",
        {
            "pipeline": "bench",
            "state_dir": str(root / "state"),
            "dataset": {"shards": args.shards},
            "source": {"type": "filelog", "path": str(data.parent)},
            "transport": {"type": "tcp", "listen": f"127.0.0.1:{port}"},
            "log": {"fsync": False},
            "applications": {"lake": {"external": True}},
        },
    )
    remote = TcpRemoteLog(RemoteLogRequest(f"127.0.0.1:{port}", "lake"))

    def start_publisher() -> subprocess.Popen[bytes]:
        process = subprocess.Popen(cli_command("publish", str(pipeline), "-q"), cwd=root)
        deadline = time.monotonic() + 300
        while True:
            try:
                if remote.positions().end >= args.updates:
                    return process
            except RemoteLogError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the publisher did not log every update in 300 s")
            time.sleep(0.2)  # polling the publisher: nothing to wait on

    publisher = start_publisher()
    try:
        modes = {
            "file": {"pipeline": str(pipeline), "application": "lake"},
            "network": {"publishers": f"127.0.0.1:{port}", "application": "lake"},
        }
        rates: dict[str, list[float]] = {name: [] for name in [*modes, "stream", "memory", "jvm"]}
        spark_gen = start_spark("local[2]")
        spark = next(spark_gen)
        register(spark)
        try:
            # Warm-up, not counted: the JVM's first queries run interpreted.
            for name, options in modes.items():
                out, checkpoint = root / f"warm-{name}", root / f"warm-ck-{name}"
                _query(spark, options, out, checkpoint)
                shutil.rmtree(out)
                shutil.rmtree(checkpoint)
            _ceilings(spark, args.updates, args.shards, root)
            for n in range(args.repeat):
                for name, options in modes.items():
                    if name == "network":
                        # A new publisher: nothing of the log in its memory or its range
                        # cache, so every run reads from disk, as a catch-up would.
                        publisher.terminate()
                        publisher.wait(60)
                        publisher = start_publisher()
                    out, checkpoint = root / f"out-{name}-{n}", root / f"ck-{name}-{n}"
                    seconds = _query(spark, options, out, checkpoint)
                    rows = spark.read.parquet(str(out)).count()
                    if rows != args.updates:
                        raise SystemExit(f"{name}: {rows} rows, expected {args.updates}")
                    rates[name].append(rows / seconds)
                    print(f"  {name:8} run {n + 1}: {rows / seconds:>10,.0f} rows/s", flush=True)
                    shutil.rmtree(out)
                    shutil.rmtree(checkpoint)
                for name, rate in _ceilings(spark, args.updates, args.shards, root).items():
                    rates[name].append(rate)
                    print(f"  {name:8} run {n + 1}: {rate:>10,.0f} rows/s (ceiling)", flush=True)
        finally:
            spark_gen.close()
    finally:
        publisher.terminate()
        publisher.wait(60)
        shutil.rmtree(root, ignore_errors=True)
    median = {name: statistics.median(values) for name, values in rates.items()}
    labels = {
        "file": "file (tasks read the log files)",
        "network": "network (tasks read ranges over TCP)",
        "stream": "ceiling: a Python streaming source of prebuilt Arrow batches",
        "memory": "ceiling: the same, a batch query",
        "jvm": "ceiling: the same rows from Spark SQL, no Python, a batch query",
    }
    print(
        f"\n{args.updates:,} updates, {args.shards} shards, local[2], {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}"
        f"\n| mode | rows/s (median) | vs file | vs streaming ceiling |\n|---|---:|---:|---:|"
    )
    for name, label in labels.items():
        print(
            f"| {label} | {median[name]:,.0f} | {median[name] / median['file']:.2f} | "
            f"{median[name] / median['stream']:.2f} |"
        )


if __name__ == "__main__":
    main()
