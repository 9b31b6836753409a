"""Multiple-copy delivery: takeover time and duplicates when the serving copy is killed.

Run: ``python bench/multiple_copy.py`` (needs java and the Debian ``zookeeper`` package; the
bench starts the test helper's throwaway ZooKeeper server, ``tickTime`` 500 ms, so that a
``session_timeout_ms`` of 2,000 ms is granted as asked).

Two copies of datastore ``db1``: a writer process appends the same ``LogWriter`` stream
(publisher id ``orders``, ``--rate`` updates/s in steps of 10 ms) to two directories, and a
``wormhole publish`` process reads each (``copy: a`` and ``copy: b``, ``delivery.mode:
multiple-copy``, ``failback: manual``, ``registry.session_timeout_ms`` 2,000). One library
subscriber (an in-process ``wormhole.Subscriber`` given ``registry=`` and ``dataset=``)
records, for every batch its ``on_batch`` handler receives, the arrival time and each
update's shard and logical sequence number (the ``LogWriter`` seq, the same in both copies),
and the time of every shard notice.

Each failover: the serving copy's publisher is killed with SIGKILL while the writer runs. The
takeover time is measured at the subscriber: from the kill to the first update *newer than
anything the killed copy delivered* (a seq greater than every seq received before the
subscriber was assigned the flows again) reaching the handler from the other copy. The
killed copy is then started again as a standby (with ``failback: manual`` the application
stays where it is) and, once it reports itself ready (it has mapped the shared datamarkers),
it is the other copy that is killed next: the application goes back and forth.
Target: p99 < 5 s with a 2 s session timeout.

Per failover, the duplicates (updates the subscriber received again) against the bound of
docs/multiple-copy.md: the updates acknowledged since the last shared datamarker, at most
one ``delivery.datamarker_interval_ms`` of them plus what was in flight (``credits`` frames).
Printed: the duplicates; the updates delivered past the shared datamarkers the killed copy
left in ZooKeeper (what the bound counts, measured); the stated bound, rate x interval +
credits x the largest frame received before the kill; and their ratio. After the last
failover the writer stops and every seq written must have arrived (nothing lost).

The takeover is broken down with a watch of the bench on the serving claim's znode and the
new copy's log: the kill to the claim's node deleted (ZooKeeper expiring the killed copy's
session), to the new claim's node (the standby hearing of it and claiming), to the new
copy's "serves it" log line (reading the shared datamarkers and mapping them into its
publisher log), to the subscriber's notice of the flows, to the first newer update.
"""

from __future__ import annotations

import argparse
import contextlib
import json
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
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import wormhole
from wormhole.core.publisher import tune_gc
from wormhole.publish import LogWriter
from wormhole.testing.helpers import cli_command, write_pipeline
from wormhole.testing.zookeeper import ZooKeeperServer, start_zookeeper

HERE = Path(__file__).parent
ROOT = "/bench-mc"
DATASET = "shop"
DATASTORE = "db1"
APP = "search"
SHARDS = 8
KEYS = 1000
CREDITS = 8  # the library subscriber's default
STEP_S = 0.01  # the writer appends every 10 ms
SERVES = re.compile(
    r"^(\S+ \S+) INFO wormhole\.copies: application \S+: copy (\S+) of \S+ serves it from "
    r"epoch (\d+)"
)


# ------------------------------------------------------------------ writer process
def writer_main(directories: list[str], rate: int) -> int:
    """The writer process: ``rate`` updates/s to every directory (the same stream), until
    SIGTERM; prints the last seq written."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    writers = [LogWriter(d, publisher_id="orders", fsync=False) for d in directories]
    i = 0
    started = time.monotonic()
    step = 0
    try:
        while not stop.is_set():
            step += 1
            target = int(rate * step * STEP_S)
            for writer in writers:
                for n in range(i, target):
                    k = n % KEYS
                    writer.publish("orders", {"id": k}, {"id": k, "n": n}, op="u")
                writer.flush()
            i = target
            delay = started + step * STEP_S - time.monotonic()
            if delay > 0:
                stop.wait(delay)
    finally:
        last = [w.next_seq - 1 for w in writers]
        for writer in writers:
            writer.close()
    assert len(set(last)) == 1, last
    print(last[0], flush=True)
    return 0


# ------------------------------------------------------------------ deployment
@dataclass
class Copy:
    name: str
    pipeline: Path
    process: subprocess.Popen[bytes] | None = None
    logs: list[Path] = field(default_factory=list)


class Deployment:
    def __init__(self, work: Path, zk: ZooKeeperServer, args: argparse.Namespace) -> None:
        self.work = work
        self.zk = zk
        self.args = args
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        }
        self.copies: dict[str, Copy] = {}
        self.writer: subprocess.Popen[bytes] | None = None
        for name in "ab":
            source = work / f"src-{name}"
            source.mkdir()
            path = write_pipeline(
                work / f"copy-{name}.yml",
                {
                    "pipeline": DATASET,
                    "registry": {
                        "type": "zookeeper",
                        "hosts": zk.hosts,
                        "root": ROOT,
                        "session_timeout_ms": args.session_timeout_ms,
                    },
                    "datastore": DATASTORE,
                    "copy": name,
                    "state_dir": str(work / f"state-{name}"),
                    "dataset": {"shards": SHARDS},
                    "source": {"type": "filelog", "path": str(source), "poll_interval_ms": 5},
                    "transport": {"type": "tcp", "listen": "127.0.0.1:0"},
                    "delivery": {
                        "mode": "multiple-copy",
                        "datamarker_interval_ms": args.datamarker_interval_ms,
                    },
                    "applications": {
                        APP: {"subscribers": 1, "copies": ["a", "b"], "failback": "manual"}
                    },
                },
            )
            self.copies[name] = Copy(name, path)

    def start_writer(self) -> None:
        self.writer = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--writer",
                str(self.work / "src-a"),
                str(self.work / "src-b"),
                "--rate",
                str(self.args.rate),
            ],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )

    def stop_writer(self) -> int:
        """Stop the writer; the last seq it wrote."""
        assert self.writer is not None
        self.writer.send_signal(signal.SIGTERM)
        out, _ = self.writer.communicate(30)
        self.writer = None
        return int(out)

    def publish(self, name: str) -> None:
        copy = self.copies[name]
        log_path = self.work / f"publisher-{name}-{len(copy.logs) + 1}.log"
        copy.logs.append(log_path)
        with open(log_path, "wb") as stderr:
            copy.process = subprocess.Popen(
                cli_command("--log-level", "info", "publish", str(copy.pipeline), "-q"),
                cwd=self.work,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,  # stopped by the bench, after the subscriber's Ctrl-C
            )

    def kill(self, name: str) -> float:
        """SIGKILL the copy's publisher; when."""
        process = self.copies[name].process
        assert process is not None
        process.send_signal(signal.SIGKILL)
        killed = time.time()
        process.wait(10)
        self.copies[name].process = None
        return killed

    def check_alive(self) -> None:
        for copy in self.copies.values():
            if copy.process is not None and copy.process.poll() is not None:
                raise RuntimeError(
                    f"publisher of copy {copy.name} exited ({copy.process.returncode}); "
                    f"see {copy.logs[-1]}"
                )

    def stop(self) -> None:
        """Writer and publishers: SIGTERM, then SIGKILL after 30 s."""
        processes = [c.process for c in self.copies.values() if c.process is not None]
        if self.writer is not None:
            processes.append(self.writer)
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                print(f"pid {process.pid} ignored SIGTERM: killed", file=sys.stderr)
                process.kill()
                process.wait(10)
        for copy in self.copies.values():
            copy.process = None
        self.writer = None


# ------------------------------------------------------------------ observers
class Recording:
    """The library subscriber, in a thread of the bench: every batch's arrival time,
    shards and seqs; every shard notice's time."""

    def __init__(self, zk: ZooKeeperServer) -> None:
        self.sub = wormhole.Subscriber(
            app=APP, registry=f"zookeeper://{zk.hosts}{ROOT}", dataset=DATASET, credits=CREDITS
        )
        self.batches: list[tuple[float, list[int], list[int]]] = []
        self.notices: list[tuple[float, int, int]] = []
        self.sub.on_batch(self._batch)
        self.sub.on_shard_notice(self._notice)
        self.thread = threading.Thread(target=self._run, name="bench subscriber", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.sub.run()
        except BaseException as exc:
            self.error = exc

    def _batch(self, updates: list[Any]) -> None:
        now = time.time()
        seqs = [int(u.logical.rpartition(":")[2]) for u in updates]
        self.batches.append((now, [u.shard for u in updates], seqs))

    def _notice(self, assigned: list[Any], revoked: list[Any]) -> None:
        self.notices.append((time.time(), len(assigned), len(revoked)))

    def highest(self) -> int:
        return max(self.batches[-1][2]) if self.batches else 0

    def start(self) -> Recording:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.sub.stop()
        self.thread.join(30)


class Claims:
    """A watch of the bench on the serving claim's znode: when it was deleted and created."""

    def __init__(self, zk: ZooKeeperServer) -> None:
        self.client = zk.client()
        base = f"{ROOT}/datasets/{DATASET}"
        self.serving = f"{base}/serving/{DATASTORE}/{APP}"
        self.datamarkers = f"{base}/datamarkers/{DATASTORE}/{APP}"
        self.status = f"{base}/status"
        self.events: list[tuple[float, dict[str, Any] | None]] = []
        self.client.DataWatch(self.serving, self._changed)

    def _changed(self, data: bytes | None, stat: Any) -> None:
        now = time.time()
        self.events.append((now, json.loads(data) if data else None))

    def holder(self) -> str | None:
        from kazoo.exceptions import NoNodeError

        try:
            data, _ = self.client.get(self.serving)
        except NoNodeError:
            return None
        return str(json.loads(data)["copy"])

    def shared(self) -> dict[int, int]:
        """The shared datamarkers: shard -> the seq of the update each names."""
        data, _ = self.client.get(self.datamarkers)
        return {int(s): int(m["version"][-1]) for s, m in json.loads(data).items()}

    def ready(self, copy: str) -> bool:
        from kazoo.exceptions import NoNodeError

        try:
            data, _ = self.client.get(f"{self.status}/{DATASTORE}@{copy}")
        except NoNodeError:
            return False
        status = json.loads(data)
        return bool(status.get("copies", {}).get("copies_ready", {}).get(APP))

    def stop(self) -> None:
        self.client.stop()
        self.client.close()


# ------------------------------------------------------------------ analysis
@dataclass
class Failover:
    killed: str
    kill: float
    markers: dict[int, int]
    frame: int
    """The largest batch the subscriber received before the kill."""
    took_over: str = ""
    deleted: float = math.nan
    claimed: float = math.nan
    serves: float = math.nan
    assigned: float = math.nan
    first_new: float = math.nan
    highest_old: int = 0
    duplicates: int = 0
    past_markers: int = 0


def wait_for(what: str, condition: Any, timeout: float, checks: Any) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        checks()
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.02)


def log_time(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def serves_lines(paths: list[Path]) -> list[tuple[float, str, int]]:
    found = []
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            match = SERVES.match(line)
            if match:
                found.append((log_time(match[1]), match[2], int(match[3])))
    return sorted(found)


def analyse(
    failovers: list[Failover], sub: Recording, claims: Claims, logs: list[Path]
) -> tuple[int, set[int]]:
    """Fill in each failover's times and duplicates; (duplicates before any kill, seen)."""
    serves = serves_lines(logs)
    for f in failovers:
        after = [(t, c) for t, c in claims.events if t >= f.kill]
        f.deleted = next((t for t, c in after if c is None), math.nan)
        new = next(((t, c) for t, c in after if c is not None), None)
        if new is not None:
            f.claimed, f.took_over = new[0], new[1]["copy"]
            f.serves = next(
                (
                    t
                    for t, copy, epoch in serves
                    if copy == f.took_over and epoch == new[1]["epoch"]
                ),
                math.nan,
            )
        f.assigned = next((t for t, a, _ in sub.notices if t >= f.kill and a), math.nan)
    seen: set[int] = set()
    early = 0
    current: Failover | None = None
    index = 0
    for t, _shards, seqs in sub.batches:
        while index < len(failovers) and t >= failovers[index].assigned:
            current = failovers[index]
            current.highest_old = max(seen) if seen else 0
            # What the bound counts: delivered past the shared datamarkers left at the kill.
            current.past_markers = sum(1 for s in seen if s > current.markers.get(shard_of(s), 0))
            index += 1
        for seq in seqs:
            if seq in seen:
                if current is None:
                    early += 1
                else:
                    current.duplicates += 1
            else:
                seen.add(seq)
                if (
                    current is not None
                    and math.isnan(current.first_new)
                    and seq > current.highest_old
                ):
                    current.first_new = t
    return early, seen


SHARD_OF: dict[int, int] = {}


def shard_of(seq: int) -> int:
    return SHARD_OF.get(seq, -1)


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: of 10 samples, p50 is the 5th and p99 the 10th (the largest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# ------------------------------------------------------------------ the run
def run(deployment: Deployment, args: argparse.Namespace) -> None:
    zk = deployment.zk
    print(
        f"2 copies of {DATASTORE} (file logs, one LogWriter stream at {args.rate:,} updates/s), "
        f"{SHARDS} shards; registry session_timeout_ms {args.session_timeout_ms}, "
        f"delivery.datamarker_interval_ms {args.datamarker_interval_ms}, failback manual; "
        f"1 library subscriber (credits {CREDITS}); {args.failovers} failovers by SIGKILL",
        flush=True,
    )
    deployment.publish("a")
    deployment.publish("b")
    claims = Claims(zk)
    sub: Recording | None = None
    try:

        def checks() -> None:
            deployment.check_alive()
            if sub is not None and sub.error is not None:
                raise RuntimeError(f"the subscriber failed: {sub.error!r}")

        wait_for("copy a (preferred) to serve", lambda: claims.holder() == "a", 60, checks)
        sub = Recording(zk).start()
        wait_for("the subscriber's flows", lambda: len(sub.sub.assigned) == SHARDS, 60, checks)
        deployment.start_writer()
        failovers: list[Failover] = []
        serving = "a"
        wait_for("updates to flow", lambda: sub.highest() > args.rate, 60, checks)
        for n in range(args.failovers):
            standby = "b" if serving == "a" else "a"
            # Steady state: the standby ready, delivery live, then a while of it.
            wait_for(f"copy {standby} to be ready", lambda s=standby: claims.ready(s), 120, checks)
            time.sleep(args.steady_s)
            checks()
            frame = max((len(s) for _, s, _ in sub.batches[-2000:]), default=0)
            killed = deployment.kill(serving)
            time.sleep(0.2)  # anything the killed copy sent ZooKeeper is in by now
            markers = claims.shared()
            failovers.append(Failover(serving, killed, markers, frame))
            wait_for(
                f"copy {standby} to take over",
                lambda s=standby: claims.holder() == s,
                60,
                checks,
            )
            highest = sub.highest()
            wait_for("delivery past the kill", lambda h=highest: sub.highest() > h, 60, checks)
            took = sub.batches[-1][0] - killed
            print(f"  failover {n + 1}: {serving} killed, {standby} serves (~{took:.2f} s)")
            deployment.publish(serving)  # back as a standby
            serving = standby
        last = deployment.stop_writer()
        wait_for("every update written", lambda: sub.highest() >= last, 120, checks)
        time.sleep(0.5)
    finally:
        if sub is not None:
            sub.stop()
        claims_events = list(claims.events)
        claims.stop()
    claims.events = claims_events
    report(deployment, failovers, sub, claims, last, args)


def report(
    deployment: Deployment,
    failovers: list[Failover],
    sub: Recording,
    claims: Claims,
    last: int,
    args: argparse.Namespace,
) -> None:
    for _, shards, seqs in sub.batches:
        for shard, seq in zip(shards, seqs, strict=True):
            SHARD_OF.setdefault(seq, shard)
    logs = [p for c in deployment.copies.values() for p in c.logs]
    early, seen = analyse(failovers, sub, claims, logs)
    lost = last - len([s for s in seen if s <= last])
    delivered = sum(len(s) for _, _, s in sub.batches)
    print(
        f"{last:,} updates written, {delivered:,} received, {delivered - len(seen):,} "
        f"duplicates ({early} before the first kill), {lost} lost"
    )
    bound_rate = args.rate * args.datamarker_interval_ms / 1000
    print(
        "per failover (seconds from the kill; 'newer': the first update newer than anything "
        "the killed copy delivered):"
    )
    header = (
        f"  {'#':>2} {'from':>4} {'to':>3} {'expired':>8} {'claimed':>8} {'serves':>8} "
        f"{'notice':>8} {'newer':>8} {'dups':>6} {'past dm':>8} {'bound':>7} {'ratio':>6}"
    )
    print(header)
    ratios = []
    for i, f in enumerate(failovers, 1):
        bound = bound_rate + CREDITS * f.frame
        ratio = f.duplicates / bound
        ratios.append(ratio)
        print(
            f"  {i:>2} {f.killed:>4} {f.took_over:>3} {f.deleted - f.kill:>8.3f} "
            f"{f.claimed - f.kill:>8.3f} {f.serves - f.kill:>8.3f} {f.assigned - f.kill:>8.3f} "
            f"{f.first_new - f.kill:>8.3f} {f.duplicates:>6,} {f.past_markers:>8,} "
            f"{bound:>7,.0f} {ratio:>6.2f}"
        )
    takeovers = [f.first_new - f.kill for f in failovers]
    print(
        f"takeover time (kill -> first newer update at the subscriber), {len(takeovers)} "
        f"failovers: p50 {percentile(takeovers, 0.5):.3f} s, p99 "
        f"{percentile(takeovers, 0.99):.3f} s, min {min(takeovers):.3f} s, max "
        f"{max(takeovers):.3f} s"
    )
    stages = [
        ("session expiry (kill -> claim node deleted)", [f.deleted - f.kill for f in failovers]),
        ("claim (deleted -> new claim node)", [f.claimed - f.deleted for f in failovers]),
        ("mapping (claim -> 'serves it' log line)", [f.serves - f.claimed for f in failovers]),
        ("assignment (log line -> subscriber notice)", [f.assigned - f.serves for f in failovers]),
        ("delivery (notice -> first newer update)", [f.first_new - f.assigned for f in failovers]),
    ]
    print(f"  breakdown, seconds: {'':<34} {'p50':>7} {'max':>7}")
    for label, values in stages:
        print(f"  {label:<54} {statistics.median(values):>7.3f} {max(values):>7.3f}")
    for direction in ("ab", "ba"):
        values = [f.first_new - f.kill for f in failovers if f.killed + f.took_over == direction]
        if values:
            print(
                f"  {direction[0]} killed, {direction[1]} takes over ({len(values)}): median "
                f"{statistics.median(values):.3f} s, max {max(values):.3f} s"
            )
    print(
        f"duplicates: bound = rate x datamarker interval ({bound_rate:,.0f}) + credits "
        f"({CREDITS}) x the largest frame before the kill; 'past dm': updates received past "
        f"the shared datamarkers left at the kill (what the bound counts, measured); largest "
        f"ratio duplicates / bound {max(ratios):.2f}; duplicates > past dm in "
        f"{sum(f.duplicates > f.past_markers for f in failovers)} failovers"
    )
    print(f"target: p99 < 5 s ({percentile(takeovers, 0.99):.3f} s)")


def interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def zookeeper() -> Iterator[ZooKeeperServer]:
    servers = start_zookeeper()
    try:
        yield next(servers)
    finally:
        servers.close()  # stops the server and removes its directory


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--failovers", type=int, default=12)
    parser.add_argument("--rate", type=int, default=3000, help="updates/s written")
    parser.add_argument("--session-timeout-ms", type=int, default=2000)
    parser.add_argument("--datamarker-interval-ms", type=int, default=500)
    parser.add_argument(
        "--steady-s", type=float, default=3.0, help="delivery before each kill, once ready"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--writer", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.writer:
        return writer_main(args.writer, args.rate)
    tune_gc()  # as `wormhole subscribe`
    # The subscriber warns when a publisher goes; the bench reports what matters.
    logging.basicConfig(level=logging.ERROR)
    # SIGTERM unwinds like Ctrl-C: publishers and writer stopped, ZooKeeper stopped.
    signal.signal(signal.SIGTERM, interrupted)
    work = Path(tempfile.mkdtemp(prefix="wormhole-bench-mc-"))
    try:
        with zookeeper() as zk:
            deployment = Deployment(work, zk, args)
            try:
                run(deployment, args)
            finally:
                deployment.stop()
    except KeyboardInterrupt:
        print("interrupted; cleaned up", file=sys.stderr)
        return 130
    finally:
        if args.keep:
            print(f"work directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
