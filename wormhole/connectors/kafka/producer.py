"""The publisher end of the Kafka transport: the publisher log, produced to Kafka.

The transport reads the publisher log itself (its spec's ``reads_log``): one thread reads
batches, produces each update to partition ``shard`` of its topic with the
idempotent producer, and moves each shard's datamarker only when the broker has
confirmed every update of that shard before it (delivery reports). The
datamarkers are stored for every application, since they all read the same
topic; each application's own progress is its consumer group's committed offsets.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import deque
from functools import partial
from typing import Any

import msgspec

from wormhole.connectors.kafka.common import (
    HEADER_AUDIENCE,
    HEADER_LOGICAL,
    HEADER_SEQ,
    HEADER_SHARD,
    Topics,
    client_config,
    dataset_topic,
    kafka,
    table_topic,
)
from wormhole.connectors.kafka.lag import log_ends
from wormhole.connectors.kafka.options import KafkaOptions
from wormhole.core.errors import ConfigError, WormholeError
from wormhole.core.update import TRUNCATE, envelope
from wormhole.plugins.components import Datamarker, LogBatch, PublisherView
from wormhole.plugins.debezium import DebeziumEncoder
from wormhole.subscriber.processes import SubscriberProcesses

log = logging.getLogger("wormhole.kafka")

META_KEY = "kafka.produced"
"""Datamarker-store metadata: per shard, the position up to which the broker confirmed."""

_key_encoder = msgspec.json.Encoder(order="sorted")
_value_encoder = msgspec.json.Encoder()


def dataset_key(update: Any) -> bytes:
    """A record key unique per table in a topic that carries every table:
    ``{"key":{...},"table":"schema.table"}``, canonical JSON (members sorted)."""
    return _key_encoder.encode({"key": update.key, "table": update.table})


def table_key(update: Any) -> bytes:
    """In a topic per table the key columns alone are unique: ``{"id":1}``."""
    return _key_encoder.encode(update.key)


DEFAULTS: dict[str, Any] = {
    # Batches grow while the producer works through a backlog; once it has caught up
    # with the publisher log it sends at once (see KafkaTransport._loop).
    "linger.ms": 50,
    # Update envelopes are repetitive JSON: LZ4 shrinks a batch several times over for
    # little CPU, and the broker stores, copies and serves that much less.
    "compression.type": "lz4",
    "message.timeout.ms": 0,  # retry through any outage: nothing is dropped
    "queue.buffering.max.messages": 200_000,
    "batch.num.messages": 10_000,
}
"""Producer settings that ``transport.producer`` may override."""

SAFETY: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    # A message that fails for good (a permanent broker error) would leave a gap
    # before later messages of its partition. With the gapless guarantee that is a
    # fatal producer error instead, so the delivery report of a partition's last
    # message in a batch vouches for every message before it: only those messages
    # carry a delivery callback, and no Python call is made per message.
    "enable.gapless.guarantee": True,
}
"""Producer settings that the datamarkers rely on; the pipeline file cannot change them."""


class ClientLog:
    """librdkafka's log lines, into the ``wormhole.kafka.client`` logger."""

    def __init__(self) -> None:
        self.logger = logging.getLogger("wormhole.kafka.client")

    def log(self, level: int, fmt: str, *args: Any) -> None:
        text = fmt % args if args else fmt
        facility = args[0] if args else ""
        if "enable.gapless.guarantee is experimental" in text:
            level = logging.DEBUG  # set on purpose (SAFETY), not the user's doing
        elif facility == "FAIL":
            # Connection failures are retried; the error callback reports outages once.
            level = min(level, logging.DEBUG)
        self.logger.log(level, "%s", text)


class ProduceFailed(WormholeError):
    """Kafka refused an update for good (not a retriable broker outage)."""


class KafkaTransport:
    """Produces the publisher log to Kafka; `wormhole run` also starts sink subscribers."""

    def __init__(self, options: KafkaOptions) -> None:
        self.options = options
        self.hub: PublisherView = None  # type: ignore[assignment]
        self.topic: str | None = None
        self.topics: Topics | None = None
        self.producer: Any = None
        self.thread: threading.Thread | None = None
        self.abort = threading.Event()
        self.draining = threading.Event()
        self.drain_target = 0
        self.finished = threading.Event()
        self.failure: BaseException | None = None
        self.pending: dict[tuple[str, int], deque[tuple[int, int]]] = {}
        self.next_marker = 0
        self.failed: dict[tuple[str, int], str] = {}
        self.skip: list[int] = []
        self.skip_until = 0
        self.shard_headers: list[tuple[str, bytes]] = []
        self.topic_tables: dict[str, str] = {}
        """With topic_naming table: the table each topic carries."""
        self.debezium: DebeziumEncoder | None = None
        if options.envelope == "debezium":
            tombstones = True if options.tombstones is None else options.tombstones
            self.debezium = DebeziumEncoder(
                options.model_copy(update={"tombstones": tombstones}), options.topic_prefix
            )
        self.produced = 0
        self.saved: list[int] = []
        self.applications: list[str] = []
        self.store_lock = threading.Lock()
        self.processes: SubscriberProcesses | None = None
        self.stopped = False
        self.unconfirmed = 0
        self.last_outage_log = 0.0

    # ------------------------------------------------------------- start
    def start(self, hub: PublisherView) -> None:
        self.hub = hub
        pipeline = hub.pipeline
        ck = kafka()
        for name, app in pipeline.applications.items():
            if isinstance(app.start, dict) and "backfill" not in app.start:
                raise ConfigError(
                    f"applications.{name}.start: a publisher-log position or a time cannot be "
                    f"mapped to Kafka offsets; with the kafka transport use earliest or latest",
                    pipeline.file,
                )
        # The producer first: an idempotent producer needs a producer id from the broker
        # before it sends anything, and gets it while the topics are checked.
        config: dict[str, Any] = dict(DEFAULTS)
        config.update(client_config(self.options, self.options.producer))
        config.update(SAFETY)
        config["error_cb"] = self._client_error
        config["logger"] = ClientLog()
        try:
            self.producer = ck.Producer(config)
        except ck.KafkaException as exc:
            raise ConfigError(
                f"transport.producer: librdkafka rejected the settings ({exc.args[0].str()})",
                pipeline.file,
            ) from None
        self.topics = Topics(self.options, pipeline.shards)
        self.topics.wait_for_brokers()
        if self.options.topic_naming == "dataset":
            self.topic = dataset_topic(self.options, pipeline.name)
            self.topics.ensure(self.topic)
        # Subscriber processes once the topic passed its checks (a topic with the wrong
        # partition count must not get offsets committed); they start while the
        # producer gets going.
        self.processes = SubscriberProcesses(hub, "kafka")
        if self.options.spawn and hub.local_subscribers:
            for name, app in pipeline.applications.items():
                if app.sink is None or app.external:
                    continue
                for index in range(app.subscribers):
                    self.processes.spawn(name, index)
        self._load_positions()
        self.thread = threading.Thread(target=self._run, name="kafka producer", daemon=True)
        self.thread.start()

    def add_application(self, app: Any) -> None:
        """Not while running: the publisher refuses to reload with this transport (every
        application reads the topics through its own consumer group)."""

    def remove_application(self, name: str) -> None:
        """As for :meth:`add_application`."""

    def _load_positions(self) -> None:
        hub = self.hub
        pipeline = hub.pipeline
        first, end = hub.log_range()
        self.applications = [n for n, a in pipeline.applications.items() if not a.external]
        stored = hub.stored_datamarkers()
        positions = []
        for shard in range(pipeline.shards):
            values = [
                stored[(name, shard)].position
                for name in self.applications
                if (name, shard) in stored
            ]
            positions.append(min(values) if values else first)
        meta = hub.stored_meta(META_KEY)
        if meta:
            # What the broker confirmed in earlier runs: an application added since
            # (start: earliest) must not make the publisher produce it all again.
            produced = json.loads(meta)
            if isinstance(produced, list) and len(produced) == pipeline.shards:
                positions = [min(max(int(p), first), end) for p in produced]
        self.skip = positions
        self.skip_until = max(positions, default=0)
        self.shard_headers = [(HEADER_SHARD, b"%d" % s) for s in range(pipeline.shards)]
        self.saved = [-1] * pipeline.shards
        self.produced = min(positions) if positions else end

    # ---------------------------------------------------------- delivery
    def _confirmed(self, key: tuple[str, int], marker: int, err: Any, msg: Any) -> None:
        if err is not None:
            self._refused(err, msg)
            return
        if key in self.failed:
            return
        queue = self.pending[key]
        if queue and queue[0][1] == marker:
            queue.popleft()

    def _refused(self, err: Any, msg: Any) -> None:
        key = (msg.topic(), msg.partition())
        reason = str(err.str())
        self.failed.setdefault(key, reason)
        if self.failure is None:
            self.failure = ProduceFailed(
                f"transport: Kafka at {self.options.bootstrap_servers} refused an update for "
                f"topic {key[0]!r} partition {key[1]} ({reason}); nothing after it was counted "
                f"as delivered. Fix the cause (topic permissions, message.max.bytes, ...) and run "
                f"again: delivery resumes from the last confirmed update"
            )

    def _client_error(self, err: Any) -> None:
        ck = kafka()
        if err.fatal():
            if self.failure is None:
                self.failure = ProduceFailed(
                    f"transport: the Kafka producer stopped with a fatal error ({err.str()}); "
                    f"run again to resume from the last confirmed update"
                )
            return
        if err.code() in (ck.KafkaError._ALL_BROKERS_DOWN, ck.KafkaError._TRANSPORT):
            now = time.monotonic()
            if now - self.last_outage_log > 10:
                self.last_outage_log = now
                log.warning(
                    "Kafka at %s: %s; the producer keeps retrying and nothing is lost",
                    self.options.bootstrap_servers,
                    err.str(),
                )
        else:
            log.debug("Kafka client: %s", err.str())

    # ---------------------------------------------------------- producing
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            if self.failure is None:
                self.failure = exc
        finally:
            with contextlib.suppress(Exception):
                self._persist()
            self.finished.set()
            if self.failure is not None and not self.abort.is_set():
                self.hub.fail(self.failure)

    def _loop(self) -> None:
        hub = self.hub
        producer = self.producer
        interval = hub.pipeline.datamarker_interval
        next_persist = time.monotonic() + interval
        reader = hub.read_log(self.produced)
        try:
            while not self.abort.is_set():
                if self.failure is not None:
                    raise self.failure
                if self.draining.is_set() and reader.position >= self.drain_target:
                    break
                batch = reader.read()
                if batch is None:
                    # Caught up with the log: send what lingers now instead of after
                    # linger.ms (flush wakes the broker threads), and serve delivery
                    # reports while waiting for the next batch.
                    producer.flush(0.01)
                    hub.wait_for_log(reader.position, 0.05)
                else:
                    self._produce(batch)
                    self.produced = batch.end_seq
                    producer.poll(0)
                if time.monotonic() >= next_persist:
                    self._persist()
                    next_persist = time.monotonic() + interval
        finally:
            reader.close()
        if self.abort.is_set():
            return
        self._flush()

    def _produce(self, batch: LogBatch) -> None:
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
            markers[i] = self._marker((topic, shard), first)
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
        markers = {i: self._marker(key, first) for key, i in last.items()}
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

    def _marker(self, key: tuple[str, int], first: int) -> Any:
        """A delivery callback that confirms ``key``'s part of a batch starting at ``first``."""
        marker = self.next_marker
        self.next_marker += 1
        self.pending.setdefault(key, deque()).append((first, marker))
        return partial(self._confirmed, key, marker)

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

    def _flush(self) -> None:
        """Wait until the broker confirmed everything produced (or stalls too long)."""
        producer = self.producer
        remaining = len(producer)
        progress = time.monotonic()
        while remaining and not self.abort.is_set():
            if self.failure is not None:
                raise self.failure
            now_remaining = producer.flush(0.5)
            if now_remaining < remaining:
                progress = time.monotonic()
            remaining = now_remaining
            if remaining and time.monotonic() - progress > self.options.drain_timeout_s:
                self.unconfirmed = remaining
                raise WormholeError(
                    f"transport: Kafka at {self.options.bootstrap_servers} confirmed nothing for "
                    f"{self.options.drain_timeout_s:g}s (transport.drain_timeout_s) with "
                    f"{remaining} updates outstanding; they were not counted as delivered and "
                    f"are produced again on the next run"
                )
        if self.failure is not None:
            raise self.failure

    # -------------------------------------------------------- datamarkers
    def positions(self) -> list[int]:
        """Per shard: every update of the shard before it was confirmed by the broker."""
        produced = self.produced
        out = [max(produced, s) for s in self.skip]
        for (_topic, shard), queue in list(self.pending.items()):
            if queue:
                with contextlib.suppress(IndexError):  # emptied by a delivery report meanwhile
                    out[shard] = min(out[shard], queue[0][0])
        return out

    def _persist(self) -> None:
        with self.store_lock:
            positions = self.positions()
            changed = [
                Datamarker(name, shard, position)
                for shard, position in enumerate(positions)
                if position != self.saved[shard]
                for name in self.applications
            ]
            if not changed:
                return
            self.hub.store_datamarkers(changed, {META_KEY: json.dumps(positions)})
            self.saved = positions

    def _caught_up(self) -> None:
        """Wait until every spawned application committed offsets up to the topics' ends,
        as long as its subscribers make progress."""
        apps = sorted({app for app, _ in (self.processes.children if self.processes else {})})
        if not apps or self.producer is None or self.topics is None:
            return
        ck = kafka()
        topics = [self.topic] if self.topic else sorted(self.topics.known)
        partitions = [
            ck.TopicPartition(t, s) for t in topics for s in range(self.hub.pipeline.shards)
        ]
        consumers = {
            app: ck.Consumer(
                client_config(
                    self.options,
                    {
                        **self.options.consumer,
                        "group.id": app,
                        "enable.auto.commit": False,
                        "enable.partition.eof": True,
                    },
                )
            )
            for app in apps
        }
        try:
            ends = log_ends(consumers[apps[0]], partitions)
            last_lag: dict[str, int] = {}
            progress = time.monotonic()
            while apps:
                for app in list(apps):
                    lag = 0
                    for tp in consumers[app].committed(partitions, timeout=10):
                        low, high = ends[(tp.topic, tp.partition)]
                        offset = tp.offset if tp.offset >= 0 else low
                        lag += max(0, high - offset)
                    if lag == 0:
                        apps.remove(app)
                    elif lag < last_lag.get(app, lag + 1):
                        progress = time.monotonic()
                    last_lag[app] = lag
                if not apps:
                    return
                if time.monotonic() - progress > self.options.drain_timeout_s:
                    behind = ", ".join(f"{app} ({last_lag[app]} offsets)" for app in apps)
                    if self.hub.once:
                        # --once promises every application everything: not so here.
                        raise WormholeError(
                            f"--once: applications did not consume every update: {behind} "
                            f"behind in Kafka after {self.options.drain_timeout_s:g}s without "
                            f"progress (transport.drain_timeout_s); see their subscribers' "
                            f"messages above (a sink retrying a write, say). They resume from "
                            f"their committed offsets on the next run"
                        )
                    log.warning(
                        "applications %s did not catch up with Kafka within %gs without "
                        "progress; their subscribers stop now and resume from their committed "
                        "offsets next time",
                        behind,
                        self.options.drain_timeout_s,
                    )
                    return
                time.sleep(0.1)
        except ck.KafkaException as exc:
            if self.hub.once:
                raise WormholeError(
                    f"--once: cannot tell whether every application consumed everything: "
                    f"reading their committed offsets failed ({exc})"
                ) from exc
            log.warning("cannot read the applications' committed offsets: %s", exc)
        finally:
            for consumer in consumers.values():
                consumer.close()

    # -------------------------------------------------------------- stop
    def stop(self, drain: bool = True) -> None:
        if self.stopped:
            return
        self.stopped = True
        error: BaseException | None = None
        if self.thread is not None:
            if drain:
                self.drain_target = self.hub.log_range()[1]
                self.draining.set()
                self.finished.wait()
                error = self.failure
            else:
                self.abort.set()
                self.thread.join(5)
        if drain and error is None:
            try:
                self._caught_up()
            except WormholeError as exc:
                error = exc  # the subscribers still stop first
        if self.processes is not None:
            stall = self.options.drain_timeout_s if drain else 1.0
            self.processes.stop(time.monotonic() + stall, stall=stall)
        if self.producer is not None and not drain:
            # Confirmed updates still move the datamarkers; nothing unconfirmed does.
            with contextlib.suppress(Exception):
                self.producer.poll(0)
                self._persist()
        if error is not None:
            raise error
