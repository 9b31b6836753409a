"""The ``kafka`` transport: flows go through a Kafka cluster (confluent-kafka).

Publisher side: :mod:`wormhole.connectors.kafka.producer` reads the publisher
log and produces every update to partition ``shard`` of the topic
``<topic_prefix>.<pipeline>`` (or ``<topic_prefix>.<schema>.<table>``).
Subscriber side: :class:`wormhole.connectors.kafka.consumer.KafkaSubscriber`, a
consumer group per application. See docs/kafka.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wormhole.connectors.kafka.options import KafkaOptions
from wormhole.plugins.components import (
    Capabilities,
    ComponentSpec,
    DestinationLag,
    SubscribeRequest,
    offer,
)

if TYPE_CHECKING:
    from wormhole.connectors.kafka.consumer import KafkaSubscriber


def _transport(options: KafkaOptions) -> Any:
    from wormhole.connectors.kafka.common import kafka
    from wormhole.connectors.kafka.producer import KafkaTransport

    kafka()  # a clear error when confluent-kafka is missing
    return KafkaTransport(options)


def __getattr__(name: str) -> Any:
    if name == "KafkaSubscriber":
        from wormhole.connectors.kafka.consumer import KafkaSubscriber

        return KafkaSubscriber
    raise AttributeError(name)


def _lag(options: KafkaOptions, pipeline: Any) -> DestinationLag:
    from wormhole.connectors.kafka.lag import group_lag

    return group_lag(options, pipeline)


def _subscribe(request: SubscribeRequest) -> None:
    from wormhole.connectors.kafka.consumer import subscribe_command

    subscribe_command(request.pipeline, request.application, request.instance)


wormhole_transports = offer(
    ComponentSpec(
        kind="transport",
        name="kafka",
        factory=_transport,
        options=KafkaOptions,
        description="Updates go through a Kafka cluster: a topic per dataset (or table), "
        "partition = shard, a consumer group per application.",
        capabilities=Capabilities(reads_log=True, subscriber_processes=True),
        subscribe=_subscribe,
        lag=_lag,
    )
)


__all__ = ["KafkaOptions", "KafkaSubscriber"]
