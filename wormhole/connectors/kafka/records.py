"""Kafka records of the publisher log's updates: topics, keys, envelopes, tombstones and
Debezium events; the last record of a shard in a batch carries its delivery report."""

from __future__ import annotations

import threading
from typing import Any

import msgspec

from wormhole.connectors.kafka.common import (
    HEADER_AUDIENCE,
    HEADER_LOGICAL,
    HEADER_SEQ,
    HEADER_SHARD,
    Topics,
    kafka,
    table_topic,
)
from wormhole.connectors.kafka.options import KafkaOptions
from wormhole.connectors.kafka.reports import DeliveryReports, ProduceFailed
from wormhole.core.update import TRUNCATE, envelope
from wormhole.plugins.components import LogBatch
from wormhole.plugins.debezium import DebeziumEncoder

_key_encoder = msgspec.json.Encoder(order="sorted")
_value_encoder = msgspec.json.Encoder()


def dataset_key(update: Any) -> bytes:
    """A record key unique per table in a topic that carries every table:
    ``{"key":{...},"table":"schema.table"}``, canonical JSON (members sorted)."""
    return _key_encoder.encode({"key": update.key, "table": update.table})


def table_key(update: Any) -> bytes:
    """In a topic per table the key columns alone are unique: ``{"id":1}``."""
    return _key_encoder.encode(update.key)


class RecordWriter:
    """Produces batches of the publisher log to ``producer``.

    ``topic`` is the dataset's one topic (``topic_naming: dataset``) or None (a topic per
    table); ``skip`` holds, per shard, the first update not yet confirmed in an earlier run.
    """

    def __init__(
        self,
        options: KafkaOptions,
        producer: Any,
        topics: Topics,
        topic: str | None,
        reports: DeliveryReports,
        abort: threading.Event,
        skip: list[int],
        debezium: DebeziumEncoder | None,
    ) -> None:
        self.options = options
        self.producer = producer
        self.topics: Topics | None = topics
        self.topic = topic
        self.reports = reports
        self.abort = abort
        self.skip = skip
        self.skip_until = max(skip, default=0)
        self.shard_headers = [(HEADER_SHARD, b"%d" % s) for s in range(len(skip))]
        self.topic_tables: dict[str, str] = {}
        """With topic_naming table: the table each topic carries."""
        self.debezium = debezium

    def produce(self, batch: LogBatch) -> None:
        updates = batch.updates
        if not updates:
            return
        first = batch.first_seq
        if self.topic is None or first < self.skip_until:
            self._produce_each(batch)
            return
        topic = self.topic
        # The last update of each shard in the batch carries the delivery callback;
        # the broker confirms a partition's messages in order (gapless, see SAFETY).
        last = {u.shard: i for i, u in enumerate(updates)}
        markers: dict[int, Any] = {}
        for shard, i in last.items():
            markers[i] = self.reports.marker((topic, shard), first)
        produce = self.producer.produce
        encode_key = dataset_key
        encode_value = _value_encoder.encode
        shard_headers = self.shard_headers
        tombstones = self._tombstones(topic)
        seq = first
        for i, u in enumerate(updates):
            shard = u.shard
            value: bytes | None = encode_value(envelope(u))
            key = encode_key(u)
            headers = [
                shard_headers[shard],
                (HEADER_LOGICAL, u.logical.encode()),
                (HEADER_SEQ, b"%d" % seq),
            ]
            if u.audience:  # a backfill for one application: the others' consumers skip it
                headers.append((HEADER_AUDIENCE, u.audience.encode()))
            marker = markers.get(i)
            if tombstones and u.op == "d":
                # The delete, then its tombstone (which carries the shard's delivery report).
                args = (topic, value, key, shard)
                if not self._produce_when_room(args, None, headers, seq, u):
                    return
                value = None
            # Positional arguments all through: librdkafka's Python binding parses
            # keyword arguments by building every keyword's name, per call.
            try:
                produce(topic, value, key, shard, marker, None, 0, headers)
            except BufferError:
                args = (topic, value, key, shard)
                if not self._produce_when_room(args, marker, headers, seq, u):
                    return
            except kafka().KafkaException as exc:
                raise self._unproducible(exc, seq, u) from None
            seq += 1

    def _produce_each(self, batch: LogBatch) -> None:
        """The general case: per-table topics, or shards still being skipped after a
        restart (updates the broker confirmed in an earlier run)."""
        updates = batch.updates
        first = batch.first_seq
        skip = self.skip
        dataset = self.topic
        topics: list[str] = []
        last: dict[tuple[str, int], int] = {}
        debezium = self.debezium
        for i, u in enumerate(updates):
            if first + i < skip[u.shard] or (
                debezium is not None and u.op == TRUNCATE and not debezium.messages([u])
            ):
                # (Debezium skips truncates by default: its skipped.operations=t.)
                topics.append("")
                continue
            topic = dataset or self._table_topic(u.table)
            topics.append(topic)
            last[(topic, u.shard)] = i
        markers = {i: self.reports.marker(key, first) for key, i in last.items()}
        encode_key = dataset_key if dataset else table_key
        encode_value = _value_encoder.encode
        for i, u in enumerate(updates):
            topic = topics[i]
            if not topic:
                continue
            headers = [
                self.shard_headers[u.shard],
                (HEADER_LOGICAL, u.logical.encode()),
                (HEADER_SEQ, b"%d" % (first + i)),
            ]
            if u.audience:
                headers.append((HEADER_AUDIENCE, u.audience.encode()))
            marker = markers.get(i)
            if debezium is not None:
                messages = debezium.messages([u])
                # The datamarker rides on the update's last message to its own topic (the
                # partition of the updates before it), not on a BEGIN or END event.
                transactions = debezium.transaction_topic
                ours = [n for n, m in enumerate(messages) if m.topic != transactions]
                carrier = ours[-1] if ours else len(messages) - 1
                for n, message in enumerate(messages):
                    last_one = n == carrier
                    out = topic
                    if message.topic == transactions:
                        out = self._transaction_topic(message.topic)
                    record = (out, message.value, message.key, u.shard)
                    if not self._produce_when_room(
                        record, marker if last_one else None, headers, first + i, u
                    ):
                        return
                continue
            key = encode_key(u)
            args: tuple[Any, ...] = (topic, encode_value(envelope(u)), key, u.shard)
            if u.op == "d" and self._tombstones(topic):
                if not self._produce_when_room(args, None, headers, first + i, u):
                    return
                args = (topic, None, key, u.shard)  # the tombstone carries the report
            if not self._produce_when_room(args, marker, headers, first + i, u):
                return

    def _unproducible(self, exc: Any, seq: int, update: Any) -> ProduceFailed:
        """The client refused an update outright (too large, ...): stop before it."""
        err = exc.args[0] if exc.args else exc
        reason = err.str() if hasattr(err, "str") else str(err)
        hint = ""
        if hasattr(err, "code") and err.code() == kafka().KafkaError.MSG_SIZE_TOO_LARGE:
            hint = (
                "; raise transport.producer message.max.bytes (and the topic's "
                "max.message.bytes on the broker)"
            )
        return ProduceFailed(
            f"transport: Kafka refused update {seq} of the publisher log (table "
            f"{update.table!r}, key {update.key}, shard {update.shard}): {reason}{hint}; "
            f"nothing from it on was counted as delivered, and the next run resumes there"
        )

    def _produce_when_room(
        self, args: tuple[Any, ...], callback: Any, headers: Any, seq: int, update: Any
    ) -> bool:
        """Produce update ``seq``, waiting while the producer's queue is full (a slow or
        absent broker); False when stopped meanwhile."""
        ck = kafka()
        while True:
            try:
                self.producer.produce(*args, callback, None, 0, headers)
                return True
            except ck.KafkaException as exc:
                raise self._unproducible(exc, seq, update) from None
            except BufferError:
                self.producer.poll(0.1)
                if self.abort.is_set():
                    return False

    def _transaction_topic(self, topic: str) -> str:
        """Debezium's ``<prefix>.transaction`` (BEGIN and END events), created as others."""
        assert self.topics is not None
        if topic not in self.topics.known:
            self.topics.ensure(topic)
        return topic

    def _table_topic(self, table: str) -> str:
        topic = table_topic(self.options, table)
        assert self.topics is not None
        if topic not in self.topics.known:
            self.topics.ensure(topic)
        owner = self.topic_tables.setdefault(topic, table)
        if owner != table:
            # Their keys would collide in one topic (compaction would drop one's rows).
            raise ProduceFailed(
                f"transport.topic_naming: tables {owner!r} and {table!r} both map to topic "
                f"{topic!r} (characters Kafka does not allow become '_'); use topic_naming: "
                f"dataset, whose keys name the table"
            )
        return topic

    def _tombstones(self, topic: str) -> bool:
        """Whether a delete in ``topic`` is followed by a tombstone."""
        if self.options.tombstones is not None:
            return self.options.tombstones
        assert self.topics is not None
        return self.topics.compacted.get(topic, False)
