"""Dead letters with real processes: `wormhole run` over TCP starts a subscriber process whose
sink (``picky``, from the test support plugin) rejects every update of listed keys. The rejected
updates land in the application's dead-letter log, every other update is delivered, later
updates of a rejected key are parked behind it (never delivered ahead of it), replay delivers
them in order once the sink is fixed, and kill -9 of the subscriber or the publisher in the
middle of all this loses nothing. Policies ``stop`` and ``retry`` too."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from tcp_support import Process, tcp_pipeline

from wormhole.testing import free_port, read_envelopes, run_cli, wait_until, write_pipeline
from wormhole.testing.helpers import start_cli, subscriber_pids

KEYS = 12


def append_rounds(path: Path, first: int, last: int) -> None:
    """Rounds first..last-1: every key gets one update ``n`` per round."""
    with open(path, "a") as f:
        for n in range(first, last):
            for key in range(KEYS):
                f.write(json.dumps({"op": "u", "key": {"id": key}, "after": {"id": key, "n": n}}))
                f.write("\n")


def setup(
    tmp_path: Path, on_error: dict[str, Any], poison: set[int], subscribers: int = 1
) -> tuple[Path, Path, Path]:
    (tmp_path / "data").mkdir()
    reject = tmp_path / "reject.txt"
    reject.write_text("".join(f"{k}\n" for k in sorted(poison)))
    out = tmp_path / "out.jsonl"
    pipeline = tcp_pipeline(
        tmp_path,
        free_port(),
        {
            "app": {
                "sink": {"type": "picky", "path": str(out), "reject": str(reject)},
                "on_error": on_error,
                "subscribers": subscribers,
            }
        },
    )
    return pipeline, out, reject


def delivered(out: Path) -> dict[int, list[int]]:
    """Per key, the ``n`` values the sink took, in order."""
    seen: dict[int, list[int]] = {}
    for e in read_envelopes(out):
        seen.setdefault(e["key"]["id"], []).append(e["after"]["n"])
    return seen


def in_order(ns: list[int], rounds: int) -> bool:
    """Rounds 0..rounds-1 arrived, first occurrences in order (replays repeat, never skip)."""
    high = -1
    for n in ns:
        if n > high:
            if n != high + 1:
                return False
            high = n
    return high == rounds - 1


def dead_letters(pipeline: Path, cwd: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    result = run_cli(
        "dead-letters", "list", str(pipeline), "--app", "app", "--json", cwd=cwd, env=env
    )
    assert result.returncode == 0, result
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    return rows


def parked_rounds(rows: list[dict[str, Any]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for row in rows:
        out.setdefault(row["key"]["id"], []).append(row["update"]["after"]["n"])
    return out


def test_a_rejected_update_is_dead_lettered_its_key_parked_and_replayed_in_order(
    tmp_path: Path, support_env: dict[str, str]
) -> None:
    policy = {"policy": "dead_letter", "retries": 1, "backoff_ms": 5}
    pipeline, out, reject = setup(tmp_path, policy, poison={7})
    source = tmp_path / "data" / "events.jsonl"
    append_rounds(source, 0, 20)
    others = [k for k in range(KEYS) if k != 7]
    run = Process("run", str(pipeline), cwd=tmp_path, env=support_env)
    try:
        wait_until(
            lambda: all(in_order(delivered(out).get(k, []), 20) for k in others),
            60,
            "every update of the other keys",
        )
        # Key 7's first update was rejected; its 19 later ones are parked behind it.
        wait_until(
            lambda: len(dead_letters(pipeline, tmp_path, support_env)) == 20, 30, "20 dead letters"
        )
        rows = dead_letters(pipeline, tmp_path, support_env)
        assert parked_rounds(rows) == {7: list(range(20))}
        first = rows[0]
        assert first["parked_behind"] is None
        assert "the sink refuses key id 7" in first["error"]
        assert first["table"] and first["position"] and first["time"]
        assert all(r["parked_behind"] == first["id"] for r in rows[1:])
        shown = run_cli(
            "dead-letters",
            "show",
            str(pipeline),
            "--app",
            "app",
            str(first["id"]),
            cwd=tmp_path,
            env=support_env,
        )
        assert shown.returncode == 0, shown
        assert json.loads(shown.stdout)["update"]["key"] == {"id": 7}
        status = run_cli("status", str(pipeline), "--json", cwd=tmp_path, env=support_env)
        assert json.loads(status.stdout)["dead_letters"] == {"app": 20}, status
        text = run_cli("status", str(pipeline), cwd=tmp_path, env=support_env)
        assert "application app: 20 dead letters" in text.stdout, text

        # The sink is fixed, but key 7 stays parked until replay: new updates of it queue
        # behind the old ones, the other keys go on.
        reject.unlink()
        append_rounds(source, 20, 30)
        wait_until(
            lambda: all(in_order(delivered(out).get(k, []), 30) for k in others),
            60,
            "the next rounds of the other keys",
        )
        wait_until(
            lambda: len(dead_letters(pipeline, tmp_path, support_env)) == 30, 30, "30 dead letters"
        )
        assert 7 not in delivered(out)

        # Replay while the pipeline runs and key 7 keeps changing: whatever the subscriber
        # gets meanwhile is parked behind the replayed updates or, once the key is free,
        # written after them. Key 7 ends up in order, once each, and free.
        replay = start_cli(
            "dead-letters", "replay", str(pipeline), "--app", "app", cwd=tmp_path, env=support_env
        )
        rounds = 30
        while replay.poll() is None and rounds < 400:
            append_rounds(source, rounds, rounds + 1)
            rounds += 1
            wait_until(
                lambda r=rounds: in_order(delivered(out).get(0, []), r), 30, "round delivered"
            )
        stdout, stderr = replay.communicate(timeout=60)
        assert replay.returncode == 0, stderr
        assert "replayed " in stdout
        append_rounds(source, rounds, rounds + 5)
        rounds += 5
        wait_until(
            lambda: all(in_order(delivered(out).get(k, []), rounds) for k in range(KEYS)),
            60,
            "every key after the replay",
        )
        assert delivered(out)[7] == list(range(rounds))
        assert dead_letters(pipeline, tmp_path, support_env) == []
    finally:
        code = run.stop()
    assert code == 0, run.stderr


def test_purge_needs_an_id_or_yes(tmp_path: Path, support_env: dict[str, str]) -> None:
    policy = {"policy": "dead_letter", "retries": 0, "backoff_ms": 5}
    pipeline, out, _ = setup(tmp_path, policy, poison={2, 5})
    append_rounds(tmp_path / "data" / "events.jsonl", 0, 3)
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, env=support_env)
    assert result.returncode == 0, result
    assert set(delivered(out)) == set(range(KEYS)) - {2, 5}
    rows = dead_letters(pipeline, tmp_path, support_env)
    assert parked_rounds(rows) == {2: [0, 1, 2], 5: [0, 1, 2]}
    refused = run_cli(
        "dead-letters", "purge", str(pipeline), "--app", "app", cwd=tmp_path, env=support_env
    )
    assert refused.returncode == 2 and "--yes" in refused.stderr, refused
    one = run_cli(
        "dead-letters",
        "purge",
        str(pipeline),
        "--app",
        "app",
        "--id",
        str(rows[0]["id"]),
        cwd=tmp_path,
        env=support_env,
    )
    assert one.returncode == 0 and "purged 1 dead letters" in one.stdout, one
    everything = run_cli(
        "dead-letters",
        "purge",
        str(pipeline),
        "--app",
        "app",
        "--yes",
        cwd=tmp_path,
        env=support_env,
    )
    assert everything.returncode == 0 and "purged 5 dead letters" in everything.stdout
    assert dead_letters(pipeline, tmp_path, support_env) == []
    # What is purged is never delivered.
    assert set(delivered(out)) == set(range(KEYS)) - {2, 5}


@pytest.mark.parametrize("subscribers", [1, 2])
def test_kill_9_in_the_middle_of_dead_lettering_loses_nothing(
    tmp_path: Path, support_env: dict[str, str], subscribers: int
) -> None:
    """With two subscriber processes, a killed one's flows move to the other while it is
    started again: the new owner must see the keys the old one parked."""
    rng = random.Random(20 + subscribers)
    poison = set(rng.sample(range(KEYS), 2))
    policy = {"policy": "dead_letter", "retries": 1, "backoff_ms": 5}
    pipeline, out, reject = setup(tmp_path, policy, poison=poison, subscribers=subscribers)
    source = tmp_path / "data" / "events.jsonl"
    others = [k for k in range(KEYS) if k not in poison]
    rounds = 0
    run = Process("run", str(pipeline), cwd=tmp_path, env=support_env)
    deadline = time.monotonic() + 120
    kills = 0
    try:
        for _ in range(5):
            if time.monotonic() > deadline:
                break
            target = len(read_envelopes(out)) + rng.randrange(1, 200)
            append_rounds(source, rounds, rounds + 40)
            rounds += 40
            # Kill once the sink has taken part of the new rounds: mid-batch, mid-dead-letter.
            wait_until(lambda t=target: len(read_envelopes(out)) >= t, 60, "progress")
            if rng.random() < 0.5 and subscriber_pids(run.pid):
                os.kill(rng.choice(subscriber_pids(run.pid)), signal.SIGKILL)
            else:
                run.kill()
                run = Process("run", str(pipeline), cwd=tmp_path, env=support_env)
            kills += 1
        wait_until(
            lambda: all(in_order(delivered(out).get(k, []), rounds) for k in others),
            90,
            "every update of the other keys after the kills",
        )
        wait_until(
            lambda: len(dead_letters(pipeline, tmp_path, support_env)) == len(poison) * rounds,
            60,
            "every update of the poison keys in the dead-letter log",
        )
    finally:
        code = run.stop()
    assert code == 0, run.stderr
    assert kills >= 3
    # The per-key rule held through every kill: no poison key reached the sink, and each
    # one's updates are in the log once each, in order.
    assert not poison & set(delivered(out))
    assert parked_rounds(dead_letters(pipeline, tmp_path, support_env)) == {
        k: list(range(rounds)) for k in sorted(poison)
    }
    # Fixed and replayed (with the pipeline stopped), everything is there, in order per key.
    reject.unlink()
    replayed = run_cli(
        "dead-letters", "replay", str(pipeline), "--app", "app", cwd=tmp_path, env=support_env
    )
    assert replayed.returncode == 0, replayed
    finished = run_cli("run", str(pipeline), "--once", cwd=tmp_path, env=support_env)
    assert finished.returncode == 0, finished
    seen = delivered(out)
    assert all(in_order(seen[k], rounds) for k in range(KEYS)), seen
    for k in poison:
        assert seen[k][:rounds] == list(range(rounds))
    assert dead_letters(pipeline, tmp_path, support_env) == []


def test_policy_stop_exits_naming_the_update_and_keeps_the_datamarker_before_it(
    tmp_path: Path, support_env: dict[str, str]
) -> None:
    pipeline, out, reject = setup(tmp_path, {"policy": "stop", "retries": 2, "backoff_ms": 5}, {4})
    append_rounds(tmp_path / "data" / "events.jsonl", 0, 5)
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, env=support_env)
    assert result.returncode != 0, result
    assert "application app" in result.stderr
    assert 'key {"id":4}' in result.stderr and "the sink refuses key id 4" in result.stderr
    assert "on_error policy stop" in result.stderr
    assert 4 not in delivered(out)
    # Fixed, the next run starts before the update: it is delivered, in order.
    reject.unlink()
    again = run_cli("run", str(pipeline), "--once", cwd=tmp_path, env=support_env)
    assert again.returncode == 0, again
    assert all(in_order(delivered(out)[k], 5) for k in range(KEYS))


def test_policy_retry_holds_the_flow_until_the_sink_takes_it(
    tmp_path: Path, support_env: dict[str, str]
) -> None:
    pipeline, out, reject = setup(
        tmp_path, {"policy": "retry", "backoff_ms": 5, "max_backoff_ms": 50}, {4}
    )
    append_rounds(tmp_path / "data" / "events.jsonl", 0, 5)
    run = Process("run", str(pipeline), cwd=tmp_path, env=support_env)
    try:
        wait_until(lambda: "retrying in" in run.stderr, 60, "a retry")
        assert 4 not in delivered(out)
        assert not (tmp_path / "state" / "dead-letters").exists()
        reject.unlink()
        wait_until(
            lambda: all(in_order(delivered(out).get(k, []), 5) for k in range(KEYS)),
            60,
            "every update once the sink takes them",
        )
    finally:
        code = run.stop()
    assert code == 0, run.stderr


def inprocess_pipeline(tmp_path: Path, on_error: dict[str, Any], poison: set[int]) -> Path:
    (tmp_path / "data").mkdir()
    (tmp_path / "reject.txt").write_text("".join(f"{k}\n" for k in sorted(poison)))
    sink = {
        "type": "picky",
        "path": str(tmp_path / "out.jsonl"),
        "reject": str(tmp_path / "reject.txt"),
    }
    return write_pipeline(
        tmp_path / "inprocess.yml",
        {
            "pipeline": "inprocess",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path / "data")},
            "transport": {"type": "inprocess"},
            "applications": {"app": {"sink": sink, "subscribers": 2, "on_error": on_error}},
        },
    )


def test_dead_letters_of_subscribers_in_the_publisher_process(
    tmp_path: Path, support_env: dict[str, str]
) -> None:
    pipeline = inprocess_pipeline(tmp_path, {"policy": "dead_letter", "retries": 0}, {1, 6})
    append_rounds(tmp_path / "data" / "events.jsonl", 0, 10)
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, env=support_env)
    assert result.returncode == 0, result
    out = tmp_path / "out.jsonl"
    seen = delivered(out)
    assert set(seen) == set(range(KEYS)) - {1, 6}
    assert all(in_order(ns, 10) for ns in seen.values())
    # Both subscriber threads share the application's one log.
    assert parked_rounds(dead_letters(pipeline, tmp_path, support_env)) == {
        1: list(range(10)),
        6: list(range(10)),
    }
    (tmp_path / "reject.txt").unlink()
    replayed = run_cli(
        "dead-letters", "replay", str(pipeline), "--app", "app", cwd=tmp_path, env=support_env
    )
    assert replayed.returncode == 0 and "replayed 20 dead letters" in replayed.stdout, replayed
    assert delivered(out)[1] == delivered(out)[6] == list(range(10))


def test_policy_stop_of_a_subscriber_in_the_publisher_process_fails_the_run(
    tmp_path: Path, support_env: dict[str, str]
) -> None:
    pipeline = inprocess_pipeline(tmp_path, {"policy": "stop", "retries": 0}, {3})
    append_rounds(tmp_path / "data" / "events.jsonl", 0, 2)
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, env=support_env)
    assert result.returncode == 2, result
    assert "application app: the sink rejected the update of table" in result.stderr
    assert 'key {"id":3}' in result.stderr
    assert 3 not in delivered(tmp_path / "out.jsonl")


def test_a_replay_killed_half_way_loses_nothing_and_keeps_each_key_in_order(
    tmp_path: Path, support_env: dict[str, str]
) -> None:
    poison = {0, 2, 4, 6, 8, 10}
    pipeline, out, reject = setup(tmp_path, {"policy": "dead_letter", "retries": 0}, poison)
    append_rounds(tmp_path / "data" / "events.jsonl", 0, 10)
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, env=support_env)
    assert result.returncode == 0, result
    assert len(dead_letters(pipeline, tmp_path, support_env)) == 60
    # The sink is fixed but slow (300 ms a write): the replay is killed after two keys.
    reject.unlink()
    slow = pipeline.read_text().replace(
        f"reject: {reject}", f"reject: {reject}\n      write_ms: 300"
    )
    assert slow != pipeline.read_text()
    pipeline.write_text(slow)
    replay = start_cli(
        "dead-letters", "replay", str(pipeline), "--app", "app", cwd=tmp_path, env=support_env
    )
    try:
        wait_until(lambda: len(poison & set(delivered(out))) >= 2, 60, "two keys replayed")
    finally:
        replay.kill()
        replay.wait(30)
    left = dead_letters(pipeline, tmp_path, support_env)
    assert 0 < len(left) < 60
    again = run_cli(
        "dead-letters", "replay", str(pipeline), "--app", "app", cwd=tmp_path, env=support_env
    )
    assert again.returncode == 0, again
    seen = delivered(out)
    # Each key once in order, or (the one cut by the kill) again from its first entry.
    assert all(in_order(seen[k], 10) for k in range(KEYS)), seen
    assert dead_letters(pipeline, tmp_path, support_env) == []
