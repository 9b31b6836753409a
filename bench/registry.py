"""A dataset in several datastores, found through ZooKeeper: fan-in and start-up latency.

Run: ``python bench/registry.py`` (needs java and the Debian ``zookeeper`` package; the
bench starts a throwaway ZooKeeper server with the default ``tickTime`` of 2,000 ms).

* fan-in throughput: one library subscriber (an in-process ``wormhole.Subscriber`` given
  ``registry=`` and ``dataset=``, whose ``on_batch`` handler only counts) receives N
  updates from 4 publishers (4 datastores, each a ``wormhole publish`` process with a
  file-log source of N/4 updates), against the same N updates from 1 publisher, in the
  same run, alternating 1, 4, 1, 4, ...; medians. The updates are written beforehand and
  linked into the sources (a hard link) only once every publisher is registered and the
  subscriber holds every flow, so that no publisher's start-up overlaps another's
  delivery; the rate is taken at the subscriber from the end of the first batch to the end
  of the last. Target: 4 publishers >= 0.8 of 1.
* start-to-first-update latency: the subscriber runs (dataset already served by one
  publisher); a publisher of a new datastore, whose source already holds one update, is
  spawned (``subprocess.Popen`` of ``wormhole publish``); the time from the spawn to the
  subscriber's handler receiving that datastore's update, 20 times (each a new datastore,
  stopped with SIGTERM before the next), with the times to its node in ZooKeeper and to
  the subscriber's first flow of it on the way. Target: p99 < 2 s. For reference, the
  time to start and exit ``python -c "import wormhole.cli"`` and ``python -m wormhole.cli
  -h`` (there is no ``--version``).

``--no-at-start`` leaves out a second fan-in pair whose sources hold the updates when the
publishers start (so the first publisher's delivery overlaps the others' start-up).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

import wormhole
from wormhole.core.publisher import tune_gc
from wormhole.testing.helpers import cli_command, run_cli, write_pipeline
from wormhole.testing.zookeeper import ZooKeeperServer, start_zookeeper

HERE = Path(__file__).parent
ROOT = "/bench"
APP = "bench"
SHARDS = 16
HELPER_TICK_MS = 500  # wormhole.testing.zookeeper's tickTime
MODES = {False: "updates linked in once all flows are held", True: "sources full at start"}


@contextlib.contextmanager
def zookeeper(tick_ms: int) -> Iterator[ZooKeeperServer]:
    """The test helper's throwaway server, restarted with ``tickTime=tick_ms`` (and
    ZooKeeper's default minimum session timeout, 2 ticks) unless that is the helper's."""
    servers = start_zookeeper()
    server = next(servers)
    try:
        if tick_ms != HELPER_TICK_MS:
            cfg = server.directory / "zoo.cfg"
            text = re.sub(r"tickTime=\d+", f"tickTime={tick_ms}", cfg.read_text())
            server.stop()
            cfg.write_text(re.sub(r"minSessionTimeout=\d+\n", "", text))
            server.start()
        yield server
    finally:
        servers.close()  # stops the server and removes its directory


def write_updates(path: Path, first: int, n: int) -> None:
    """``n`` rider-location updates as JSON lines (about 117 bytes each)."""
    encode = msgspec.json.encode
    with open(path, "wb") as f:
        chunk: list[bytes] = []
        for i in range(first, first + n):
            rider = i % 5000
            chunk.append(
                encode(
                    {
                        "op": "u",
                        "table": "rider_location",
                        "key": {"rider": rider},
                        "after": {"rider": rider, "seq": i, "lat": 12.97, "lon": 77.59},
                    }
                )
                + b"\n"
            )
            if len(chunk) == 10_000:
                f.write(b"".join(chunk))
                chunk.clear()
        f.write(b"".join(chunk))


class Deployment:
    """The publisher processes of the bench, each stopped gracefully at the end."""

    def __init__(self, work: Path, zk: ZooKeeperServer) -> None:
        self.work = work
        self.zk = zk
        self.processes: list[subprocess.Popen[bytes]] = []
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        }

    def pipeline(self, dataset: str, datastore: str) -> tuple[Path, Path]:
        """A publisher's pipeline file and its (empty) source directory."""
        base = self.work / dataset / datastore
        source = base / "source"
        source.mkdir(parents=True)
        path = write_pipeline(
            base / "pipeline.yml",
            {
                "pipeline": dataset,
                "registry": {"type": "zookeeper", "hosts": self.zk.hosts, "root": ROOT},
                "datastore": datastore,
                "state_dir": str(base / "state"),
                "dataset": {"shards": SHARDS},
                "source": {"type": "filelog", "path": str(source), "poll_interval_ms": 5},
                "transport": {"type": "tcp", "listen": "127.0.0.1:0"},
                "applications": {APP: {"subscribers": 1}},
            },
        )
        return path, source

    def register_application(self, path: Path) -> None:
        """``wormhole apps add PIPELINE bench --from-file``: a library subscriber refuses to
        start while its application is not in the registry (``wormhole subscribe`` waits)."""
        result = run_cli("apps", "add", str(path), APP, "--from-file", env=self.env, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"wormhole apps add failed: {result}")

    def publish(self, path: Path) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            cli_command("--log-level", "warning", "publish", str(path), "-q"),
            cwd=path.parent,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(path.parent / "publisher.log", "wb"),  # noqa: SIM115
            start_new_session=True,  # stopped by the bench, after the subscriber's Ctrl-C
        )
        self.processes.append(process)
        return process

    def stop(self, processes: list[subprocess.Popen[bytes]] | None = None) -> None:
        """SIGTERM, then SIGKILL for a publisher still running after 30 s."""
        chosen = list(self.processes if processes is None else processes)
        for process in chosen:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in chosen:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                print(f"publisher pid {process.pid} ignored SIGTERM: killed", file=sys.stderr)
                process.kill()
                process.wait(10)
            if process.stderr is not None:
                process.stderr.close()
            self.processes.remove(process)


class Counting:
    """A registry subscriber in a thread of the bench: counts updates, notes times."""

    def __init__(self, zk: ZooKeeperServer, dataset: str, per_flow: bool = False) -> None:
        self.sub = wormhole.Subscriber(
            app=APP, registry=f"zookeeper://{zk.hosts}{ROOT}", dataset=dataset
        )
        self.lock = threading.Lock()
        self.count = 0
        self.first_batch = 0
        self.first = self.last = 0.0
        self.first_cpu = self.last_cpu = 0.0
        """CPU of the bench process (the subscriber: the main thread sleeps meanwhile)."""
        self.target = 0
        self.done = threading.Event()
        self.arrived: dict[str, float] = {}
        """With ``per_flow``: when each datastore's first update reached the handler."""
        self.assigned: dict[str, float] = {}
        """When the subscriber was first given a flow of each datastore."""
        self.sub.on_shard_notice(self._notice)
        if per_flow:
            self.sub.on_updates(self._first_of_datastore)
        else:
            self.sub.on_batch(self._count)
        self.thread = threading.Thread(target=self._run, name="bench subscriber", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.sub.run()
        except BaseException as exc:
            self.error = exc

    def _notice(self, assigned: list[Any], revoked: list[Any]) -> None:
        now = time.monotonic()
        with self.lock:
            for flow in assigned:
                if isinstance(flow, tuple):
                    self.assigned.setdefault(flow[0], now)

    def _count(self, updates: list[Any]) -> None:
        self.count += len(updates)
        now, cpu = time.perf_counter(), time.process_time()
        if not self.first:
            self.first, self.first_cpu = now, cpu
            self.first_batch = self.count
        self.last, self.last_cpu = now, cpu
        if self.count >= self.target:
            self.done.set()

    def _first_of_datastore(self, flow: Any, updates: list[Any]) -> None:
        now = time.monotonic()
        with self.lock:
            self.arrived.setdefault(flow.datastore, now)

    def flows(self) -> int:
        return len(self.sub.assigned)

    def expect(self, n: int) -> None:
        self.count = self.first_batch = 0
        self.first = self.last = 0.0
        self.target = n
        self.done.clear()

    def start(self) -> Counting:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.sub.stop()
        self.thread.join(30)


def wait_for(what: str, condition: Any, timeout: float, sub: Counting) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if sub.error is not None:
            raise RuntimeError(f"the subscriber failed: {sub.error!r}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.01)


def prepare(work: Path, n: int, publishers: int) -> dict[int, list[Path]]:
    """The fan-in's updates, written once: N in one file, and the same N in ``publishers``
    files (one per datastore); each run links them into its sources."""
    files: dict[int, list[Path]] = {}
    for k in sorted({1, publishers}):
        share = n // k
        files[k] = []
        for i in range(k):
            path = work / "updates" / f"{k}-{i + 1}.jsonl"
            path.parent.mkdir(exist_ok=True)
            write_updates(path, i * share, share if i < k - 1 else n - share * (k - 1))
            files[k].append(path)
    return files


def fan_in(
    deployment: Deployment, run: int, files: list[Path], n: int, at_start: bool
) -> tuple[float, float]:
    """Updates/s at one subscriber, and its CPU seconds per second, for N updates from
    ``len(files)`` datastores (one file each), linked into the sources once the subscriber
    holds every flow, or (``at_start``) before the publishers start."""
    dataset = f"fanin{run}"
    sources: list[Path] = []
    paths: list[Path] = []
    for i in range(len(files)):
        path, source = deployment.pipeline(dataset, f"db{i + 1}")
        paths.append(path)
        sources.append(source)
    deployment.register_application(paths[0])
    sub = Counting(deployment.zk, dataset).start()
    started: list[subprocess.Popen[bytes]] = []
    try:
        sub.expect(n)
        if at_start:
            for file, source in zip(files, sources, strict=True):
                os.link(file, source / "orders.jsonl")
        for path in paths:
            started.append(deployment.publish(path))
        if not at_start:
            wait_for(
                f"the subscriber to hold all {len(files) * SHARDS} flows",
                lambda: sub.flows() == len(files) * SHARDS,
                120,
                sub,
            )
            for file, source in zip(files, sources, strict=True):
                os.link(file, source / "orders.jsonl")  # the whole file appears at once
        while not sub.done.wait(0.2):
            for process in started:
                if process.poll() is not None:
                    raise RuntimeError(f"publisher pid {process.pid} exited: {process.returncode}")
            if sub.error is not None:
                raise RuntimeError(f"the subscriber failed: {sub.error!r}")
        assert sub.count == n, (sub.count, n)
        wall = sub.last - sub.first
        return (n - sub.first_batch) / wall, (sub.last_cpu - sub.first_cpu) / wall
    finally:
        sub.stop()
        deployment.stop(started)
        shutil.rmtree(deployment.work / dataset, ignore_errors=True)


def startup_latency(deployment: Deployment, repeat: int) -> dict[str, list[float]]:
    """Seconds from spawning a new datastore's publisher to its node in ZooKeeper, to the
    subscriber's first flow of it and to its first update at the handler."""
    dataset = "late"
    base, _ = deployment.pipeline(dataset, "base")
    deployment.register_application(base)
    base_publisher = deployment.publish(base)
    sub = Counting(deployment.zk, dataset, per_flow=True).start()
    samples: dict[str, list[float]] = {"registered": [], "assigned": [], "first update": []}
    registered: dict[str, float] = {}

    def publishers(children: list[str]) -> None:
        now = time.monotonic()
        for child in children:
            registered.setdefault(child, now)

    client = deployment.zk.client()
    try:
        client.ChildrenWatch(f"{ROOT}/datasets/{dataset}/publishers", publishers)
        wait_for("the subscriber to hold the base's flows", lambda: sub.flows() == SHARDS, 60, sub)
        for i in range(repeat):
            datastore = f"ds{i:02d}"
            path, source = deployment.pipeline(dataset, datastore)
            write_updates(source / "orders.jsonl", i, 1)
            spawned = time.monotonic()
            process = deployment.publish(path)
            wait_for(
                f"the first update of {datastore}",
                lambda name=datastore: name in sub.arrived,
                60,
                sub,
            )
            samples["registered"].append(registered[datastore] - spawned)
            samples["assigned"].append(sub.assigned[datastore] - spawned)
            samples["first update"].append(sub.arrived[datastore] - spawned)
            deployment.stop([process])
            shutil.rmtree(path.parent, ignore_errors=True)
    finally:
        client.stop()
        client.close()
        sub.stop()
        deployment.stop([base_publisher])
    return samples


def process_start(deployment: Deployment, args: list[str], repeat: int = 5) -> float:
    """Median wall time of ``python ARGS`` to exit."""
    times = []
    for _ in range(repeat):
        started = time.monotonic()
        subprocess.run(
            [sys.executable, *args], env=deployment.env, check=True, stdout=subprocess.DEVNULL
        )
        times.append(time.monotonic() - started)
    return statistics.median(times)


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: of 20 samples, p50 is the 10th and p99 the 20th (the largest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=2_000_000, help="N, per fan-in run")
    parser.add_argument("--publishers", type=int, default=4, help="datastores of the fan-in")
    parser.add_argument("--rounds", type=int, default=2, help="fan-in rounds (1, 4 each)")
    parser.add_argument(
        "--at-start",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the fan-in with the updates in the sources when the publishers start",
    )
    parser.add_argument("--latency-runs", type=int, default=20)
    parser.add_argument("--tick-ms", type=int, default=2000, help="ZooKeeper's tickTime")
    args = parser.parse_args()
    tune_gc()  # as `wormhole subscribe`
    # The latency runs stop publishers under a running subscriber, which says so (warning).
    logging.basicConfig(level=logging.ERROR)
    # SIGTERM unwinds like Ctrl-C: publishers stopped, ZooKeeper stopped, files removed.
    signal.signal(signal.SIGTERM, interrupted)
    work = Path(tempfile.mkdtemp(prefix="wormhole-bench-registry-"))
    try:
        with zookeeper(args.tick_ms) as zk:
            deployment = Deployment(work, zk)
            try:
                run_all(deployment, args)
            finally:
                deployment.stop()
    except KeyboardInterrupt:
        print("interrupted; cleaned up", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def run_all(deployment: Deployment, args: argparse.Namespace) -> None:
    k = args.publishers
    print(
        f"ZooKeeper tickTime {args.tick_ms} ms; {args.updates:,} updates per fan-in run, "
        f"{SHARDS} shards per datastore; 1 library subscriber (on_batch counts); "
        f"rounds alternate 1, {k} publishers; medians of {args.rounds}"
    )
    files = prepare(deployment.work, args.updates, k)
    modes = [False, True] if args.at_start else [False]
    rates: dict[tuple[bool, int], list[float]] = {}
    cpus: dict[tuple[bool, int], list[float]] = {}
    run = 0
    for _ in range(args.rounds):
        for at_start in modes:
            for publishers in (1, k):
                run += 1
                rate, cpu = fan_in(deployment, run, files[publishers], args.updates, at_start)
                rates.setdefault((at_start, publishers), []).append(rate)
                cpus.setdefault((at_start, publishers), []).append(cpu)
                print(
                    f"  run {run}: {publishers} publisher(s), {MODES[at_start]}: "
                    f"{rate:,.0f} updates/s, {args.updates / rate:.2f} s, "
                    f"subscriber CPU {cpu:.2f} s/s",
                    flush=True,
                )
    labels = {1: "1 publisher (1 datastore)", k: f"{k} publishers ({k} datastores)"}
    width = max(map(len, labels.values()))
    header = f"{'updates/s':>12}  {'ratio':>6}  {'subscriber CPU s/s':>18}"
    for at_start in modes:
        print(f"fan-in, {MODES[at_start]}:")
        print(f"{'':<{width}}  {header}")
        one = statistics.median(rates[at_start, 1])
        for publishers in (1, k):
            rate = statistics.median(rates[at_start, publishers])
            cpu = statistics.median(cpus[at_start, publishers])
            label = labels[publishers]
            print(f"{label:<{width}}  {rate:>12,.0f}  {rate / one:>6.2f}  {cpu:>18.2f}")
    one, many = statistics.median(rates[False, 1]), statistics.median(rates[False, k])
    print(f"target: {k} publishers >= 0.8 of 1 ({many / one:.2f})", flush=True)

    timings = startup_latency(deployment, args.latency_runs)
    version = process_start(deployment, ["-m", "wormhole.cli", "-h"])
    imports = process_start(deployment, ["-c", "import wormhole.cli"])
    bare = process_start(deployment, ["-c", "pass"])
    samples = timings["first update"]
    p99 = percentile(samples, 0.99)
    print(
        f"start of a new datastore's publisher, {len(samples)} times; seconds from "
        f"Popen(wormhole publish) to:"
    )
    print(f"  {'':<44}  {'p50':>6}  {'p99':>6}  {'min':>6}  {'max':>6}")
    for label, key in (
        ("its node in ZooKeeper (a watch of the bench)", "registered"),
        ("the subscriber's first flow of it (notice)", "assigned"),
        ("its first update at the subscriber's handler", "first update"),
    ):
        values = timings[key]
        print(
            f"  {label:<44}  {percentile(values, 0.5):>6.3f}  {percentile(values, 0.99):>6.3f}"
            f"  {min(values):>6.3f}  {max(values):>6.3f}"
        )
    print(
        f"for reference, process start-up to exit (median of 5): python -c pass {bare:.3f} s, "
        f'python -c "import wormhole.cli" {imports:.3f} s, '
        f"python -m wormhole.cli -h {version:.3f} s"
    )
    print(f"target: p99 < 2 s ({p99:.3f} s)")


if __name__ == "__main__":
    sys.exit(main())
