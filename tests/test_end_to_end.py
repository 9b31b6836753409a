"""`wormhole run` as a user runs it: real processes, real files, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, assert_complete_in_order

from wormhole.core.datamarkers import read_datamarkers
from wormhole.demo import produce
from wormhole.publish import LogWriter
from wormhole.testing import (
    CliResult,
    read_envelopes,
    run_cli,
    start_cli,
    wait_until,
    write_pipeline,
)
from wormhole.testing.helpers import cli_command

QUICKSTART = REPO / "pipelines" / "quickstart.yml"


def quickstart_env(tmp_path: Path) -> dict[str, str]:
    return {
        "QUICKSTART_STATE": str(tmp_path / "state"),
        "QUICKSTART_DATA": str(tmp_path / "data"),
        "QUICKSTART_OUT": str(tmp_path / "out"),
    }


def latest_rows(path: Path) -> dict[int, dict[str, Any]]:
    import sqlite3

    db = sqlite3.connect(path)
    rows = {
        json.loads(k)["rider"]: json.loads(r) for k, r in db.execute("SELECT key, row FROM latest")
    }
    db.close()
    return rows


def test_quickstart_delivers_every_event_to_each_application_in_rider_order(
    tmp_path: Path,
) -> None:
    env = quickstart_env(tmp_path)
    riders, seconds = 2000, 10
    produce(str(tmp_path / "data" / "rider-gps"), riders, seconds, "rider-gps", seed=1)
    result = run_cli("run", str(QUICKSTART), "--once", "--json", cwd=tmp_path, env=env)
    assert result.returncode == 0, result
    summary = json.loads(result.stdout)
    total = riders * seconds
    assert summary["source_updates"] == total
    for app in ("history", "latest"):
        assert summary["applications"][app] == {"updates": total, "datamarker": total, "lag": 0}

    history = read_envelopes(tmp_path / "out" / "history.jsonl")
    assert len(history) == total
    assert_complete_in_order(history, riders, seconds, duplicates_allowed=False)
    assert history[0]["source"]["logical"].startswith("rider-gps:")
    latest = latest_rows(tmp_path / "out" / "latest.db")
    assert len(latest) == riders
    assert {row["seq"] for row in latest.values()} == {seconds - 1}

    # A second run delivers only what the producer wrote since.
    produce(str(tmp_path / "data" / "rider-gps"), riders, 3, "rider-gps", seed=2)
    result = run_cli("run", str(QUICKSTART), "--once", "--json", cwd=tmp_path, env=env)
    assert result.returncode == 0, result
    assert json.loads(result.stdout)["source_updates"] == riders * 3
    history = read_envelopes(tmp_path / "out" / "history.jsonl")
    assert_complete_in_order(history, riders, seconds + 3, duplicates_allowed=False)
    assert {row["seq"] for row in latest_rows(tmp_path / "out" / "latest.db").values()} == {
        seconds + 2
    }

    status = run_cli("status", str(QUICKSTART), "--json", cwd=tmp_path, env=env)
    assert status.returncode == 0, status
    flows = json.loads(status.stdout)["flows"]
    assert len(flows) == 2 * 16
    assert {f["lag"] for f in flows} == {0}
    assert {f["datamarker"] for f in flows} == {riders * (seconds + 3)}


def test_make_run_quickstart_prints_its_summary(tmp_path: Path) -> None:
    # What `make run` does, in a scratch copy of the working directory layout.
    env = {**os.environ, **quickstart_env(tmp_path)}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "wormhole.demo",
            "produce",
            "--out",
            str(tmp_path / "data" / "gps"),
            "--riders",
            "500",
            "--seconds",
            "4",
        ],
        check=True,
        env=env,
        cwd=tmp_path,
        capture_output=True,
    )
    run = run_cli("run", str(QUICKSTART), "--once", cwd=tmp_path, env=quickstart_env(tmp_path))
    assert run.returncode == 0, run
    assert "pipeline quickstart: 2,000 updates read" in run.stdout
    assert "history" in run.stdout and "latest" in run.stdout and "lag" in run.stdout
    show = subprocess.run(
        [sys.executable, "-m", "wormhole.demo", "show", str(QUICKSTART)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "history: 2,000 events" in show.stdout
    assert "latest position of 500 riders" in show.stdout


def _riders_pipeline(tmp_path: Path, **extra: Any) -> Path:
    pipeline: dict[str, Any] = {
        "pipeline": "riders",
        "state_dir": str(tmp_path / "state"),
        "source": {"type": "filelog", "path": str(tmp_path / "data")},
        "applications": {
            "history": {
                "sink": {"type": "jsonl", "path": str(tmp_path / "out" / "history.jsonl")},
                "subscribers": 2,
            },
            "latest": {"sink": {"type": "latest", "path": str(tmp_path / "out" / "latest.db")}},
        },
    }
    pipeline.update(extra)
    return write_pipeline(tmp_path / "riders.yml", pipeline)


def test_kill_9_mid_stream_then_restart_loses_nothing(tmp_path: Path) -> None:
    riders, seconds = 1000, 60
    pipeline = _riders_pipeline(tmp_path, log={"roll_size": "256KiB"})
    gps = tmp_path / "data" / "gps"
    writer = LogWriter(gps, publisher_id="gps", batch_size=1000)
    writer.publish("rider_location", {"rider": 0}, {"rider": 0, "seq": 0})
    writer.flush()
    history = tmp_path / "out" / "history.jsonl"

    def write_rest() -> None:
        for second in range(seconds):
            for rider in range(riders):
                if (second, rider) != (0, 0):
                    writer.publish(
                        "rider_location", {"rider": rider}, {"rider": rider, "seq": second}
                    )
            writer.flush()
            time.sleep(0.01)  # a producer with a pace of its own, not a synchronisation
        writer.close()

    proc = subprocess.Popen(
        cli_command("run", str(pipeline)),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    producer = threading.Thread(target=write_rest)
    producer.start()
    try:
        wait_until(
            lambda: history.exists() and history.stat().st_size > 200_000, 60, "delivery to start"
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert proc.returncode == -signal.SIGKILL
        # Complete lines only: the kill may have cut the last one short.
        delivered_before = history.read_bytes().count(b"\n")
    finally:
        producer.join()
        if proc.poll() is None:
            proc.kill()
    assert delivered_before < riders * seconds, "the kill was not mid-stream"

    result = run_cli("run", str(pipeline), "--once", "--json", cwd=tmp_path)
    assert result.returncode == 0, result
    envelopes = read_envelopes(history)
    assert_complete_in_order(envelopes, riders, seconds, duplicates_allowed=True)
    latest = latest_rows(tmp_path / "out" / "latest.db")
    assert {row["seq"] for row in latest.values()} == {seconds - 1}
    assert len(latest) == riders
    # Nothing acknowledged was lost, and replays stayed within unacknowledged data.
    assert len(envelopes) - riders * seconds <= riders * seconds


def test_sigterm_drains_and_persists_datamarkers(tmp_path: Path) -> None:
    produce(str(tmp_path / "data" / "gps"), 500, 10, "gps", seed=3)
    pipeline = _riders_pipeline(tmp_path)
    proc = start_cli("run", str(pipeline), cwd=tmp_path)
    history = tmp_path / "out" / "history.jsonl"
    latest = tmp_path / "out" / "latest.db"

    def latest_done() -> bool:
        try:
            rows = latest_rows(latest)
        except Exception:  # not created yet
            return False
        return len(rows) == 500 and {r["seq"] for r in rows.values()} == {9}

    try:
        # Both applications hold everything; their last datamarkers may still be
        # held back (sent every N updates or T ms): the drain must send them.
        wait_until(lambda: len(read_envelopes(history)) == 5000, 60, "history")
        wait_until(latest_done, 60, "the latest view")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "SIGTERM: draining" in err
    assert "pipeline riders: 5,000 updates read" in out
    markers = read_datamarkers(tmp_path / "state")
    assert len(markers) == 2 * 16
    assert {m.position for m in markers.values()} == {5000}


def test_a_duplicated_publisher_stream_is_delivered_once(tmp_path: Path) -> None:
    for host in ("host-a", "host-b"):  # two publishers writing the same stream
        produce(str(tmp_path / "data" / host), 300, 5, "gps", seed=4)
    result = run_cli("run", str(_riders_pipeline(tmp_path)), "--once", "--json", cwd=tmp_path)
    assert result.returncode == 0, result
    envelopes = read_envelopes(tmp_path / "out" / "history.jsonl")
    assert len(envelopes) == 1500
    assert_complete_in_order(envelopes, 300, 5, duplicates_allowed=False)
    assert len({e["source"]["logical"] for e in envelopes}) == 1500


def test_garbage_collection_waits_for_the_slowest_flow(
    tmp_path: Path, support_env: dict[str, str]
) -> None:
    produce(str(tmp_path / "data" / "gps"), 1000, 20, "gps", seed=5)
    gate = tmp_path / "gate-open"
    pipeline = write_pipeline(
        tmp_path / "gc.yml",
        {
            "pipeline": "gc",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path / "data"), "batch_bytes": "16KiB"},
            "log": {"roll_size": "64KiB"},
            "delivery": {"datamarker_interval_ms": 20},
            "applications": {
                "fast": {"sink": {"type": "null"}},
                "slow": {"sink": {"type": "gate", "gate": str(gate)}},
            },
            "transport": {"type": "inprocess", "drain_timeout_s": 1},
        },
    )
    log_dir = tmp_path / "state" / "log"
    proc = subprocess.Popen(
        cli_command("run", str(pipeline)),
        cwd=tmp_path,
        env={**os.environ, **support_env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The fast application is done, the slow one is held at its start.
        def fast_done() -> bool:
            markers = read_datamarkers(tmp_path / "state")
            return sum(m.position for (a, _), m in markers.items() if a == "fast") == 16 * 20000

        wait_until(fast_done, 60, "the fast application to finish")
        segments = sorted(p.name for p in log_dir.glob("log.*"))
        # produce() writes records of 5,000 messages: one publisher-log batch each.
        assert "log.0.0" in segments and len(segments) >= 4, segments
        gate.touch()

        def slow_done() -> bool:
            markers = read_datamarkers(tmp_path / "state")
            return {m.position for m in markers.values()} == {20000}

        wait_until(slow_done, 60, "the slow application to catch up")
        wait_until(
            lambda: sorted(p.name for p in log_dir.glob("log.*")) == [segments[-1]],
            30,
            "segments every flow passed to be collected",
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_filtered_updates_never_reach_the_sink_but_datamarkers_pass_them(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    lines = []
    for i in range(100):
        lines.append(
            {
                "table": "orders" if i % 2 else "users",
                "op": "c",
                "key": {"id": i},
                "after": {"id": i},
            }
        )
        if i % 10 == 0:
            lines.append({"table": "users", "op": "d", "key": {"id": i}, "before": {"id": i}})
    (data / "0001.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    pipeline = write_pipeline(
        tmp_path / "f.yml",
        {
            "pipeline": "f",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(data)},
            "dataset": {"shards": 4},
            "applications": {
                "users": {
                    "filter": {"tables": ["us*"], "ops": ["c", "u"]},
                    "sink": {"type": "jsonl", "path": str(tmp_path / "users.jsonl")},
                },
                "deletes": {
                    "filter": {"ops": ["d"]},
                    "sink": {"type": "jsonl", "path": str(tmp_path / "deletes.jsonl")},
                },
            },
        },
    )
    result = run_cli("run", str(pipeline), "--once", "--json", cwd=tmp_path)
    assert result.returncode == 0, result
    users = read_envelopes(tmp_path / "users.jsonl")
    assert {e["source"]["table"] for e in users} == {"users"} and len(users) == 50
    assert {e["op"] for e in users} == {"c"}
    deletes = read_envelopes(tmp_path / "deletes.jsonl")
    assert len(deletes) == 10 and deletes[0]["before"] == {"id": 0}
    assert deletes[0]["after"] is None
    summary = json.loads(result.stdout)["applications"]
    assert summary["users"]["lag"] == 0 and summary["deletes"]["lag"] == 0


def test_a_flaky_sink_is_retried_and_loses_nothing(
    tmp_path: Path, support_env: dict[str, str]
) -> None:
    produce(str(tmp_path / "data" / "gps"), 100, 5, "gps", seed=6)
    pipeline = write_pipeline(
        tmp_path / "flaky.yml",
        {
            "pipeline": "flaky",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path / "data")},
            "applications": {
                "a": {"sink": {"type": "flaky", "failures": 3, "path": str(tmp_path / "a.jsonl")}}
            },
        },
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, env=support_env)
    assert result.returncode == 0, result
    assert result.stderr.count("simulated outage") == 3
    assert "retrying in" in result.stderr
    assert_complete_in_order(read_envelopes(tmp_path / "a.jsonl"), 100, 5, duplicates_allowed=False)


# ------------------------------------------------------------------ bad input
def _expect_exit_2(result: CliResult, *fragments: str) -> None:
    assert result.returncode == 2, result
    for fragment in fragments:
        assert fragment in result.stderr, result
    assert "Traceback" not in result.stderr, result


def test_an_unwritable_state_dir_exits_2(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory should be")
    pipeline = _riders_pipeline(tmp_path, state_dir=str(blocker / "state"))
    _expect_exit_2(run_cli("run", str(pipeline), "--once", cwd=tmp_path), "state_dir", str(blocker))


def test_a_missing_source_directory_exits_2(tmp_path: Path) -> None:
    pipeline = _riders_pipeline(tmp_path)
    _expect_exit_2(
        run_cli("run", str(pipeline), "--once", cwd=tmp_path),
        f"source.path: {tmp_path / 'data'} does not exist",
    )


def test_a_malformed_source_line_is_recorded_and_skipped_or_stops_after_what_precedes_it(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    good = "".join(
        json.dumps({"key": {"rider": i}, "after": {"rider": i, "seq": 0}}) + "\n" for i in range(5)
    )
    (data / "1.jsonl").write_text(good + "this is not json\n" + good)
    source = {"type": "filelog", "path": str(data), "on_decode_error": "stop"}
    pipeline = _riders_pipeline(tmp_path, source=source)
    _expect_exit_2(run_cli("run", str(pipeline), "--once", cwd=tmp_path), "1.jsonl: line 6")
    # The lines before the bad one are delivered; nothing from it on.
    history = read_envelopes(tmp_path / "out" / "history.jsonl")
    assert sorted(e["key"]["rider"] for e in history) == list(range(5))
    # The default: the line is kept in the state_dir's rejects file, the rest delivered.
    source["on_decode_error"] = "fallback"
    pipeline = _riders_pipeline(tmp_path, source=source)
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    assert "1.jsonl: line 6 (offset" in result.stderr and "filelog-rejects.jsonl" in result.stderr
    history = read_envelopes(tmp_path / "out" / "history.jsonl")
    assert sorted(e["key"]["rider"] for e in history) == sorted([*range(5), *range(5)])
    [reject] = (tmp_path / "state" / "filelog-rejects.jsonl").read_text().splitlines()
    assert json.loads(reject)["text"] == "this is not json"


def _write_riders(directory: Path, riders: int, seconds: int, batch_size: int) -> None:
    with LogWriter(directory, publisher_id="gps", batch_size=batch_size) as writer:
        for second in range(seconds):
            for rider in range(riders):
                writer.publish("rider_location", {"rider": rider}, {"rider": rider, "seq": second})


def test_a_corrupt_publisher_log_exits_2_naming_file_and_offset(tmp_path: Path) -> None:
    _write_riders(tmp_path / "data" / "gps", 100, 10, batch_size=100)
    # Small source batches: one publisher-log record per LogWriter record.
    source = {"type": "filelog", "path": str(tmp_path / "data"), "batch_bytes": "4KiB"}
    pipeline = _riders_pipeline(tmp_path, source=source)
    assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
    # Flip a byte in a record in the middle of the segment: damage, not a torn tail.
    target = tmp_path / "state" / "log" / "log.0.0"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    _expect_exit_2(result, "log.0.0: corrupt record at offset", "CRC mismatch")
    assert target.read_bytes() == bytes(data), "a damaged log must be left as it is"


def test_a_torn_publisher_log_tail_is_truncated_and_the_run_continues(tmp_path: Path) -> None:
    produce(str(tmp_path / "data" / "gps"), 100, 5, "gps", seed=9)
    pipeline = _riders_pipeline(tmp_path)
    assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
    segment = tmp_path / "state" / "log" / "log.0.0"
    good_size = segment.stat().st_size
    with open(segment, "ab") as f:
        f.write(b"WH\x01\x02" + b"\x00" * 9)  # an append cut short by a crash
    produce(str(tmp_path / "data" / "gps"), 100, 2, "gps", seed=10)
    result = run_cli("run", str(pipeline), "--once", "--json", cwd=tmp_path)
    assert result.returncode == 0, result
    assert "torn tail" in result.stderr
    assert json.loads(result.stdout)["truncated"] == [f"log.0.0@{good_size}"]
    assert_complete_in_order(
        read_envelopes(tmp_path / "out" / "history.jsonl"), 100, 7, duplicates_allowed=False
    )


def test_changing_the_shard_count_in_place_exits_2(tmp_path: Path) -> None:
    produce(str(tmp_path / "data" / "gps"), 10, 1, "gps", seed=11)
    assert run_cli("run", str(_riders_pipeline(tmp_path)), "--once", cwd=tmp_path).returncode == 0
    pipeline = _riders_pipeline(tmp_path, dataset={"shards": 8})
    _expect_exit_2(
        run_cli("run", str(pipeline), "--once", cwd=tmp_path),
        "dataset.shards is 8 but the state",
        "built with 16 shards",
    )


def test_a_fatal_sink_error_exits_2_with_its_message(
    tmp_path: Path, support_env: dict[str, str]
) -> None:
    produce(str(tmp_path / "data" / "gps"), 10, 1, "gps", seed=12)
    pipeline = _riders_pipeline(tmp_path, applications={"b": {"sink": {"type": "broken"}}})
    _expect_exit_2(
        run_cli("run", str(pipeline), "--once", cwd=tmp_path, env=support_env),
        "applications.b.sink: broken on purpose",
    )


def test_a_start_position_outside_the_log_exits_2(tmp_path: Path) -> None:
    produce(str(tmp_path / "data" / "gps"), 10, 1, "gps", seed=13)
    fine = tmp_path / "fine.jsonl"
    pipeline = _riders_pipeline(
        tmp_path,
        applications={
            "late": {"start": {"position": 999}, "sink": {"type": "null"}},
            "fine": {"sink": {"type": "jsonl", "path": str(fine)}},
        },
    )
    _expect_exit_2(
        run_cli("run", str(pipeline), "--once", cwd=tmp_path),
        "applications.late.start is position 999, past the end of the publisher log",
    )
    # Only that application did not run: the others received everything.
    assert len(read_envelopes(fine)) == 10


@pytest.mark.parametrize("start,expected", [("earliest", 30), ("latest", 0)])
def test_a_new_application_starts_where_it_chooses(
    tmp_path: Path, start: str, expected: int
) -> None:
    produce(str(tmp_path / "data" / "gps"), 10, 3, "gps", seed=14)
    assert run_cli("run", str(_riders_pipeline(tmp_path)), "--once", cwd=tmp_path).returncode == 0
    pipeline = _riders_pipeline(
        tmp_path,
        applications={
            "history": {"sink": {"type": "jsonl", "path": str(tmp_path / "out" / "history.jsonl")}},
            "newcomer": {
                "start": start,
                "sink": {"type": "jsonl", "path": str(tmp_path / "new.jsonl")},
            },
        },
    )
    result = run_cli("run", str(pipeline), "--once", "--json", cwd=tmp_path)
    assert result.returncode == 0, result
    assert len(read_envelopes(tmp_path / "new.jsonl")) == expected
    assert len(read_envelopes(tmp_path / "out" / "history.jsonl")) == 30


def test_a_second_process_on_the_same_state_dir_exits_2(tmp_path: Path) -> None:
    produce(str(tmp_path / "data" / "gps"), 10, 1, "gps", seed=15)
    pipeline = _riders_pipeline(tmp_path)
    first = start_cli("run", str(pipeline), cwd=tmp_path)
    try:
        wait_until(
            lambda: (
                (tmp_path / "state" / "lock").exists()
                and (tmp_path / "state" / "lock").read_text().strip() == str(first.pid)
            ),
            30,
            "the first run to lock its state dir",
        )
        second = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
        _expect_exit_2(second, "is in use by another wormhole process", f"pid {first.pid}")
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)
    assert first.returncode == 0
