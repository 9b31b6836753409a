"""The kafka transport against a real Kafka-protocol broker (Tansu) and real wormhole processes."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import REPO, assert_complete_in_order
from tcp_support import Process

from wormhole.core.datamarkers import read_datamarkers
from wormhole.core.publisher_log import inspect_log
from wormhole.testing import read_envelopes, run_cli, wait_until, write_pipeline
from wormhole.testing.helpers import free_port, subscriber_pids

pytest.importorskip("confluent_kafka")

from confluent_kafka import Consumer
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from wormhole.connectors.kafka import KafkaSubscriber
from wormhole.testing.kafka import TansuBroker

# Consumer groups settle in seconds, not the defaults' tens of seconds (see docs/kafka.md).
FAST_GROUPS = {
    "session.timeout.ms": 6000,
    "heartbeat.interval.ms": 500,
    "max.poll.interval.ms": 10000,
}


def write_riders(directory: Path, riders: int, seconds: int, start: int = 0) -> int:
    """``riders`` keys, each with positions ``start..start+seconds-1``; one JSON-lines file."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps(
            {"table": "rider_location", "key": {"rider": r}, "after": {"rider": r, "seq": s}}
        )
        + "\n"
        for s in range(start, start + seconds)
        for r in range(riders)
    ]
    (directory / f"{start:06d}.jsonl").write_text("".join(lines))
    return len(lines)


def kafka_pipeline(
    tmp_path: Path,
    broker: TansuBroker,
    applications: dict[str, Any],
    name: str = "riders",
    shards: int = 4,
    **transport: Any,
) -> Path:
    return write_pipeline(
        tmp_path / f"{name}.yml",
        {
            "pipeline": name,
            "state_dir": str(tmp_path / "state"),
            "dataset": {"shards": shards},
            "source": {"type": "filelog", "path": str(tmp_path / "data"), "poll_interval_ms": 20},
            "transport": {
                "type": "kafka",
                "bootstrap_servers": broker.bootstrap,
                "topic_prefix": f"t{free_port()}",  # a fresh topic per test
                "consumer": FAST_GROUPS,
                **transport,
            },
            "delivery": {"datamarker_interval_ms": 50},
            "applications": applications,
        },
    )


def topic_of(pipeline: Path) -> str:
    import yaml

    raw = yaml.safe_load(pipeline.read_text())
    return f"{raw['transport']['topic_prefix']}.{raw['pipeline']}"


def read_topic(bootstrap: str, topic: str, count: int) -> list[Any]:
    """Every message of ``topic`` with a plain confluent-kafka consumer (no wormhole code)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"plain-{free_port()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            **FAST_GROUPS,
        }
    )
    consumer.subscribe([topic])
    messages: list[Any] = []

    def more() -> bool:
        for m in consumer.consume(1000, 0.5):
            assert m.error() is None, m.error()
            messages.append(m)
        return len(messages) >= count

    try:
        wait_until(more, 60, f"{count} messages in {topic}")
    finally:
        consumer.close()
    return messages


def test_every_update_reaches_applications_in_order_and_plain_consumers_read_it(
    tmp_path: Path, tansu: TansuBroker
) -> None:
    total = write_riders(tmp_path / "data" / "gps", 200, 10)
    history = tmp_path / "history.jsonl"
    pipeline = kafka_pipeline(
        tmp_path,
        tansu,
        {
            "history": {"sink": {"type": "jsonl", "path": str(history)}, "subscribers": 2},
            # Publisher-side filters apply in the subscriber, before the sink.
            "odd": {
                "sink": {"type": "jsonl", "path": str(tmp_path / "odd.jsonl")},
                "filter": {"plugins": [{"type": "sample", "fraction": 0.5}]},
            },
            "library": {},
        },
    )
    result = run_cli("run", str(pipeline), "--once", timeout=120)
    assert result.returncode == 0, result
    envelopes = read_envelopes(history)
    assert len(envelopes) == total
    assert_complete_in_order(envelopes, 200, 10, duplicates_allowed=False)
    odd = read_envelopes(tmp_path / "odd.jsonl")
    kept = {e["key"]["rider"] for e in odd}
    assert 0 < len(kept) < 200 and len(odd) == 10 * len(kept)
    # The publisher's datamarkers moved to the end for every application and shard.
    markers = read_datamarkers(tmp_path / "state")
    assert {(a, s): m.position for (a, s), m in markers.items()} == {
        (a, s): total for a in ("history", "odd", "library") for s in range(4)
    }

    # A consumer that knows nothing of wormhole reads the topic.
    topic = topic_of(pipeline)
    messages = read_topic(tansu.bootstrap, topic, total)
    lines = {json.dumps(e, separators=(",", ":")) for e in envelopes}
    for m in messages:
        value = json.loads(m.value())
        assert json.dumps(value, separators=(",", ":")) in lines
        # Unique per table in the dataset's one topic: the table is part of the key.
        key = {"key": value["key"], "table": value["source"]["table"]}
        assert m.key() == json.dumps(key, separators=(",", ":"), sort_keys=True).encode()
        headers = dict(m.headers())
        assert m.partition() == value["shard"] == int(headers["shard"])
        assert headers["logical"].decode() == value["source"]["logical"]
    assert len(messages) == total

    # The library subscriber: same API as wormhole.Subscriber, over Kafka.
    sub = KafkaSubscriber.from_pipeline(pipeline, "library")
    notices: list[tuple[list[int], list[int]]] = []
    seen: dict[int, list[int]] = {}
    sub.on_shard_notice(lambda assigned, revoked: notices.append((assigned, revoked)))

    @sub.on_updates
    def handle(flow: Any, batch: list[Any]) -> None:
        assert {u.shard for u in batch} == {flow.shard}
        for u in batch:
            seen.setdefault(u.key["rider"], []).append(msgspec.json.decode(u.after)["seq"])

    thread = threading.Thread(target=sub.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: sub.processed >= total, 60, "the library subscriber to catch up")
    finally:
        sub.stop()
        thread.join(30)
    assert notices[0] == ([0, 1, 2, 3], [])
    assert notices[-1] == ([], [0, 1, 2, 3])
    assert seen == {r: list(range(10)) for r in range(200)}

    # A second run delivers only what is new.
    more = write_riders(tmp_path / "data" / "gps", 200, 5, start=10)
    result = run_cli("run", str(pipeline), "--once", timeout=120)
    assert result.returncode == 0, result
    envelopes = read_envelopes(history)
    assert len(envelopes) == total + more, result
    assert_complete_in_order(envelopes, 200, 15, duplicates_allowed=False)


def broker_away_mid_stream(
    tmp_path: Path, broker: TansuBroker, away: Callable[[], None], back: Callable[[], None]
) -> None:
    """Half the stream, then the broker goes ``away`` while the other half arrives, then it
    comes ``back``: every update is delivered, in per-key order."""
    first = write_riders(tmp_path / "data" / "gps", 200, 20)
    history = tmp_path / "history.jsonl"
    pipeline = kafka_pipeline(
        tmp_path, broker, {"history": {"sink": {"type": "jsonl", "path": str(history)}}}
    )
    run = Process("run", str(pipeline), cwd=tmp_path)
    try:
        wait_until(lambda: len(read_envelopes(history)) > 0, 60, "delivery to start")
        away()
        try:
            total = first + write_riders(tmp_path / "data" / "gps", 200, 20, start=20)
            assert len(read_envelopes(history)) < total, "the broker should go mid-stream"
            # The publisher keeps reading the source into its log while Kafka is away.
            log = tmp_path / "state" / "log"
            wait_until(lambda: inspect_log(log).next_seq == total, 60, "the source to be read")
        finally:
            back()
        wait_until(lambda: len(read_envelopes(history)) >= total, 120, "delivery afterwards")
        wait_until(
            lambda: all(m.position == total for m in read_datamarkers(tmp_path / "state").values()),
            30,
            "datamarkers at the end",
        )
    finally:
        assert run.stop() == 0, run.stderr
    assert_complete_in_order(read_envelopes(history), 200, 40, duplicates_allowed=True)


def test_broker_outage_mid_stream_loses_and_reorders_nothing(
    tmp_path: Path, tansu: TansuBroker
) -> None:
    # Every connection cut and refused; the broker keeps its data.
    broker_away_mid_stream(tmp_path, tansu, tansu.disconnect, tansu.reconnect)


def test_broker_process_restart_mid_stream_loses_and_reorders_nothing(
    tmp_path: Path, tansu_s3: TansuBroker
) -> None:
    # The broker process exits and starts again; its data is in S3.
    broker_away_mid_stream(tmp_path, tansu_s3, tansu_s3.stop, tansu_s3.start)


class RiderStream(threading.Thread):
    """Appends one second of positions for every rider, a file at a time, until stopped."""

    def __init__(self, directory: Path, riders: int, start: int) -> None:
        super().__init__(daemon=True)
        self.directory = directory
        self.riders = riders
        self.seconds = start
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            write_riders(self.directory, self.riders, 1, start=self.seconds)
            self.seconds += 1
            self.halt.wait(0.05)  # pacing of the workload, not synchronisation

    def stop(self) -> int:
        self.halt.set()
        self.join()
        return self.seconds


def delivering_run(tmp_path: Path, broker: TansuBroker) -> tuple[RiderStream, Path, Path, Process]:
    """40 seconds of 500 riders, and `wormhole run` delivering them to one subscriber
    process; returns a RiderStream (not started) for what comes next, the jsonl sink's
    file, the pipeline file and the run."""
    gps = tmp_path / "data" / "gps"
    write_riders(gps, 500, 40)
    history = tmp_path / "history.jsonl"
    pipeline = kafka_pipeline(
        tmp_path, broker, {"history": {"sink": {"type": "jsonl", "path": str(history)}}}
    )
    run = Process("run", str(pipeline), cwd=tmp_path)
    try:
        wait_until(lambda: len(subscriber_pids(run.pid)) == 1, 30, "the subscriber process")
        wait_until(lambda: len(read_envelopes(history)) > 0, 60, "delivery to start")
    except BaseException:
        run.stop()
        raise
    return RiderStream(gps, 500, start=40), history, pipeline, run


def test_kill_9_of_the_subscriber_mid_stream_redelivers_in_order(
    tmp_path: Path, tansu: TansuBroker
) -> None:
    stream, history, _, run = delivering_run(tmp_path, tansu)
    try:
        victim = subscriber_pids(run.pid)[0]
        # The updates keep coming while the subscriber dies and is restarted.
        stream.start()
        os.kill(victim, signal.SIGKILL)
        at_kill = stream.seconds
        wait_until(lambda: subscriber_pids(run.pid) not in ([], [victim]), 30, "a new subscriber")
        wait_until(lambda: stream.seconds >= at_kill + 10, 30, "updates after the kill")
        seconds = stream.stop()
        wait_until(
            lambda: len(read_envelopes(history)) >= 500 * seconds, 120, "delivery after the kill"
        )
    finally:
        if stream.is_alive():
            stream.stop()
        assert run.stop() == 0, run.stderr
    assert "exited with code -9; restarting" in run.stderr
    assert_complete_in_order(read_envelopes(history), 500, seconds, duplicates_allowed=True)


def test_kill_9_of_the_publisher_mid_stream_loses_and_reorders_nothing(
    tmp_path: Path, tansu: TansuBroker
) -> None:
    stream, history, pipeline, run = delivering_run(tmp_path, tansu)
    try:
        # Updates keep coming while the publisher dies with produced but unconfirmed ones.
        stream.start()
        wait_until(lambda: stream.seconds >= 45, 30, "more updates")
        os.kill(run.pid, signal.SIGKILL)
        assert run.wait(30) == -signal.SIGKILL
        wait_until(lambda: stream.seconds >= 50, 30, "updates after the kill")
        seconds = stream.stop()
    finally:
        if stream.is_alive():
            stream.stop()
        if run.proc.poll() is None:
            run.proc.kill()
    # The next run produces again from the stored positions and delivers the rest.
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result
    assert_complete_in_order(read_envelopes(history), 500, seconds, duplicates_allowed=True)


def test_updates_at_the_tail_do_not_wait_for_linger(tmp_path: Path, tansu: TansuBroker) -> None:
    """Batches linger only while the producer works through a backlog: once it has caught
    up with the publisher log, what it produced goes out at once. With a linger of ten
    minutes, every update written while the publisher runs must still reach Kafka within
    the test's wait (a minute)."""
    pipeline = kafka_pipeline(
        tmp_path,
        tansu,
        {"library": {}},
        producer={"linger.ms": 600_000},
    )
    (tmp_path / "data" / "gps").mkdir(parents=True)
    run = Process("run", str(pipeline), cwd=tmp_path)
    admin = AdminClient({"bootstrap.servers": tansu.bootstrap})
    try:
        wait_until(
            lambda: topic_of(pipeline) in admin.list_topics(timeout=5).topics,
            60,
            "the publisher to create its topic",
        )
        total = 0
        for start in range(3):
            # Each file arrives after the producer caught up with the previous one.
            total += write_riders(tmp_path / "data" / "gps", 50, 1, start=start)
            messages = read_topic(tansu.bootstrap, topic_of(pipeline), total)
            assert len(messages) == total
    finally:
        assert run.stop() == 0, run.stderr


def test_a_topic_whose_partitions_do_not_match_the_shards_is_an_error(
    tmp_path: Path, tansu: TansuBroker
) -> None:
    write_riders(tmp_path / "data" / "gps", 10, 1)
    pipeline = kafka_pipeline(
        tmp_path, tansu, {"history": {"sink": {"type": "jsonl", "path": "h.jsonl"}}}
    )
    topic = topic_of(pipeline)
    admin = AdminClient({"bootstrap.servers": tansu.bootstrap})
    admin.create_topics([NewTopic(topic, 3, 1)])[topic].result()
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result
    assert f"topic '{topic}' has 3 partitions but dataset.shards is 4" in result.stderr


def test_an_update_kafka_refuses_stops_the_run_before_it(
    tmp_path: Path, tansu: TansuBroker
) -> None:
    data = tmp_path / "data" / "gps"
    data.mkdir(parents=True)
    lines = [{"table": "t", "key": {"id": i}, "after": {"id": i, "v": "x"}} for i in range(40)]
    lines[25]["after"] = {"id": 25, "v": "x" * 5000}  # over message.max.bytes below
    (data / "0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    history = tmp_path / "h.jsonl"
    pipeline = kafka_pipeline(
        tmp_path,
        tansu,
        {"history": {"sink": {"type": "jsonl", "path": str(history)}}},
        shards=1,
        producer={"message.max.bytes": 2000},
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result
    assert "Kafka refused update 25 of the publisher log (table 't', key {'id': 25}" in (
        result.stderr
    )
    assert "raise transport.producer message.max.bytes" in result.stderr
    # Nothing at or after the refused update counts as delivered.
    markers = read_datamarkers(tmp_path / "state")
    assert markers and all(m.position <= 25 for m in markers.values()), markers
    delivered = [e["key"]["id"] for e in read_envelopes(history)] if history.exists() else []
    assert 25 not in delivered and delivered == sorted(delivered), delivered


def test_an_unreachable_broker_is_retried_then_named(tmp_path: Path) -> None:
    write_riders(tmp_path / "data" / "gps", 10, 1)
    broker = TansuBroker(free_port(), 0, tmp_path, "")
    pipeline = kafka_pipeline(
        tmp_path,
        broker,
        {"history": {"sink": {"type": "jsonl", "path": "h.jsonl"}}},
        connect_timeout_s=1,
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result
    assert f"transport.bootstrap_servers: cannot reach Kafka at {broker.bootstrap} within 1s" in (
        result.stderr
    )
    assert "retrying" in result.stderr


def test_producer_settings_the_datamarkers_rely_on_cannot_be_changed(tmp_path: Path) -> None:
    broker = TansuBroker(free_port(), 0, tmp_path, "")
    pipeline = kafka_pipeline(
        tmp_path,
        broker,
        {"history": {"sink": {"type": "jsonl", "path": "h.jsonl"}}},
        producer={"acks": 1},
    )
    result = run_cli("validate", str(pipeline), cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result
    assert "transport.producer" in result.stderr
    assert "acks is set by wormhole" in result.stderr


def test_per_table_topics_as_debezium_names_them(tmp_path: Path, tansu: TansuBroker) -> None:
    data = tmp_path / "data" / "shop"
    data.mkdir(parents=True)
    lines = []
    for i in range(300):
        table = ("public.orders", "public.users")[i % 2]
        lines.append({"table": table, "key": {"id": i // 2}, "after": {"id": i // 2, "n": i}})
    (data / "0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    pipeline = kafka_pipeline(
        tmp_path,
        tansu,
        {
            "all": {"sink": {"type": "jsonl", "path": str(tmp_path / "all.jsonl")}},
            "orders": {
                "sink": {"type": "jsonl", "path": str(tmp_path / "orders.jsonl")},
                "filter": {"tables": ["public.orders"]},
            },
        },
        name="shop",
        topic_naming="table",
    )
    result = run_cli("run", str(pipeline), "--once", timeout=120)
    assert result.returncode == 0, result
    prefix = topic_of(pipeline).rsplit(".", 1)[0]
    metadata = AdminClient({"bootstrap.servers": tansu.bootstrap}).list_topics(timeout=10)
    ours = {t: len(m.partitions) for t, m in metadata.topics.items() if t.startswith(prefix)}
    assert ours == {f"{prefix}.public.orders": 4, f"{prefix}.public.users": 4}
    orders = read_topic(tansu.bootstrap, f"{prefix}.public.orders", 150)
    assert {json.loads(m.value())["source"]["table"] for m in orders} == {"public.orders"}
    everything = read_envelopes(tmp_path / "all.jsonl")
    assert sorted(e["after"]["n"] for e in everything) == list(range(300))
    filtered = read_envelopes(tmp_path / "orders.jsonl")
    assert sorted(e["after"]["n"] for e in filtered) == list(range(0, 300, 2))


def test_the_example_pipeline_runs(tmp_path: Path, tansu: TansuBroker) -> None:
    total = write_riders(tmp_path / "data", 50, 4)
    env = {
        "KAFKA_BOOTSTRAP": tansu.bootstrap,
        "KAFKA_TOPIC_PREFIX": f"example{free_port()}",
        "FILE_DATA": str(tmp_path / "data"),
        "FILE_STATE": str(tmp_path / "state"),
        "FILE_OUT": str(tmp_path / "out"),
    }
    pipeline = str(REPO / "pipelines" / "file-to-kafka.yml")
    result = run_cli("run", pipeline, "--once", env=env, timeout=120)
    assert result.returncode == 0, result
    assert len(read_envelopes(tmp_path / "out" / "history.jsonl")) == total
    messages = read_topic(tansu.bootstrap, f"{env['KAFKA_TOPIC_PREFIX']}.file-to-kafka", total)
    assert len(messages) == total
    assert {m.partition() for m in messages} <= set(range(16))


def test_once_fails_naming_an_application_that_did_not_consume_everything(
    tmp_path: Path, tansu: TansuBroker, support_env: dict[str, str]
) -> None:
    write_riders(tmp_path / "data", 10, 5)
    out = tmp_path / "out.jsonl"
    pipeline = kafka_pipeline(
        tmp_path,
        tansu,
        {
            # Its sink never finishes a write: the application makes no progress.
            "stuck": {"sink": {"type": "gate", "gate": str(tmp_path / "never")}},
            "fine": {"sink": {"type": "jsonl", "path": str(out)}},
        },
        # Long enough for "fine"'s subscriber to start and consume on a loaded machine (with
        # 2 s it once made no progress in time while its process was still starting).
        drain_timeout_s=10,
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, env=support_env, timeout=120)
    assert result.returncode != 0, result
    error = result.stderr.split("error:")[-1]
    assert "did not consume every update: stuck (" in error, result.stderr
    assert "fine" not in error
    assert len(read_envelopes(out)) == 50


def _two_tables_one_id(data: Path) -> None:
    """`orders` and `refunds` each with a row of id 1, then the order is deleted."""
    data.mkdir(parents=True)
    lines = [
        {"table": "public.orders", "key": {"id": 1}, "after": {"id": 1, "total": 5}},
        {"table": "public.refunds", "key": {"id": 1}, "after": {"id": 1, "amount": 2}},
        {"table": "public.orders", "op": "d", "key": {"id": 1}, "before": {"id": 1}},
    ]
    (data / "0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_keys_are_unique_per_table_and_a_delete_leaves_a_tombstone_for_compaction(
    tmp_path: Path, tansu: TansuBroker
) -> None:
    """What log compaction acts on, in a topic created with cleanup.policy=compact.

    Tansu (its in-memory engine, as the tests run it) accepts and reports cleanup.policy
    but never compacts: every version of a key stays readable. So this checks the records
    compaction would keep or drop: a key per (table, key columns), and after a delete a
    tombstone (same key, no value), the last record of its key."""
    _two_tables_one_id(tmp_path / "data")
    out = tmp_path / "all.jsonl"
    pipeline = kafka_pipeline(
        tmp_path,
        tansu,
        {"all": {"sink": {"type": "jsonl", "path": str(out)}}},
        name="shop",
        shards=1,
        topic_config={"cleanup.policy": "compact"},
    )
    result = run_cli("run", str(pipeline), "--once", "--json", timeout=120)
    assert result.returncode == 0, result
    assert json.loads(result.stdout)["complete"] is True
    topic = topic_of(pipeline)
    admin = AdminClient({"bootstrap.servers": tansu.bootstrap})
    resource = ConfigResource("topic", topic)
    config = admin.describe_configs([resource])[resource].result(timeout=10)
    assert config["cleanup.policy"].value == "compact"
    records = [(m.key(), m.value()) for m in read_topic(tansu.bootstrap, topic, 4)]
    orders = b'{"key":{"id":1},"table":"public.orders"}'
    refunds = b'{"key":{"id":1},"table":"public.refunds"}'
    assert [k for k, _ in records] == [orders, refunds, orders, orders]
    assert json.loads(records[2][1])["op"] == "d"
    assert records[3][1] is None  # the tombstone: compaction then removes the key
    # The application gets the three updates; the tombstone is not one.
    assert [(e["op"], e["source"]["table"]) for e in read_envelopes(out)] == [
        ("c", "public.orders"),
        ("c", "public.refunds"),
        ("d", "public.orders"),
    ]


def test_per_table_topics_key_by_the_key_columns_and_tombstones_can_be_asked_for(
    tmp_path: Path, tansu: TansuBroker
) -> None:
    _two_tables_one_id(tmp_path / "data")
    pipeline = kafka_pipeline(
        tmp_path,
        tansu,
        {"library": {}},
        name="shop",
        shards=1,
        topic_naming="table",
        tombstones=True,
    )
    result = run_cli("run", str(pipeline), "--once", timeout=120)
    assert result.returncode == 0, result
    prefix = topic_of(pipeline).rsplit(".", 1)[0]
    records = read_topic(tansu.bootstrap, f"{prefix}.public.orders", 3)
    assert [(m.key(), m.value() is None) for m in records] == [
        (b'{"id":1}', False),
        (b'{"id":1}', False),
        (b'{"id":1}', True),
    ]


def test_status_and_top_count_an_applications_lag_by_its_committed_offsets(
    tmp_path: Path, tansu: TansuBroker
) -> None:
    total = write_riders(tmp_path / "data", 20, 3)
    apps = {"history": {"sink": {"type": "jsonl", "path": str(tmp_path / "history.jsonl")}}}
    pipeline = kafka_pipeline(tmp_path, tansu, apps, spawn=False)
    # Produced, but nothing consumed it: no subscriber was started.
    assert run_cli("run", str(pipeline), "--once", timeout=120).returncode == 0
    assert not (tmp_path / "history.jsonl").exists()
    result = run_cli("status", str(pipeline), "--json")
    assert result.returncode == 0, result
    status = json.loads(result.stdout)
    assert "consumer group" in status["lag_of"] and status["lag_error"] == ""
    assert sum(f["lag"] for f in status["flows"]) == total
    text = run_cli("status", str(pipeline))
    assert "lag: Kafka records not committed by the application's consumer group" in text.stdout
    top = run_cli("top", str(pipeline), "--once")
    assert top.returncode == 0, top
    assert f"{total:,}" in top.stdout and "Kafka records not committed" in top.stdout

    # Its subscriber consumes everything: lag 0.
    import yaml

    raw = yaml.safe_load(pipeline.read_text())
    raw["transport"]["spawn"] = True
    write_pipeline(pipeline, raw)
    result = run_cli("run", str(pipeline), "--once", timeout=120)
    assert result.returncode == 0, result
    assert len(read_envelopes(tmp_path / "history.jsonl")) == total
    status = json.loads(run_cli("status", str(pipeline), "--json").stdout)
    assert {f["lag"] for f in status["flows"]} == {0}
