"""Caravans: applications at different points share readers of the publisher log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from wormhole.testing import read_envelopes, run_cli, write_pipeline

UPDATES = 60_000
KEYS = 500


def _write_source(path: Path) -> None:
    with open(path, "w") as f:
        for i in range(UPDATES):
            row = {"id": i % KEYS, "n": i // KEYS, "pad": "x" * 40}
            f.write(json.dumps({"op": "u", "key": {"id": i % KEYS}, "after": row}) + "\n")


def _pipeline(tmp_path: Path, applications: dict[str, Any], **delivery: Any) -> Path:
    return write_pipeline(
        tmp_path / "caravans.yml",
        {
            "pipeline": "caravans",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path / "data")},
            "transport": {"type": "inprocess"},
            # A small tail cache: catching up reads the log from disk, as after a long stop.
            "log": {"tail_updates": 1024},
            "delivery": delivery,
            "applications": applications,
        },
    )


def _fill_log(tmp_path: Path) -> int:
    (tmp_path / "data").mkdir()
    _write_source(tmp_path / "data" / "events.jsonl")
    seed = _pipeline(tmp_path, {"seed": {"sink": {"type": "null"}}})
    result = run_cli("run", str(seed), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    return sum(p.stat().st_size for p in (tmp_path / "state" / "log").glob("log.*"))


def _ten_applications(tmp_path: Path) -> dict[str, Any]:
    return {
        f"app{k}": {
            "start": {"position": k * UPDATES // 10},
            "sink": {"type": "jsonl", "path": str(tmp_path / f"app{k}.jsonl")},
        }
        for k in range(10)
    }


def _check_everyone_got_everything_in_order(tmp_path: Path) -> None:
    for k in range(10):
        envelopes = read_envelopes(tmp_path / f"app{k}.jsonl")
        start = k * UPDATES // 10
        assert len(envelopes) == UPDATES - start, f"app{k}"
        last: dict[int, int] = {}
        for e in envelopes:
            key, n = e["key"]["id"], e["after"]["n"]
            assert n == last.get(key, start // KEYS - 1) + 1, f"app{k} key {key}"
            last[key] = n


@pytest.mark.parametrize(
    ("delivery", "at_most"),
    [
        # One reader: the log is read once, from the oldest start point.
        ({"max_caravans": 1}, 1.1),
        # Three readers: the nearest start points ride together.
        ({"max_caravans": 3}, 2.2),
    ],
    ids=["max_caravans=1", "max_caravans=3"],
)
def test_ten_applications_at_ten_points_read_the_log_far_fewer_than_ten_times(
    tmp_path: Path, delivery: dict[str, Any], at_most: float
) -> None:
    log_bytes = _fill_log(tmp_path)
    pipeline = _pipeline(tmp_path, _ten_applications(tmp_path), **delivery)
    result = run_cli("run", str(pipeline), "--once", "--json", cwd=tmp_path)
    assert result.returncode == 0, result
    summary = json.loads(result.stdout)
    # Each application alone would read from its start: 5.5 times the log in all.
    alone = sum(log_bytes * (10 - k) / 10 for k in range(10))
    assert alone > 5 * log_bytes
    assert summary["log_bytes_read"] <= at_most * log_bytes, (summary, log_bytes)
    _check_everyone_got_everything_in_order(tmp_path)


def test_caravans_merge_into_one_lead_caravan_at_the_tail(tmp_path: Path) -> None:
    import signal

    from wormhole.testing import start_cli, wait_until

    _fill_log(tmp_path)
    pipeline = _pipeline(
        tmp_path, _ten_applications(tmp_path), max_caravans=3, datamarker_interval_ms=50
    )
    proc = start_cli("run", str(pipeline), cwd=tmp_path)
    try:

        def one_lead() -> bool:
            result = run_cli("status", str(pipeline), "--json", cwd=tmp_path)
            caravans = json.loads(result.stdout)["caravans"]
            return len(caravans) == 1 and (
                sorted(caravans[0]["applications"]) == sorted(f"app{k}" for k in range(10))
                and caravans[0]["position"] == UPDATES
            )

        wait_until(one_lead, 60, "one caravan for all ten applications at the tail")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    _check_everyone_got_everything_in_order(tmp_path)


def test_an_application_starts_at_a_time(tmp_path: Path) -> None:
    import datetime

    base = 1_795_000_000_000
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "events.jsonl", "w") as f:
        for i in range(100):
            line = {"op": "c", "key": {"id": i}, "after": {"id": i}, "ts_ms": base + i * 1000}
            f.write(json.dumps(line) + "\n")
    seed = _pipeline(tmp_path, {"seed": {"sink": {"type": "null"}}})
    assert run_cli("run", str(seed), "--once", cwd=tmp_path).returncode == 0
    moment = datetime.datetime.fromtimestamp((base + 49_500) / 1000, datetime.UTC)
    late = tmp_path / "late.jsonl"
    pipeline = _pipeline(
        tmp_path,
        {
            "seed": {"sink": {"type": "null"}},
            "late": {
                "start": {"time": moment.isoformat().replace("+00:00", "Z")},
                "sink": {"type": "jsonl", "path": str(late)},
            },
        },
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    assert [e["key"]["id"] for e in read_envelopes(late)] == list(range(50, 100))


def test_a_start_time_needs_times_in_the_log(tmp_path: Path) -> None:
    _fill_log(tmp_path)
    pipeline = _pipeline(
        tmp_path,
        {
            "seed": {"sink": {"type": "null"}},
            "late": {"start": {"time": 1_795_000_000_000}, "sink": {"type": "null"}},
        },
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 2, result
    assert "applications.late.start: the updates in the publisher log carry no source time" in (
        result.stderr
    )
    bad = _pipeline(tmp_path, {"late": {"start": {"time": "yesterday"}, "sink": {"type": "null"}}})
    result = run_cli("validate", str(bad), cwd=tmp_path)
    assert result.returncode == 2, result
    assert "applications.late.start: time 'yesterday' is not an ISO-8601 time" in result.stderr


def test_an_application_with_a_subscriber_is_never_parked_behind_one_without(
    tmp_path: Path,
) -> None:
    """At max_caravans, a new application must not join a caravan that is blocked on
    another application's first subscriber: it would never be served."""
    import threading

    from wormhole.connectors.null import NullSink
    from wormhole.core.caravan import CaravanManager
    from wormhole.core.hub import ApplicationRuntime, FlowState, Hub
    from wormhole.core.pipeline import parse_pipeline
    from wormhole.core.publisher_log import PublisherLog
    from wormhole.core.update import Update
    from wormhole.subscriber.local import LocalSubscriber
    from wormhole.testing import wait_until

    pipeline = parse_pipeline(
        "pipeline: parked\n"
        f"state_dir: {tmp_path / 'state'}\n"
        "dataset: {shards: 4}\n"
        f"source: {{type: filelog, path: {tmp_path / 'data'}}}\n"
        "applications: {idle: {}, busy: {}, late: {}}\n"
    )
    plog = PublisherLog(tmp_path / "log")
    plog.open()
    for b in range(10):
        updates = [
            Update.create(op="c", key={"id": i}, after={"id": i}, table="t") for i in range(100)
        ]
        for u in updates:
            u.shard = u.key["id"] % 4
        plog.append(updates, {"batch": b})
    end = plog.next_seq

    def runtime(name: str) -> ApplicationRuntime:
        return ApplicationRuntime(
            config=pipeline.applications[name],
            flows=[FlowState(name, shard, 0, 0, 0) for shard in range(4)],
            filter=None,
        )

    idle, busy, late = runtime("idle"), runtime("busy"), runtime("late")
    hub = Hub(pipeline, {"idle": idle, "busy": busy})
    stop = threading.Event()
    subscribers: list[LocalSubscriber] = []

    def subscribe(app: ApplicationRuntime) -> None:
        subscriber = LocalSubscriber(hub, app.name, 0, NullSink())
        subscribers.append(subscriber)
        hub.attach(app.name, subscriber)
        subscriber.start()

    def acknowledged(app: ApplicationRuntime) -> bool:
        with hub.lock:
            return app.min_datamarker() == end

    manager = CaravanManager(hub, plog, stop, max_caravans=1, merge_distance=10)
    subscribe(busy)
    manager.start()
    try:
        # `idle` never gets a subscriber: it leaves the shared caravan.
        wait_until(lambda: acknowledged(busy), 30, "busy acknowledges the whole log")
        wait_until(lambda: manager.splits == 1 and not manager.evicted, 30, "idle moved off")
        hub.add_application(late)
        subscribe(late)
        manager.add_application(late)
        wait_until(lambda: acknowledged(late), 30, "late acknowledges the whole log")
        with hub.lock:
            assert idle.min_datamarker() == 0
    finally:
        stop.set()
        manager.join(10)
        for subscriber in subscribers:
            subscriber.stop()
        plog.close()


def test_read_rates_of_caravans_that_are_gone_are_forgotten(tmp_path: Path) -> None:
    """The live status keeps a read rate per caravan; caravans come and go for as long
    as a pipeline runs (merges, splits), and their figures must go with them."""
    from types import SimpleNamespace

    from wormhole.core.hub import Hub
    from wormhole.core.pipeline import parse_pipeline
    from wormhole.core.publisher_log import PublisherLog
    from wormhole.core.snapshot import RunSnapshot
    from wormhole.observability.status import save

    pipeline = parse_pipeline(
        "pipeline: rates\n"
        f"state_dir: {tmp_path / 'state'}\n"
        f"source: {{type: filelog, path: {tmp_path / 'data'}}}\n"
        "applications: {a: {}}\n"
    )
    pipeline.state_dir.mkdir()
    plog = PublisherLog(tmp_path / "log")
    plog.open()
    live = RunSnapshot()
    hub = Hub(pipeline, {})
    for round_ in range(50):
        caravan = SimpleNamespace(
            applications=[], position=round_, batches=0, updates_read=round_, bytes_read=0
        )
        save(pipeline.state_dir, live.take(plog, hub, [caravan]))  # type: ignore[list-item]
    assert len(live._rates) == 1
    status = json.loads((pipeline.state_dir / "live.json").read_text())
    assert status["caravans"][0]["read_rate"] == 0.0  # a new caravan: no rate yet
    plog.close()
