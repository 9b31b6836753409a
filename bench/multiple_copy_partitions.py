"""Multiple-copy delivery under real network partitions: time to serve again, against a pause.

Run (as root: the hosts are network namespaces): ``python bench/multiple_copy_partitions.py
[--trials N] [--seed S]``. Needs java and the Debian ``zookeeper`` package.

The deployment is the one of ``tests/test_multiple_copy_partitions.py``: copies ``a``
(preferred, ``failback: auto``) and ``b`` of datastore db1, two directories of one
``LogWriter`` stream, each read by a ``wormhole publish`` process on a host of its own;
ZooKeeper on host ``zk``; one ``wormhole subscribe`` process (jsonl sink) on host ``sub``;
``registry.session_timeout_ms`` 2,000, ``datamarker_interval_ms`` 200, heartbeat timeout
1,500 ms. The bench writes a round of every one of 20 keys every 50 ms throughout.

Faults, ``--trials`` of each kind in a seeded order, each held for the session timeout plus
0.5 to 2 s (seeded) while the writes go on:

- ``partition``: the serving copy's host is cut from every other host (its switch ports go
  down: packets are dropped in silence), then healed;
- ``zookeeper``: ZooKeeper's host is cut from every other host, then healed;
- ``unreached``: the subscribers' host is cut from the serving copy only, then healed;
- ``pause`` (the baseline, measured in the same run): the serving copy's publisher is
  stopped with SIGSTOP, then resumed with SIGCONT.

Measured, from the subscriber's output: *failover while cut* (the fault's start to the first
round written after it at every key: another copy serves), *healed → serving again* (the
fault's end to the first round written after it at every key), and *healed → failback* (the
fault's end to copy ``a`` holding the claim again with a round written after that at every
key). Printed: p50 / p99 / max per kind and measure, and each partition's ratio to the pause.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wormhole.publish import LogWriter
from wormhole.testing.helpers import cli_command, write_pipeline
from wormhole.testing.netns import Network, can_make_hosts, start_network
from wormhole.testing.zookeeper import start_zookeeper

KEYS = 20
SHARDS = 8
SESSION_MS = 2000
INTERVAL_MS = 200
ROOT = "/bench-mcp"
KINDS = ("partition", "zookeeper", "unreached", "pause")
BOUND_S = 60.0


class Bench:
    def __init__(self, work: Path, network: Network, zk: Any) -> None:
        self.work, self.network, self.zk = work, network, zk
        self.writers = [LogWriter(work / f"src-{c}", publisher_id="orders") for c in "ab"]
        self.out = work / "search.jsonl"
        self.rounds = 0
        self.lock = threading.Lock()
        self.highest: dict[int, int] = defaultdict(lambda: -1)
        self.offset, self.rest = 0, b""
        self.done = threading.Event()
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.files = {c: self.pipeline(c) for c in "ab"}
        self.client = zk.client()

    def pipeline(self, copy: str) -> Path:
        return write_pipeline(
            self.work / f"copy-{copy}.yml",
            {
                "pipeline": "shop",
                "registry": {
                    "type": "zookeeper",
                    "hosts": self.zk.hosts,
                    "root": ROOT,
                    "session_timeout_ms": SESSION_MS,
                },
                "datastore": "db1",
                "copy": copy,
                "state_dir": str(self.work / f"state-{copy}"),
                "dataset": {"shards": SHARDS},
                "source": {"type": "filelog", "path": str(self.work / f"src-{copy}")},
                "transport": {
                    "type": "tcp",
                    "listen": f"{self.network.address(copy)}:0",
                    "heartbeat_ms": 300,
                    "heartbeat_timeout_ms": 1500,
                },
                "delivery": {"mode": "multiple-copy", "datamarker_interval_ms": INTERVAL_MS},
                "applications": {
                    "search": {
                        "sink": {"type": "jsonl", "path": str(self.out)},
                        "copies": ["a", "b"],
                    }
                },
            },
        )

    def spawn(self, name: str, host: str, *args: str) -> None:
        log = open(self.work / f"{name}.log", "ab")  # noqa: SIM115 - the process owns it
        self.processes[name] = subprocess.Popen(
            self.network.command(host, cli_command(*args)),
            cwd=self.work,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        log.close()

    def write(self) -> None:
        while not self.done.is_set():
            with self.lock:
                n = self.rounds
                self.rounds += 1
            for writer in self.writers:
                for k in range(KEYS):
                    writer.publish("orders", key={"id": k}, after={"id": k, "n": n})
                writer.flush()
            self.done.wait(0.05)

    def lowest(self) -> int:
        if self.out.exists():
            with open(self.out, "rb") as f:
                f.seek(self.offset)
                data = self.rest + f.read()
            self.offset += len(data) - len(self.rest)
            *lines, self.rest = data.split(b"\n")
            for line in lines:
                e = json.loads(line)
                key = e["key"]["id"]
                self.highest[key] = max(self.highest[key], e["after"]["n"])
        return min((self.highest[k] for k in range(KEYS)), default=-1)

    def claim(self) -> str | None:
        try:
            data, _ = self.client.get(f"{ROOT}/datasets/shop/serving/db1/search")
        except Exception:
            return None
        return str(json.loads(data)["copy"])

    def ready(self, copy: str) -> bool:
        try:
            data, _ = self.client.get(f"{ROOT}/datasets/shop/status/db1@{copy}")
        except Exception:
            return False
        status = json.loads(data).get("copies", {})
        return bool(status.get("copies_ready", {}).get("search"))

    def wait(self, condition: Callable[[], bool], what: str, timeout: float = BOUND_S) -> float:
        started = time.monotonic()
        while not condition():
            if time.monotonic() - started > timeout:
                raise SystemExit(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.01)  # polling the subscriber's output and the registry
        return time.monotonic() - started

    def new_round(self, since: float) -> float:
        """Seconds from ``since`` until a round written after it reached every key."""
        with self.lock:
            first = self.rounds
        self.wait(lambda: self.lowest() >= first, f"round {first} at every key")
        return time.monotonic() - since

    def steady(self) -> None:
        self.wait(lambda: self.claim() == "a" and self.ready("b"), "a serving, b ready")
        self.new_round(time.monotonic())

    def start(self) -> None:
        self.spawn("a", "a", "publish", str(self.files["a"]), "-q")
        self.wait(lambda: self.claim() == "a", "copy a to serve")
        self.spawn("b", "b", "publish", str(self.files["b"]), "-q")
        self.spawn("sub", "sub", "subscribe", str(self.files["a"]), "--app", "search")
        threading.Thread(target=self.write, daemon=True).start()
        self.steady()

    def trial(self, kind: str, hold: float) -> dict[str, float]:
        network, took = self.network, {}
        started = time.monotonic()
        if kind == "partition":
            network.isolate("a")
        elif kind == "zookeeper":
            network.isolate("zk")
        elif kind == "unreached":
            network.cut("a", "sub")
        else:
            os.kill(self.processes["a"].pid, signal.SIGSTOP)
        try:
            if kind != "zookeeper":
                took["failover while cut"] = self.new_round(started)
            remaining = started + hold - time.monotonic()
            if remaining > 0:
                time.sleep(remaining)  # the fault holds this long
        finally:
            if kind == "pause":
                os.kill(self.processes["a"].pid, signal.SIGCONT)
            else:
                network.heal()
        ended = time.monotonic()
        took["healed → serving again"] = self.new_round(ended)
        self.wait(lambda: self.claim() == "a", "failback to a")
        took["healed → failback"] = self.new_round(ended)
        self.steady()
        return took

    def close(self) -> None:
        self.done.set()
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        for writer in self.writers:
            writer.close()
        self.client.stop()
        self.client.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=8, help="faults of each kind")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    ok, what = can_make_hosts()
    if not ok:
        print(f"skipped: this bench needs {what}", file=sys.stderr)
        return 0  # `make bench` goes on with the others
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    rng = random.Random(seed)
    kinds = [k for k in KINDS if k in args.kinds]
    order = [k for k in kinds for _ in range(args.trials)]
    rng.shuffle(order)
    holds = [SESSION_MS / 1000 + rng.uniform(0.5, 2.0) for _ in order]
    print(f"seed {seed}: {args.trials} faults of each kind ({', '.join(kinds)}), held "
          f"{SESSION_MS / 1000:.0f}s + 0.5..2s; session {SESSION_MS} ms, datamarker interval "
          f"{INTERVAL_MS} ms, heartbeat timeout 1500 ms")  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="wormhole-bench-mcp-"))
    network_gen = start_network(["zk", "a", "b", "sub"], control=["zk"])
    network = next(network_gen)
    zk_gen = start_zookeeper(network.address("zk"), network.command("zk", []))
    results: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    bench = None
    try:
        zk = next(zk_gen)
        bench = Bench(work, network, zk)
        bench.start()
        for n, (kind, hold) in enumerate(zip(order, holds, strict=True)):
            took = bench.trial(kind, hold)
            for measure, value in took.items():
                results[kind][measure].append(value)
            shown = ", ".join(f"{m} {v:.2f}s" for m, v in took.items())
            print(f"  {n + 1:>3} {kind:<10} held {hold:.1f}s: {shown}", flush=True)
    finally:
        if bench is not None:
            bench.close()
        zk_gen.close()
        network_gen.close()
        if args.keep:
            print(f"work directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'fault':<10} {'measure':<24} {'n':>3} {'p50 s':>7} {'p99 s':>7} {'max s':>7}"
          f" {'p50 / pause':>12}")  # fmt: skip
    for kind in kinds:
        for measure, values in results[kind].items():
            base = results["pause"].get(measure)
            ratio = (
                f"{statistics.median(values) / statistics.median(base):>11.2f}x"
                if base and kind != "pause"
                else f"{'(baseline)' if kind == 'pause' else '-':>12}"
            )
            print(
                f"{kind:<10} {measure:<24} {len(values):>3} {statistics.median(values):>7.2f} "
                f"{percentile(values, 0.99):>7.2f} {max(values):>7.2f} {ratio}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
