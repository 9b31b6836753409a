"""An application's lag over Kafka: its consumer group's committed offsets against the end
of its topics (what ``wormhole status`` and ``top`` show for the kafka transport)."""

from __future__ import annotations

from typing import Any

from wormhole.connectors.kafka.common import client_config, dataset_topic, kafka
from wormhole.connectors.kafka.options import KafkaOptions
from wormhole.plugins.components import DestinationLag

WHAT = "Kafka records not committed by the application's consumer group (topic end - offset)"

TIMEOUT_S = 5.0
"""How long each question to the broker may take: status must not hang on a broker that is
down."""


def group_lag(options: KafkaOptions, pipeline: Any) -> DestinationLag:
    """Per application (its consumer group is its name) and shard: records of its topics
    after its committed offset (an application that committed nothing: every record)."""
    ck = kafka()
    config = client_config(options, {**options.consumer, "enable.auto.commit": False})
    names = sorted(n for n, a in pipeline.applications.items() if not a.external)
    probe = None
    try:
        probe = ck.Consumer(
            {
                **config,
                "group.id": f"{options.topic_prefix}.lag-probe",
                "enable.partition.eof": True,
            }
        )
        topics = _topics(probe, options, pipeline.name)
        partitions = [ck.TopicPartition(t, s) for t in topics for s in range(pipeline.shards)]
        ends = log_ends(probe, partitions)
        shards: dict[str, dict[int, int]] = {}
        for name in names:
            group = ck.Consumer({**config, "group.id": name})
            try:
                committed = group.committed(partitions, timeout=TIMEOUT_S) if partitions else []
            finally:
                group.close()
            lag = dict.fromkeys(range(pipeline.shards), 0)
            for tp in committed:
                low, high = ends[(tp.topic, tp.partition)]
                offset = tp.offset if tp.offset >= 0 else low
                lag[tp.partition] += max(0, high - offset)
            shards[name] = lag
        return DestinationLag(WHAT, shards)
    except Exception as exc:  # the broker is away: status still shows the rest
        reason = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
        return DestinationLag(
            WHAT, error=f"Kafka at {options.bootstrap_servers} did not answer ({reason})"
        )
    finally:
        if probe is not None:
            probe.close()


def log_ends(consumer: Any, partitions: list[Any]) -> dict[tuple[str, int], tuple[int, int]]:
    """Per partition: the first offset and the offset after the last record.

    The high watermark is that end on Kafka; some brokers (Tansu 0.6) report the first
    offset of the last record batch + 1 instead, so the last batch is read from there to find
    the real end. ``consumer`` needs ``enable.partition.eof`` and is left unassigned."""
    import time

    ck = kafka()
    ends = {
        (tp.topic, tp.partition): consumer.get_watermark_offsets(tp, timeout=TIMEOUT_S)
        for tp in partitions
    }
    last = [ck.TopicPartition(t, p, high - 1) for (t, p), (low, high) in ends.items() if high > low]
    if not last:
        return ends
    consumer.assign(last)
    pending = {(tp.topic, tp.partition) for tp in last}
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while pending and time.monotonic() < deadline:
            for m in consumer.consume(1000, 0.2):
                key = (m.topic(), m.partition())
                if m.error() is not None:
                    if m.error().code() == ck.KafkaError._PARTITION_EOF:
                        pending.discard(key)
                    continue
                low, high = ends[key]
                ends[key] = (low, max(high, m.offset() + 1))
    finally:
        consumer.unassign()
    return ends


def _topics(probe: Any, options: KafkaOptions, pipeline: str) -> list[str]:
    if options.topic_naming == "dataset":
        return [dataset_topic(options, pipeline)]
    listed = probe.list_topics(timeout=TIMEOUT_S).topics
    return sorted(t for t in listed if t.startswith(f"{options.topic_prefix}."))
