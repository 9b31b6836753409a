"""The quickstart demo: rider-location events through a file log.

``python -m wormhole.demo produce --out DIR`` plays a fleet of riders, each
sending its position once a second (simulated time, written as fast as the disk
allows), into a durable local log with :class:`wormhole.publish.LogWriter`.
Every event carries the rider's own sequence number, so per-rider order can be
checked downstream. ``python -m wormhole.demo show PIPELINE`` prints what the
two quickstart applications hold afterwards.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sqlite3
import sys
import time
from pathlib import Path

from wormhole.core.pipeline import load_pipeline
from wormhole.publish import LogWriter

BASE_TS_MS = 1_763_769_600_000  # a fixed epoch keeps runs comparable


def produce(out: str, riders: int, seconds: int, publisher_id: str, seed: int) -> int:
    """Write ``riders * seconds`` rider_location events; returns how many."""
    directory = Path(out)
    with LogWriter(directory, publisher_id=publisher_id, batch_size=5000) as log:
        start_second = _next_second(log.next_seq, riders)
        rng = random.Random(seed + start_second)
        # Riders start around Bengaluru and drift a few metres a second.
        positions = [
            [12.97 + rng.uniform(-0.1, 0.1), 77.59 + rng.uniform(-0.1, 0.1)] for _ in range(riders)
        ]
        headings = [rng.uniform(0, 2 * math.pi) for _ in range(riders)]
        for second in range(start_second, start_second + seconds):
            for rider in range(riders):
                headings[rider] += rng.uniform(-0.3, 0.3)
                pos = positions[rider]
                pos[0] += 0.00005 * math.cos(headings[rider])
                pos[1] += 0.00005 * math.sin(headings[rider])
                log.publish(
                    "rider_location",
                    key={"rider": rider},
                    after={
                        "rider": rider,
                        "seq": second,
                        "lat": round(pos[0], 6),
                        "lon": round(pos[1], 6),
                    },
                    op="c" if second == 0 else "u",
                    ts_ms=BASE_TS_MS + second * 1000 + rider % 1000,
                )
        log.flush()
    return riders * seconds


def _next_second(next_seq: int, riders: int) -> int:
    # A producer run continues the simulated clock of the previous one.
    return (next_seq - 1) // riders if riders else 0


def show(pipeline_path: str) -> None:
    pipeline = load_pipeline(pipeline_path)
    for app in pipeline.applications.values():
        if app.sink is None:
            continue
        options = app.sink.options
        if app.sink.type == "jsonl":
            path = Path(options.path.format(application=app.name, subscriber=0))
            lines = 0
            if path.exists():
                with open(path, "rb") as f:
                    lines = sum(1 for _ in f)
            print(f"  {app.name}: {lines:,} events kept in {path}")
        elif app.sink.type == "latest":
            path = Path(options.path.format(application=app.name))
            db = sqlite3.connect(path)
            (count,) = db.execute("SELECT count(*) FROM latest").fetchone()
            row = db.execute("SELECT row FROM latest ORDER BY key LIMIT 1").fetchone()
            db.close()
            sample = json.loads(row[0]) if row else None
            print(f"  {app.name}: latest position of {count:,} riders in {path}")
            if sample:
                print(
                    f"    rider {sample['rider']}: ({sample['lat']}, {sample['lon']}) "
                    f"after {sample['seq'] + 1} positions"
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wormhole.demo")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("produce", help="write rider-location events into a LogWriter log")
    p.add_argument("--out", required=True, help="the publisher's session directory")
    p.add_argument("--riders", type=int, default=5000)
    p.add_argument("--seconds", type=int, default=20)
    p.add_argument("--publisher-id", default="rider-gps")
    p.add_argument("--seed", type=int, default=7)
    s = sub.add_parser("show", help="what the quickstart applications hold")
    s.add_argument("pipeline")
    args = parser.parse_args(argv)
    if args.command == "produce":
        started = time.monotonic()
        n = produce(args.out, args.riders, args.seconds, args.publisher_id, args.seed)
        print(
            f"producer: {args.riders:,} riders x {args.seconds} s = {n:,} rider_location events "
            f"written to {args.out} in {time.monotonic() - started:.2f}s"
        )
    else:
        show(args.pipeline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
