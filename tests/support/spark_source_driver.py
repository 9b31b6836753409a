"""A Spark driver for tests: ``readStream.format("wormhole")`` over the network into
Parquet, on the cluster given by ``--master``.

    python spark_source_driver.py --master URL --publishers HOST:PORT --out DIR
        --checkpoint DIR [--available-now] [--trip PATH]

Without ``--available-now`` it runs micro-batches until killed. ``--trip PATH`` runs one
task that opens PATH on an executor and prints what happened (the guard's check).
``--pipeline PATH`` reads in the file mode instead of from ``--publishers``.

``--pause-at POINT --pause-file PATH`` holds the query at one moment so that a test can kill
the driver there for real: ``initial`` (asked for its first offset: nothing planned yet),
``plan`` (a batch planned, its offsets written, no task started), ``read`` (a task of a batch
is reading), ``commit`` (a batch committed to the checkpoint; Spark is handing its end to the
source). The driver writes PATH when it gets there and waits to be killed. ``plan`` and
``commit`` hold at their ``--pause-call``-th call, so that earlier batches complete first;
``read`` holds in the first task that reaches it, on whichever executor.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from pyspark.sql import SparkSession

from wormhole.connectors.spark import register
from wormhole.connectors.spark.stream import WormholeDataSource, WormholeStreamReader, _Options

HOLD_S = 300
"""How long a held query waits to be killed before it gives up (a test that never kills)."""


def _hold(path: str) -> None:
    """Say we got here (once, whichever process is first), then wait to be killed."""
    import threading

    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return  # another task holds the batch already: this one runs on
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    threading.Event().wait(HOLD_S)
    raise RuntimeError(f"held at {path} for {HOLD_S}s and never killed")


def pausing_source(point: str, path: str, call: int) -> type[WormholeDataSource]:
    """The ``wormhole`` format with the pause of ``--pause-at`` (the reader is the real one)."""
    calls = {"n": 0}

    def due(at: str) -> bool:
        if at != point:
            return False
        calls["n"] += 1
        return calls["n"] == call

    class Reader(WormholeStreamReader):
        def initialOffset(self) -> Any:
            if due("initial"):
                _hold(path)
            return super().initialOffset()

        def partitions(self, start: Any, end: Any) -> Any:
            if due("plan"):
                _hold(path)
            return super().partitions(start, end)

        def read(self, partition: Any) -> Any:
            if point == "read":
                _hold(path)
            return super().read(partition)

        def commit(self, end: Any) -> None:
            if due("commit"):
                _hold(path)
            super().commit(end)

    class Source(WormholeDataSource):
        def streamReader(self, schema: Any) -> Any:
            return Reader(_Options(self.options))

    return Source


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", required=True)
    parser.add_argument("--publishers", default="")
    parser.add_argument("--application", default="lake")
    parser.add_argument("--token", default="")
    parser.add_argument("--out", default="")
    parser.add_argument("--checkpoint", default="")
    parser.add_argument("--max-updates", default="")
    parser.add_argument("--available-now", action="store_true")
    parser.add_argument("--trip", default="")
    parser.add_argument("--pipeline", default="")
    parser.add_argument("--pause-at", choices=["initial", "plan", "read", "commit"])
    parser.add_argument("--pause-file", default="")
    parser.add_argument("--pause-call", type=int, default=1)
    args = parser.parse_args()

    builder = (
        SparkSession.builder.master(args.master)
        .appName("wormhole-source-test")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.executor.memory", "512m")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.task.maxFailures", "8")
        # A short-lived JVM: the first JIT tier only starts it in about 0.6 of the time.
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
    )
    # The executors' Python workers load the guard (tests/guard/sitecustomize.py).
    for name in ("PYTHONPATH", "WORMHOLE_GUARD_DIR", "WORMHOLE_GUARD_LOG"):
        if os.environ.get(name):
            builder = builder.config(f"spark.executorEnv.{name}", os.environ[name])
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    if args.trip:
        path = args.trip

        def touch(_: object) -> str:
            try:
                with open(path, "rb"):
                    return "opened"
            except PermissionError as exc:
                return f"refused: {exc}"

        print(spark.sparkContext.parallelize([0], 1).map(touch).collect()[0], flush=True)
        spark.stop()
        return 0

    if args.pause_at:
        spark.dataSource.register(pausing_source(args.pause_at, args.pause_file, args.pause_call))
    else:
        register(spark)
    reader = spark.readStream.format("wormhole").option("application", args.application)
    if args.pipeline:
        reader = reader.option("pipeline", args.pipeline)
    else:
        reader = reader.option("publishers", args.publishers).option("token", args.token)
    if args.max_updates:
        reader = reader.option("maxUpdatesPerTrigger", args.max_updates)
    writer = (
        reader.load()
        .writeStream.format("parquet")
        .option("path", args.out)
        .option("checkpointLocation", args.checkpoint)
    )
    if args.available_now:
        writer.trigger(availableNow=True).start().awaitTermination()
    else:
        writer.trigger(processingTime="200 milliseconds").start().awaitTermination()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
