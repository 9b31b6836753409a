"""Multiple-copy delivery keeps serving: some ready copy serves the application after a
restart, a pause or a copy that cannot serve, with real ZooKeeper and real processes.

Each test is a deterministic trigger of one way an application was left with no copy
serving it while a copy that holds every update was up (issue: "Multiple-copy delivery
that always serves"). The deployment is the two-copy one of ``test_multiple_copy``.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_multiple_copy import Copies, check, reached, serving_epoch, shared_versions

from wormhole.testing import free_port, wait_until, write_pipeline
from wormhole.testing.prometheus import sample, scrape


@pytest.fixture
def copies(tmp_path: Path, zookeeper_server: Any, request: pytest.FixtureRequest) -> Any:
    deployment = Copies(tmp_path, zookeeper_server, f"/mcl-{request.node.name[:40]}")
    yield deployment
    deployment.stop()


def _deliver_round_0(copies: Copies, tmp_path: Path, keys: int) -> Path:
    """A subscriber gets round 0 of ``keys`` keys, and the shared datamarkers name its last
    update: a quiet period. Returns the sink's file."""
    copies.subscribe(0)
    out = tmp_path / "search.jsonl"
    copies.write(keys, 0)
    wait_until(lambda: reached(out, keys, 0), 60, "round 0")
    wait_until(
        lambda: max(shared_versions(copies).values(), default=(0,)) == (keys,),
        30,
        "the shared datamarkers to reach the last update",
    )
    return out


def test_a_copy_restarted_in_a_quiet_period_keeps_what_the_shared_datamarkers_name(
    copies: Copies, tmp_path: Path
) -> None:
    """The preferred copy stops gracefully once everything was delivered and comes back:
    its first persist must not collect the update the shared datamarkers name (the last
    one of its previous session), so the application fails back to it and it serves."""
    keys = 10
    for copy in "ab":
        copies.pipeline(copy)
    copies.publish("a")
    wait_until(lambda: copies.serving() == "a", 60, "copy a (preferred) to serve")
    copies.publish("b")
    out = _deliver_round_0(copies, tmp_path, keys)
    assert copies.publishers["a"].stop() == 0
    wait_until(lambda: copies.serving() == "b", 30, "copy b to take over")
    restarted = copies.publish("a")
    wait_until(lambda: copies.serving() == "a", 30, "the application to fail back to a")
    copies.write(keys, 1)
    wait_until(lambda: reached(out, keys, 1), 30, "round 1, from the restarted copy a")
    assert copies.serving() == "a"
    assert "Gone" not in restarted.stderr and "older than" not in restarted.stderr, restarted.stderr


def test_a_copy_whose_status_says_ready_from_before_a_pause_is_not_handed_the_application(
    copies: Copies, tmp_path: Path
) -> None:
    """Copy b serves; the preferred copy a is live again, its status saying "ready" as it
    did before a pause (when it was serving) while its publisher log is far behind the
    shared datamarkers. b checks a's readiness against the datamarkers it would hand over,
    at the moment it would: it keeps serving, under the same claim."""
    from wormhole.connectors.zookeeper.registry import ZooKeeperOptions, ZooKeeperRegistry
    from wormhole.plugins.components import PublisherEntry
    from wormhole.plugins.manager import default_registry

    keys = 10
    for copy in "ab":
        copies.pipeline(copy)
    b = copies.publish("b")
    wait_until(lambda: copies.serving() == "b", 60, "copy b (the only one) to serve")
    out = _deliver_round_0(copies, tmp_path, keys)
    epoch = serving_epoch(copies)
    options = ZooKeeperOptions(hosts=copies.zk.hosts, root=copies.root)
    stale = default_registry().create("registry", "zookeeper", options)
    assert isinstance(stale, ZooKeeperRegistry)
    stale.open("shop", threading.Event())
    try:
        stale.register_publisher(PublisherEntry("db1", shards=8, copy="a", host="paused"))
        stale.publish_status(
            "db1@a",
            {
                "copies": {
                    "copy": "a",
                    "newest": [1],
                    "serving": {},
                    "copies_ready": {"search": True},
                }
            },
        )
        wait_until(lambda: "a is preferred but cannot take over" in b.stderr, 30, "b to hold on")
        line = next(ln for ln in b.stderr_lines if "cannot take over yet" in ln)
        assert f"reached version [1], the shared datamarkers ({keys},)" in line, line
        copies.write(keys, 1)
        wait_until(lambda: reached(out, keys, 1), 30, "round 1, from b")
        assert serving_epoch(copies) == epoch, "b kept its claim"
        assert "hands it over" not in b.stderr, b.stderr
    finally:
        stale.close()


def test_a_preferred_copy_that_cannot_serve_does_not_block_a_ready_one(
    copies: Copies, tmp_path: Path
) -> None:
    """Copy a is preferred but its datastore is behind the shared datamarkers; copy b, which
    holds everything, stops gracefully and comes back. a must not claim the free application
    in a loop (each claim restarting b's grace period): it does not claim what it cannot
    serve, says why, and b takes the application over after its grace period."""
    keys = 10
    metrics = {}
    for copy in "ab":
        path = copies.pipeline(copy, {"failback": "auto"})
        raw = yaml.safe_load(path.read_text())
        metrics[copy] = raw["metrics"] = {"listen": f"127.0.0.1:{free_port()}"}
        write_pipeline(path, raw)
    b = copies.publish("b")
    wait_until(lambda: copies.serving() == "b", 60, "copy b (the only one) to serve")
    copies.subscribe(0)
    out = tmp_path / "search.jsonl"
    # Round 0 reaches copy b only: a's datastore is behind from the start.
    lagging = copies.writers.pop("a")
    copies.write(keys, 0)
    wait_until(lambda: reached(out, keys, 0), 60, "round 0, from b")
    wait_until(
        lambda: max(shared_versions(copies).values(), default=(0,)) == (keys,),
        30,
        "the shared datamarkers to reach round 0",
    )
    a = copies.publish("a")
    wait_until(lambda: "a is preferred but cannot take over" in b.stderr, 30, "a to be seen")
    epoch = serving_epoch(copies)
    assert b.stop() == 0
    wait_until(lambda: "copy a cannot serve it" in a.stderr, 30, "a to say why it does not claim")
    line = next(ln for ln in a.stderr_lines if "copy a cannot serve it" in ln)
    assert "WARNING" in line and "has not reached the shared datamarker" in line, line
    b = copies.publish("b")
    wait_until(lambda: copies.serving() == "b", 30, "the restarted copy b to take over")
    copies.write(keys, 1)
    wait_until(lambda: reached(out, keys, 1), 30, "round 1, from b")
    # a never claimed: the epoch moved by b's own claim only.
    assert serving_epoch(copies) == epoch + 1
    assert "serves it from epoch" not in a.stderr, a.stderr
    claims = "wormhole_serving_claims_total"
    exposition = scrape(metrics["a"]["listen"])
    assert sample(exposition, claims, application="search", outcome="refused") is None
    assert sample(exposition, claims, application="search", outcome="served") is None
    exposition = scrape(metrics["b"]["listen"])
    assert sample(exposition, claims, application="search", outcome="served") == 1
    lagging.close()


def test_a_serving_copy_keeps_what_the_shared_datamarkers_name_through_a_registry_blip(
    copies: Copies, tmp_path: Path
) -> None:
    """The only copy is restarted in a quiet period and takes the application over at once;
    its own datamarkers then stand at the end of its previous session, ahead of the update
    the shared datamarkers name. Its retention must keep that update: when ZooKeeper goes
    away and comes back, the copy claims the application again from the shared datamarkers
    (a Gone or Behind there leaves it with no copy serving)."""
    keys = 10
    copies.pipeline("a")
    copies.publish("a")
    wait_until(lambda: copies.serving() == "a", 60, "copy a to serve")
    out = _deliver_round_0(copies, tmp_path, keys)
    assert copies.publishers["a"].stop() == 0
    a = copies.publish("a")
    wait_until(lambda: copies.serving() == "a", 30, "the restarted copy a to serve")
    epoch = serving_epoch(copies)
    copies.zk.pause()
    try:
        wait_until(lambda: "stops serving" in a.stderr, 30, "a to lose ZooKeeper")
    finally:
        copies.zk.resume()
    wait_until(lambda: serving_epoch_or_none(copies) not in (None, epoch), 30, "a new claim")
    wait_until(lambda: copies.serving() == "a", 30, "copy a to serve again")
    copies.write(keys, 1)
    wait_until(lambda: reached(out, keys, 1), 30, "round 1, after the blip")
    assert "older than this copy's publisher log" not in a.stderr, a.stderr


def serving_epoch_or_none(copies: Copies) -> int | None:
    try:
        return serving_epoch(copies)
    except Exception:  # no claim now
        return None


def test_a_standby_behind_reads_on_from_where_its_last_scan_ended(
    tmp_path: Path, zookeeper_server: Any
) -> None:
    """A standby whose log has not reached the shared datamarkers (none mapped yet) looks
    for them at every tick: it reads on from where its previous scan ended, not its whole
    log again, and maps them once its log reaches them."""
    from wormhole.core.copies import CopyCoordinator, copy_registry
    from wormhole.core.hub import Hub
    from wormhole.core.pipeline import load_pipeline
    from wormhole.core.publisher_log import PublisherLog
    from wormhole.core.update import Update
    from wormhole.plugins.components import SharedDatamarker

    deployment = Copies(tmp_path, zookeeper_server, "/mcl-standby-scan")
    pipeline = load_pipeline(deployment.pipeline("b"))
    registries = []
    for _ in range(2):
        assert pipeline.dataset_registry is not None
        registry = pipeline.dataset_registry.create()
        registry.open("shop", threading.Event())
        registries.append(registry)
    serving, standby = registries

    def append(plog: PublisherLog, first: int, count: int) -> None:
        updates = [
            Update.create(op="c", key={"id": i}, table="t", after={"id": i}, connector="filelog")
            for i in range(first, first + count)
        ]
        for i, u in enumerate(updates):
            u.position, u.logical = f"f:{first + i}", f"orders:{first + i}"
        plog.append(updates, {"at": first})

    plog = PublisherLog(tmp_path / "log")
    plog.open()
    for first in range(1, 1001, 50):
        append(plog, first, 50)
    plog.close()
    plog = PublisherLog(tmp_path / "log")  # a new session: the log is read from disk
    plog.open()
    try:
        epoch = serving.serving_claims().claim_serving("search", "db1", "a")
        assert epoch is not None
        marker = SharedDatamarker("orders:1020", (1020,), epoch)
        assert serving.serving_claims().save_datamarkers("search", "db1", epoch, {0: marker})
        coordinator = CopyCoordinator(pipeline, copy_registry(standby), Hub(pipeline, {}), plog)
        coordinator.add("search")
        read = [plog.bytes_read]
        for _ in range(3):
            coordinator.tick()
            read.append(plog.bytes_read)
        # The first tick reads the log's 20 records; each later one, the last record again.
        whole = read[1] - read[0]
        assert whole > 0 and all(b - a < whole / 4 for a, b in itertools.pairwise(read[1:])), read
        assert coordinator.status()["copies_ready"] == {"search": False}
        append(plog, 1001, 50)
        coordinator.tick()
        assert coordinator.status()["copies_ready"] == {"search": True}
        assert coordinator.apps["search"].mapped == {0: ((1020,), 1020)}
    finally:
        plog.close()
        for registry in registries:
            registry.close()


def test_a_copy_resumed_after_a_pause_gets_the_application_back_only_once_ready(
    copies: Copies, tmp_path: Path
) -> None:
    """Copy a serves; it is paused past its session, b takes over, and a round reaches b's
    datastore only. Resumed, a is behind the shared datamarkers: b keeps the application
    (before, a came back with its "ready" status from before the pause and b handed over
    at once to a copy that could not serve). Once a's datastore catches up, b hands over."""
    keys = 10
    for copy in "ab":
        copies.pipeline(copy)
    copies.publish("a")
    wait_until(lambda: copies.serving() == "a", 60, "copy a (preferred) to serve")
    b = copies.publish("b")
    copies.subscribe(0)
    out = tmp_path / "search.jsonl"
    copies.write(keys, 0)
    wait_until(lambda: reached(out, keys, 0), 60, "round 0")
    paused = copies.publishers["a"]
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: copies.serving() == "b", 30, "copy b to take over from paused a")
        lagging = copies.writers.pop("a")
        copies.write(keys, 1)  # b's datastore only
        wait_until(lambda: reached(out, keys, 1), 30, "round 1, from b")
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    wait_until(lambda: "stops serving" in paused.stderr, 30, "the resumed copy a to stand down")
    wait_until(lambda: "a is preferred but cannot take over" in b.stderr, 30, "b to hold on")
    epoch = serving_epoch(copies)
    copies.write(keys, 2)
    wait_until(lambda: reached(out, keys, 2), 30, "round 2, from b")
    assert serving_epoch(copies) == epoch and "hands it over" not in b.stderr, b.stderr
    # a's datastore catches up: the application goes back to it.
    for n in (1, 2):
        for k in range(keys):
            lagging.publish("orders", key={"id": k}, after={"id": k, "n": n})
    lagging.flush()
    copies.writers["a"] = lagging
    wait_until(lambda: copies.serving() == "a", 30, "the application to fail back to a")
    copies.write(keys, 3)
    wait_until(lambda: reached(out, keys, 3), 30, "round 3, from a")
    copies.stop()
    lines, duplicates = check(out, keys, 4, [(0, {})])
    assert lines - duplicates == keys * 4


def test_a_single_copy_killed_and_restarted_in_a_quiet_period_delivers_the_next_round(
    copies: Copies, tmp_path: Path
) -> None:
    """The only copy is killed (-9) once everything was delivered and started again at
    once (it waits for its old session to expire): it serves, and the next round arrives."""
    keys = 10
    copies.pipeline("a")
    copies.publish("a")
    wait_until(lambda: copies.serving() == "a", 60, "copy a to serve")
    out = _deliver_round_0(copies, tmp_path, keys)
    # Its own datamarkers are on disk at the log's end: the restart's first persist used to
    # collect the segment holding the update the shared datamarkers name.
    wait_until(lambda: persisted_at_one_end(tmp_path / "state-a", keys), 30, "a to persist")
    copies.publishers["a"].kill()
    copies.publish("a")
    wait_until(lambda: copies.serving() == "a", 30, "the restarted copy a to serve")
    copies.write(keys, 1)
    wait_until(lambda: reached(out, keys, 1), 30, "round 1, from the restarted copy")


def persisted_at_one_end(state_dir: Path, keys: int) -> bool:
    """Whether every flow of ``search`` is persisted, all at one position past ``keys``."""
    from wormhole.core.datamarkers import read_datamarkers

    stored = read_datamarkers(state_dir)
    positions = {m.position for (name, _), m in stored.items() if name == "search"}
    return len(stored) == 8 and len(positions) == 1 and min(positions) >= keys


def test_claims_that_come_and_go_do_not_hold_a_ready_copy_off(
    copies: Copies, tmp_path: Path
) -> None:
    """A preferred copy a that claims the application and gives it back at once, over and
    over (what a copy that could not serve used to do): each claim used to restart the
    grace period of copy b, which then never took the application. A claim given back
    within the grace period does not count as held: b takes it over."""
    from wormhole.connectors.zookeeper.registry import ZooKeeperOptions, ZooKeeperRegistry
    from wormhole.plugins.components import PublisherEntry
    from wormhole.plugins.manager import default_registry

    keys = 10
    for copy in "ab":
        copies.pipeline(copy)
    b = copies.publish("b")
    wait_until(lambda: copies.serving() == "b", 60, "copy b (the only one) to serve")
    copies.subscribe(0)
    out = tmp_path / "search.jsonl"
    copies.write(keys, 0)
    wait_until(lambda: reached(out, keys, 0), 60, "round 0")
    options = ZooKeeperOptions(hosts=copies.zk.hosts, root=copies.root)
    churn = default_registry().create("registry", "zookeeper", options)
    assert isinstance(churn, ZooKeeperRegistry)
    churn.open("shop", threading.Event())
    done = threading.Event()
    claims = []

    def claim_and_give_back() -> None:
        while not done.is_set():
            epoch = churn.serving_claims().claim_serving("search", "db1", "a")
            if epoch is not None:
                claims.append(epoch)
                churn.serving_claims().release_serving("search", "db1", epoch)
            done.wait(0.05)

    thread = threading.Thread(target=claim_and_give_back, daemon=True)
    try:
        churn.register_publisher(PublisherEntry("db1", shards=8, copy="a", host="churn"))
        thread.start()
        assert b.stop() == 0
        wait_until(lambda: len(claims) >= 5, 30, "copy a to claim and give back")
        b = copies.publish("b")
        wait_until(lambda: copies.serving() == "b", 30, "copy b to take over")
        copies.write(keys, 1)
        wait_until(lambda: reached(out, keys, 1), 30, "round 1, from b")
    finally:
        done.set()
        thread.join(10)
        churn.close()


@pytest.mark.parametrize("step", ["start", "finish"])
def test_a_registry_interruption_during_a_hand_over_takes_the_hand_over_with_it(
    tmp_path: Path, zookeeper_server: Any, step: str
) -> None:
    """The serving copy reads the other copy's status before it starts a hand-over and
    again before it finishes one; the read waits out a registry interruption, whose handling
    (the claim is lost: stop serving) may run meanwhile. The hand-over must then end with the
    claim: nothing started on a claim no longer held, nothing released or activated under it,
    and no crash (a TypeError stopped the publisher's supervisor). A real ZooKeeper gives this
    moment only by chance: a stand-in wraps the real registry and runs the interruption's
    handling inside the status read."""
    import time

    from wormhole.core.copies import CopyCoordinator, copy_registry
    from wormhole.core.flows import FlowState
    from wormhole.core.hub import ApplicationRuntime, Hub
    from wormhole.core.pipeline import load_pipeline
    from wormhole.core.publisher_log import PublisherLog

    deployment = Copies(tmp_path, zookeeper_server, f"/mcl-handover-blip-{step}")
    pipeline = load_pipeline(deployment.pipeline("a"))
    assert pipeline.dataset_registry is not None
    registry = pipeline.dataset_registry.create()
    registry.open("shop", threading.Event())
    parts = copy_registry(registry)
    plog = PublisherLog(tmp_path / "log")
    plog.open()
    flows = [FlowState("search", s, 0, 0, 0) for s in range(pipeline.shards)]
    runtime = ApplicationRuntime(
        config=pipeline.applications["search"], flows=flows, filter=None, active=False
    )
    hub = Hub(pipeline, {"search": runtime})
    released: list[int] = []
    b_ready = {"db1@b": {"copies": {"copies_ready": {"search": step == "start"}}}}

    class Interrupted:
        """The registry, with an interruption handled while the statuses are read."""

        def __getattr__(self, name: str) -> Any:
            return getattr(parts, name)

        def statuses(self) -> dict[str, Any]:
            coordinator._connection(False)
            return b_ready

        def release_serving(self, application: str, datastore: str, epoch: int) -> None:
            released.append(epoch)
            parts.release_serving(application, datastore, epoch)

    try:
        coordinator = CopyCoordinator(pipeline, Interrupted(), hub, plog)
        coordinator.add("search")
        epoch = parts.claim_serving("search", "db1", "a")
        assert epoch
        state = coordinator.apps["search"]
        coordinator.election.take_over(state, epoch, coordinator.generation)
        assert runtime.active and state.epoch == epoch
        # Copy b is the one to hand the application to (as `apps move` or failback ask).
        coordinator.serving.hand_over_to = lambda state, app: "b"  # type: ignore[method-assign]
        now = time.monotonic()
        if step == "finish":
            state.handing_over = state.settled_at = now - 1
        coordinator.serving.serve(state, now)
        assert state.epoch == 0 and not runtime.active
        assert state.handing_over is None and state.settled_at is None
        assert released == []
    finally:
        plog.close()
        registry.close()


def test_an_application_removed_and_added_again_keeps_one_watch_of_each_kind(
    tmp_path: Path, zookeeper_server: Any
) -> None:
    """A publisher watches each application's subscribers (its membership) and, as a copy,
    its serving claim; removing the application ends both watches, so applications removed
    and added again, or removed for good, leave no watch behind (each one is read again
    after every reconnect, and told of changes of an application that is gone)."""
    from wormhole.core.copies import CopyCoordinator, copy_registry
    from wormhole.core.flows import FlowState
    from wormhole.core.hub import ApplicationRuntime, Hub
    from wormhole.core.pipeline import load_pipeline
    from wormhole.core.publisher_log import PublisherLog
    from wormhole.core.registry import PublisherMembership

    deployment = Copies(tmp_path, zookeeper_server, "/mcl-unwatch")
    pipeline = load_pipeline(deployment.pipeline("a"))
    membership = PublisherMembership(pipeline, threading.Event())
    registry: Any = membership.registry
    plog = PublisherLog(tmp_path / "log")
    plog.open()
    flows = [FlowState("search", s, 0, 0, 0) for s in range(pipeline.shards)]
    runtime = ApplicationRuntime(
        config=pipeline.applications["search"], flows=flows, filter=None, active=False
    )
    hub = Hub(pipeline, {"search": runtime})
    membership.hub = hub
    told: list[Any] = []
    try:
        coordinator = CopyCoordinator(pipeline, copy_registry(registry), hub, plog)
        coordinator._serving = lambda name, claim: told.append(claim)  # type: ignore[method-assign]
        watches = registry.session.dispatcher.watched
        before = watches()
        for _ in range(3):
            membership.watch_subscribers("search")
            coordinator.add("search")
            assert watches() == before + 2
            coordinator.remove("search")
            assert watches() == before + 1
            membership.unwatch_subscribers("search")
            assert watches() == before
        assert len(told) == 3  # each watch told the claim once, when set
    finally:
        plog.close()
        membership.registry.close()
