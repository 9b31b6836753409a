"""The subscriber end of the Kafka transport: a consumer group per application.

:class:`KafkaSubscriber` offers the API of :class:`wormhole.Subscriber` over Kafka.
The consumer group is the application's name; the partitions assigned to this
consumer are its shards (``on_shard_notice``); a batch's offsets are committed
only after every handler returned, so the committed offset is the datamarker.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import uuid
from typing import Any

from wormhole.connectors.kafka.common import (
    HEADER_AUDIENCE,
    client_config,
    dataset_topic,
    kafka,
    table_pattern,
)
from wormhole.connectors.kafka.options import ConfigValue, KafkaOptions
from wormhole.core.errors import ConfigError, WormholeError
from wormhole.core.update import Update, decode_envelope
from wormhole.plugins.assignment import shards_of
from wormhole.plugins.debezium import decode_message
from wormhole.plugins.engine import load_pipeline
from wormhole.plugins.filters import BatchFilter, application_filter
from wormhole.plugins.views import ApplicationView, PipelineView
from wormhole.subscriber.handlers import Handlers

log = logging.getLogger("wormhole.subscriber")

COMMIT_INTERVAL_S = 0.2
"""Most time between offset commits while batches keep coming."""

Start = str | int
"""``"earliest"``, ``"latest"``, or a time in milliseconds since the epoch."""


class KafkaSubscriber(Handlers):
    """An application's subscriber over the ``kafka`` transport.

    Same handlers and lifecycle as :class:`wormhole.Subscriber`: ``on_shard_notice``,
    ``on_updates``, ``on_batch``, ``run``, ``run_async``, ``stop``.
    """

    def __init__(
        self,
        app: str,
        bootstrap_servers: str,
        topics: list[str],
        *,
        start: Start = "earliest",
        config: dict[str, ConfigValue] | None = None,
        filter: BatchFilter | None = None,
        instance: str | None = None,
        batch_updates: int = 1000,
        max_backoff: float = 30.0,
        shards: list[int] | None = None,
        envelope: str = "wormhole",
        skip_topics: frozenset[str] = frozenset(),
    ) -> None:
        if not topics:
            raise ValueError("topics: give at least one topic (or one ^pattern)")
        if not (start in ("earliest", "latest") or (isinstance(start, int) and start >= 0)):
            raise ValueError("start: earliest, latest or a time in ms since the epoch")
        if envelope not in ("wormhole", "debezium"):
            raise ValueError("envelope: wormhole or debezium (what the topics hold)")
        self.envelope = envelope
        """What the topics' values are: the update envelope, or Debezium's change events."""
        self.skip_topics = skip_topics
        """Topics read past, not as updates: Debezium's ``<prefix>.transaction`` (its BEGIN
        and END events), which the topics' pattern also matches."""
        self.app = app
        self.bootstrap_servers = bootstrap_servers
        self.topics = list(topics)
        self.start = start
        self.filter = filter
        self.instance = instance or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.batch_updates = batch_updates
        self.max_backoff = max_backoff
        self.handler_max_backoff = max_backoff
        self.shards = sorted(shards) if shards is not None else None
        """Fixed shards (partitions) to read, without group rebalancing; None: the group
        divides the partitions among its members."""
        self.config: dict[str, Any] = {
            "session.timeout.ms": 10_000,
            "heartbeat.interval.ms": 1_000,
            "topic.metadata.refresh.interval.ms": 2_000,
            # Some Kafka-protocol brokers answer a fetch only when this wait is over, even
            # when data arrived meanwhile; it bounds the delivery latency they add.
            "fetch.wait.max.ms": 100,
            # Once a subscriber has 100,000 messages queued, librdkafka pauses fetching
            # for this long (1 s by default): a subscriber that drains its queue sooner
            # then waits, idle, for the rest of it.
            "fetch.queue.backoff.ms": 20,
            "enable.partition.eof": False,
            **(config or {}),
            "bootstrap.servers": bootstrap_servers,
            "group.id": app,
            "client.id": f"wormhole-{app}-{self.instance}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": start if isinstance(start, str) else "earliest",
        }
        self.assigned: set[int] = set()
        self.processed = 0
        self.frame_appended_ns = 0
        self.message_timestamp_ms = 0
        self._owned: set[tuple[str, int]] = set()
        self._uncommitted: dict[tuple[str, int], int] = {}
        self._next_commit = 0.0
        self._init_handlers()
        self._stop = threading.Event()
        self._consumer: Any = None

    @classmethod
    def from_pipeline(
        cls,
        pipeline: str | os.PathLike[str] | PipelineView,
        app: str,
        *,
        instance: str | None = None,
        start: Start | None = None,
        shards: list[int] | None = None,
    ) -> KafkaSubscriber:
        """A subscriber of ``app`` as the pipeline file configures it (topics, filter,
        start, librdkafka settings). ``pipeline``: the file, or a pipeline already loaded
        (:func:`wormhole.plugins.engine.load_pipeline`)."""
        if isinstance(pipeline, str | os.PathLike):
            pipeline = load_pipeline(pipeline)
        options = pipeline.transport.options
        if not isinstance(options, KafkaOptions):
            raise ConfigError(
                f"transport.type: {pipeline.transport.type}; KafkaSubscriber needs the kafka "
                f"transport (use wormhole.Subscriber for tcp)",
                pipeline.file,
            )
        application = _application(pipeline, app)
        if start is None:
            if not isinstance(application.start, dict):
                start = application.start
            elif "backfill" in application.start:
                start = "latest"  # the backfill brings the rest
            else:
                raise ConfigError(
                    f"applications.{app}.start: a publisher-log position or a time cannot be "
                    f"mapped to Kafka offsets; with the kafka transport use earliest or latest",
                    pipeline.file,
                )
        topics = (
            [dataset_topic(options, pipeline.name)]
            if options.topic_naming == "dataset"
            else [table_pattern(options)]
        )
        return cls(
            app,
            options.bootstrap_servers,
            topics,
            start=start,
            config=client_config(options, options.consumer),
            filter=application_filter(application),
            instance=instance,
            batch_updates=options.batch_updates,
            envelope=options.envelope,
            shards=shards,
            # (No table's topic has that name: theirs are <prefix>.<schema>.<table>.)
            skip_topics=frozenset({f"{options.topic_prefix}.transaction"})
            if options.envelope == "debezium"
            else frozenset(),
        )

    # --------------------------------------------------------------- run
    def stop(self) -> None:
        """Finish the batch in hand, commit it, leave the group; ``run`` then returns."""
        self._stop.set()

    def run(self) -> None:
        """Serve until ``stop()``. Broker outages are retried by the client without end."""
        ck = kafka()
        try:
            consumer = ck.Consumer(self.config)
        except ck.KafkaException as exc:
            raise ConfigError(
                f"transport.consumer: librdkafka rejected the settings ({exc.args[0].str()})"
            ) from None
        self._consumer = consumer
        if self.shards is None:
            consumer.subscribe(
                self.topics,
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )
        next_lookup = 0.0
        lookup_interval = 0.025  # doubled before its first use: 50 ms
        log.info(
            "subscribing to %s at %s as %s/%s",
            ", ".join(self.topics),
            self.bootstrap_servers,
            self.app,
            self.instance,
        )
        try:
            while not self._stop.is_set():
                if self.shards is not None and time.monotonic() >= next_lookup:
                    self._assign_fixed(consumer)
                    # Soon again while none of the topics exists yet (a subscriber
                    # starts with its publisher), then every 2 s for new ones.
                    lookup_interval = 2.0 if self._owned else min(2.0, lookup_interval * 2)
                    next_lookup = time.monotonic() + lookup_interval
                messages = consumer.consume(self.batch_updates, 0.1)
                if messages:
                    self._process(messages)
                elif self._uncommitted:
                    self._commit()  # idle: commit what is handled
            self._commit()
        finally:
            try:
                consumer.close()
            finally:
                self._consumer = None
                self._change(set())

    def latency(self) -> float:
        """Seconds since the batch being handled was written to Kafka (broker clock)."""
        return time.time() - self.message_timestamp_ms / 1000.0

    # -------------------------------------------------------- processing
    def _process(self, messages: list[Any]) -> None:
        updates: list[Update] = []
        append = updates.append
        decode = decode_envelope
        debezium = self.envelope == "debezium"
        skip = self.skip_topics
        owned = self._owned
        offsets: dict[tuple[str, int], int] = {}
        for m in messages:
            if m.error() is not None:
                self._message_error(m)
                continue
            key = (m.topic(), m.partition())
            if key not in owned:
                continue
            if m.value() is None or key[0] in skip:
                # A tombstone after a delete (for compaction), or a BEGIN or END event.
                offsets[key] = m.offset() + 1
                continue
            headers = m.headers()
            if headers is not None and len(headers) > 3 and self._not_ours(headers):
                offsets[key] = m.offset() + 1  # a backfill for another application
                continue
            try:
                if debezium:
                    append(decode_message(m.key(), m.value(), m.partition()))
                else:
                    append(decode(m.value()))
            except Exception as exc:
                raise WormholeError(
                    f"topic {key[0]!r} partition {key[1]} offset {m.offset()}: not "
                    f"{'a Debezium change event' if debezium else 'a wormhole update envelope'} "
                    f"({exc}); only the kafka transport of a wormhole publisher "
                    f"should write to this topic"
                ) from None
            offsets[key] = m.offset() + 1
        if not offsets:
            return
        self.message_timestamp_ms = messages[-1].timestamp()[1]
        kept = self.filter(updates) if self.filter is not None else updates
        if kept:
            self._handle(kept)
        self.processed += len(kept)
        self._uncommitted.update(offsets)
        # Offsets are committed after the sink made the batches durable, at most every
        # COMMIT_INTERVAL_S (a synchronous round trip per batch would halve throughput);
        # a crash in between delivers those batches again (at-least-once).
        if time.monotonic() >= self._next_commit:
            self._commit()

    def _not_ours(self, headers: list[tuple[str, bytes]]) -> bool:
        """Whether a message's headers name another application as its only audience."""
        for name, value in headers:
            if name == HEADER_AUDIENCE:
                return bytes(value).decode() != self.app
        return False

    def _message_error(self, m: Any) -> None:
        ck = kafka()
        err = m.error()
        if err.fatal():
            raise WormholeError(f"Kafka consumer of {self.app}: {err.str()}")
        if err.code() == ck.KafkaError.UNKNOWN_TOPIC_OR_PART:
            log.debug("%s: %s (not created yet?)", self.app, err.str())
        else:
            log.warning("%s: Kafka: %s", self.app, err.str())

    def _stopped_while_retrying(self, exc: Exception) -> BaseException:
        return WormholeError(
            f"{self.app}: stopped while retrying a batch; it was not committed and "
            f"is delivered again"
        )

    def _commit(self, only: set[tuple[str, int]] | None = None) -> None:
        """Commit the offsets of handled batches: the application's datamarkers."""
        consumer = self._consumer
        self._next_commit = time.monotonic() + COMMIT_INTERVAL_S
        if consumer is None or not self._uncommitted:
            return
        ck = kafka()
        keys = [k for k in self._uncommitted if only is None or k in only]
        if not keys:
            return
        offsets = [ck.TopicPartition(t, p, self._uncommitted[(t, p)]) for t, p in keys]
        try:
            consumer.commit(offsets=offsets, asynchronous=False)
        except ck.KafkaException as exc:
            # Kept for the next commit while the partitions stay here; if they move,
            # their next owner delivers these updates again (at-least-once).
            log.warning(
                "%s: offsets not committed yet (%s); retried with the next batch",
                self.app,
                exc.args[0].str() if exc.args else exc,
            )
            return
        for key in keys:
            self._uncommitted.pop(key, None)

    # ------------------------------------------------------- rebalancing
    def _assign_fixed(self, consumer: Any) -> None:
        """Fixed shards: read them in every topic that exists (new per-table topics too),
        from the group's committed offsets."""
        ck = kafka()
        assert self.shards is not None
        try:
            metadata = consumer.list_topics(timeout=5)
        except ck.KafkaException as exc:
            log.warning("%s: cannot list topics (%s); retrying", self.app, exc)
            return
        patterns = [re.compile(t) for t in self.topics if t.startswith("^")]
        names = [t for t in self.topics if not t.startswith("^")]
        found = [
            t
            for t in metadata.topics
            if (t in names or any(p.match(t) for p in patterns))
            and metadata.topics[t].error is None
        ]
        new = [
            ck.TopicPartition(t, s)
            for t in sorted(found)
            for s in self.shards
            if (t, s) not in self._owned and s < len(metadata.topics[t].partitions)
        ]
        if not new:
            return
        if isinstance(self.start, int) and not isinstance(self.start, bool):
            new = self._time_offsets(consumer, new)
        consumer.incremental_assign(new)
        self._change(self._owned | {(tp.topic, tp.partition) for tp in new})

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        if isinstance(self.start, int) and not isinstance(self.start, bool) and partitions:
            self._seek_to_time(consumer, partitions)
        self._change(self._owned | {(tp.topic, tp.partition) for tp in partitions})

    def _seek_to_time(self, consumer: Any, partitions: list[Any]) -> None:
        consumer.assign(self._time_offsets(consumer, partitions))

    def _time_offsets(self, consumer: Any, partitions: list[Any]) -> list[Any]:
        """Partitions without a committed offset start at the first message at or after
        ``start`` (ms)."""
        ck = kafka()
        committed = consumer.committed(partitions, timeout=10)
        fresh = [ck.TopicPartition(tp.topic, tp.partition, self.start) for tp in committed]
        fresh = [tp for tp, c in zip(fresh, committed, strict=True) if c.offset < 0]
        if not fresh:
            return list(committed)
        found = {(tp.topic, tp.partition): tp.offset for tp in consumer.offsets_for_times(fresh)}
        chosen = []
        for tp in committed:
            offset = found.get((tp.topic, tp.partition))
            if offset is not None:
                # -1: nothing that new yet; start at the end.
                offset = ck.OFFSET_END if offset < 0 else offset
                chosen.append(ck.TopicPartition(tp.topic, tp.partition, offset))
            else:
                chosen.append(ck.TopicPartition(tp.topic, tp.partition, tp.offset))
        return chosen

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        gone = {(tp.topic, tp.partition) for tp in partitions}
        self._commit(gone)
        for key in gone:
            self._uncommitted.pop(key, None)
        self._change(self._owned - gone)

    def _on_lost(self, consumer: Any, partitions: list[Any]) -> None:
        gone = {(tp.topic, tp.partition) for tp in partitions}
        for key in gone:
            self._uncommitted.pop(key, None)
        self._change(self._owned - gone)

    def _change(self, owned: set[tuple[str, int]]) -> None:
        before = self.assigned
        self._owned = owned
        after = {p for _, p in owned}
        self.assigned = after
        assigned = sorted(after - before)
        revoked = sorted(before - after)
        if assigned or revoked:
            log.info(
                "%s/%s: shards assigned %s, revoked %s", self.app, self.instance, assigned, revoked
            )
            for fn in self._notice_handlers:
                fn(assigned, revoked)


def _application(pipeline: PipelineView, name: str) -> ApplicationView:
    application = pipeline.applications.get(name)
    if application is None:
        known = ", ".join(sorted(pipeline.applications))
        raise ConfigError(f"--app: unknown application {name!r} (known: {known})", pipeline.file)
    return application


def subscribe_command(pipeline: PipelineView, app_name: str, instance: int) -> int:
    """``wormhole subscribe`` with the kafka transport: the application's sink, in a
    consumer group named after the application (the pipeline file's application: the
    consumer's filter is the file's too)."""
    app = _application(pipeline, app_name)
    sink_component = app.sink
    if sink_component is None:
        raise ConfigError(
            f"applications.{app_name}.sink: none configured; this application's subscribers "
            f"are programs using wormhole.connectors.kafka.KafkaSubscriber",
            pipeline.file,
        )
    if not 0 <= instance < app.subscribers:
        raise ConfigError(
            f"--instance: {instance} is not below applications.{app_name}.subscribers "
            f"({app.subscribers}); with the kafka transport, instance I reads the shards s with "
            f"s % subscribers == I",
            pipeline.file,
        )
    shards = shards_of(instance, app.subscribers, pipeline.shards)
    subscriber = KafkaSubscriber.from_pipeline(
        pipeline, app_name, instance=str(instance), shards=shards
    )
    subscriber.serve_sink(sink_component, pipeline, app, instance)
    return 0


__all__ = ["KafkaSubscriber", "Start", "subscribe_command"]
