"""The dead-letter log and the on_error policies, in one process: bisection isolates the
rejected updates, later updates of their keys are parked behind them, the log survives a torn
tail, replay delivers in order per key and purge removes."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wormhole.core.errors import WormholeError
from wormhole.core.pipeline import OnErrorConfig
from wormhole.core.update import Update
from wormhole.subscriber import dead_letters as dl


def update(key: int, n: int, shard: int | None = None) -> Update:
    return Update.create(
        op="u",
        key={"id": key},
        table="public.t",
        after={"id": key, "n": n},
        position=f"{key}:{n}",
        shard=key % 4 if shard is None else shard,
    )


class Picky:
    """A sink that rejects every batch holding a rejected key, and records what it took."""

    def __init__(self, rejected: set[int]) -> None:
        self.rejected = rejected
        self.written: list[tuple[int, int]] = []
        self.attempts = 0

    def write(self, updates: list[Update]) -> None:
        self.attempts += 1
        if any(u.key["id"] in self.rejected for u in updates):
            raise OSError("rejected on purpose")
        self.written += [(u.key["id"], (u.after_row() or {})["n"]) for u in updates]

    def close(self) -> None:
        pass


def guarded(tmp_path: Path, sink: Picky, policy: str = "dead_letter", retries: int = 1) -> Any:
    return dl.GuardedSink(sink, "app", policy, retries, 0.001, 0.001, tmp_path, threading.Event())


def test_bisection_isolates_the_rejected_updates_and_delivers_the_rest_in_order(
    tmp_path: Path,
) -> None:
    rng = random.Random(7)
    sink = Picky({3, 11})
    guard = guarded(tmp_path, sink)
    batch = [update(rng.randrange(16), n) for n in range(200)]
    guard.write(batch)
    dead = dl.read_dead_letters(tmp_path, "app")
    expected_dead = [
        (u.key["id"], (u.after_row() or {})["n"]) for u in batch if u.key["id"] in (3, 11)
    ]
    assert [(e.key["id"], (e.update.after_row() or {})["n"]) for e in dead.entries.values()] == (
        expected_dead
    )
    # Each rejected key: its first update failed itself, the later ones are parked behind it.
    for key in (3, 11):
        entries = [e for e in dead.entries.values() if e.key["id"] == key]
        assert entries[0].parked_behind == 0 and "rejected on purpose" in entries[0].error
        assert all(e.parked_behind == entries[0].id for e in entries[1:])
    # Everything else reached the sink, once, in order.
    assert sink.written == [
        (u.key["id"], (u.after_row() or {})["n"]) for u in batch if u.key["id"] not in (3, 11)
    ]
    # Isolating two bad keys in 200 takes a few dozen attempts, not one per update.
    assert sink.attempts < 60


def test_a_parked_key_stays_parked_across_batches_and_other_keys_flow_on(tmp_path: Path) -> None:
    sink = Picky({1})
    guard = guarded(tmp_path, sink)
    guard.write([update(1, 0), update(2, 0)])
    sink.rejected.clear()  # the sink is fixed, but key 1 still has a dead letter
    guard.write([update(1, 1), update(2, 1)])
    assert sink.written == [(2, 0), (2, 1)]
    dead = dl.read_dead_letters(tmp_path, "app")
    assert [(e.key["id"], e.parked_behind) for e in dead.entries.values()] == [(1, 0), (1, 1)]
    # Replay delivers the key in order and frees it: its next update goes to the sink.
    result = dl.replay(dl.DeadLetterLog(tmp_path, "app"), sink)
    assert result.replayed == [1, 2] and not result.failed
    guard.write([update(1, 2)])
    assert sink.written == [(2, 0), (2, 1), (1, 0), (1, 1), (1, 2)]
    assert dl.read_dead_letters(tmp_path, "app").entries == {}


def test_replay_leaves_a_key_the_sink_rejects_again_and_ids_are_never_reused(
    tmp_path: Path,
) -> None:
    sink = Picky({1, 2})
    guard = guarded(tmp_path, sink)
    guard.write([update(1, 0), update(2, 0), update(1, 1)])
    sink.rejected = {2}
    result = dl.replay(dl.DeadLetterLog(tmp_path, "app"), sink)
    # Ids in log order: 1:0 failed, then 1:1 was parked behind it, then 2:0 failed.
    assert result.replayed == [1, 2]
    assert [i for i, _ in result.failed] == [3]
    assert sink.written == [(1, 0), (1, 1)]
    assert list(dl.read_dead_letters(tmp_path, "app").entries) == [3]
    assert dl.purge(dl.DeadLetterLog(tmp_path, "app"), None) == [3]
    # The log started over, empty; new entries continue the ids.
    assert dl.count_dead_letters(tmp_path) == {"app": 0}
    sink.rejected = {5}
    guard.write([update(5, 0)])
    assert list(dl.read_dead_letters(tmp_path, "app").entries) == [4]


def test_an_update_delivered_again_after_a_crash_is_recorded_once(tmp_path: Path) -> None:
    sink = Picky({1})
    batch = [update(1, 0), update(2, 0), update(1, 1)]
    guarded(tmp_path, sink).write(batch)
    # A new subscriber (the first one died before acknowledging) gets the batch again.
    guarded(tmp_path, sink).write(batch)
    dead = dl.read_dead_letters(tmp_path, "app")
    assert [(e.id, e.key["id"]) for e in dead.entries.values()] == [(1, 1), (2, 1)]
    assert sink.written == [(2, 0), (2, 0)]  # at least once for the others


def test_a_torn_last_record_is_cut_off_and_the_log_goes_on(tmp_path: Path) -> None:
    sink = Picky({1, 2})
    guard = guarded(tmp_path, sink)
    guard.write([update(1, 0)])
    path = dl.log_path(tmp_path, "app")
    whole = path.stat().st_size
    guard.write([update(2, 0)])
    # A writer killed mid-append: half of the second record made it to disk.
    size = path.stat().st_size
    os.truncate(path, whole + (size - whole) // 2)
    assert list(dl.read_dead_letters(tmp_path, "app").entries) == [1]
    # The next writer cuts the torn record off and appends after the last whole one.
    guarded(tmp_path, sink).write([update(2, 0)])
    dead = dl.read_dead_letters(tmp_path, "app")
    assert [(e.id, e.key["id"]) for e in dead.entries.values()] == [(1, 1), (2, 2)]


def test_damage_before_the_last_record_is_an_error_naming_the_file(tmp_path: Path) -> None:
    sink = Picky({1, 2})
    guard = guarded(tmp_path, sink)
    guard.write([update(1, 0)])
    guard.write([update(2, 0)])
    path = dl.log_path(tmp_path, "app")
    data = bytearray(path.read_bytes())
    data[40] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(WormholeError, match=str(path)):
        dl.read_dead_letters(tmp_path, "app")


def test_policy_stop_names_the_update_after_writing_everything_before_it(tmp_path: Path) -> None:
    sink = Picky({5})
    guard = guarded(tmp_path, sink, policy="stop", retries=2)
    batch = [update(k, 0) for k in (1, 2, 5, 6, 7)]
    with pytest.raises(WormholeError) as raised:
        guard.write(batch)
    message = str(raised.value)
    assert "application app" in message
    assert 'table public.t key {"id":5} position 5:0 (shard 1)' in message
    assert "rejected on purpose" in message and "after 2 retries" in message
    assert sink.written == [(1, 0), (2, 0)]
    assert not dl.log_path(tmp_path, "app").exists()


def test_retries_are_counted_and_a_passing_retry_keeps_the_batch(tmp_path: Path) -> None:
    class Flaky(Picky):
        def write(self, updates: list[Update]) -> None:
            if self.attempts < 2:
                self.attempts += 1
                raise OSError("a passing outage")
            super().write(updates)

    sink = Flaky(set())
    guarded(tmp_path, sink, retries=2).write([update(1, 0), update(2, 0)])
    assert sink.written == [(1, 0), (2, 0)]
    assert dl.read_dead_letters(tmp_path, "app").entries == {}


def test_on_error_keys_are_validated() -> None:
    assert OnErrorConfig().policy == "retry"
    assert OnErrorConfig(policy="stop").attempts_after_first == 3
    with pytest.raises(ValueError, match="policy retry retries until"):
        OnErrorConfig(policy="retry", retries=2)
    with pytest.raises(ValueError, match="max_backoff_ms must be at least backoff_ms"):
        OnErrorConfig(policy="stop", backoff_ms=100, max_backoff_ms=10)


def test_every_dead_letter_reaches_the_hook(tmp_path: Path) -> None:
    seen: list[tuple[str, int]] = []

    def hook(application: str, entry: dl.Entry) -> None:
        seen.append((application, entry.id))

    dl.dead_letter_hooks.append(hook)
    try:
        guarded(tmp_path, Picky({1})).write([update(1, 0), update(1, 1), update(2, 0)])
    finally:
        dl.dead_letter_hooks.remove(hook)
    assert seen == [("app", 1), ("app", 2)]


def test_dead_letters_and_parked_updates_are_counted_in_the_metrics(tmp_path: Path) -> None:
    from wormhole.plugins.events import REGISTRY

    def count(name: str) -> float:
        return REGISTRY.get_sample_value(name, {"application": "app"}) or 0.0

    before = count("wormhole_dead_letters_total"), count("wormhole_dead_letters_parked_total")
    guarded(tmp_path, Picky({1})).write([update(1, 0), update(1, 1), update(1, 2), update(2, 0)])
    after = count("wormhole_dead_letters_total"), count("wormhole_dead_letters_parked_total")
    assert (after[0] - before[0], after[1] - before[1]) == (1, 2)


def test_a_subscriber_taking_over_a_flow_sees_the_keys_its_last_owner_parked(
    tmp_path: Path,
) -> None:
    first = Picky({1})
    second = Picky(set())
    old_owner = guarded(tmp_path, first)
    new_owner = guarded(tmp_path, second)  # started before the dead letter existed
    old_owner.write([update(1, 0), update(2, 0)])
    new_owner.write([update(1, 1), update(2, 1)])
    assert second.written == [(2, 1)]
    dead = dl.read_dead_letters(tmp_path, "app")
    assert [(e.key["id"], e.parked_behind) for e in dead.entries.values()] == [(1, 0), (1, 1)]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    batches=st.lists(
        st.lists(st.integers(min_value=0, max_value=9), min_size=1, max_size=40),
        min_size=1,
        max_size=5,
    ),
    poison=st.sets(st.integers(min_value=0, max_value=9), max_size=4),
)
def test_any_batches_any_poison_keys_split_exactly(
    tmp_path_factory: pytest.TempPathFactory, batches: list[list[int]], poison: set[int]
) -> None:
    """Whatever the batches and the rejected keys: the sink gets every update of the other
    keys exactly once, in order; the log holds every update of a rejected key from its first
    rejected one on, in order, the first one failed and the rest parked behind it."""
    state = tmp_path_factory.mktemp("dead")
    sink = Picky(poison)
    guard = guarded(state, sink, retries=0)
    sent: list[tuple[int, int]] = []
    for batch in batches:
        updates = []
        for key in batch:
            updates.append(update(key, len(sent)))
            sent.append((key, len(sent)))
        guard.write(updates)
    assert sink.written == [(k, n) for k, n in sent if k not in poison]
    dead = dl.read_dead_letters(state, "app")
    logged = [(e.key["id"], (e.update.after_row() or {})["n"]) for e in dead.entries.values()]
    assert sorted(logged, key=lambda kn: kn[1]) == [(k, n) for k, n in sent if k in poison]
    for key in poison:
        entries = [e for e in dead.entries.values() if e.key["id"] == key]
        if entries:
            assert [(e.update.after_row() or {})["n"] for e in entries] == sorted(
                (e.update.after_row() or {})["n"] for e in entries
            )
            assert entries[0].parked_behind == 0
            assert all(e.parked_behind == entries[0].id for e in entries[1:])


def test_with_several_datastores_a_key_is_parked_in_its_own_flow_only(tmp_path: Path) -> None:
    sink = Picky({1})
    current = ["db1"]
    guard = dl.GuardedSink(
        sink, "app", "dead_letter", 0, 0.001, 0.001, tmp_path, threading.Event(), lambda: current[0]
    )
    guard.write([update(1, 0)])
    sink.rejected.clear()
    current[0] = "db2"
    guard.write([update(1, 1)])  # the same key in another datastore: not parked
    current[0] = "db1"
    guard.write([update(1, 2)])  # parked behind db1's dead letter
    assert sink.written == [(1, 1)]
    dead = dl.read_dead_letters(tmp_path, "app")
    assert [(e.datastore, e.parked_behind) for e in dead.entries.values()] == [
        ("db1", 0),
        ("db1", 1),
    ]
