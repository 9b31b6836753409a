"""The end of a drained run: wait until every spawned application consumed the topics."""

from __future__ import annotations

import logging
import time

from wormhole.connectors.kafka.common import client_config, kafka
from wormhole.connectors.kafka.lag import log_ends
from wormhole.connectors.kafka.options import KafkaOptions
from wormhole.core.errors import WormholeError

log = logging.getLogger("wormhole.kafka")


def wait_for_applications(
    options: KafkaOptions, apps: list[str], topics: list[str], shards: int, once: bool
) -> None:
    """Wait until every spawned application committed offsets up to the topics' ends,
    as long as its subscribers make progress."""
    if not apps:
        return
    ck = kafka()
    partitions = [ck.TopicPartition(t, s) for t in topics for s in range(shards)]
    consumers = {
        app: ck.Consumer(
            client_config(
                options,
                {
                    **options.consumer,
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
            if time.monotonic() - progress > options.drain_timeout_s:
                behind = ", ".join(f"{app} ({last_lag[app]} offsets)" for app in apps)
                if once:
                    # --once promises every application everything: not so here.
                    raise WormholeError(
                        f"--once: applications did not consume every update: {behind} "
                        f"behind in Kafka after {options.drain_timeout_s:g}s without "
                        f"progress (transport.drain_timeout_s); see their subscribers' "
                        f"messages above (a sink retrying a write, say). They resume from "
                        f"their committed offsets on the next run"
                    )
                log.warning(
                    "applications %s did not catch up with Kafka within %gs without "
                    "progress; their subscribers stop now and resume from their committed "
                    "offsets next time",
                    behind,
                    options.drain_timeout_s,
                )
                return
            time.sleep(0.1)
    except ck.KafkaException as exc:
        if once:
            raise WormholeError(
                f"--once: cannot tell whether every application consumed everything: "
                f"reading their committed offsets failed ({exc})"
            ) from exc
        log.warning("cannot read the applications' committed offsets: %s", exc)
    finally:
        for consumer in consumers.values():
            consumer.close()
