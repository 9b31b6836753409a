"""A Spark driver for tests: ``readStream.format("wormhole")`` over the network into
Parquet, on the cluster given by ``--master``.

    python spark_source_driver.py --master URL --publishers HOST:PORT --out DIR
        --checkpoint DIR [--available-now] [--trip PATH]

Without ``--available-now`` it runs micro-batches until killed. ``--trip PATH`` runs one
task that opens PATH on an executor and prints what happened (the guard's check).
"""

from __future__ import annotations

import argparse
import os
import sys

from pyspark.sql import SparkSession

from wormhole.connectors.spark import register


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

    register(spark)
    reader = (
        spark.readStream.format("wormhole")
        .option("publishers", args.publishers)
        .option("application", args.application)
        .option("token", args.token)
    )
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
