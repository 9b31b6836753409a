"""File log -> publisher log -> flows -> null sink, with metrics on against metrics off.

Run: ``python bench/metrics.py --updates 1000000``.

Both are measured in the same run on the same file, in alternating runs (off, on, on, off,
off, on, ...: the order swaps every round), so the ratio holds on a noisy, shared machine even
when absolute rates drift:

* off: the pipeline without ``metrics``, as ``bench/filelog_throughput.py`` runs it;
* on: the same with ``metrics: {listen: 127.0.0.1:0}`` (per-flow series on), and a thread
  scraping ``/metrics`` every ``--scrape-interval`` seconds (default 1 s, far more often
  than Prometheus's default 15 s) for the whole run.

The median of each is reported, with the ratio on/off, and the CPU time per update (every
thread of the process), which scheduling on a busy machine disturbs less. The target: >= 0.95.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from filelog_throughput import write_jsonl

from wormhole.core.pipeline import parse_pipeline
from wormhole.core.publisher import Publisher, tune_gc


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def pipeline_rate(
    source: Path, state: Path, metrics: bool, scrape_interval: float
) -> tuple[float, float]:
    """Updates per second (wall clock) and CPU microseconds per update (every thread)."""
    text = f"""
pipeline: bench
state_dir: {state}
source: {{type: filelog, path: {source}}}
transport: {{type: inprocess}}
applications:
  app0: {{sink: {{type: "null"}}}}
"""
    if metrics:
        text += 'metrics: {listen: "127.0.0.1:0"}\n'
    shutil.rmtree(state, ignore_errors=True)
    pipeline = parse_pipeline(text, "bench.yml", env={})
    publisher = Publisher(pipeline, once=True)
    done = threading.Event()
    scrapes = [0]

    def scrape() -> None:
        while not done.wait(scrape_interval):
            address = publisher.snapshot.metrics  # set once the endpoint serves
            if address is None:
                continue
            try:
                with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
                    r.read()
                scrapes[0] += 1
            except OSError:
                continue  # stopping

    scraper = threading.Thread(target=scrape, daemon=True)
    if metrics:
        scraper.start()
    gc.collect()
    started, cpu = time.perf_counter(), _cpu()
    summary = publisher.run()
    elapsed, cpu = time.perf_counter() - started, _cpu() - cpu
    done.set()
    if metrics:
        scraper.join()
        assert scrapes[0] > 0 or elapsed < scrape_interval * 2, "the endpoint was never scraped"
    for app in summary.applications.values():
        assert app.updates == summary.source_updates and app.lag == 0, app
    return summary.source_updates / elapsed, cpu / summary.source_updates * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5, help="runs of each, alternating")
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()
    tune_gc()  # as `wormhole run`
    work = Path(tempfile.mkdtemp(prefix="wormhole-bench-metrics-"))
    try:
        jsonl = work / "jsonl" / "riders" / "0001.jsonl"
        write_jsonl(jsonl, args.updates)
        print(
            f"{args.updates:,} rider updates, file log -> null sink, 1 application; "
            f"median of {args.repeat} alternating runs each; scraped every "
            f"{args.scrape_interval:g}s with metrics on"
        )
        rates: dict[str, list[float]] = {"metrics off": [], "metrics on": []}
        cpus: dict[str, list[float]] = {"metrics off": [], "metrics on": []}
        pair = [("metrics off", False), ("metrics on", True)]
        for round_ in range(args.repeat):
            # ABBA: each round swaps the order, so that whatever one run leaves behind for
            # the next (freed memory, the page cache) falls on both alike.
            for label, on in pair if round_ % 2 == 0 else pair[::-1]:
                rate, cpu = pipeline_rate(jsonl.parent, work / "state", on, args.scrape_interval)
                rates[label].append(rate)
                cpus[label].append(cpu)
        off, on = (statistics.median(rates[k]) for k in ("metrics off", "metrics on"))
        cpu_off, cpu_on = (statistics.median(cpus[k]) for k in ("metrics off", "metrics on"))
        print(f"{'measure':<12}  {'updates/s':>12}  {'ratio to off':>12}  {'CPU us/update':>13}")
        print(f"{'metrics off':<12}  {off:>12,.0f}  {1.0:>12.2f}  {cpu_off:>13.2f}")
        print(f"{'metrics on':<12}  {on:>12,.0f}  {on / off:>12.2f}  {cpu_on:>13.2f}")
        print(
            f"target: metrics on >= 0.95 of off: ratio {on / off:.3f} "
            f"(CPU per update: off/on {cpu_off / cpu_on:.3f})"
        )
        if args.json:
            print(
                json.dumps({"off": off, "on": on, "ratio": on / off, "runs": rates, "cpu_us": cpus})
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
