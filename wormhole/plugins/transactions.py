"""Transaction metadata: what a source adds to its updates when a consumer asks for it.

Debezium's ``provide.transaction.metadata`` gives every change event a ``transaction``
block (the transaction's id, the event's order in it and in its table) and writes a BEGIN
event before a transaction's first change and an END event (how many events, per table)
after its last. Wormhole shards a transaction's updates into flows, so no flow sees a
whole transaction: the numbers are made where it is still seen whole and in order, by
the source, and travel with each update (:attr:`~wormhole.core.update.Update.transaction`).
The publisher asks a source for them with ``SourceContext.transaction_metadata`` (some
output's options said ``marks_transactions()``); a source then calls, per transaction,
:meth:`TransactionMarker.begin`, :meth:`TransactionMarker.mark` for each update it emits,
and :meth:`TransactionMarker.commit` at the commit. A third-party source does the same.

What a source must guarantee: it hands an update to the publisher (returns its batch)
only once it knows whether the update is its transaction's last, since the END summary
rides on that update. A source that ends a batch in the middle of a large transaction
does so before a change of it (it read the change, keeps it, and returns), never right
after one.
"""

from __future__ import annotations

from typing import Any

import msgspec

from wormhole.core.update import TRUNCATE, Update

_encode = msgspec.json.Encoder().encode


class TransactionMarker:
    """Numbers the updates of one source's transactions, as Debezium's TransactionMonitor.

    ``mark`` gives each update ``[block, begin, end]`` (:attr:`Update.transaction`):
    ``block`` is Debezium's ``{"id", "total_order", "data_collection_order"}``, ``begin``
    the value of the BEGIN event on the transaction's first update, ``end`` the value of
    the END event on its last (set by ``commit``). Truncates are not counted (Debezium
    skips them by default) and have no block, but can carry BEGIN or END.
    """

    __slots__ = ("begin_value", "counts", "last", "last_begin", "last_block", "total", "ts_ms")

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.total = 0
        self.begin_value: bytes | None = None
        self.last: Update | None = None
        self.last_block = b"null"
        self.last_begin = b"null"
        self.ts_ms = 0

    def begin(self, transaction_id: str, ts_ms: int) -> None:
        """A transaction starts: ``transaction_id`` as its BEGIN event names it."""
        self.counts = {}
        self.total = 0
        self.last = None
        self.ts_ms = ts_ms
        self.begin_value = (
            b'{"status":"BEGIN","id":%s,"event_count":null,' % _encode(transaction_id)
            + b'"data_collections":null,"ts_ms":%d}' % ts_ms
        )

    def mark(self, update: Update, transaction_id: str) -> None:
        """``update`` is the transaction's next; ``transaction_id`` as its event names it."""
        if update.op == TRUNCATE:
            block = b"null"
        else:
            table = update.table
            order = self.counts[table] = self.counts.get(table, 0) + 1
            self.total += 1
            block = b'{"id":%s,"total_order":%d,"data_collection_order":%d}' % (
                _encode(transaction_id),
                self.total,
                order,
            )
        begin = b"null"
        if self.begin_value is not None:
            begin, self.begin_value = self.begin_value, None
        update.transaction = msgspec.Raw(b"[%s,%s,null]" % (block, begin))
        self.last, self.last_block, self.last_begin = update, block, begin

    def commit(self, transaction_id: str) -> None:
        """The transaction committed: its last update gets the END event, named
        ``transaction_id``. Nothing when no update was marked since :meth:`begin`."""
        last = self.last
        self.last = None
        if last is None:
            return
        collections = [
            {"data_collection": name, "event_count": count}
            for name, count in _hash_map_order(self.counts)
        ]
        end = b'{"status":"END","id":%s,"event_count":%d,"data_collections":%s,"ts_ms":%d}' % (
            _encode(transaction_id),
            self.total,
            _encode(collections),
            self.ts_ms,
        )
        last.transaction = msgspec.Raw(b"[%s,%s,%s]" % (self.last_block, self.last_begin, end))


def _java_string_hash(text: str) -> int:
    h = 0
    for unit in text.encode("utf-16-be").hex(" ", 2).split():
        h = (31 * h + int(unit, 16)) & 0xFFFFFFFF
    return h


def _hash_map_order(counts: dict[str, int]) -> list[tuple[str, int]]:
    """``counts`` in the order Java's HashMap iterates them (Debezium keeps the per-table
    counts in one): by bucket of the spread hash, then in insertion order."""
    capacity = 16
    while len(counts) > capacity * 3 // 4:
        capacity *= 2
    buckets: list[Any] = []
    for n, (name, count) in enumerate(counts.items()):
        h = _java_string_hash(name)
        buckets.append(((h ^ (h >> 16)) & (capacity - 1), n, name, count))
    return [(name, count) for _, _, name, count in sorted(buckets)]


__all__ = ["TransactionMarker"]
