"""Multiple-copy delivery under real network partitions: hosts are network namespaces.

Copy ``a`` (preferred) and copy ``b`` of datastore db1 (two file-log copies of one
``LogWriter`` stream, as in the fault loop) each publish from a host of their own, ZooKeeper
runs on host ``zk`` and the application's two subscribers on host ``sub``
(:func:`wormhole.testing.plugin.netns_hosts`). A writer writes a round of every key every
50 ms throughout. Each test cuts wires between hosts for real (the switch ports go down:
packets are dropped in silence, as in a partitioned network), holds the cut past the session
timeout, and heals it:

- the serving copy cut from everything (ZooKeeper, the subscribers, the other copy);
- the serving copy cut from ZooKeeper only (its subscribers still reach it);
- the subscribers cut from the serving copy only (it gives the application up to the copy
  they reach);
- the standby cut from everything;
- ZooKeeper cut from every copy and subscriber.

Checked: some ready copy serves the application (a round written after the cut started, or
after it healed, reaches every key) within the bounds of docs/multiple-copy.md; the cut copy
comes back by itself (registered again, ready, and the preferred copy serves again after
failback); at the end every update written arrived in per-key order, every duplicate comes
after the shared datamarker of its shard read just before the cut, and none is of a round
written after the serving copy must have stopped serving.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_multiple_copy import INTERVAL_MS, SESSION_MS, Copies, check
from test_multiple_copy_faults import KEYS, LIVENESS_S, Delivered, Registry, Writer

from wormhole.testing import wait_until

TICK_S = min(500, INTERVAL_MS) / 1000
QUICK_S = min(2.0, SESSION_MS / 2000)
"""How long a serving copy waits for ZooKeeper to take a datamarker write."""
STOP_S = 2 * TICK_S + QUICK_S
"""docs/multiple-copy.md, "Partitions": a serving copy cut from ZooKeeper stops serving within
two ticks (the next datamarker to share, its write in the next tick) plus the write's wait."""
STOP_MARGIN_S = 3.0
"""For the machine (2 shared cores): the copy's tick running late, the frames in flight."""
HEARTBEAT_TIMEOUT_S = 1.5
"""The deployment's ``transport.heartbeat_timeout_ms``: a subscriber silent this long is gone."""
UNREACHED_FAILOVER_S = HEARTBEAT_TIMEOUT_S + 2 * 2.0 + 2 * TICK_S + 20.0
"""From a cut between the serving copy and all its subscribers (docs/multiple-copy.md,
"Partitions"): their sessions time out, the copy gives the application up after 2 s without
any, the other copy's rank wait (2 s), ticks, and the fault loop's margin."""
FAILOVER_S = SESSION_MS / 1000 + 2.0 + TICK_S + 20.0
"""From the cut: the session expires, the other copy's rank wait, a tick, and the fault
loop's margin (docs/multiple-copy.md, "Liveness")."""


class Status(Registry):
    def ready(self, copy: str) -> bool:
        """Whether copy ``copy`` says in its live status that it could take ``search`` over."""
        raw = self._get(f"status/db1@{copy}") or {}
        return bool(raw.get("copies", {}).get("copies_ready", {}).get("search"))


class Deployment:
    """Both copies serving ``search`` to two subscribers on host ``sub``, a writer writing
    throughout, and the round each write started at."""

    def __init__(self, copies: Copies) -> None:
        self.copies = copies
        self.registry = Status(copies)
        self.out = copies.tmp / "search.jsonl"
        self.delivered = Delivered(self.out)
        self.written: list[float] = []
        self.writer = Writer(self._write)
        self.faults: list[tuple[int, dict[int, tuple[int, ...]]]] = []

    def _write(self, keys: int, n: int) -> None:
        self.written.append(time.monotonic())
        self.copies.write(keys, n)

    def start(self) -> None:
        for copy in "ab":
            self.copies.pipeline(copy)
        self.copies.publish("a")
        wait_until(lambda: self.claim() == "a", 60, "copy a to serve")
        self.copies.publish("b")
        for instance in (0, 1):
            self.copies.subscribe(instance)
        self.writer.start()
        wait_until(lambda: self.delivered.lowest() >= 0, 60, "the first round")
        self.settled()

    def claim(self) -> str | None:
        held = self.registry.claim()
        return held[0] if held else None

    def settled(self) -> None:
        """Both copies registered by their current processes, a serving, b ready."""
        publishers = self.copies.publishers
        wait_until(
            lambda: (
                all(self.registry.registered(c) == publishers[c].pid for c in "ab")
                and self.claim() == "a"
                and self.registry.ready("b")
            ),
            60,
            "both copies registered, a serving, b ready",
        )

    def before_cut(self) -> None:
        size = self.out.stat().st_size if self.out.exists() else 0
        self.faults.append((size, self.registry.shared()))

    def round_reaches_every_key(self, since: float, bound: float, what: str) -> float:
        """A round written after ``since`` reaches every key within ``bound`` of it; returns
        how long after ``since`` it did."""
        first = self.writer.rounds
        try:
            wait_until(
                lambda: self.delivered.lowest() >= first,
                max(0.0, since + bound - time.monotonic()),
                f"{what}: round {first}, written after it, at every key",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}; {self.tails()}") from exc
        return time.monotonic() - since

    def rejoined(self, copy: str, since: float, bound: float) -> None:
        """The cut copy is registered again, ready or serving, and a serves (failback)."""
        process = self.copies.publishers[copy]
        try:
            wait_until(
                lambda: (
                    self.registry.registered(copy) == process.pid
                    and (self.registry.ready(copy) or self.claim() == copy)
                    and self.claim() == "a"
                ),
                max(0.0, since + bound - time.monotonic()),
                f"copy {copy} to rejoin (registered, ready) and a to serve",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}; {self.tails()}") from exc
        assert process.proc.poll() is None, process.stderr[-3000:]

    def finish(self, cut_at: float | None) -> tuple[int, int]:
        """Stop writing; every update arrived in per-key order, duplicates within the bound.
        ``cut_at``: when the serving copy was cut from ZooKeeper (its duplicates must be of
        rounds written before it had to stop serving)."""
        self.writer.done.set()
        self.writer.join(30)
        rounds = self.writer.rounds
        wait_until(lambda: self.delivered.lowest() >= rounds - 1, 60, "every key's last round")
        lines, duplicates = check(self.out, KEYS, rounds, self.faults)
        assert lines - duplicates == KEYS * rounds, (lines, duplicates)
        again = self.duplicated_rounds()
        if cut_at is not None and again:
            stopped = cut_at + STOP_S + STOP_MARGIN_S
            late = [n for n in again if self.written[n] > stopped]
            assert not late, (
                f"rounds {late[:5]}... written more than {STOP_S + STOP_MARGIN_S:.1f}s after "
                f"the cut were delivered twice: the cut copy kept serving"
            )
            kept = self.written[again[-1]] - cut_at
            print(
                f"  {duplicates} duplicates; the last round delivered twice was written "
                f"{kept:.2f}s after the cut (stop bound {STOP_S:.1f}s)"
            )
        return lines, duplicates

    def duplicated_rounds(self) -> list[int]:
        highest: dict[int, int] = {}
        again = set()
        with open(self.out, "rb") as f:
            for line in f:
                e = json.loads(line)
                key, n = e["key"]["id"], e["after"]["n"]
                if n <= highest.get(key, -1):
                    again.add(n)
                highest[key] = max(highest.get(key, -1), n)
        return sorted(again)

    def tails(self) -> str:
        return "; ".join(
            f"copy {c} stderr tail: {p.stderr[-1500:]!r}" for c, p in self.copies.publishers.items()
        )

    def close(self) -> None:
        self.writer.done.set()
        self.registry.close()
        self.copies.stop()


@pytest.fixture
def network(netns_hosts: Any) -> Iterator[Any]:
    """The session's hosts; every wire a test cut is healed when it ends, also on failure."""
    try:
        yield netns_hosts
    finally:
        netns_hosts.heal()


@pytest.fixture
def deployment(
    tmp_path: Path, host_zookeeper: Any, network: Any, request: pytest.FixtureRequest
) -> Iterator[Deployment]:
    copies = Copies(tmp_path, host_zookeeper, f"/mcp-{request.node.name[:40]}", network=network)
    running = Deployment(copies)
    try:
        running.start()
        yield running
    finally:
        running.close()


def _hold_past_session(deployment: Deployment, cut_at: float, condition: Any, what: str) -> None:
    """Hold the cut until ``condition`` holds and the session timeout (plus a tick) has
    passed since ``cut_at``, so that the cut host's session has expired."""
    wait_until(condition, FAILOVER_S, what)
    expired = cut_at + SESSION_MS / 1000 + TICK_S
    wait_until(lambda: time.monotonic() >= expired, SESSION_MS / 1000 + 1, "the session to expire")


def _heal_then_fail_back_to_a(deployment: Deployment, network: Any) -> None:
    """Heal the cut: copy a rejoins, and takes the application back from b (failback)."""
    network.heal()
    deployment.rejoined("a", time.monotonic(), LIVENESS_S)
    took = deployment.round_reaches_every_key(time.monotonic(), LIVENESS_S, "failback to a")
    print(f"healed: failback to a, then a new round {took:.2f}s after")


def test_the_serving_copy_cut_from_everything_the_other_serves_and_it_rejoins(
    deployment: Deployment, network: Any
) -> None:
    deployment.before_cut()
    cut_at = time.monotonic()
    network.isolate("a")
    took = deployment.round_reaches_every_key(cut_at, FAILOVER_S, "a cut off: b to serve")
    _hold_past_session(deployment, cut_at, lambda: deployment.claim() == "b", "b to claim")
    print(f"a cut off: a new round at every key {took:.2f}s after the cut")
    network.heal()
    healed_at = time.monotonic()
    took = deployment.round_reaches_every_key(healed_at, LIVENESS_S, "healed")
    deployment.rejoined("a", healed_at, LIVENESS_S)
    deployment.round_reaches_every_key(time.monotonic(), LIVENESS_S, "failback to a")
    print(f"healed: a new round at every key {took:.2f}s after")
    deployment.finish(cut_at)


def test_the_serving_copy_cut_from_zookeeper_only_stops_serving_and_rejoins(
    deployment: Deployment, network: Any
) -> None:
    """Its subscribers still reach it: it must stop delivering within the stop bound (its
    claim may be gone), and b serves them."""
    deployment.before_cut()
    cut_at = time.monotonic()
    network.cut("a", "zk")
    took = deployment.round_reaches_every_key(cut_at, FAILOVER_S, "a cut from zk: b to serve")
    _hold_past_session(deployment, cut_at, lambda: deployment.claim() == "b", "b to claim")
    deployment.round_reaches_every_key(time.monotonic(), LIVENESS_S, "b serving")
    a = deployment.copies.publishers["a"]
    assert "stops serving it" in a.stderr, a.stderr[-3000:]
    print(f"a cut from ZooKeeper: a new round at every key {took:.2f}s after the cut")
    _heal_then_fail_back_to_a(deployment, network)
    deployment.finish(cut_at)


def test_the_subscribers_cut_from_the_serving_copy_are_served_by_the_other(
    deployment: Deployment, network: Any
) -> None:
    """Copy a still holds ZooKeeper and its claim, but none of the application's subscribers
    reaches it while they reach b: a gives the application up to b (which is ready and
    reached), and gets it back once the cut heals (failback)."""
    deployment.before_cut()
    cut_at = time.monotonic()
    network.cut("a", "sub")
    took = deployment.round_reaches_every_key(cut_at, UNREACHED_FAILOVER_S, "a unreached: b")
    assert deployment.claim() == "b"
    a = deployment.copies.publishers["a"]
    assert "none of its subscribers" in a.stderr, a.stderr[-3000:]
    print(f"subscribers cut from a: a new round at every key {took:.2f}s after the cut")
    _heal_then_fail_back_to_a(deployment, network)
    deployment.finish(None)


def test_the_standby_cut_from_everything_does_not_disturb_and_rejoins(
    deployment: Deployment, network: Any
) -> None:
    deployment.before_cut()
    cut_at = time.monotonic()
    network.isolate("b")
    deployment.round_reaches_every_key(cut_at, LIVENESS_S, "b cut off: a serving on")
    _hold_past_session(
        deployment, cut_at, lambda: deployment.registry.registered("b") is None, "b's session"
    )
    deployment.round_reaches_every_key(time.monotonic(), LIVENESS_S, "b's session gone")
    assert deployment.claim() == "a"
    network.heal()
    healed_at = time.monotonic()
    deployment.rejoined("b", healed_at, LIVENESS_S)
    deployment.finish(None)


def test_zookeeper_cut_from_everyone_the_copies_serve_again_after_healing(
    deployment: Deployment, network: Any
) -> None:
    """Every copy stops serving when ZooKeeper is cut off (fencing: none knows whether its
    claim survived); after healing a copy serves again within the liveness bound."""
    deployment.before_cut()
    cut_at = time.monotonic()
    network.isolate("zk")
    for copy in "ab":
        process = deployment.copies.publishers[copy]
        wait_until(
            lambda p=process: "lost the connection to ZooKeeper" in p.stderr,  # type: ignore[misc]
            FAILOVER_S,
            f"copy {copy} to notice",
        )
    _hold_past_session(deployment, cut_at, lambda: True, "")
    network.heal()
    healed_at = time.monotonic()
    took = deployment.round_reaches_every_key(healed_at, LIVENESS_S, "healed")
    deployment.rejoined("b", healed_at, LIVENESS_S)
    print(f"ZooKeeper cut off, healed: a new round at every key {took:.2f}s after")
    deployment.finish(cut_at)


def test_a_subscriber_waiting_out_its_backoff_connects_at_once_to_a_publisher_back_in_the_registry(
    zookeeper_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A subscriber whose attempts to reach a copy failed for a while (the copy was cut off)
    waits up to ``max_backoff`` between attempts. When the copy registers again (it is back
    after its session expired), the subscriber tries at once rather than at the end of the
    wait: the copy is not ready for the application before a subscriber reaches it."""
    import logging
    import socket
    import threading

    from wormhole.connectors.tcp.client import Subscriber
    from wormhole.connectors.zookeeper.registry import ZooKeeperOptions
    from wormhole.plugins.components import PublisherEntry
    from wormhole.plugins.manager import default_registry
    from wormhole.testing import free_port

    root = "/mcp-backoff"
    options = ZooKeeperOptions(hosts=zookeeper_server.hosts, root=root)
    entry = PublisherEntry("db1", shards=8, copy="a", address=f"127.0.0.1:{free_port()}")

    def register(address: str) -> Any:
        registry = default_registry().create("registry", "zookeeper", options)
        registry.open("shop", threading.Event())
        registry.application_store().seed_applications(
            {"search": {"sink": {"type": "jsonl", "path": "out.jsonl"}}}
        )
        registry.register_publisher(dataclasses.replace(entry, address=address))
        return registry

    unreachable = register(entry.address)  # nothing listens there
    listener = socket.create_server(("127.0.0.1", 0))
    subscriber = Subscriber(
        "search", registry=f"zookeeper://{zookeeper_server.hosts}{root}", dataset="shop",
        max_backoff=30.0,
    )  # fmt: skip
    thread = threading.Thread(target=subscriber.run, daemon=True)
    caplog.set_level(logging.WARNING, logger="wormhole.subscriber")
    thread.start()
    back = None
    try:
        wait_until(lambda: "reconnecting in 6.4s" in caplog.text, 60, "the backoff to grow")
        unreachable.close()  # its session ends: the entry goes
        back = register(f"127.0.0.1:{listener.getsockname()[1]}")
        listener.settimeout(3.0)  # well within the 6.4 s wait under way
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            pytest.fail("the subscriber waited out its backoff: no connection within 3s")
        connection.close()
    finally:
        subscriber.stop()
        thread.join(30)
        listener.close()
        if back is not None:
            back.close()
