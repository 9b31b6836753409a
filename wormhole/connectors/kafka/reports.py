"""Delivery reports of the Kafka transport: which updates the broker confirmed, per partition.

The last record of a partition in a batch carries a delivery callback (a *marker*); the broker
confirms a partition's records in order (the gapless guarantee), so a confirmed marker vouches
for every record of its partition before it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from functools import partial
from typing import Any

from wormhole.connectors.kafka.common import kafka
from wormhole.connectors.kafka.options import KafkaOptions
from wormhole.core.errors import WormholeError

log = logging.getLogger("wormhole.kafka")


class ProduceFailed(WormholeError):
    """Kafka refused an update for good (not a retriable broker outage)."""


class DeliveryReports:
    """What is still unconfirmed per (topic, partition), and the first failure, if any."""

    def __init__(self, options: KafkaOptions) -> None:
        self.options = options
        self.pending: dict[tuple[str, int], deque[tuple[int, int]]] = {}
        self.next_marker = 0
        self.failed: dict[tuple[str, int], str] = {}
        self.failure: BaseException | None = None
        self.last_outage_log = 0.0

    def marker(self, key: tuple[str, int], first: int) -> Any:
        """A delivery callback that confirms ``key``'s part of a batch starting at ``first``."""
        marker = self.next_marker
        self.next_marker += 1
        self.pending.setdefault(key, deque()).append((first, marker))
        return partial(self._confirmed, key, marker)

    def oldest_unconfirmed(self, positions: list[int]) -> list[int]:
        """``positions`` (one per shard) lowered to each shard's oldest unconfirmed batch."""
        out = list(positions)
        for (_topic, shard), queue in list(self.pending.items()):
            if queue:
                with contextlib.suppress(IndexError):  # emptied by a delivery report meanwhile
                    out[shard] = min(out[shard], queue[0][0])
        return out

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

    def client_error(self, err: Any) -> None:
        """librdkafka's ``error_cb``: a fatal error fails the transport, outages are logged."""
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
