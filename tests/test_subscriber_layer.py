"""The subscriber layer (wormhole.subscriber) with a transport that supplies only its
connection: notices and batches in, acknowledgements out; the rest (flows, handlers and their
retries, reconnecting, what a batch acknowledges) is the layer's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from wormhole.core.update import Update
from wormhole.subscriber.connected import ConnectedSubscriber
from wormhole.subscriber.link import ConnectionClosed, Link

Script = list[tuple[str, Any]]


def _update(shard: int, n: int) -> Update:
    update = Update.create(op="c", key={"id": n}, table="t", after={"n": n})
    update.shard = shard
    return update


class ScriptedLink(Link):
    """A connection that plays one session per script, then loses it (or, with no script
    left, stops the subscriber)."""

    owner: ScriptedSubscriber

    def _serve(self, address: str) -> None:
        owner = self.owner
        owner.addresses_tried.append(address)
        if not owner.sessions:
            owner.stop()
            return
        self._connected = True
        for kind, body in owner.sessions.pop(0):
            if kind == "notice":
                self.take_notice(*body)
                owner.sent.append(("notice-ack", None))
            elif kind == "batch":
                updates, datamarkers = body
                owner.sent.append(("ack", self.take_batch(updates, datamarkers, 0)))
        raise ConnectionClosed("the scripted session ends")


class ScriptedSubscriber(ConnectedSubscriber):
    def __init__(self, sessions: list[Script]) -> None:
        self.app = "app"
        self.instance = "one"
        self.registry = None
        self.dataset = None
        self.publishers = ["first:1", "second:2"]
        self._publishers = None
        self.reconnect = True
        self.max_backoff = 0.01
        self.give_up_s = None
        self.heartbeat_timeout = 1.0
        self.sessions = sessions
        self.addresses_tried: list[str] = []
        self.sent: list[tuple[str, Any]] = []
        self._init_connected()

    def _link(self, datastore: str | None, addresses: Callable[[], list[str]]) -> Link:
        return ScriptedLink(self, datastore, addresses)


def test_a_transport_that_supplies_only_its_connection_gets_flows_handlers_and_reconnects() -> None:
    failures = [RuntimeError("the sink is down")]
    sub = ScriptedSubscriber(
        [
            [
                ("notice", ([0, 1], [], 0)),
                ("batch", ([_update(0, 1), _update(2, 2)], {0: 10, 2: 20})),
                ("notice", ([], [1], 0)),
                ("batch", ([_update(1, 3)], {1: 30})),
            ],
            [("notice", ([2], [], 0)), ("batch", ([_update(2, 4)], {2: 40}))],
        ]
    )
    sub.handler_first_backoff = 0.001
    handled: list[int] = []
    notices: list[tuple[list[Any], list[Any]]] = []

    @sub.on_batch
    def handle(updates: list[Update]) -> None:
        if failures:
            raise failures.pop()
        handled.extend(u.after_row()["n"] for u in updates)

    sub.on_shard_notice(lambda assigned, revoked: notices.append((assigned, revoked)))
    sub.run()

    # A failing handler is retried; only the flows the link holds are handled and acknowledged.
    assert handled == [1, 4]
    assert sub.sent == [
        ("notice-ack", None),
        ("ack", {0: 10}),
        ("notice-ack", None),
        ("ack", {}),
        ("notice-ack", None),
        ("ack", {2: 40}),
    ]
    # A lost connection revokes its flows; the next attempt goes to the next address.
    assert notices == [([0, 1], []), ([], [1]), ([], [0]), ([2], []), ([], [2])]
    assert sub.addresses_tried == ["first:1", "second:2", "first:1"]
    assert sub.processed == 2
    assert sub.assigned == set()


def test_without_reconnecting_a_lost_connection_ends_the_run_with_its_reason() -> None:
    sub = ScriptedSubscriber([[("notice", ([0], [], 0))]])
    sub.reconnect = False
    with pytest.raises(ConnectionClosed, match="the scripted session ends"):
        sub.run()
    assert sub.assigned == set()
