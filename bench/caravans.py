"""1, 10 and 50 applications on one dataset: per-application throughput, publisher-log
bytes read from disk, and CPU seconds.

Run: ``make bench`` (or ``python bench/caravans.py --updates 500000``).

Two cases, each in-process (inprocess transport, null sinks), ``wormhole run --once``:

* at the tail: the applications receive the updates as the source is read; one lead
  caravan serves them all from the publisher log's memory tail;
* catching up: the log already holds the updates and the applications start at
  ``earliest`` with a small tail cache, so the caravans read the log from disk
  (``max_caravans`` 1 and the default 8).

CPU is the process's user + system time for the run (publisher, caravans and
subscribers are threads of one process). The target: 10 applications at the tail
cost less than 2x the CPU of one.
"""

from __future__ import annotations

import argparse
import gc
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from filelog_throughput import write_jsonl

from wormhole.core.pipeline import parse_pipeline
from wormhole.core.publisher import Publisher


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _pipeline(work: Path, data: Path, apps: int, **delivery: Any) -> Any:
    applications = "\n".join(f"  app{i}: {{sink: {{type: 'null'}}}}" for i in range(apps))
    extra = "".join(f"\n  {k}: {v}" for k, v in delivery.items())
    text = f"""
pipeline: caravans
state_dir: {work / "state"}
source: {{type: filelog, path: {data}}}
transport: {{type: inprocess}}
log: {{tail_updates: 4096}}
delivery:
  datamarker_interval_ms: 1000{extra}
applications:
{applications}
"""
    return parse_pipeline(text, "bench.yml", env={})


def run(work: Path, data: Path, apps: int, prefill: bool, **delivery: Any) -> dict[str, float]:
    shutil.rmtree(work / "state", ignore_errors=True)
    if prefill:
        Publisher(_pipeline(work, data, 1), once=True).run()
    if prefill:
        # app0 filled the log; the measured applications are new, at earliest.
        pipeline = _pipeline(work, data, apps + 1, **delivery)
        pipeline.applications.pop("app0")
    else:
        pipeline = _pipeline(work, data, apps, **delivery)
    gc.collect()
    cpu, wall = _cpu(), time.perf_counter()
    summary = Publisher(pipeline, once=True).run()
    wall, cpu = time.perf_counter() - wall, _cpu() - cpu
    delivered = sum(a.updates for a in summary.applications.values())
    return {
        "wall": wall,
        "cpu": cpu,
        "bytes_read": summary.log_bytes_read,
        "per_app": delivered / max(1, len(summary.applications)) / wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=300_000)
    args = parser.parse_args()
    gc.freeze()
    work = Path(tempfile.mkdtemp(prefix="wormhole-bench-caravans-"))
    try:
        data = work / "data" / "rider-gps"
        write_jsonl(data / "rider-gps.jsonl", args.updates)
        log_bytes = None
        rows = []
        for apps in (1, 10, 50):
            tail = run(work, data, apps, prefill=False)
            if log_bytes is None:
                log_bytes = sum(p.stat().st_size for p in (work / "state" / "log").glob("log.*"))
            rows.append(("at the tail", apps, "8", tail))
            for cap in (1, 8):
                rows.append(
                    ("catching up", apps, str(cap), run(work, data, apps, True, max_caravans=cap))
                )
        assert log_bytes is not None
        base = rows[0][3]["cpu"]
        print(f"{args.updates:,} updates, null sinks, in-process; log {log_bytes:,} bytes")
        print(
            f"{'case':<12} {'apps':>5} {'max car.':>8} {'per app/s':>11} {'log read (x)':>13} "
            f"{'CPU s':>7} {'CPU vs 1 app':>12}"
        )
        for case, apps, cap, r in rows:
            print(
                f"{case:<12} {apps:>5} {cap:>8} {r['per_app']:>11,.0f} "
                f"{r['bytes_read'] / log_bytes:>13.2f} {r['cpu']:>7.2f} {r['cpu'] / base:>12.2f}"
            )
        ten = next(r for c, a, _, r in rows if c == "at the tail" and a == 10)
        print(f"target: 10 applications at the tail < 2x the CPU of one ({ten['cpu'] / base:.2f})")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
