"""Options of the ``kafka`` transport, shared by the publisher and ``wormhole subscribe``."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from wormhole.plugins.debezium import DebeziumFields

ConfigValue = str | int | float | bool

_TOPIC = re.compile(r"^[A-Za-z0-9._-]+$")


class KafkaOptions(DebeziumFields):
    """Updates go through a Kafka cluster: one topic per dataset (or per table)."""

    bootstrap_servers: str = Field(
        "127.0.0.1:9092", description="comma-separated host:port list of Kafka brokers"
    )
    topic_prefix: str = Field(
        "wormhole",
        description="topics are named <topic_prefix>.<pipeline> (or <topic_prefix>.<table>)",
    )
    topic_naming: Literal["dataset", "table"] = Field(
        "dataset",
        description="dataset: one topic for the pipeline; table: one topic per source table, "
        "named <topic_prefix>.<schema>.<table> as Debezium names them",
    )
    create_topics: bool = Field(
        True, description="create missing topics with one partition per shard"
    )
    topic_config: dict[str, ConfigValue] = Field(
        default_factory=dict,
        description="settings of the topics wormhole creates, e.g. {cleanup.policy: compact}",
    )
    tombstones: bool | None = Field(  # type: ignore[assignment]
        None,
        description="after a delete, a record with the same key and no value, so that log "
        "compaction removes the key (default: where the topic's cleanup.policy has compact; "
        "with envelope debezium, always, as Debezium's tombstones.on.delete)",
    )
    replication_factor: int = Field(
        -1, ge=-1, description="replication factor of created topics (-1: the broker's default)"
    )
    config: dict[str, ConfigValue] = Field(
        default_factory=dict,
        description="librdkafka settings for every client (security.protocol, sasl.*, ssl.*, ...)",
    )
    producer: dict[str, ConfigValue] = Field(
        default_factory=dict, description="librdkafka settings for the publisher's producer only"
    )
    consumer: dict[str, ConfigValue] = Field(
        default_factory=dict, description="librdkafka settings for subscribers' consumers only"
    )
    connect_timeout_s: float = Field(
        30.0, gt=0, description="at start, how long to retry reaching the brokers before failing"
    )
    batch_updates: int = Field(
        1000, ge=1, le=100_000, description="a subscriber hands its sink at most this many updates"
    )
    spawn: bool = Field(
        True, description="`wormhole run` starts each application's subscribers as processes"
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="on stop, how long the broker and the subscribers may go without progress",
    )

    @model_validator(mode="after")
    def _debezium_topics(self) -> KafkaOptions:
        if self.envelope == "debezium" and self.topic_naming != "table":
            raise ValueError(
                "envelope debezium writes a topic per table, as Debezium does: set "
                "topic_naming: table"
            )
        return self

    @field_validator("topic_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not _TOPIC.match(value) or len(value) > 200:
            raise ValueError(
                "must be 1-200 characters of A-Z, a-z, 0-9, '.', '_' or '-' (a Kafka topic name)"
            )
        return value

    @field_validator("config", "producer", "consumer")
    @classmethod
    def _settings(cls, value: dict[str, ConfigValue]) -> dict[str, ConfigValue]:
        for key in value:
            if key in ("bootstrap.servers", "group.id"):
                raise ValueError(
                    f"{key} is set by wormhole (use bootstrap_servers; the consumer group is "
                    f"the application's name)"
                )
        return value

    @field_validator("config", "producer")
    @classmethod
    def _producer_safety(cls, value: dict[str, ConfigValue]) -> dict[str, ConfigValue]:
        for key in ("enable.idempotence", "acks", "enable.gapless.guarantee", "on_delivery"):
            if key in value:
                raise ValueError(
                    f"{key} is set by wormhole: the datamarkers rely on an idempotent producer "
                    f"with acks=all whose failures leave no gap; remove it"
                )
        return value
