"""Multiple-copy delivery under a seeded loop of faults: liveness after each, safety at the end.

Two file-log copies of datastore db1 (``a`` preferred, ``b``) with a ZooKeeper server of
their own, two subscriber processes of application ``search``, and a writer that keeps
writing rounds of every key into both copies' streams throughout. The faults, drawn by a
seeded RNG: kill -9 of the serving copy, SIGSTOP of it past its session then SIGCONT, a
graceful restart of it, a restart of it in a quiet period (writes paused until the shared
datamarkers reached the last update), both copies restarted, ZooKeeper restarted, ZooKeeper
restarted during a hand-over (an ``apps move`` to the other copy, ZooKeeper stopped 0 to
0.6 s later), and ``wormhole apps move`` to the other copy (which, with ``failback: auto``,
hands the application back to the preferred copy once it has moved). After
each fault ends, a round written after that moment must reach every key within
:data:`LIVENESS_S` (a copy serves and its subscribers receive new updates); at the end
every update must have arrived, in per-key order, with duplicates only after the shared
datamarker taken just before the fault that precedes them; and the shared datamarkers, watched
throughout, never went back (no shard's epoch or version ever lower than one seen before it:
nothing was written under a stale claim).

In the file-log loop each copy's publisher, ZooKeeper and the subscribers run on hosts of
their own (network namespaces, :func:`wormhole.testing.plugin.netns_hosts`), and network
partitions join the faults: the serving copy cut from every host, from ZooKeeper only, the
subscribers cut from the serving copy only, and ZooKeeper cut from every host, each held past
the session timeout and healed. The MariaDB loop runs on the machine's own network (its
servers listen on loopback) with signals and restarts only.

Replay a seed: ``WORMHOLE_CHAOS_SEED=N pytest tests/test_multiple_copy_faults.py -s``; a
longer run: ``make soak`` (``WORMHOLE_COPIES_FAULTS``, the number of faults).
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_multiple_copy import INTERVAL_MS, SESSION_MS, Copies, check, shared_epochs, version

from wormhole.testing import wait_until

KEYS = 20
ROUND_GAP_S = 0.05  # the writer's pause between rounds: about 400 updates/s
FAULTS = int(os.environ.get("WORMHOLE_COPIES_FAULTS") or 8)

KILL = "kill -9 of the serving copy"
PAUSE = "SIGSTOP of the serving copy past its session, then SIGCONT"
RESTART = "graceful restart of the serving copy"
QUIET = "restart of the serving copy in a quiet period"
BOTH = "both copies restarted"
ZOOKEEPER = "ZooKeeper restarted"
HANDOVER = "ZooKeeper restarted during a hand-over"
MOVE = "`wormhole apps move` of the application to the other copy"
KINDS = [KILL, PAUSE, RESTART, QUIET, BOTH, ZOOKEEPER, HANDOVER, MOVE]
CUT_OFF = "the serving copy's host cut from every host, then healed"
CUT_ZK = "the serving copy's host cut from ZooKeeper's only, then healed"
UNREACHED = "the subscribers' host cut from the serving copy's only, then healed"
ZK_CUT = "ZooKeeper's host cut from every host, then healed"
PARTITIONS = [CUT_OFF, CUT_ZK, UNREACHED, ZK_CUT]
"""Faults of a loop whose processes run on hosts (network namespaces): a cut holds for the
session timeout plus 0.5 to 2 s."""

# The liveness bound, from the moment a fault ends (docs/multiple-copy.md, "Liveness"): the
# claim of a copy that did not stop gracefully is free at most a session timeout later; the
# copy of rank r claims it r x 2 s after that (two copies: rank 1 at most), plus one tick
# (the shorter of 500 ms and datamarker_interval_ms). MARGIN_S covers what the bound leaves
# out on a loaded machine (2 shared cores): starting a publisher process (imports, opening
# its log), kazoo's reconnection backoff (up to 2 s) after ZooKeeper comes back, a failback
# hand-over in the window, the subscribers' reconnection and the sink writing the round.
TICK_S = min(500, INTERVAL_MS) / 1000
RANK_WAIT_S = 2.0
MARGIN_S = 20.0
LIVENESS_S = SESSION_MS / 1000 + RANK_WAIT_S * (2 - 1) + TICK_S + MARGIN_S


@pytest.fixture
def zookeeper() -> Iterator[Any]:
    """A ZooKeeper server of the loop's own: it is restarted by a fault."""
    from wormhole.testing.zookeeper import start_zookeeper

    yield from start_zookeeper()


@pytest.fixture
def hosts(netns_hosts: Any) -> Iterator[Any]:
    """The session's hosts; every wire the loop cut is healed when it ends, also on failure."""
    try:
        yield netns_hosts
    finally:
        netns_hosts.heal()


@pytest.fixture
def host_zookeeper_of_its_own(hosts: Any) -> Iterator[Any]:
    """A ZooKeeper server of the loop's own on host ``zk``: it is restarted by a fault."""
    from wormhole.testing.zookeeper import start_zookeeper

    yield from start_zookeeper(hosts.address("zk"), hosts.command("zk", []))


class Writer(threading.Thread):
    """Writes round after round (every key gets value ``n``) into both copies' streams
    until stopped; :meth:`quiet` pauses it between rounds."""

    def __init__(self, write: Callable[[int, int], None]) -> None:
        super().__init__(name="copies writer", daemon=True)
        self.write = write
        self.rounds = 0
        self.running = threading.Event()
        self.running.set()
        self.idle = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            if not self.running.is_set():
                self.idle.set()
                self.running.wait(0.1)
                continue
            self.idle.clear()
            self.write(KEYS, self.rounds)
            self.rounds += 1
            self.done.wait(ROUND_GAP_S)
        self.idle.set()

    def quiet(self) -> None:
        self.running.clear()
        wait_until(self.idle.is_set, 30, "the writer to pause")

    def resume(self) -> None:
        self.running.set()


class Delivered:
    """The highest round delivered per key and the newest version per shard, read on
    from where the last read ended."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.rest = b""
        self.highest: dict[int, int] = defaultdict(lambda: -1)
        self.newest: dict[int, tuple[int, ...]] = {}

    def lowest(self) -> int:
        """The round every key has reached (-1 before any)."""
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = self.rest + f.read()
            self.offset += len(data) - len(self.rest)
            *lines, self.rest = data.split(b"\n")
            for line in lines:
                envelope = json.loads(line)
                key = envelope["key"]["id"]
                self.highest[key] = max(self.highest[key], envelope["after"]["n"])
                shard = envelope["shard"]
                self.newest[shard] = max(self.newest.get(shard, ()), version(envelope))
        return min((self.highest[k] for k in range(KEYS)), default=-1)


class Registry:
    """Reads the serving claim and the shared datamarkers of ``search`` through one kazoo
    client of the test's own, which reconnects after ZooKeeper restarts."""

    def __init__(self, copies: Copies) -> None:
        from kazoo.retry import KazooRetry

        self.root = f"{copies.root}/datasets/shop"
        retry = KazooRetry(max_tries=-1, delay=0.1, max_delay=1.0)
        self.client = copies.zk.client(connection_retry=retry)
        self.went_back: list[str] = []
        """Each time a shard's shared datamarker was seen to go back (epoch or version)."""
        self.seen: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.changes = 0
        self.client.DataWatch(f"{self.root}/datamarkers/db1/search", self._datamarkers)

    def _datamarkers(self, data: bytes | None, _stat: Any) -> None:
        """Every value of the shared datamarkers this client is told of (a kazoo thread)."""
        for shard, marker in (json.loads(data) if data else {}).items():
            now = (int(marker["epoch"]), tuple(marker["version"]))
            before = self.seen.get(int(shard))
            if before is not None and (now[0] < before[0] or now[1] < before[1]):
                self.went_back.append(f"shard {shard}: {before} then {now}")
            self.seen[int(shard)] = now
        self.changes += 1

    def _get(self, path: str) -> Any:
        try:
            data, _ = self.client.get(f"{self.root}/{path}")
        except Exception:  # no such node, or ZooKeeper away
            return None
        return json.loads(data)

    def claim(self) -> tuple[str, int] | None:
        """The copy holding the serving claim and its epoch, or None."""
        raw = self._get("serving/db1/search")
        return (str(raw["copy"]), int(raw["epoch"])) if raw else None

    def registered(self, copy: str) -> int | None:
        """The pid copy ``copy``'s publisher registered with, or None."""
        raw = self._get(f"publishers/db1@{copy}")
        return int(raw["pid"]) if raw else None

    def shared(self) -> dict[int, tuple[int, ...]]:
        """The shared datamarkers by shard (versions); {} when there are none."""
        raw = self._get("datamarkers/db1/search") or {}
        return {int(s): tuple(m["version"]) for s, m in raw.items()}

    def close(self) -> None:
        self.client.stop()
        self.client.close()


class Loop:
    """The deployment, the writer and what the loop recorded."""

    def __init__(
        self, copies: Copies, write: Callable[[int, int], None], rng: random.Random, seed: int
    ) -> None:
        self.copies = copies
        self.rng = rng
        self.seed = seed
        self.out = copies.tmp / "search.jsonl"
        self.registry = Registry(copies)
        self.delivered = Delivered(self.out)
        self.writer = Writer(write)
        self.faults: list[tuple[int, dict[int, tuple[int, ...]]]] = []
        self.took: dict[str, list[float]] = defaultdict(list)
        self.fenced: list[int] = []
        """Epochs of claims held by a copy that was paused past its session."""
        self.moved_from = 0
        """The epoch of the claim an ``apps move`` was requested under (0: none pending)."""
        self.handovers: dict[str, int] = defaultdict(int)
        """Where the hand-overs ZooKeeper was stopped in were, by step."""

    def victim(self) -> str:
        held = self.registry.claim()
        return held[0] if held else self.rng.choice("ab")

    def move(self, to: str) -> None:
        """``wormhole apps move PIPELINE search TO``, as an operator runs it."""
        from wormhole.testing import run_cli

        held = self.registry.claim()
        self.moved_from = held[1] if held else 0
        files = self.copies.files
        moved = run_cli("apps", "move", str(files["a"]), "search", to, cwd=self.copies.tmp)
        assert moved.returncode == 0, (self.seed, moved)

    def shared_reached_delivered(self) -> bool:
        """Whether each shard's shared datamarker is at or past the last update delivered of
        it (a MariaDB datamarker moves to the end of the transaction, past other shards')."""
        shared = self.registry.shared()
        return all(shared.get(s, ()) >= v for s, v in self.delivered.newest.items())

    def both_up(self) -> None:
        """Wait until each copy's current process has registered (a graceful stop of one
        still starting would be the interpreter's default SIGTERM, not a stop)."""
        publishers = self.copies.publishers
        wait_until(
            lambda: all(self.registry.registered(c) == publishers[c].pid for c in "ab"),
            60,
            "both copies to register",
        )

    def before_fault(self) -> None:
        """Record the output's size and the shared datamarkers (the duplicate bound)."""
        size = self.out.stat().st_size if self.out.exists() else 0
        self.faults.append((size, self.registry.shared()))

    def restart(self, copy: str, kill: bool) -> None:
        process = self.copies.publishers[copy]
        if kill:
            process.kill()
        else:
            assert process.stop() == 0, process.stderr[-3000:]
        self.copies.publish(copy)

    def inject(self, kind: str) -> None:
        """One fault, from its start to its end."""
        copies, rng = self.copies, self.rng
        if kind == QUIET:
            self.writer.quiet()
            try:
                wait_until(
                    lambda: (
                        self.delivered.lowest() == self.writer.rounds - 1
                        and self.shared_reached_delivered()
                    ),
                    60,
                    "the quiet period: everything delivered and shared",
                )
            except AssertionError as exc:
                found = (self.writer.rounds, self.delivered.lowest())
                shared = (self.registry.shared(), self.delivered.newest)
                raise AssertionError(f"seed {self.seed}: {exc}: {found}, {shared}") from exc
        self.before_fault()
        if kind in (KILL, QUIET):
            self.restart(self.victim(), kill=kind == KILL or rng.random() < 0.5)
        elif kind == RESTART:
            self.restart(self.victim(), kill=False)
        elif kind == PAUSE:
            held = self.registry.claim()
            victim = held[0] if held else rng.choice("ab")
            if held:
                self.fenced.append(held[1])
            paused = copies.publishers[victim]
            os.kill(paused.pid, signal.SIGSTOP)
            try:
                time.sleep(SESSION_MS / 1000 + rng.uniform(0.5, 2.0))  # the fault: a pause
            finally:
                os.kill(paused.pid, signal.SIGCONT)
        elif kind == BOTH:
            for copy in "ab":
                self.restart(copy, kill=rng.random() < 0.5)
        elif kind == ZOOKEEPER:
            copies.zk.stop()
            time.sleep(rng.uniform(0.2, 3.0))  # the fault: ZooKeeper away
            copies.zk.start()
        elif kind == HANDOVER:
            self.move("b" if self.victim() == "a" else "a")
            time.sleep(rng.uniform(0.0, 0.6))  # the fault: somewhere in the hand-over
            held = self.registry.claim()
            step = "claim free" if held is None else "old claim held"
            if held is not None and held[1] > self.moved_from:
                step = "new claim held"
            self.handovers[step] += 1
            copies.zk.stop()
            time.sleep(rng.uniform(0.2, 3.0))  # ZooKeeper away
            copies.zk.start()
        elif kind == MOVE:
            self.move("b" if self.victim() == "a" else "a")
        elif kind in PARTITIONS:
            network = copies.network
            serving = self.victim()
            if kind == CUT_OFF:
                network.isolate(serving)
            elif kind == CUT_ZK:
                network.cut(serving, "zk")
            elif kind == UNREACHED:
                network.cut(serving, "sub")
            else:
                network.isolate("zk")
            try:
                time.sleep(SESSION_MS / 1000 + rng.uniform(0.5, 2.0))  # the fault: a cut
            finally:
                network.heal()
        self.writer.resume()

    def live(self, kind: str, index: int) -> None:
        """A round written after the fault ended reaches every key within LIVENESS_S."""
        ended = time.monotonic()
        first = self.writer.rounds
        try:
            wait_until(
                lambda: self.delivered.lowest() >= first and self.moved(),
                LIVENESS_S,
                f"fault {index} ({kind}): round {first}, written after it ended, at every key",
            )
        except AssertionError as exc:
            raise AssertionError(f"seed {self.seed}: {exc}; {self.tails()}") from exc
        self.took[kind].append(time.monotonic() - ended)
        self.moved_from = 0

    def moved(self) -> bool:
        """Whether a copy serves, under a later claim than the one a move was requested
        under if one was (the application moved)."""
        held = self.registry.claim()
        return held is not None and held[1] > self.moved_from

    def tails(self) -> str:
        return "; ".join(
            f"copy {c} stderr tail: {p.stderr[-1500:]!r}" for c, p in self.copies.publishers.items()
        )


def test_two_file_log_copies_serve_after_every_fault_and_lose_nothing(
    tmp_path: Path, host_zookeeper_of_its_own: Any, hosts: Any
) -> None:
    """The copies, ZooKeeper and the subscribers each on a host of their own: network
    partitions join the faults."""
    copies = Copies(tmp_path, host_zookeeper_of_its_own, "/mc-faults", network=hosts)
    run_loop(copies, copies.write, KINDS + PARTITIONS)


def test_a_mariadb_primary_and_replica_serve_after_every_fault_and_lose_nothing(
    tmp_path: Path, zookeeper: Any
) -> None:
    from wormhole.testing.mysql import make_replica, start_mariadb

    primary_gen, replica_gen = start_mariadb(), start_mariadb()
    primary, replica = next(primary_gen), next(replica_gen)
    try:
        make_replica(replica, primary)
        db = primary.create_database()
        primary.sql("CREATE TABLE orders (id INT PRIMARY KEY, n INT NOT NULL)", database=db)
        (gtid,) = primary.sql("SELECT @@gtid_binlog_pos")[0]
        wait_until(lambda: replica.sql("SELECT @@gtid_slave_pos")[0][0] == gtid, 60, "the replica")
        source = {"type": "mysql", "tables": [f"{db}.orders"], "snapshot": "never"}
        sources = {"a": {**source, "dsn": primary.dsn()}, "b": {**source, "dsn": replica.dsn()}}
        conn = primary.connect(db)
        conn.autocommit(True)

        def write(keys: int, n: int) -> None:
            with conn.cursor() as cur:
                cur.execute(
                    f"INSERT INTO orders SELECT seq, {n} FROM seq_0_to_{keys - 1} "
                    f"ON DUPLICATE KEY UPDATE n = VALUES(n)"
                )

        run_loop(Copies(tmp_path, zookeeper, "/mc-faults-mariadb", sources), write, KINDS)
        conn.close()
    finally:
        replica_gen.close()
        primary_gen.close()


def run_loop(copies: Copies, write: Callable[[int, int], None], kinds: list[str]) -> None:
    """Start both copies and two subscribers, write throughout, inject FAULTS faults (each
    of ``kinds`` at least once) checking liveness after each, then check safety."""
    seed = int(os.environ.get("WORMHOLE_CHAOS_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"seed {seed}, {FAULTS} faults, liveness bound {LIVENESS_S:.1f}s")
    rng = random.Random(seed)
    order = kinds + rng.choices(kinds, k=max(0, FAULTS - len(kinds)))
    rng.shuffle(order)
    loop = Loop(copies, write, rng, seed)
    try:
        for copy in "ab":
            copies.pipeline(copy)
        copies.publish("a")
        wait_until(lambda: loop.registry.claim() is not None, 60, "copy a to serve")
        copies.publish("b")
        for instance in (0, 1):
            copies.subscribe(instance)
        loop.writer.start()
        wait_until(lambda: loop.delivered.lowest() >= 0, 60, "the first round")
        for index, kind in enumerate(order):
            time.sleep(rng.uniform(0.3, 1.2))  # writes run undisturbed between faults
            print(f"fault {index}: {kind}")
            loop.both_up()
            loop.inject(kind)
            loop.live(kind, index)
        loop.writer.done.set()
        loop.writer.join(30)
        rounds = loop.writer.rounds
        wait_until(lambda: loop.delivered.lowest() >= rounds - 1, 60, "every key's last round")
        final = shared_epochs(copies)
    finally:
        loop.writer.done.set()
        loop.registry.close()
        copies.stop()
    # Datamarkers shared after every pause were written under later claims than the paused one.
    assert all(epoch > max(loop.fenced, default=0) for epoch in final.values()), (seed, final)
    # No shared datamarker ever went back: none was written under a claim older than another's.
    assert loop.registry.changes > len(order), (seed, loop.registry.changes)
    assert not loop.registry.went_back, (seed, loop.registry.went_back[:5])
    try:
        lines, duplicates = check(loop.out, KEYS, rounds, loop.faults)
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}: {exc}") from exc
    assert lines - duplicates == KEYS * rounds, (seed, lines, duplicates)
    every = [t for took in loop.took.values() for t in took]
    print(f"seed {seed}: {rounds} rounds, {lines:,} lines, {duplicates:,} duplicates")
    print(f"a new round at every key after a fault ends: median {statistics.median(every):.2f}s")
    for kind, took in sorted(loop.took.items()):
        median, most = statistics.median(took), max(took)
        print(f"  {kind}: {len(took)} times, median {median:.2f}s, max {most:.2f}s")
    if loop.handovers:
        print(f"  ZooKeeper stopped in a hand-over at: {dict(sorted(loop.handovers.items()))}")
