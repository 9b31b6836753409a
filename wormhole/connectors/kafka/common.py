"""What the Kafka producer and consumer share: topic names, client settings, topic checks."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from wormhole.connectors.kafka.options import ConfigValue, KafkaOptions
from wormhole.core.backoff import Backoff
from wormhole.core.errors import ConfigError, StateError, WormholeError

log = logging.getLogger("wormhole.kafka")

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")

HEADER_SHARD = "shard"
HEADER_LOGICAL = "logical"
HEADER_SEQ = "seq"
HEADER_AUDIENCE = "audience"
"""Only on an update for one application (a backfill for it): its name."""


def kafka() -> Any:
    """The confluent_kafka module, or an error that says how to install it."""
    try:
        import confluent_kafka
        import confluent_kafka.admin
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(
            "transport.type: kafka needs the confluent-kafka package; install it with "
            "pip install 'wormhole-cdc[kafka]'"
        ) from exc
    return confluent_kafka


def dataset_topic(options: KafkaOptions, pipeline: str) -> str:
    return f"{options.topic_prefix}.{_UNSAFE.sub('_', pipeline)}"


def table_topic(options: KafkaOptions, table: str) -> str:
    """``<prefix>.<schema>.<table>``; characters Kafka does not allow become ``_``."""
    return f"{options.topic_prefix}.{_UNSAFE.sub('_', table or '_')}"[:249]


def table_pattern(options: KafkaOptions) -> str:
    """The subscription pattern that matches every per-table topic of ``options``."""
    return "^" + re.escape(options.topic_prefix + ".") + ".+"


def client_config(options: KafkaOptions, role: dict[str, ConfigValue]) -> dict[str, Any]:
    config: dict[str, Any] = {"bootstrap.servers": options.bootstrap_servers}
    config.update(options.config)
    config.update(role)
    return config


class Topics:
    """Checks and creates topics: one partition per shard."""

    def __init__(self, options: KafkaOptions, shards: int) -> None:
        self.options = options
        self.shards = shards
        ck = kafka()
        # Connection failures are reported once, by wait_for_brokers, not per attempt.
        self.admin = ck.admin.AdminClient({"log_level": 2, **client_config(options, {})})
        self.known: set[str] = set()
        self.compacted: dict[str, bool] = {}
        """Per known topic: whether its cleanup.policy includes compact."""

    def wait_for_brokers(self) -> None:
        """Retry the brokers for ``connect_timeout_s``; then fail, naming the address."""
        deadline = time.monotonic() + self.options.connect_timeout_s
        backoff = Backoff(log, first=0.2, cap=5.0)
        while True:
            try:
                self.admin.list_topics(
                    timeout=max(0.2, min(2.0, self.options.connect_timeout_s / 5))
                )
                return
            except Exception as exc:
                if time.monotonic() + backoff.delay > deadline:
                    raise StateError(
                        f"transport.bootstrap_servers: cannot reach Kafka at "
                        f"{self.options.bootstrap_servers} within "
                        f"{self.options.connect_timeout_s:g}s ({_reason(exc)}); "
                        f"check the address and that the brokers are running, "
                        f"or raise transport.connect_timeout_s"
                    ) from None
                backoff.wait(
                    "Kafka at %s is not reachable (%s); retrying in %.1fs",
                    self.options.bootstrap_servers,
                    _reason(exc),
                )

    def ensure(self, topic: str) -> None:
        """The topic exists with ``shards`` partitions (created if allowed), else an error."""
        if topic in self.known:
            return
        ck = kafka()
        metadata = self.admin.list_topics(timeout=10)
        found = metadata.topics.get(topic)
        missing = found is None or (
            found.error is not None and found.error.code() == ck.KafkaError.UNKNOWN_TOPIC_OR_PART
        )
        if not missing:
            assert found is not None
            if found.error is not None:
                raise StateError(f"transport: topic {topic!r}: {found.error.str()}")
            self._check(topic, len(found.partitions))
            self._known(topic)
            return
        if not self.options.create_topics:
            raise StateError(
                f"transport.create_topics: topic {topic!r} does not exist and create_topics is "
                f"false; create it with {self.shards} partitions (one per shard), or set "
                f"create_topics: true"
            )
        new = ck.admin.NewTopic(
            topic,
            num_partitions=self.shards,
            replication_factor=self.options.replication_factor,
            config={
                k: str(v).lower() if isinstance(v, bool) else str(v)
                for k, v in self.options.topic_config.items()
            },
        )
        future = self.admin.create_topics([new], operation_timeout=30)[topic]
        try:
            future.result()
            log.info("created topic %s with %d partitions", topic, self.shards)
        except ck.KafkaException as exc:
            if exc.args[0].code() != ck.KafkaError.TOPIC_ALREADY_EXISTS:
                raise StateError(
                    f"transport: cannot create topic {topic!r} with {self.shards} partitions "
                    f"({_reason(exc)}); create it yourself, or check the broker's permissions"
                ) from None
            # Created meanwhile by someone else: check it like an existing one.
            metadata = self.admin.list_topics(timeout=10)
            self._check(topic, len(metadata.topics[topic].partitions))
        self._known(topic)

    def _known(self, topic: str) -> None:
        self.known.add(topic)
        self.compacted[topic] = "compact" in self.cleanup_policy(topic)

    def cleanup_policy(self, topic: str) -> str:
        """The topic's ``cleanup.policy`` as the broker says ("" if it cannot tell)."""
        ck = kafka()
        resource = ck.admin.ConfigResource("topic", topic)
        try:
            found = self.admin.describe_configs([resource])[resource].result(timeout=10)
        except Exception as exc:
            log.warning("topic %s: cannot read its cleanup.policy (%s)", topic, _reason(exc))
            return ""
        entry = found.get("cleanup.policy")
        return str(entry.value or "") if entry is not None else ""

    def _check(self, topic: str, partitions: int) -> None:
        if partitions != self.shards:
            raise StateError(
                f"transport: topic {topic!r} has {partitions} partitions but dataset.shards is "
                f"{self.shards}; each partition carries one shard, so the counts must match: "
                f"set dataset.shards to {partitions} (for a new state_dir), or choose another "
                f"transport.topic_prefix"
            )


def _reason(exc: BaseException) -> str:
    ck = kafka()
    if isinstance(exc, ck.KafkaException) and exc.args:
        err = exc.args[0]
        if isinstance(err, ck.KafkaError):
            return str(err.str())
    return str(exc)


def fatal(message: str) -> WormholeError:
    return WormholeError(message)
