"""``spark.readStream.format("wormhole")`` into Parquet on local[2]: the network mode
(tasks read their flow's range from the publisher over TCP) next to the file mode (tasks
read the publisher log files), in the same run, on the same log.

Run: ``python bench/spark_source.py --updates 400000``. Needs Java 17 and the ``spark``
extra.

A ``wormhole publish`` process (file-log source, ``tcp`` transport, one external
application) holds the log. Each measurement is one ``Trigger.AvailableNow`` query from
the application's start to the end of the log into an empty Parquet directory, with a new
checkpoint, timed from ``start()`` to its end (the SparkSession is started once, before).
The modes alternate, ``--repeat`` times each. Figures: rows per second; the ratio is
network / file (target: network >= 100,000 rows/s and >= 0.5 of file mode).
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from filelog_throughput import write_jsonl

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--updates", type=int, default=400_000)
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
    publisher = subprocess.Popen(cli_command("publish", str(pipeline), "-q"), cwd=root)
    remote = TcpRemoteLog(RemoteLogRequest(f"127.0.0.1:{port}", "lake"))
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if remote.positions().end >= args.updates:
                    break
            except RemoteLogError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the publisher did not log every update in 300 s")
            time.sleep(0.2)  # polling the publisher: nothing to wait on
        modes = {
            "file": {"pipeline": str(pipeline), "application": "lake"},
            "network": {"publishers": f"127.0.0.1:{port}", "application": "lake"},
        }
        rates: dict[str, list[float]] = {name: [] for name in modes}
        spark_gen = start_spark("local[2]")
        spark = next(spark_gen)
        register(spark)
        try:
            for n in range(args.repeat):
                for name, options in modes.items():
                    out, checkpoint = root / f"out-{name}-{n}", root / f"ck-{name}-{n}"
                    seconds = _query(spark, options, out, checkpoint)
                    rows = spark.read.parquet(str(out)).count()
                    if rows != args.updates:
                        raise SystemExit(f"{name}: {rows} rows, expected {args.updates}")
                    rates[name].append(rows / seconds)
                    print(f"  {name:8} run {n + 1}: {rows / seconds:>10,.0f} rows/s", flush=True)
                    shutil.rmtree(out)
                    shutil.rmtree(checkpoint)
        finally:
            spark_gen.close()
    finally:
        publisher.terminate()
        publisher.wait(60)
        shutil.rmtree(root, ignore_errors=True)
    file_rate = statistics.median(rates["file"])
    network_rate = statistics.median(rates["network"])
    print(
        f"\n{args.updates:,} updates, {args.shards} shards, local[2], {os.cpu_count()} cores"
        f"\n| mode | rows/s (median) | vs file |\n|---|---:|---:|"
        f"\n| file (tasks read the log files) | {file_rate:,.0f} | 1.00 |"
        f"\n| network (tasks read ranges over TCP) | {network_rate:,.0f} | "
        f"{network_rate / file_rate:.2f} |"
    )


if __name__ == "__main__":
    main()
