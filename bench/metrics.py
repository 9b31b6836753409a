"""File log -> publisher log -> flows -> null sink, with metrics on against metrics off.

Run: ``python bench/metrics.py --updates 1000000``.

Both are measured in the same run on the same file, in alternating runs (off, on, off,
on, ...), so the ratio holds on a noisy, shared machine even when absolute rates drift:

* off: the pipeline without ``metrics``, as ``bench/filelog_throughput.py`` runs it;
* on: the same with ``metrics: {listen: 127.0.0.1:0}`` (per-flow series on), and a thread
  scraping ``/metrics`` every ``--scrape-interval`` seconds (default 1 s, far more often
  than Prometheus's default 15 s) for the whole run.

The median of each is reported, with the ratio on/off. The target: >= 0.95.
"""

from __future__ import annotations

import argparse
import gc
import json
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


def pipeline_rate(source: Path, state: Path, metrics: bool, scrape_interval: float) -> float:
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
            server = publisher.metrics_server
            if server is None:
                continue
            try:
                with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=5) as r:
                    r.read()
                scrapes[0] += 1
            except OSError:
                continue  # stopping

    scraper = threading.Thread(target=scrape, daemon=True)
    if metrics:
        scraper.start()
    gc.collect()
    started = time.perf_counter()
    summary = publisher.run()
    elapsed = time.perf_counter() - started
    done.set()
    if metrics:
        scraper.join()
        assert scrapes[0] > 0 or elapsed < scrape_interval * 2, "the endpoint was never scraped"
    for app in summary.applications.values():
        assert app.updates == summary.source_updates and app.lag == 0, app
    return summary.source_updates / elapsed


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
        for _ in range(args.repeat):
            for label, on in (("metrics off", False), ("metrics on", True)):
                rates[label].append(
                    pipeline_rate(jsonl.parent, work / "state", on, args.scrape_interval)
                )
        off = statistics.median(rates["metrics off"])
        on = statistics.median(rates["metrics on"])
        print(f"{'measure':<12}  {'updates/s':>12}  {'ratio to off':>12}")
        print(f"{'metrics off':<12}  {off:>12,.0f}  {1.0:>12.2f}")
        print(f"{'metrics on':<12}  {on:>12,.0f}  {on / off:>12.2f}")
        print(f"target: metrics on >= 0.95 of off: ratio {on / off:.3f}")
        if args.json:
            print(json.dumps({"off": off, "on": on, "ratio": on / off, "runs": rates}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
