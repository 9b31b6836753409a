"""The database source's snapshot part: a source built on `DatabaseSource` reads its snapshot
through the part it sets as `snapshots`, and one written against the older hooks
(`_open_snapshot_table`, `_end_snapshot`, `_snapshot_estimate`, `_snapshot_details`) still
works through the default part.

The tables here are lists behind a `fetchmany` cursor: what is checked is how the base class
drives the part (which calls, in which order, what the updates carry), not a database; the
built-in sources' snapshots are checked against real servers in test_postgres.py and
test_mysql.py."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from wormhole.core.errors import SourceError
from wormhole.plugins.database_source import DatabaseSource, SnapshotTable


class _Rows:
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = list(rows)
        self.closed = False

    def fetchmany(self, size: int) -> list[dict[str, Any]]:
        out, self.rows = self.rows[:size], self.rows[size:]
        return out

    def close(self) -> None:
        self.closed = True


TABLES = {"s.a": [{"id": 1}, {"id": 2}, {"id": 3}], "s.b": [{"id": 9}]}


class _Stream(DatabaseSource):
    """The stream half: nothing to stream, only what the base class needs to hand over."""

    connector = "test"

    def __init__(self) -> None:
        super().__init__(batch_updates=2)
        self.calls: list[str] = []
        self.phase = "snapshot"
        self.snapshot_tables = list(TABLES)
        self.snapshot_position = "p"
        self.snapshot_logical = "l"
        self.describe = True

    def _connect_and_check(self, context: Any) -> None: ...
    def _start(self, interrupted: bool) -> None: ...
    def _resume(self, checkpoint: Any) -> None: ...
    def _checkpoint(self) -> Any:
        return {"phase": "stream"}

    def _start_stream(self) -> None:
        self.calls.append("start_stream")
        self.phase = "stream"

    def _read_stream(self, deadline: float) -> Any:
        return None

    def _lost(self, exc: Exception) -> str:
        raise exc

    def _disconnect(self) -> None: ...
    def _reconnect(self) -> str | None:
        return None

    def _stream_reached(self, end: Any) -> bool:
        return True


class _Part:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def estimate(self) -> int | None:
        self.calls.append("estimate")
        return 4

    def open_table(self, table: Any) -> SnapshotTable:
        self.calls.append(f"open {table}")
        return SnapshotTable(table, ["id"], _Rows(TABLES[table]), lambda rows: rows)

    def details(self, table: SnapshotTable, flag: str) -> msgspec.Raw:
        return msgspec.Raw(msgspec.json.encode({"snapshot": flag}))

    def end(self) -> None:
        self.calls.append("end")


class _WithPart(_Stream):
    def __init__(self) -> None:
        super().__init__()
        self.snapshots = _Part(self.calls)


class _WithHooks(_Stream):
    """A subclass written against the older hooks."""

    def _snapshot_estimate(self) -> int | None:
        return _Part(self.calls).estimate()

    def _open_snapshot_table(self, table: Any) -> SnapshotTable:
        return _Part(self.calls).open_table(table)

    def _snapshot_details(self, table: SnapshotTable, flag: str) -> msgspec.Raw:
        return _Part(self.calls).details(table, flag)

    def _end_snapshot(self) -> None:
        _Part(self.calls).end()


def _read_all(source: DatabaseSource) -> list[Any]:
    updates = []
    while source.phase == "snapshot":
        batch = source.read(0.1)
        if batch is not None:
            updates += batch.updates
    return updates


def test_the_snapshot_is_read_through_the_sources_part_then_the_stream_starts() -> None:
    for source in (_WithPart(), _WithHooks()):
        updates = _read_all(source)
        assert [(u.table, u.key, u.op, u.position) for u in updates] == [
            ("s.a", {"id": 1}, "r", "p:1"),
            ("s.a", {"id": 2}, "r", "p:2"),
            ("s.a", {"id": 3}, "r", "p:3"),
            ("s.b", {"id": 9}, "r", "p:4"),
        ], type(source).__name__
        flags = [msgspec.json.decode(u.details)["snapshot"] for u in updates]
        assert flags == ["first", "true", "last_in_data_collection", "last"]
        assert source.calls == ["estimate", "open s.a", "open s.b", "end", "start_stream"]


def test_a_source_without_a_snapshot_part_nor_the_old_hook_says_what_it_lacks() -> None:
    with pytest.raises(SourceError, match="_Stream: a DatabaseSource sets its snapshots part"):
        _Stream().read(0.1)


def test_the_stream_transaction_builds_updates_and_the_older_names_reach_it() -> None:
    """A stream decoder keeps ``source.txn``; one written against the older ``txn_*``
    attributes and ``_update`` sets and reads the same fields."""
    source = _Stream()
    source.phase = "stream"
    source.txn.begin("0/16B3748", "0/16B3748", 731, 1_700_000_000_000)
    assert not source.reached(None)  # never inside a transaction
    source.txn.index += 1
    update = source.txn.update("c", "s.a", {"id": 1}, None, {"id": 1, "v": "x"})
    assert (update.position, update.logical, update.txid, update.ts_ms, update.connector) == (
        "0/16B3748:0",
        "0/16B3748",
        731,
        1_700_000_000_000,
        "test",
    )
    assert msgspec.json.decode(update.after) == {"id": 1, "v": "x"}
    old: Any = source
    old.txn_position, old.txn_index, old.txn_logical = "f.000001:4", 6, "0-1-5"
    old.txn_id, old.txn_ts = 5, 7
    assert (source.txn.position, source.txn.index, source.txn.id, source.txn.ts_ms) == (
        "f.000001:4",
        6,
        5,
        7,
    )
    before = old._update("d", "s.a", {"id": 1}, {"id": 1}, None)
    assert (before.position, before.logical, before.op) == ("f.000001:4:6", "0-1-5", "d")
    source.txn.end()
    assert old.in_txn is False and source.reached(None)
