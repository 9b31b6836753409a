"""The ``zookeeper`` registry against a real ZooKeeper: publishers claim datastores,
applications are seeded once and changed at run time, subscribers register in order, and
everything a process registered comes back after its session expires or the server
restarts."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import pytest

pytest.importorskip("kazoo")

from pydantic import ValidationError

from wormhole.connectors.zookeeper.registry import (
    ZooKeeperOptions,
    ZooKeeperRegistry,
)
from wormhole.core.errors import ConfigError, StateError, Stopped
from wormhole.plugins.components import (
    DatastoreHeld,
    InvalidEntry,
    PublisherEntry,
    ServingClaim,
    SharedDatamarker,
    SubscriberEntry,
)
from wormhole.plugins.manager import default_registry
from wormhole.testing import ThrottlingProxy, free_port, wait_until

T = TypeVar("T")
WAIT = 20.0


class Recorder(Generic[T]):
    """A watcher function that queues every value it is called with."""

    def __init__(self) -> None:
        self.values: queue.Queue[T] = queue.Queue()
        self.calls = 0

    def __call__(self, value: T) -> None:
        self.calls += 1
        self.values.put(value)

    def next(self, timeout: float = WAIT) -> T:
        return self.values.get(timeout=timeout)

    def until(self, condition: Callable[[T], bool], timeout: float = WAIT) -> T:
        """The first value (from now on, in call order) for which ``condition`` holds."""
        deadline = time.monotonic() + timeout
        seen: list[T] = []
        while True:
            try:
                value = self.values.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no value matched within {timeout}s; saw {seen}") from None
            if condition(value):
                return value
            seen.append(value)


@pytest.fixture
def root() -> str:
    return f"/t/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def registries(zookeeper_server: Any, root: str) -> Iterator[Callable[..., ZooKeeperRegistry]]:
    """``make(**options)``: an open registry of dataset ``shop`` under the test's root."""
    made: list[ZooKeeperRegistry] = []

    def make(dataset: str = "shop", **options: Any) -> ZooKeeperRegistry:
        opts = ZooKeeperOptions(**{"hosts": zookeeper_server.hosts, "root": root, **options})
        registry = default_registry().create("registry", "zookeeper", opts)
        assert isinstance(registry, ZooKeeperRegistry)
        registry.open(dataset, threading.Event())
        made.append(registry)
        return registry

    yield make
    for registry in made:
        registry.close()


@pytest.fixture
def raw(zookeeper_server: Any) -> Iterator[Any]:
    """A plain kazoo client of the server."""
    client = zookeeper_server.client()
    yield client
    client.stop()
    client.close()


def entry(datastore: str = "db1", **fields: Any) -> PublisherEntry:
    values: dict[str, Any] = {"shards": 8, "transport": "tcp", "host": "alpha", "pid": 41}
    return PublisherEntry(datastore, **{**values, **fields})


# --------------------------------------------------------------------- options
def test_options_are_validated_and_describe_names_the_ensemble() -> None:
    with pytest.raises(ValidationError, match="must be an absolute znode path"):
        ZooKeeperOptions(hosts="zk1:2181", root="wormhole")
    with pytest.raises(ValidationError, match="greater than or equal to 2000"):
        ZooKeeperOptions(hosts="zk1:2181", session_timeout_ms=500)
    with pytest.raises(ValidationError):
        ZooKeeperOptions(hosts="zk1:2181", zookeeper="x")  # type: ignore[call-arg]
    registry = ZooKeeperRegistry(ZooKeeperOptions(hosts="10.0.0.1:2181,10.0.0.2:2181"))
    assert registry.describe() == "zookeeper 10.0.0.1:2181,10.0.0.2:2181/wormhole"
    spec = default_registry().get("registry", "zookeeper").spec
    assert spec.options is ZooKeeperOptions
    assert spec.capabilities is not None and spec.capabilities.shared_registry
    from wormhole.core.registry import registry_component

    component = registry_component("zookeeper://zk1:2181,zk2:2181/wr")
    made = component.create()
    assert made.describe() == "zookeeper zk1:2181,zk2:2181/wr"
    made.dataset = "shop"
    assert (
        made.application_store()
        .application_path("search")
        .endswith("node /wr/datasets/shop/applications/search")
    )


def test_open_gives_up_naming_the_hosts_when_nothing_listens() -> None:
    hosts = f"127.0.0.1:{free_port()}"
    registry = ZooKeeperRegistry(ZooKeeperOptions(hosts=hosts, connect_timeout_s=2))
    started = time.monotonic()
    with pytest.raises(StateError) as raised:
        registry.open("shop", threading.Event())
    assert time.monotonic() - started < 10
    assert f"is ZooKeeper running at {hosts}? check registry.hosts" in str(raised.value)
    registry.close()


def test_open_stops_waiting_when_asked() -> None:
    registry = ZooKeeperRegistry(
        ZooKeeperOptions(hosts=f"127.0.0.1:{free_port()}", connect_timeout_s=60)
    )
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    started = time.monotonic()
    with pytest.raises(Stopped, match="stopped while connecting"):
        registry.open("shop", stop)
    assert time.monotonic() - started < 10


# ------------------------------------------------------------------ publishers
def test_a_publisher_is_watched_claimed_once_and_gone_when_closed(
    registries: Callable[..., ZooKeeperRegistry], root: str
) -> None:
    first = registries()
    watcher = registries()
    seen: Recorder[list[PublisherEntry]] = Recorder()
    watcher.watch_publishers(seen)
    assert seen.next() == []

    first.register_publisher(entry())
    assert seen.until(lambda v: v != []) == [entry()]
    # The address arrives once the transport listens: a data change fires too.
    first.register_publisher(entry(address="127.0.0.1:7070"))
    assert seen.until(lambda v: v != [entry()]) == [entry(address="127.0.0.1:7070")]

    second = registries()
    with pytest.raises(StateError) as raised:
        second.register_publisher(entry(host="beta", pid=7))
    message = str(raised.value)
    assert "datastore db1 of dataset shop is already published by alpha:41" in message
    assert "(address 127.0.0.1:7070)" in message
    assert f"node {root}/datasets/shop/publishers/db1" in message
    assert "give this one another datastore" in message

    second.register_publisher(entry("db2", host="beta", pid=7))
    assert [e.datastore for e in seen.until(lambda v: len(v) == 2)] == ["db1", "db2"]

    first.close()
    first.close()  # idempotent
    assert seen.until(lambda v: len(v) == 1) == [entry("db2", host="beta", pid=7)]
    # Now the datastore is free.
    second.register_publisher(entry(host="beta", pid=7))
    assert len(seen.until(lambda v: len(v) == 2)) == 2


def test_invalid_publisher_nodes_are_skipped_with_a_warning(
    registries: Callable[..., ZooKeeperRegistry],
    raw: Any,
    root: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = registries()
    path = f"{root}/datasets/shop/publishers/broken"
    raw.create(path, b"{not json", ephemeral=True)
    seen: Recorder[list[PublisherEntry]] = Recorder()
    with caplog.at_level(logging.WARNING, logger="wormhole.zookeeper"):
        registry.watch_publishers(seen)
        assert seen.next() == []
        registry.register_publisher(entry())
        assert seen.until(lambda v: v != []) == [entry()]
    assert any(path in r.getMessage() for r in caplog.records)


def test_status_is_shared_and_read(registries: Callable[..., ZooKeeperRegistry]) -> None:
    first = registries()
    reader = registries()
    first.publish_status("db1", {"flows": 3, "owners": {"app": ["s0"]}})
    first.publish_status("db1", {"flows": 4})
    assert reader.statuses() == {"db1": {"flows": 4}}
    first.close()
    assert reader.statuses() == {}


def test_each_registry_offers_the_parts_it_can(
    registries: Callable[..., ZooKeeperRegistry],
) -> None:
    """The contract's optional parts: zookeeper offers the application store and serving
    claims; the file registry offers neither, and multiple-copy delivery refuses it."""
    from wormhole.connectors.pipelinefile import FileRegistry
    from wormhole.core.copies import copy_registry
    from wormhole.core.registry import application_path

    zookeeper = registries()
    store = zookeeper.application_store()
    store.put_application("search", {"sink": {"type": "jsonl"}})
    assert store.applications() == {"search": {"sink": {"type": "jsonl"}}}
    assert application_path(zookeeper, "search").endswith("/datasets/shop/applications/search")
    claims = zookeeper.serving_claims()
    assert claims.claim_serving("search", "db1", "a") == 1
    assert copy_registry(zookeeper).load_datamarkers("search", "db1") == {}

    file = FileRegistry()
    file.open("shop", threading.Event())
    assert file.application_store() is None
    assert file.serving_claims() is None
    assert application_path(file, "search") == "the pipeline file: application search"
    refused = r"registry with serving claims.*\(the pipeline file has none\)"
    with pytest.raises(ConfigError, match=refused):
        copy_registry(file)


# ---------------------------------------------------------------- applications
def test_the_file_seeds_the_applications_once_even_when_publishers_race(
    registries: Callable[..., ZooKeeperRegistry],
) -> None:
    apps = {"search": {"sink": {"type": "jsonl"}}, "audit": {"filter": "true", "shards": 4}}
    racers = [registries() for _ in range(4)]
    barrier = threading.Barrier(len(racers))
    results: list[bool] = []

    def seed(registry: ZooKeeperRegistry) -> None:
        barrier.wait()
        results.append(registry.application_store().seed_applications(apps))

    threads = [threading.Thread(target=seed, args=(r,)) for r in racers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert sorted(results) == [False, False, False, True]
    assert racers[0].application_store() is not None
    assert racers[0].application_store().applications() == apps
    # Removing them all does not make the next publisher seed again.
    assert racers[1].application_store().remove_application("search")
    assert racers[1].application_store().remove_application("audit")
    assert not racers[2].application_store().seed_applications(apps)
    assert racers[2].application_store().applications() == {}


def test_an_unreadable_application_names_its_node(
    registries: Callable[..., ZooKeeperRegistry], raw: Any, root: str
) -> None:
    registry = registries()
    registry.application_store().put_application("good", {"sink": {"type": "jsonl"}})
    raw.create(f"{root}/datasets/shop/applications/bad", b"{oops")
    raw.create(f"{root}/datasets/shop/applications/list", b"[1, 2]")
    apps = registry.application_store().applications()
    assert apps["good"] == {"sink": {"type": "jsonl"}}
    bad, listed = apps["bad"], apps["list"]
    assert isinstance(bad, InvalidEntry) and isinstance(listed, InvalidEntry)
    assert bad.path == f"{root}/datasets/shop/applications/bad"
    assert "not JSON" in bad.reason
    assert listed.path.endswith("/applications/list") and "not a JSON object" in listed.reason


def test_put_and_remove_application_fire_the_watch(
    registries: Callable[..., ZooKeeperRegistry],
) -> None:
    admin = registries()
    publisher = registries()
    seen: Recorder[dict[str, Any]] = Recorder()
    publisher.application_store().watch_applications(seen)
    assert seen.next() == {}
    admin.application_store().put_application("search", {"sink": {"type": "jsonl"}})
    assert seen.until(lambda v: v != {}) == {"search": {"sink": {"type": "jsonl"}}}
    admin.application_store().put_application("search", {"sink": {"type": "jsonl"}, "shards": 2})
    assert seen.until(lambda v: v["search"].get("shards") == 2)
    admin.register_subscriber("search", SubscriberEntry("s0"))
    admin.application_store().put_application("audit", {})
    assert set(seen.until(lambda v: len(v) == 2)) == {"search", "audit"}
    assert admin.application_store().remove_application("search")  # its subscribers with it
    assert seen.until(lambda v: len(v) == 1) == {"audit": {}}
    assert not admin.application_store().remove_application("search")
    with pytest.raises(ConfigError, match="cannot be a znode name"):
        admin.application_store().put_application("a/b", {})


# ------------------------------------------------------------------ subscribers
def test_subscribers_are_listed_in_registration_order(
    registries: Callable[..., ZooKeeperRegistry],
) -> None:
    one = registries()
    two = registries()
    watcher = registries()
    with pytest.raises(ConfigError, match=r"unknown application 'search' of dataset shop"):
        one.register_subscriber("search", SubscriberEntry("s0"))
    one.application_store().put_application("search", {"sink": {"type": "jsonl"}})

    seen: Recorder[list[SubscriberEntry]] = Recorder()
    watcher.watch_subscribers("search", seen)
    assert seen.next() == []
    two.register_subscriber("search", SubscriberEntry("s1", host="beta", pid=2))
    one.register_subscriber("search", SubscriberEntry("s0", host="alpha", pid=1))
    two.register_subscriber("search", SubscriberEntry("s2", host="beta", pid=3))
    listed = seen.until(lambda v: len(v) == 3)
    assert [s.instance for s in listed] == ["s1", "s0", "s2"]
    assert [s.order for s in listed] == sorted(s.order for s in listed)
    assert (listed[1].host, listed[1].pid) == ("alpha", 1)

    two.unregister_subscriber("search", "s1")
    assert [s.instance for s in seen.until(lambda v: len(v) == 2)] == ["s0", "s2"]

    # The application goes: no subscribers; it comes back: the watch still works.
    watcher.application_store().remove_application("search")
    assert seen.until(lambda v: v == []) == []
    watcher.application_store().put_application("search", {})
    one.register_subscriber("search", SubscriberEntry("s9"))
    assert [s.instance for s in seen.until(lambda v: len(v) == 1)] == ["s9"]


# ----------------------------------------------------------- losing ZooKeeper
def _owner(raw: Any, path: str) -> int | None:
    stat = raw.exists(path)
    return None if stat is None else int(stat.ephemeralOwner)


def _subscriber_nodes(raw: Any, root: str) -> list[str]:
    parent = f"{root}/datasets/shop/applications/search/subscribers"
    return list(raw.get_children(parent)) if raw.exists(parent) else []


def _registered(registry: ZooKeeperRegistry) -> Recorder[list[PublisherEntry]]:
    registry.application_store().put_application("search", {})
    registry.register_publisher(entry(address="127.0.0.1:7070"))
    registry.publish_status("db1", {"flows": 1})
    registry.register_subscriber("search", SubscriberEntry("s0", host="alpha", pid=41))
    seen: Recorder[list[PublisherEntry]] = Recorder()
    registry.watch_publishers(seen)
    assert seen.next() == [entry(address="127.0.0.1:7070")]
    return seen


def _wait_registered_again(raw: Any, root: str, registry: ZooKeeperRegistry, old: int) -> None:
    base = f"{root}/datasets/shop"
    deadline = time.monotonic() + WAIT
    while True:
        sid = registry.session.session_id()
        owners = {
            _owner(raw, f"{base}/publishers/db1"),
            *(
                _owner(raw, f"{base}/applications/search/subscribers/{n}")
                for n in _subscriber_nodes(raw, root)
            ),
        }
        if sid != old and owners == {sid} and len(_subscriber_nodes(raw, root)) == 1:
            return
        assert time.monotonic() < deadline, f"not registered again: {owners}, session {sid}"
        time.sleep(0.05)


def test_an_expired_session_registers_everything_again(
    registries: Callable[..., ZooKeeperRegistry], zookeeper_server: Any, raw: Any, root: str
) -> None:
    registry = registries()
    seen = _registered(registry)
    session = registry.session.client.client_id
    # Closing another client of the same session expires it for its owner.
    from kazoo.client import KazooClient

    thief = KazooClient(hosts=zookeeper_server.hosts, client_id=session)
    thief.start(timeout=WAIT)
    thief.stop()
    thief.close()

    _wait_registered_again(raw, root, registry, session[0])
    assert json.loads(raw.get(f"{root}/datasets/shop/publishers/db1")[0]) == dataclasses.asdict(
        entry(address="127.0.0.1:7070")
    )
    # The watch fires again with the publisher once the registry is back.
    assert seen.until(lambda v: v != []) == [entry(address="127.0.0.1:7070")]
    _a_status_from_before_an_expiry_comes_back_only_published_again(registry, raw, root)


def _a_status_from_before_an_expiry_comes_back_only_published_again(
    registry: ZooKeeperRegistry, raw: Any, root: str
) -> None:
    """A status describes the process before the loss (a copy serving then, so "ready"):
    the publisher and subscriber nodes are back, the status is not, until published again."""
    assert registry.statuses() == {}
    registry.publish_status("db1", {"flows": 2})
    assert _owner(raw, f"{root}/datasets/shop/status/db1") == registry.session.session_id()
    assert registry.statuses() == {"db1": {"flows": 2}}


def test_a_registration_held_by_another_after_expiry_is_logged_not_raised(
    registries: Callable[..., ZooKeeperRegistry],
    zookeeper_server: Any,
    raw: Any,
    root: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = registries()
    registry.register_publisher(entry())
    path = f"{root}/datasets/shop/publishers/db1"
    session = registry.session.client.client_id
    from kazoo.client import KazooClient

    thief = KazooClient(hosts=zookeeper_server.hosts, client_id=session)
    thief.start(timeout=WAIT)
    with caplog.at_level(logging.ERROR, logger="wormhole.zookeeper"):
        thief.stop()  # the session ends; another publisher takes the datastore at once
        thief.close()
        for _ in range(200):
            try:
                raw.create(path, json.dumps({"host": "gamma", "pid": 9}).encode(), ephemeral=True)
                break
            except Exception:
                time.sleep(0.02)
        deadline = time.monotonic() + WAIT
        while not any("gamma:9" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "no error logged"
            time.sleep(0.05)
    assert _owner(raw, path) == raw.client_id[0]
    registry.close()  # leaves the other publisher's node alone
    assert _owner(raw, path) == raw.client_id[0]


def test_a_paused_server_past_the_session_timeout(
    registries: Callable[..., ZooKeeperRegistry], zookeeper_server: Any, root: str
) -> None:
    """ZooKeeper stops answering (SIGSTOP) and hears nothing from the registry for longer
    than the session timeout: the session expires, and the registry registers everything
    again in a new one.

    The registry reaches the server through a proxy that holds what the registry sends
    from the pause on. Without it, what the registry sent during the pause (a ping, a
    reconnect naming its session) waits in the paused server's sockets, and as the server
    resumes, its request threads race its session tracker: the session is renewed or
    expired, whichever runs first. A pause longer than the session timeout does not by
    itself make ZooKeeper expire the session; not hearing from its client does.
    """
    with ThrottlingProxy(zookeeper_server.hosts) as proxy:
        registry = registries(session_timeout_ms=4000, hosts=proxy.address)
        seen = _registered(registry)
        calls = seen.calls
        old = registry.session.session_id()
        assert old is not None
        proxy.pause()
        zookeeper_server.pause()
        try:
            # Its pings go unanswered: the registry sees the connection lost.
            wait_until(
                lambda: not registry.session.connected.is_set(), WAIT, "the registry to notice"
            )
        finally:
            zookeeper_server.resume()
        client = zookeeper_server.client()
        try:
            try:
                # The server hears nothing more of the session and expires it, which
                # deletes its ephemeral nodes: the session timeout, counted by the server.
                publisher = f"{root}/datasets/shop/publishers/db1"
                wait_until(lambda: _owner(client, publisher) is None, WAIT, "the expiry")
                assert registry.session.expiries == 0  # the registry cannot know it yet
            finally:
                proxy.resume()
            _wait_registered_again(client, root, registry, old)
            assert registry.session.expiries == 1
            _a_status_from_before_an_expiry_comes_back_only_published_again(registry, client, root)
        finally:
            client.stop()
            client.close()
        assert seen.until(lambda v: v != []) == [entry(address="127.0.0.1:7070")]
        assert seen.calls > calls
        registry.close()


def test_a_restarted_server_keeps_or_regains_the_registrations(
    registries: Callable[..., ZooKeeperRegistry], zookeeper_server: Any, root: str
) -> None:
    registry = registries()
    seen = _registered(registry)
    zookeeper_server.stop()
    try:
        wait_until(lambda: not registry.session.connected.is_set(), WAIT, "the registry to notice")
        # Meanwhile registrations are remembered, not refused.
        registry.register_publisher(entry("db2"))
        registry.publish_status("db2", {"flows": 2})
        registry.register_subscriber("search", SubscriberEntry("s1"))
    finally:
        zookeeper_server.start()
    client = zookeeper_server.client()
    try:
        base = f"{root}/datasets/shop"
        deadline = time.monotonic() + WAIT
        while not (
            _owner(client, f"{base}/publishers/db1") == registry.session.session_id()
            and _owner(client, f"{base}/publishers/db2") == registry.session.session_id()
            and len(_subscriber_nodes(client, root)) == 2
        ):
            assert time.monotonic() < deadline, "not registered after the restart"
            time.sleep(0.05)
        assert client.exists(f"{base}/status/db1") is not None
    finally:
        client.stop()
        client.close()
    assert registry.application_store().applications() == {"search": {}}
    assert registry.statuses() == {"db1": {"flows": 1}, "db2": {"flows": 2}}
    assert [e.datastore for e in seen.until(lambda v: len(v) == 2)] == ["db1", "db2"]


# ------------------------------------------------------- multiple-copy delivery
def _marker(logical: str, version: tuple[int, ...], epoch: int) -> SharedDatamarker:
    return SharedDatamarker(logical, version, epoch)


def _expire(zookeeper_server: Any, registry: ZooKeeperRegistry) -> int:
    """End the registry's session from another client of it; the old session id."""
    from kazoo.client import KazooClient

    session = registry.session.client.client_id
    thief = KazooClient(hosts=zookeeper_server.hosts, client_id=session)
    thief.start(timeout=WAIT)
    thief.stop()
    thief.close()
    return int(session[0])


def test_copies_register_side_by_side_and_release_by_node(
    registries: Callable[..., ZooKeeperRegistry], root: str
) -> None:
    a, b, c = registries(), registries(), registries()
    seen: Recorder[list[PublisherEntry]] = Recorder()
    c.watch_publishers(seen)
    assert seen.next() == []
    a.register_publisher(entry(copy="a"))
    b.register_publisher(entry(copy="b", host="beta", pid=7))
    listed = seen.until(lambda v: len(v) == 2)
    assert [(e.datastore, e.copy, e.node) for e in listed] == [
        ("db1", "a", "db1@a"),
        ("db1", "b", "db1@b"),
    ]
    a.publish_status("db1@a", {"flows": 1})
    b.publish_status("db1@b", {"flows": 2})
    assert c.statuses() == {"db1@a": {"flows": 1}, "db1@b": {"flows": 2}}

    with pytest.raises(DatastoreHeld) as raised:
        c.register_publisher(entry(copy="a", host="gamma", pid=9))
    assert "datastore db1 (copy a) of dataset shop is already published by alpha:41" in str(
        raised.value
    )
    assert raised.value.path == f"{root}/datasets/shop/publishers/db1@a"
    holder = raised.value.holder
    assert holder is not None and holder.node == "db1@a"
    with pytest.raises(ConfigError, match="cannot hold '@'"):
        c.register_publisher(entry(copy="x@y"))

    # Releasing a (dead) holder removes its copy's nodes only.
    assert c.release_publisher("db1", holder)
    assert [e.node for e in seen.until(lambda v: len(v) == 1)] == ["db1@b"]
    assert c.statuses() == {"db1@b": {"flows": 2}}


def test_serving_claims_fence_datamarkers_and_hand_over(
    registries: Callable[..., ZooKeeperRegistry], raw: Any, root: str
) -> None:
    a, b, watcher = registries(), registries(), registries()
    claims: Recorder[ServingClaim | None] = Recorder()
    watcher.serving_claims().watch_serving(
        "search", "db1", claims
    )  # before any claim: no parent node yet
    assert claims.next() is None

    assert a.serving_claims().claim_serving("search", "db1", "a") == 1
    assert b.serving_claims().claim_serving("search", "db1", "b") is None
    assert a.serving_claims().claim_serving("search", "db1", "a") is None  # held, by itself
    found = claims.until(lambda v: v is not None)
    assert found == ServingClaim("a", 1, socket.gethostname(), os.getpid())

    # The holder shares datamarkers, merged by shard.
    assert b.serving_claims().load_datamarkers("search", "db1") == {}
    assert a.serving_claims().save_datamarkers("search", "db1", 1, {0: _marker("l0", (1, 2), 1)})
    assert a.serving_claims().save_datamarkers(
        "search", "db1", 1, {1: _marker("l1", (1, 3), 1), 0: _marker("l0b", (1, 4), 1)}
    )
    expected = {0: _marker("l0b", (1, 4), 1), 1: _marker("l1", (1, 3), 1)}
    assert b.serving_claims().load_datamarkers("search", "db1") == expected
    path = f"{root}/datasets/shop/datamarkers/db1/search"
    written = raw.get(path)[1].mzxid

    # A stale epoch or another process is fenced: nothing is written.
    assert not a.serving_claims().save_datamarkers("search", "db1", 2, {0: _marker("x", (9,), 2)})
    assert not b.serving_claims().save_datamarkers("search", "db1", 1, {0: _marker("x", (9,), 1)})
    assert raw.get(path)[1].mzxid == written
    b.serving_claims().release_serving("search", "db1", 1)  # not b's: nothing happens
    assert raw.exists(f"{root}/datasets/shop/serving/db1/search") is not None

    # Released: the watch sees it free, the other copy claims under a greater epoch.
    a.serving_claims().release_serving("search", "db1", 1)
    assert claims.until(lambda v: v is None) is None
    assert not a.serving_claims().save_datamarkers("search", "db1", 1, {0: _marker("x", (9,), 1)})
    assert b.serving_claims().claim_serving("search", "db1", "b") == 2
    assert claims.until(lambda v: v is not None) == ServingClaim(
        "b", 2, socket.gethostname(), os.getpid()
    )
    assert json.loads(raw.get(f"{root}/datasets/shop/epochs/db1/search")[0]) == 2
    assert not a.serving_claims().save_datamarkers("search", "db1", 1, {0: _marker("x", (9,), 1)})
    assert b.serving_claims().save_datamarkers("search", "db1", 2, {1: _marker("l1b", (2, 1), 2)})
    assert a.serving_claims().load_datamarkers("search", "db1") == {
        0: _marker("l0b", (1, 4), 1),
        1: _marker("l1b", (2, 1), 2),
    }
    # Claims of other applications and datastores are separate.
    assert a.serving_claims().claim_serving("audit", "db1", "a") == 1
    assert a.serving_claims().claim_serving("search", "db2", "a") == 1

    # Closing the holder removes its claim.
    b.close()
    assert claims.until(lambda v: v is None) is None
    assert a.serving_claims().claim_serving("search", "db1", "a") == 3


def test_unreadable_shared_datamarkers_name_their_node(
    registries: Callable[..., ZooKeeperRegistry], raw: Any, root: str
) -> None:
    registry = registries()
    path = f"{root}/datasets/shop/datamarkers/db1/search"
    raw.create(path, b'{"0": {"logical": "x", "version": "nope"}}', makepath=True)
    with pytest.raises(StateError, match=f"znode {path}.*version is 'nope'"):
        registry.serving_claims().load_datamarkers("search", "db1")
    raw.set(path, b"{oops")
    with pytest.raises(StateError, match=f"znode {path}.*not JSON"):
        registry.serving_claims().load_datamarkers("search", "db1")


def test_an_expired_session_loses_its_claims_for_good(
    registries: Callable[..., ZooKeeperRegistry], zookeeper_server: Any, raw: Any, root: str
) -> None:
    holder, other = registries(), registries()
    connection: Recorder[bool] = Recorder()
    holder.watch_connection(connection)
    assert connection.next() is True
    claims: Recorder[ServingClaim | None] = Recorder()
    other.serving_claims().watch_serving("search", "db1", claims)
    assert claims.next() is None
    holder.register_publisher(entry(copy="a"))
    assert holder.serving_claims().claim_serving("search", "db1", "a") == 1
    assert claims.until(lambda v: v is not None).epoch == 1
    assert holder.serving_claims().save_datamarkers("search", "db1", 1, {0: _marker("l0", (1,), 1)})

    old = _expire(zookeeper_server, holder)
    assert connection.next() is False
    assert connection.next() is True
    assert claims.until(lambda v: v is None) is None
    # The publisher is registered again, the claim is not.
    publisher = f"{root}/datasets/shop/publishers/db1@a"
    wait_until(
        lambda: (
            _owner(raw, publisher) not in (None, old)
            and _owner(raw, publisher) == holder.session.session_id()
        ),
        WAIT,
        "the publisher registered again",
    )
    assert raw.exists(f"{root}/datasets/shop/serving/db1/search") is None
    assert not holder.serving_claims().save_datamarkers(
        "search", "db1", 1, {0: _marker("x", (9,), 1)}
    )
    assert other.serving_claims().load_datamarkers("search", "db1") == {0: _marker("l0", (1,), 1)}
    # Claiming again gives a new epoch.
    assert holder.serving_claims().claim_serving("search", "db1", "a") == 2
    assert claims.until(lambda v: v is not None).epoch == 2


def test_a_save_while_disconnected_fails_at_once_and_gives_the_claim_up(
    registries: Callable[..., ZooKeeperRegistry], zookeeper_server: Any, root: str
) -> None:
    holder = registries(session_timeout_ms=6000)
    connection: Recorder[bool] = Recorder()
    holder.watch_connection(connection)
    assert connection.next() is True
    assert holder.serving_claims().claim_serving("search", "db1", "a") == 1
    session = holder.session.session_id()
    zookeeper_server.pause()
    try:
        assert connection.next() is False
        started = time.monotonic()
        assert not holder.serving_claims().save_datamarkers(
            "search", "db1", 1, {0: _marker("l0", (1,), 1)}
        )
        assert holder.serving_claims().claim_serving("search", "db1", "a") is None
        assert time.monotonic() - started < 0.5
    finally:
        zookeeper_server.resume()
    assert connection.next() is True
    client = zookeeper_server.client()
    try:
        # The session outlived the outage, the claim did not: its node is deleted.
        path = f"{root}/datasets/shop/serving/db1/search"
        wait_until(lambda: client.exists(path) is None, WAIT, "the claim given up")
        assert holder.session.session_id() == session
    finally:
        client.stop()
        client.close()
    assert holder.serving_claims().claim_serving("search", "db1", "a") == 2


class _StoppedAsItConnects:
    """A stand-in registry component whose ``open`` connects just as the stop comes (it
    sets the stop event, then returns): a moment a real ZooKeeper gives only by chance."""

    def __init__(self) -> None:
        self.closed = False

    def create(self) -> _StoppedAsItConnects:
        return self

    def open(self, dataset: str, stop: threading.Event) -> None:
        stop.set()

    def describe(self) -> str:
        return "stand-in registry"

    def close(self) -> None:
        self.closed = True


def test_a_stop_that_comes_as_the_registry_connects_is_a_stop() -> None:
    from wormhole.connectors.tcp.client import Subscriber
    from wormhole.core.registry import open_registry

    component = _StoppedAsItConnects()
    with pytest.raises(Stopped, match="stopped while connecting to stand-in registry"):
        open_registry(component, "shop", threading.Event())  # type: ignore[arg-type]
    assert component.closed
    # A subscriber that connects as it is stopped leaves at once: `run` returns.
    component = _StoppedAsItConnects()
    subscriber = Subscriber("search", registry=component, dataset="shop")
    raised: list[BaseException] = []

    def run() -> None:
        try:
            subscriber.run()
        except BaseException as exc:
            raised.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(10)
    assert not runner.is_alive() and component.closed
    assert raised == []


def test_a_copys_status_is_shared_at_once_when_what_it_could_take_over_changes(
    zookeeper_server: Any,
    root: str,
    registries: Callable[..., ZooKeeperRegistry],
    tmp_path: Any,
) -> None:
    """A publisher shares its status about once a second, but a change of what its copy
    serves or could take over goes out at once: the serving copy waits for it to hand the
    application back (a copy back from a partition is ready a moment after reconnecting)."""
    from wormhole.core.pipeline import parse_pipeline
    from wormhole.core.registry import PublisherMembership

    (tmp_path / "data").mkdir()
    pipeline = parse_pipeline(
        json.dumps(
            {
                "pipeline": "shop",
                "state_dir": str(tmp_path / "state"),
                "registry": {"type": "zookeeper", "hosts": zookeeper_server.hosts, "root": root},
                "datastore": "db1",
                "copy": "a",
                "delivery": {"mode": "multiple-copy"},
                "source": {"type": "filelog", "path": str(tmp_path / "data")},
                "applications": {"search": {}},
            }
        )
    )
    membership = PublisherMembership(pipeline, threading.Event())
    reader = registries()

    def status(flows: int, ready: bool) -> dict[str, Any]:
        return {"flows": flows, "copies": {"serving": {}, "copies_ready": {"search": ready}}}

    def shared() -> dict[str, Any]:
        [(_, found)] = reader.statuses().items()
        return found

    try:
        # An interval no test run reaches: only a change of standing shares it sooner.
        membership.publish_status(status(1, False), interval=3600)
        assert shared()["flows"] == 1
        membership.publish_status(status(2, False), interval=3600)
        assert shared()["flows"] == 1  # the same standing: at the next interval
        membership.publish_status(status(3, True), interval=3600)
        assert shared() == status(3, True)
    finally:
        membership.close()
