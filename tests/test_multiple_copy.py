"""Multiple-copy delivery with a real ZooKeeper registry and real processes.

Two hosts write the same ``LogWriter`` stream (same publisher id, same sequence numbers)
into two directories: two copies of datastore ``db1``. A publisher reads each
(``copy: a`` and ``copy: b``, ``delivery.mode: multiple-copy``); one serves the
application at a time. The serving copy is killed, paused past its ZooKeeper session and
resumed, or stopped and brought back (failback): every update reaches the application in
per-key order, the duplicates stay within what was delivered since the last shared
datamarker, and a fenced copy delivers nothing more.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml
from tcp_support import Process, stop_all

from wormhole.publish import LogWriter
from wormhole.testing import run_cli, wait_until, write_pipeline

SHARDS = 8
SESSION_MS = 2000
INTERVAL_MS = 200


class Copies:
    """Two copies of datastore db1 (``a`` preferred, ``b``), their publishers and the
    application's subscribers. ``sources`` gives each copy's source; without it, each copy
    reads its own directory of one ``LogWriter`` stream that :meth:`write` writes. With
    ``network`` (:func:`wormhole.testing.plugin.netns_hosts`), each copy's publisher runs on
    the host of its name and the subscribers on host ``sub``."""

    def __init__(
        self,
        tmp: Path,
        zk: Any,
        root: str,
        sources: dict[str, dict[str, Any]] | None = None,
        network: Any = None,
    ) -> None:
        self.tmp = tmp
        self.zk = zk
        self.root = root
        self.network = network
        self.publishers: dict[str, Process] = {}
        self.subscribers: list[Process] = []
        self.files: dict[str, Path] = {}
        self.writers: dict[str, LogWriter] = {}
        if sources is None:
            self.writers = {c: LogWriter(tmp / f"src-{c}", publisher_id="orders") for c in "ab"}
            sources = {c: {"type": "filelog", "path": str(tmp / f"src-{c}")} for c in "ab"}
        self.sources = sources

    def pipeline(self, copy: str, extra: dict[str, Any] | None = None) -> Path:
        path = write_pipeline(
            self.tmp / f"copy-{copy}.yml",
            {
                "pipeline": "shop",
                "registry": {
                    "type": "zookeeper",
                    "hosts": self.zk.hosts,
                    "root": self.root,
                    "session_timeout_ms": SESSION_MS,
                },
                "datastore": "db1",
                "copy": copy,
                "state_dir": str(self.tmp / f"state-{copy}"),
                "dataset": {"shards": SHARDS},
                "source": self.sources[copy],
                "transport": {
                    "type": "tcp",
                    "listen": f"{self.network.address(copy) if self.network else '127.0.0.1'}:0",
                    "heartbeat_ms": 300,
                    "heartbeat_timeout_ms": 1500,
                },
                "delivery": {"mode": "multiple-copy", "datamarker_interval_ms": INTERVAL_MS},
                "applications": {
                    "search": {
                        "sink": {"type": "jsonl", "path": str(self.tmp / "search.jsonl")},
                        "copies": ["a", "b"],
                        **(extra or {}),
                    }
                },
            },
        )
        self.files[copy] = path
        return path

    def publish(self, copy: str) -> Process:
        path = self.files.get(copy) or self.pipeline(copy)
        process = Process("publish", str(path), "-q", cwd=self.tmp, prefix=self._on(copy))
        self.publishers[copy] = process
        return process

    def subscribe(self, instance: int) -> Process:
        process = Process(
            "subscribe",
            str(self.files["a"]),
            "--app",
            "search",
            "--instance",
            str(instance),
            cwd=self.tmp,
            prefix=self._on("sub"),
        )
        self.subscribers.append(process)
        return process

    def _on(self, host: str) -> list[str]:
        """What runs a command on ``host`` (nothing without a network)."""
        return self.network.command(host, []) if self.network else []

    def write(self, keys: int, n: int) -> None:
        """One round: every key gets value n, in both copies of the stream."""
        for writer in self.writers.values():
            for k in range(keys):
                writer.publish("orders", key={"id": k}, after={"id": k, "n": n})
            writer.flush()

    def serving(self) -> str | None:
        result = run_cli("status", str(self.files["a"]), "--json", cwd=self.tmp)
        assert result.returncode == 0, result
        deployment = json.loads(result.stdout)["deployment"]
        serving = [p["copy"] for p in deployment["publishers"] if "search" in p["serving"]]
        assert len(serving) <= 1, deployment["publishers"]
        return serving[0] if serving else None

    def stop(self) -> None:
        stop_all([*self.subscribers, *self.publishers.values()])
        for writer in self.writers.values():
            writer.close()


@pytest.fixture
def copies(tmp_path: Path, zookeeper_server: Any, request: pytest.FixtureRequest) -> Any:
    deployment = Copies(tmp_path, zookeeper_server, f"/mc-{request.node.name[:40]}")
    yield deployment
    deployment.stop()


def version(envelope: dict[str, Any]) -> tuple[int, ...]:
    """The envelope's update version (what shared datamarkers are made of)."""
    from wormhole.core.update import Update
    from wormhole.plugins.versions import version_of

    source = envelope["source"]
    update = Update(
        op=envelope["op"],
        key=b"{}",
        connector=source["connector"],
        position=source["position"],
        logical=source["logical"],
    )
    found = version_of(update)
    assert found is not None, envelope
    return tuple(found)


def check(
    path: Path, keys: int, rounds: int, faults: list[tuple[int, dict[int, tuple[int, ...]]]]
) -> tuple[int, int]:
    """Per key, values in file order are runs of consecutive rounds (a replay starts at or
    below the highest delivered, never past it); every key reaches the last round. Every
    update delivered again comes after the shared datamarker of its shard taken just before
    the last fault that precedes it (``faults``: output size and shared datamarker versions
    by shard, before each fault): the duplicate bound. Returns (lines, duplicates)."""
    seen: dict[int, list[int]] = defaultdict(list)
    lines = duplicates = offset = 0
    highest: dict[int, int] = defaultdict(lambda: -1)
    with open(path, "rb") as f:
        for raw in f:
            envelope = json.loads(raw)
            key, n = envelope["key"]["id"], envelope["after"]["n"]
            seen[key].append(n)
            if n <= highest[key]:
                before = [markers for size, markers in faults if size <= offset]
                assert before, f"offset {offset}: key {key} round {n} again before any fault"
                marker = before[-1].get(envelope["shard"])
                assert marker is None or version(envelope) > marker, (
                    f"offset {offset}: key {key} round {n} delivered again although the shared "
                    f"datamarker of shard {envelope['shard']} was past it ({marker}) before "
                    f"the fault"
                )
                duplicates += 1
            highest[key] = max(highest[key], n)
            offset += len(raw)
            lines += 1
    for key in range(keys):
        high = previous = -1
        for n in seen.get(key, []):
            assert n <= high + 1, f"key {key}: {n} after {previous} (highest {high}): a gap"
            if n != previous + 1:
                assert n <= high, f"key {key}: {n} after {previous}: out of order"
            high, previous = max(high, n), n
        assert high == rounds - 1, f"key {key}: reached round {high} of {rounds}"
    return lines, duplicates


def test_one_copy_serves_and_the_other_takes_over_through_faults(
    copies: Copies, tmp_path: Path
) -> None:
    run_through_faults(copies, tmp_path, copies.write)


def run_through_faults(copies: Copies, tmp_path: Path, write: Any) -> None:
    """Writes run throughout; (a) the serving copy is killed with -9, (c) it comes back and
    the application fails back, (b) it is paused past its session and resumed: every update
    arrives in per-key order, within the duplicate bound."""
    keys, rounds = 100, 120
    for copy in "ab":
        copies.pipeline(copy)
        copies.publish(copy)
    copies.subscribe(0)
    copies.subscribe(1)
    wait_until(lambda: copies.serving() == "a", 60, "copy a (preferred) to serve")
    written = {"rounds": 0}

    faults_done = threading.Event()

    def writer() -> None:
        for n in range(rounds):
            if n == rounds - 10:
                # The last rounds come after every fault: the copy serving then shares them.
                faults_done.wait(120)
            write(keys, n)
            written["rounds"] = n + 1
            threading.Event().wait(0.05)

    seed = int(os.environ.get("WORMHOLE_CHAOS_SEED") or random.SystemRandom().randrange(1 << 32))
    rng = random.Random(seed)
    print(f"seed {seed}")
    thread = threading.Thread(target=writer, daemon=True)
    thread.start()

    out = tmp_path / "search.jsonl"
    faults: list[tuple[int, dict[int, tuple[int, ...]]]] = []

    def at_round(n: int) -> None:
        wait_until(lambda: written["rounds"] >= n, 60, f"round {n}")

    def fault() -> None:
        """Before a fault: what is delivered caught up, then the shared datamarkers."""
        wait_until(lambda: reached(out, keys, written["rounds"] - 2), 60, "delivery to catch up")
        faults.append((out.stat().st_size, shared_versions(copies)))

    # (a) the serving copy killed with -9: b takes over
    at_round(rng.randrange(10, 30))
    fault()
    copies.publishers["a"].proc.send_signal(signal.SIGKILL)
    copies.publishers["a"].wait(10)
    wait_until(lambda: copies.serving() == "b", 30, "copy b to take over")
    # (c) a comes back: the application fails back to it
    at_round(rng.randrange(40, 60))
    fault()
    copies.publish("a")
    wait_until(lambda: copies.serving() == "a", 60, "the application to fail back to a")
    # (b) a paused past its session: b takes over; a, resumed, is fenced
    at_round(rng.randrange(70, 90))
    fault()
    paused = copies.publishers["a"]
    paused_epoch = serving_epoch(copies)
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: copies.serving() == "b", 30, "copy b to take over from paused a")
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    # Resumed, it knows its claim may be gone before doing anything else: it stops serving.
    wait_until(lambda: "stops serving" in paused.stderr, 30, "the resumed copy a to stand down")
    faults_done.set()
    thread.join(120)
    assert written["rounds"] == rounds

    wait_until(lambda: reached(out, keys, rounds - 1), 120, "every key's last round")
    # Every shared datamarker was written after the pause, under a later epoch: the paused
    # copy, resumed, wrote none under its lost claim.
    final = shared_epochs(copies)
    assert final and all(epoch > paused_epoch for epoch in final.values()), (paused_epoch, final)
    copies.stop()
    try:
        lines, duplicates = check(out, keys, rounds, faults)
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}: {exc}") from exc
    assert lines - duplicates == keys * rounds, (seed, lines, duplicates)
    print(f"{lines:,} lines, {duplicates:,} duplicates")


def serving_epoch(copies: Copies) -> int:
    """The epoch of the claim serving ``search`` in db1 now."""
    client = copies.zk.client()
    try:
        data, _ = client.get(f"{copies.root}/datasets/shop/serving/db1/search")
    finally:
        client.stop()
    epoch: int = json.loads(data)["epoch"]
    return epoch


def shared_epochs(copies: Copies) -> dict[int, int]:
    """The epoch each shared datamarker of ``search`` in db1 was written under."""
    client = copies.zk.client()
    try:
        data, _ = client.get(f"{copies.root}/datasets/shop/datamarkers/db1/search")
    finally:
        client.stop()
    return {int(s): int(m["epoch"]) for s, m in json.loads(data).items()}


def shared_versions(copies: Copies) -> dict[int, tuple[int, ...]]:
    """The shared datamarkers of ``search`` in db1, by shard (their versions)."""
    client = copies.zk.client()
    try:
        data, _ = client.get(f"{copies.root}/datasets/shop/datamarkers/db1/search")
    except Exception:
        return {}
    finally:
        client.stop()
    return {int(s): tuple(m["version"]) for s, m in json.loads(data).items()}


def reached(out: Path, keys: int, n: int) -> bool:
    """Whether every key has been delivered round ``n``."""
    if not out.exists():
        return n < 0
    done = {json.loads(line)["key"]["id"] for line in out.open() if f'"n":{max(n, 0)}}}' in line}
    return n < 0 or len(done) == keys


def test_locate_finds_where_a_shared_datamarker_continues_in_another_copys_log(
    tmp_path: Path,
) -> None:
    from wormhole.core.copies import Behind, Gone, locate
    from wormhole.core.publisher_log import PublisherLog
    from wormhole.core.update import Update

    def updates(first: int, count: int) -> list[Update]:
        return [
            Update.create(op="c", key={"id": i}, table="t", after={"id": i}, connector="filelog")
            for i in range(first, first + count)
        ]

    plog = PublisherLog(tmp_path / "log")
    plog.open()
    try:
        # This copy's log holds stream seqs 101..400 (it started reading at 101).
        for first in range(101, 401, 50):
            batch = updates(first, 50)
            for i, u in enumerate(batch):
                u.position = f"f:{first + i}"
                u.logical = f"orders:{first + i}"
            plog.append(batch, {"at": first})
        # the first update after stream seq 150 is local seq 50; after 399: local 299
        assert locate(plog, {0: (150,), 1: (399,), 2: (101,)}, 0) == {0: 50, 1: 299, 2: 1}
        # at the very end: serve from the log's end
        assert locate(plog, {3: (400,)}, 0) == {3: 300}
        # a hint past earlier targets' positions is not used for them: scan from the hint
        assert locate(plog, {0: (360,)}, 200) == {0: 260}
        with pytest.raises(Behind, match="not reached"):
            locate(plog, {0: (401,)}, 0)
        with pytest.raises(Gone, match="older than this copy's publisher log"):
            locate(plog, {0: (99,)}, 0)
    finally:
        plog.close()


def test_a_mariadb_primary_and_its_replica_are_two_copies(
    tmp_path: Path, zookeeper_server: Any
) -> None:
    from wormhole.testing.mysql import make_replica, start_mariadb

    primary_gen, replica_gen = start_mariadb(), start_mariadb()
    primary, replica = next(primary_gen), next(replica_gen)
    deployment = None
    try:
        make_replica(replica, primary)
        db = primary.create_database()
        primary.sql("CREATE TABLE orders (id INT PRIMARY KEY, n INT NOT NULL)", database=db)
        (gtid,) = primary.sql("SELECT @@gtid_binlog_pos")[0]
        wait_until(lambda: replica.sql("SELECT @@gtid_slave_pos")[0][0] == gtid, 60, "the replica")
        source = {"type": "mysql", "tables": [f"{db}.orders"], "snapshot": "never"}
        deployment = Copies(
            tmp_path,
            zookeeper_server,
            "/mc-mariadb",
            {
                "a": {**source, "dsn": primary.dsn()},
                "b": {**source, "dsn": replica.dsn()},
            },
        )
        conn = primary.connect(db)
        conn.autocommit(True)

        def write(keys: int, n: int) -> None:
            with conn.cursor() as cur:
                cur.execute(
                    f"INSERT INTO orders SELECT seq, {n} FROM seq_0_to_{keys - 1} "
                    f"ON DUPLICATE KEY UPDATE n = VALUES(n)"
                )

        run_through_faults(deployment, tmp_path, write)
        conn.close()
    finally:
        if deployment is not None:
            deployment.stop()
        replica_gen.close()
        primary_gen.close()


def test_with_manual_failback_the_application_stays_until_moved(
    copies: Copies, tmp_path: Path
) -> None:
    keys = 20
    for copy in "ab":
        copies.pipeline(copy, {"failback": "manual"})
    # a first: with manual failback, a copy b that claimed the application while a was still
    # starting would keep it.
    copies.publish("a")
    wait_until(lambda: copies.serving() == "a", 60, "copy a (preferred) to serve")
    copies.publish("b")
    copies.subscribe(0)
    out = tmp_path / "search.jsonl"
    copies.write(keys, 0)
    wait_until(lambda: reached(out, keys, 0), 60, "round 0")
    copies.publishers["a"].proc.send_signal(signal.SIGKILL)
    copies.publishers["a"].wait(10)
    wait_until(lambda: copies.serving() == "b", 30, "copy b to take over")
    copies.write(keys, 1)
    copies.publish("a")

    def a_ready() -> bool:
        result = run_cli("status", str(copies.files["a"]), "--json", cwd=tmp_path)
        publishers = json.loads(result.stdout)["deployment"]["publishers"]
        return any(p["copy"] == "a" and "search" in p["ready"] for p in publishers)

    wait_until(a_ready, 60, "copy a to be ready to take over")
    copies.write(keys, 2)
    wait_until(lambda: reached(out, keys, 2), 60, "round 2, from b")
    assert copies.serving() == "b", "failback: manual keeps the application on b"
    moved = run_cli("apps", "move", str(copies.files["a"]), "search", "a", cwd=tmp_path)
    assert moved.returncode == 0, moved
    wait_until(lambda: copies.serving() == "a", 60, "the application to move to a")
    copies.write(keys, 3)
    wait_until(lambda: reached(out, keys, 3), 60, "round 3, from a")
    copies.stop()
    lines, duplicates = check(out, keys, 4, [(0, {})])
    assert lines - duplicates == keys * 4


def test_a_copy_behind_waits_then_refuses_and_takes_over_once_it_has_caught_up(
    copies: Copies, tmp_path: Path
) -> None:
    keys = 20
    for copy in "ab":
        copies.pipeline(copy)
    raw = yaml.safe_load(copies.files["b"].read_text())
    raw["delivery"]["catch_up_ms"] = 1000
    write_pipeline(copies.files["b"], raw)
    for copy in "ab":
        copies.publish(copy)
    copies.subscribe(0)
    wait_until(lambda: copies.serving() == "a", 60, "copy a (preferred) to serve")
    out = tmp_path / "search.jsonl"
    copies.write(keys, 0)
    wait_until(lambda: reached(out, keys, 0), 60, "round 0")
    # Round 1 reaches copy a only: b's datastore is behind.
    lagging = copies.writers.pop("b")
    copies.write(keys, 1)
    wait_until(lambda: reached(out, keys, 1), 60, "round 1, from a")
    wait_until(
        lambda: min(shared_versions(copies).values(), default=(0,)) >= (2 * keys,),
        30,
        "a to share datamarkers past round 1",
    )
    copies.publishers["a"].proc.send_signal(signal.SIGKILL)
    copies.publishers["a"].wait(10)
    b = copies.publishers["b"]
    wait_until(lambda: "delivery.catch_up_ms" in b.stderr, 60, "b to refuse")
    line = next(ln for ln in b.stderr_lines if "delivery.catch_up_ms" in ln)
    assert "ERROR" in line and "has not reached the shared datamarker" in line, line
    assert "version (40,)" in line, line
    assert copies.serving() is None, "nobody serves while b is behind: nothing is skipped"
    # b's datastore catches up: b takes over, from where a stopped.
    copies.writers["b"] = lagging
    for k in range(keys):
        lagging.publish("orders", key={"id": k}, after={"id": k, "n": 1})
    lagging.flush()
    wait_until(lambda: copies.serving() == "b", 60, "b to take over once caught up")
    copies.write(keys, 2)
    wait_until(lambda: reached(out, keys, 2), 60, "round 2, from b")
    copies.stop()
    lines, duplicates = check(out, keys, 3, [(0, {})])
    assert lines - duplicates == keys * 3


def test_a_subscriber_drops_a_flows_batches_from_a_copy_with_an_older_epoch() -> None:
    """Two connections to two copies of db1: once the copy with epoch 2 assigned shard 0,
    what the copy with epoch 1 still sends of it is dropped (and not acknowledged), while
    its other flows are handled."""
    from wormhole.connectors.tcp import protocol as p
    from wormhole.connectors.tcp.client import Subscriber
    from wormhole.connectors.tcp.link import TcpLink
    from wormhole.core.update import Update

    sub = Subscriber(app="search", registry="zookeeper://127.0.0.1:1/x", dataset="shop")
    handled: list[tuple[int, int]] = []
    notices: list[tuple[list[Any], list[Any]]] = []
    sub.on_batch(lambda updates: handled.extend((u.shard, u.after_row()["n"]) for u in updates))
    sub.on_shard_notice(lambda a, r: notices.append((a, r)))
    old, new = (TcpLink(sub, "db1", lambda: ["127.0.0.1:1"]) for _ in range(2))
    sub._links = {"db1@a": old, "db1@b": new}
    acks: dict[str, list[dict[int, int]]] = {"old": [], "new": []}

    def recorder(name: str) -> Any:
        def send(data: bytes) -> None:
            kind = data[p._LENGTH.size - 1]
            if kind == p.ACK:
                body = p._decoders[p.ACK].decode(data[p._LENGTH.size :])
                acks[name].append(dict(body.datamarkers))

        return send

    old._send = recorder("old")  # type: ignore[method-assign]
    new._send = recorder("new")  # type: ignore[method-assign]

    def batch(frame_id: int, shards_n: list[tuple[int, int]]) -> p.BatchFrame:
        updates = [
            Update.create(op="c", key={"id": s}, table="t", after={"n": n}) for s, n in shards_n
        ]
        for u, (s, _) in zip(updates, shards_n, strict=True):
            u.shard = s
        markers = {s: frame_id * 10 for s, _ in shards_n}
        return p.BatchFrame(
            id=frame_id, first=0, end=1, appended_ns=0, datamarkers=markers, updates=updates
        )

    old._notice(p.Notice(id=1, assigned=[0, 1], revoked=[], epoch=1))
    old._batch(batch(1, [(0, 1), (1, 1)]))
    new._notice(p.Notice(id=1, assigned=[0], revoked=[], epoch=2))
    old._batch(batch(2, [(0, 2), (1, 2)]))  # shard 0 from the fenced copy: dropped
    new._batch(batch(3, [(0, 2)]))
    assert handled == [(0, 1), (1, 1), (1, 2), (0, 2)]
    assert acks["old"][-1] == {1: 20}, "the fenced flow's datamarker is not acknowledged"
    assert acks["new"][-1] == {0: 30}
    assert sub.assigned == {("db1", 0), ("db1", 1)}
    # Shard 0 was reported assigned once, though two copies assigned it.
    assert notices == [([("db1", 0), ("db1", 1)], [])]
