"""File log -> publisher log -> TCP -> 2 subscriber processes, against in-process delivery.

Run: ``make bench`` (or ``python bench/tcp_delivery.py``).

* throughput: ``wormhole run --once`` semantics on a prewritten file log, one
  application with 2 subscribers and the null sink, once over TCP (2 subscriber
  processes on loopback) and once in-process (2 subscriber threads), same run,
  same file, the runs of the setups interleaved; the ratio is TCP / in-process;
* the same over TCP with ``on_error: {policy: dead_letter}`` and nothing rejected: the
  cost of checking the dead-letter log for every batch, as a ratio to the default policy;
* latency: a producer appends 10,000 updates/s (100 every 10 ms) to a LogWriter
  log while the publisher runs; 2 subscriber processes record, for every batch,
  the time from its append to the publisher log to their callback (one monotonic
  clock: same machine). p50/p99 are weighted by updates.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from wormhole.core.pipeline import parse_pipeline
from wormhole.core.publisher import Publisher, tune_gc
from wormhole.publish import LogWriter

HERE = Path(__file__).parent


def write_log(directory: Path, n: int) -> None:
    with LogWriter(directory, publisher_id="bench", batch_size=5000, fsync=False) as log:
        for i in range(n):
            rider = i % 5000
            log.publish(
                "rider_location",
                {"rider": rider},
                {"rider": rider, "seq": i // 5000, "lat": 12.97, "lon": 77.59},
                op="u",
            )


def pipeline_text(state: Path, source: Path, transport: str, app: str) -> str:
    return f"""
pipeline: bench
state_dir: {state}
source: {{type: filelog, path: {source}, poll_interval_ms: 5}}
transport: {transport}
applications:
  {app}
"""


def throughput(source: Path, state: Path, transport: str, on_error: str = "") -> float:
    shutil.rmtree(state, ignore_errors=True)
    app = 'sink: {type: "null"}, subscribers: 2' + (f", on_error: {on_error}" if on_error else "")
    text = pipeline_text(state, source, transport, "nulls: {" + app + "}")
    pipeline = parse_pipeline(text, str(state.parent / "bench.yml"), env={})
    (state.parent / "bench.yml").write_text(text)
    gc.collect()
    started = time.perf_counter()
    summary = Publisher(pipeline, once=True).run()
    elapsed = time.perf_counter() - started
    assert summary.applications["nulls"].lag == 0
    return summary.source_updates / elapsed


def latency(work: Path, seconds: float, rate: int) -> tuple[float, float, int]:
    source = work / "live"
    state = work / "live-state"
    shutil.rmtree(state, ignore_errors=True)
    (source / "gps").mkdir(parents=True)
    text = pipeline_text(
        state, source, '{type: tcp, listen: "127.0.0.1:0"}', "lat: {subscribers: 2}"
    )
    pipeline = parse_pipeline(text, "latency.yml", env={})
    publisher = Publisher(pipeline, local_subscribers=False)
    runner = threading.Thread(target=publisher.run, daemon=True)
    runner.start()
    address_file = state / "publisher.addr"
    while not address_file.exists():
        time.sleep(0.01)
    address = address_file.read_text().strip()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
    }
    subscribers = [
        subprocess.Popen(
            [sys.executable, str(HERE / "latency_subscriber.py"), "lat", address, str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    time.sleep(1.0)  # let both subscribers join before the measured load starts
    per_tick = rate // 100
    with LogWriter(source / "gps", publisher_id="gps", batch_size=per_tick) as log:
        tick = time.monotonic()
        end = tick + seconds
        i = 0
        while tick < end:
            for _ in range(per_tick):
                rider = i % 5000
                log.publish("rider_location", {"rider": rider}, {"rider": rider, "seq": i})
                i += 1
            log.flush()
            tick += 0.01
            time.sleep(max(0.0, tick - time.monotonic()))
    time.sleep(1.0)  # the last batches arrive
    samples: list[list[float]] = []
    for proc in subscribers:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        samples += json.loads(out)["samples"]
    publisher.request_stop()
    runner.join(30)
    weighted = sorted((lat, n) for lat, n in samples if n)
    total = sum(n for _, n in weighted)

    def percentile(q: float) -> float:
        target = q * total
        seen = 0
        for lat, n in weighted:
            seen += n
            if seen >= target:
                return lat
        return weighted[-1][0]

    return percentile(0.5), percentile(0.99), int(total)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    args = parser.parse_args()
    tune_gc()  # as `wormhole run`
    work = Path(tempfile.mkdtemp(prefix="wormhole-bench-tcp-"))
    try:
        source = work / "riders"
        write_log(source / "gps", args.updates)
        print(
            f"{args.updates:,} updates; one application, 2 subscribers, null sink; "
            f"median of {args.repeat} runs"
        )
        tcp_transport = '{type: tcp, listen: "127.0.0.1:0"}'
        setups = (
            ("in-process (2 subscriber threads)", "{type: inprocess}", ""),
            ("TCP loopback (2 subscriber processes)", tcp_transport, ""),
            ("TCP loopback, on_error dead_letter", tcp_transport, "{policy: dead_letter}"),
        )
        samples: dict[str, list[float]] = {label: [] for label, _, _ in setups}
        # Interleaved, so that a change in the machine's load spreads over every setup.
        for _ in range(args.repeat):
            for label, transport, on_error in setups:
                samples[label].append(throughput(source, work / "state", transport, on_error))
        rates = {label: statistics.median(values) for label, values in samples.items()}
        base = rates["in-process (2 subscriber threads)"]
        width = max(map(len, rates))
        print(f"{'delivery':<{width}}  {'updates/s':>12}  {'ratio':>6}")
        for label, rate in rates.items():
            print(f"{label:<{width}}  {rate:>12,.0f}  {rate / base:>6.2f}")
        dead_letter = rates["TCP loopback, on_error dead_letter"]
        print(
            f"on_error dead_letter (nothing rejected) / default retry, over TCP: "
            f"{dead_letter / rates['TCP loopback (2 subscriber processes)']:.2f}"
        )
        p50, p99, n = latency(work, args.latency_seconds, 10_000)
        print(
            f"latency, publisher-log append -> subscriber callback, 10,000 updates/s for "
            f"{args.latency_seconds:.0f}s ({n:,} updates): p50 {p50 * 1000:.2f} ms, "
            f"p99 {p99 * 1000:.2f} ms"
        )
        tcp = rates["TCP loopback (2 subscriber processes)"]
        print(
            f"targets: >= 200,000 updates/s over loopback ({tcp:,.0f}); p99 < 20 ms "
            f"({p99 * 1000:.2f} ms)"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
