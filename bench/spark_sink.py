"""Updates into Parquet with the ``spark`` sink, and Spark's current-state refresh on local[2].

Run: ``make bench`` (or ``python bench/spark_sink.py --updates 1000000``).
Needs Java 17 (for Spark) and the ``spark`` extra.

Measured in the same run on the same updates (rider positions, 5,000 keys):

* raw: pyarrow writes the same columns to Parquet in batches of the same size,
  fsyncing each file -- the ceiling for appending from Python;
* sink: ``SparkSink.write`` on those batches (group by table and date, the
  per-key version, Parquet, fsync, rename);
* end to end: file log -> publisher log -> spark sink, ``wormhole run --once``
  semantics in-process (inprocess transport), current state off;
* refresh: Spark on local[2] builds the current-state table from every change
  file, the first time (rows of changes per second);
* refresh vs history: the same live rows (5,000 keys) after 1x, 5x and 10x the
  history (``--history`` changes), then the same new changes (``--new``) folded
  in by an incremental refresh, timed ``--repeat`` times (target: 10x costs at
  most 1.5x the 1x refresh).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).parent))
from filelog_throughput import write_jsonl

from wormhole.connectors.spark.sink import (
    SparkSink,
    SparkSinkOptions,
    _schema,
    refresh_current_state,
)
from wormhole.core.pipeline import parse_pipeline
from wormhole.core.publisher import Publisher
from wormhole.core.update import Update
from wormhole.plugins.components import SinkContext
from wormhole.testing.spark import start_spark

BATCH = 8192


def load_updates(path: Path) -> list[Update]:
    decoder = msgspec.json.Decoder(Update)
    updates = []
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            u = decoder.decode(line)
            u.connector, u.position = "filelog", f"rider-gps.jsonl:{i * 120}"
            u.logical, u.shard = u.position, i % 16
            updates.append(u)
    return updates


def raw_rate(updates: list[Update], out: Path) -> float:
    schema = _schema()
    started = time.perf_counter()
    for n, start in enumerate(range(0, len(updates), BATCH)):
        chunk = updates[start : start + BATCH]
        table = pa.Table.from_pydict(
            {
                "op": [u.op for u in chunk],
                "key": [msgspec.json.encode(u.key).decode() for u in chunk],
                "before": [None for _ in chunk],
                "after": [bytes(u.after).decode() for u in chunk],
                "shard": [u.shard for u in chunk],
                "position": [u.position for u in chunk],
                "logical": [u.logical for u in chunk],
                "ts_ms": [u.ts_ms for u in chunk],
                "version": [None for _ in chunk],
                "arrival": list(range(len(chunk))),
            },
            schema=schema,
        )
        with open(out / f"raw-{n}.parquet", "wb") as f:
            pq.write_table(table, f, compression="snappy")
            f.flush()
            os.fsync(f.fileno())
    return len(updates) / (time.perf_counter() - started)


def sink_rate(updates: list[Update], out: Path) -> float:
    sink = SparkSink(SparkSinkOptions(path=str(out), current_state=False))
    sink.open(SinkContext("bench", "lake", 0, 1, out, logging.getLogger("bench")))
    started = time.perf_counter()
    for start in range(0, len(updates), BATCH):
        sink.write(updates[start : start + BATCH])
    elapsed = time.perf_counter() - started
    sink.close()
    return len(updates) / elapsed


def end_to_end_rate(data: Path, work: Path, n: int) -> float:
    text = f"""
pipeline: bench
state_dir: {work / "state"}
source: {{type: filelog, path: {data}}}
transport: {{type: inprocess}}
applications:
  lake: {{sink: {{type: spark, path: "{work / "lake"}", current_state: false}}}}
"""
    pipeline = parse_pipeline(text, "bench.yml", env={})
    started = time.perf_counter()
    summary = Publisher(pipeline, once=True).run()
    elapsed = time.perf_counter() - started
    assert summary.source_updates == n, summary
    return n / elapsed


def history_refresh(
    spark: object, updates: list[Update], work: Path, history: int, new: int, repeat: int
) -> list[tuple[int, float, float]]:
    """Per history multiple: (changes in the history, the first refresh over all of them in
    seconds, the median incremental refresh of ``new`` changes in seconds)."""
    assert 10 * history + repeat * new <= len(updates), "--updates too small for --history"
    fresh = updates[10 * history :]  # the same new changes after each history
    out = []
    for multiple in (1, 5, 10):
        root = work / f"history-{multiple}"
        sink = SparkSink(SparkSinkOptions(path=str(root), current_state=False))
        sink.open(SinkContext("bench", "lake", 0, 1, root, logging.getLogger("bench")))
        for start in range(0, multiple * history, BATCH):
            sink.write(updates[start : min(start + BATCH, multiple * history)])
        started = time.perf_counter()
        refresh_current_state(spark, root)
        full = time.perf_counter() - started
        times = []
        for n in range(repeat):
            for start in range(n * new, (n + 1) * new, BATCH):
                sink.write(fresh[start : min(start + BATCH, (n + 1) * new)])
            started = time.perf_counter()
            refresh_current_state(spark, root)
            times.append(time.perf_counter() - started)
        sink.close()
        out.append((multiple * history, full, statistics.median(times)))
        print(
            f"  history x{multiple}: first refresh {full:.2f}s, incremental "
            f"{', '.join(f'{t:.2f}' for t in times)}s",
            file=sys.stderr,
        )
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--history", type=int, default=90_000, help="changes in the 1x history")
    parser.add_argument("--new", type=int, default=10_000, help="new changes per refresh")
    args = parser.parse_args()
    gc.freeze()
    work = Path(tempfile.mkdtemp(prefix="wormhole-bench-spark-"))
    try:
        data = work / "data" / "rider-gps"
        write_jsonl(data / "rider-gps.jsonl", args.updates)
        updates = load_updates(data / "rider-gps.jsonl")
        raws, sinks, ends = [], [], []
        for attempt in range(args.repeat):
            for d in ("raw", "sink", "e2e"):
                shutil.rmtree(work / d, ignore_errors=True)
                (work / d).mkdir()
            raws.append(raw_rate(updates, work / "raw"))
            sinks.append(sink_rate(updates, work / "sink"))
            ends.append(end_to_end_rate(data, work / "e2e", args.updates))
            print(
                f"  run {attempt + 1}: raw {raws[-1]:,.0f}  sink {sinks[-1]:,.0f}  "
                f"end to end {ends[-1]:,.0f}",
                file=sys.stderr,
            )
        spark_gen = start_spark("local[2]")
        spark = next(spark_gen)
        refreshes = []
        for _ in range(args.repeat):
            shutil.rmtree(work / "sink" / "current", ignore_errors=True)  # from every file
            started = time.perf_counter()
            refresh_current_state(spark, work / "sink")
            refreshes.append(args.updates / (time.perf_counter() - started))
        live = spark.read.parquet(str(work / "sink" / "current" / "rider_location")).count()
        refresh_current_state(spark, work / "sink")  # warm: the first x1 refresh is not slower
        histories = history_refresh(spark, updates, work, args.history, args.new, args.repeat)
        threading.Thread(target=lambda: next(spark_gen, None), daemon=True).start()
        raw, sink, end = (statistics.median(x) for x in (raws, sinks, ends))
        refresh = statistics.median(refreshes)
        print(f"{args.updates:,} updates, batches of {BATCH:,}, median of {args.repeat} runs")
        print(f"{'measure':<58}  {'rows/s':>10}  {'ratio':>6}")
        print(f"{'raw pyarrow Parquet append (fsync per file)':<58}  {raw:>10,.0f}  {1.0:>6.2f}")
        print(
            f"{'spark sink append (Parquet by table and date)':<58}  {sink:>10,.0f}  "
            f"{sink / raw:>6.2f}"
        )
        print(f"{'file log -> publisher log -> spark sink':<58}  {end:>10,.0f}  {end / raw:>6.2f}")
        print(f"{'Spark local[2] current-state refresh (changes read)':<58}  {refresh:>10,.0f}")
        print(f"current-state rows: {live:,}; target: >= 100,000 rows/s into Parquet")
        print()
        print(f"current-state refresh after more history, {args.new:,} new changes each time")
        print(f"{'history':>8}  {'changes':>10}  {'first (all)':>11}  {'incremental':>11}  ratio")
        base = histories[0][2]
        for multiple, (changes, full, incremental) in zip((1, 5, 10), histories, strict=True):
            print(
                f"{'x' + str(multiple):>8}  {changes:>10,}  {full:>10.2f}s  {incremental:>10.2f}s  "
                f"{incremental / base:>5.2f}"
            )
        print("target: the x10 incremental refresh at most 1.5 x the x1")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
