"""File log -> publisher log -> flows -> null sink, against the raw read+parse rate.

Run: ``make bench`` (or ``python bench/filelog_throughput.py --updates 1000000``).

Both figures are measured in the same run on the same file, so the ratio holds
on a noisy, shared machine even when absolute rates drift:

* raw: read the file in 1 MiB chunks, split lines and parse every line with
  msgspec (the fastest JSON parser for Python) -- what any reader must do;
* end to end: ``wormhole run --once`` semantics in-process: tail the file, shard
  every update, append + fsync batches to the publisher log, fan out through the
  lead caravan to every flow, deliver to a null sink, wait for every datamarker.

Each is repeated and the median reported.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from wormhole.core.pipeline import parse_pipeline
from wormhole.core.publisher import Publisher, tune_gc
from wormhole.publish import LogWriter

RIDERS = 5000


def rider_event(i: int) -> dict[str, object]:
    rider = i % RIDERS
    return {
        "table": "rider_location",
        "op": "u",
        "key": {"rider": rider},
        "after": {
            "rider": rider,
            "seq": i // RIDERS,
            "lat": 12.97 + (i % 997) * 1e-5,
            "lon": 77.59 - (i % 991) * 1e-5,
        },
        "ts_ms": 1_763_769_600_000 + i,
    }


def write_jsonl(path: Path, n: int) -> int:
    encode = msgspec.json.encode
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for start in range(0, n, 100_000):
            f.write(
                b"".join(
                    encode(rider_event(i)) + b"\n" for i in range(start, min(n, start + 100_000))
                )
            )
    return path.stat().st_size


def write_logwriter(directory: Path, n: int) -> None:
    with LogWriter(directory, publisher_id="bench", batch_size=5000, fsync=False) as log:
        for i in range(n):
            e = rider_event(i)
            log.publish("rider_location", e["key"], e["after"], op="u", ts_ms=e["ts_ms"])  # type: ignore[arg-type]


def raw_rate(path: Path) -> tuple[float, int]:
    decode = msgspec.json.Decoder().decode
    count = 0
    started = time.perf_counter()
    with open(path, "rb") as f:
        tail = b""
        while chunk := f.read(1 << 20):
            data = tail + chunk
            cut = data.rfind(b"\n") + 1
            tail = data[cut:]
            lines = data[:cut].split(b"\n")
            lines.pop()
            parsed = decode(b"[" + b",".join(lines) + b"]")
            count += len(parsed)
    elapsed = time.perf_counter() - started
    return count / elapsed, count


def pipeline_rate(source: Path, state: Path, apps: int) -> tuple[float, int]:
    applications = "\n".join(f'  app{i}: {{sink: {{type: "null"}}}}' for i in range(apps))
    text = f"""
pipeline: bench
state_dir: {state}
source: {{type: filelog, path: {source}}}
transport: {{type: inprocess}}
applications:
{applications}
"""
    shutil.rmtree(state, ignore_errors=True)
    pipeline = parse_pipeline(text, "bench.yml", env={})
    gc.collect()
    started = time.perf_counter()
    summary = Publisher(pipeline, once=True).run()
    elapsed = time.perf_counter() - started
    for app in summary.applications.values():
        assert app.updates == summary.source_updates and app.lag == 0, app
    return summary.source_updates / elapsed, summary.source_updates


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()
    tune_gc()  # as `wormhole run`
    work = Path(tempfile.mkdtemp(prefix="wormhole-bench-"))
    try:
        jsonl = work / "jsonl" / "riders" / "0001.jsonl"
        size = write_jsonl(jsonl, args.updates)
        write_logwriter(work / "logwriter" / "riders" / "gps", args.updates)
        print(
            f"{args.updates:,} rider updates, {size / args.updates:.0f} bytes each as JSON lines; "
            f"median of {args.repeat} runs"
        )
        results: dict[str, float] = {}
        raw = [raw_rate(jsonl)[0] for _ in range(args.repeat)]
        results["raw read+parse (msgspec)"] = median(raw)
        for label, source, apps in (
            ("end to end, JSON lines, 1 application", jsonl.parent, 1),
            ("end to end, JSON lines, 2 applications", jsonl.parent, 2),
            ("end to end, LogWriter log, 1 application", work / "logwriter" / "riders", 1),
        ):
            rates = [pipeline_rate(source, work / "state", apps)[0] for _ in range(args.repeat)]
            results[label] = median(rates)
        base = results["raw read+parse (msgspec)"]
        width = max(map(len, results))
        print(f"{'measure':<{width}}  {'updates/s':>12}  {'ratio to raw':>12}")
        for label, rate in results.items():
            print(f"{label:<{width}}  {rate:>12,.0f}  {rate / base:>12.2f}")
        target = results["end to end, JSON lines, 1 application"]
        print(
            f"target: >= 300,000 updates/s end to end and >= 0.3 of raw: "
            f"{target:,.0f} updates/s, ratio {target / base:.2f}"
        )
        if args.json:
            print(json.dumps(results))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
