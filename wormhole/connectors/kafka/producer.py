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
from typing import Any

from wormhole.connectors.kafka.caught_up import wait_for_applications
from wormhole.connectors.kafka.common import Topics, client_config, dataset_topic, kafka
from wormhole.connectors.kafka.options import KafkaOptions
from wormhole.connectors.kafka.records import RecordWriter, dataset_key, table_key
from wormhole.connectors.kafka.reports import DeliveryReports, ProduceFailed
from wormhole.core.errors import ConfigError, WormholeError
from wormhole.plugins.components import Datamarker, PublisherView
from wormhole.plugins.debezium import DebeziumEncoder

__all__ = ["DEFAULTS", "SAFETY", "KafkaTransport", "ProduceFailed", "dataset_key", "table_key"]

log = logging.getLogger("wormhole.kafka")

META_KEY = "kafka.produced"
"""Datamarker-store metadata: per shard, the position up to which the broker confirmed."""


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


class KafkaTransport:
    """Produces the publisher log to Kafka; `wormhole run` also starts sink subscribers."""

    def __init__(self, options: KafkaOptions) -> None:
        self.options = options
        self.hub: PublisherView = None  # type: ignore[assignment]
        self.topic: str | None = None
        self.topics: Topics | None = None
        self.producer: Any = None
        self.records: RecordWriter | None = None
        self.reports = DeliveryReports(options)
        self.thread: threading.Thread | None = None
        self.abort = threading.Event()
        self.draining = threading.Event()
        self.drain_target = 0
        self.finished = threading.Event()
        self.skip: list[int] = []
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
        self.stopped = False
        self.unconfirmed = 0

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
        config["error_cb"] = self.reports.client_error
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
        self._load_positions()
        self.records = RecordWriter(
            self.options,
            self.producer,
            self.topics,
            self.topic,
            self.reports,
            self.abort,
            self.skip,
            self.debezium,
        )
        self.thread = threading.Thread(target=self._run, name="kafka producer", daemon=True)
        self.thread.start()

    def subscriber_args(self) -> list[str] | None:
        """The engine starts the subscriber processes once ``start`` returned: after the
        topics passed their checks (a topic with the wrong partition count must not get
        offsets committed). None with ``spawn: false``."""
        return [] if self.options.spawn else None

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
        self.saved = [-1] * pipeline.shards
        self.produced = min(positions) if positions else end

    # ---------------------------------------------------------- producing
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            if self.reports.failure is None:
                self.reports.failure = exc
        finally:
            with contextlib.suppress(Exception):
                self._persist()
            self.finished.set()
            if self.reports.failure is not None and not self.abort.is_set():
                self.hub.fail(self.reports.failure)

    def _loop(self) -> None:
        hub = self.hub
        producer = self.producer
        records = self.records
        assert records is not None
        interval = hub.pipeline.datamarker_interval
        next_persist = time.monotonic() + interval
        reader = hub.read_log(self.produced)
        try:
            while not self.abort.is_set():
                if self.reports.failure is not None:
                    raise self.reports.failure
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
                    records.produce(batch)
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

    def _flush(self) -> None:
        """Wait until the broker confirmed everything produced (or stalls too long)."""
        producer = self.producer
        remaining = len(producer)
        progress = time.monotonic()
        while remaining and not self.abort.is_set():
            if self.reports.failure is not None:
                raise self.reports.failure
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
        if self.reports.failure is not None:
            raise self.reports.failure

    # -------------------------------------------------------- datamarkers
    def positions(self) -> list[int]:
        """Per shard: every update of the shard before it was confirmed by the broker."""
        produced = self.produced
        return self.reports.oldest_unconfirmed([max(produced, s) for s in self.skip])

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
        apps = self.hub.subscriber_applications()
        if not apps or self.producer is None or self.topics is None:
            return
        topics = [self.topic] if self.topic else sorted(self.topics.known)
        wait_for_applications(self.options, apps, topics, self.hub.pipeline.shards, self.hub.once)

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
                error = self.reports.failure
            else:
                self.abort.set()
                self.thread.join(5)
        if drain and error is None:
            try:
                self._caught_up()
            except WormholeError as exc:
                error = exc  # the subscribers still stop first
        if self.hub is not None:
            stall = self.options.drain_timeout_s if drain else 1.0
            self.hub.stop_subscribers(time.monotonic() + stall, stall)
        if self.producer is not None and not drain:
            # Confirmed updates still move the datamarkers; nothing unconfirmed does.
            with contextlib.suppress(Exception):
                self.producer.poll(0)
                self._persist()
        if error is not None:
            raise error
