"""The subscriber processes `wormhole run` starts: restarted ones drain like the first, and
a stop waits for a sink that is still closing, but not for one that hangs or fails."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

from tcp_support import Process, tcp_pipeline

from wormhole.testing import free_port, read_envelopes, run_cli, wait_until
from wormhole.testing.helpers import subscriber_pids


def _append(path: Path, start: int, count: int) -> None:
    with open(path, "a") as f:
        for i in range(start, start + count):
            f.write(json.dumps({"op": "c", "key": {"id": i}, "after": {"id": i}}) + "\n")


def _setup(tmp_path: Path, count: int, **sink: Any) -> tuple[Path, Path, Path]:
    (tmp_path / "data").mkdir()
    source = tmp_path / "data" / "events.jsonl"
    _append(source, 0, count)
    out, marker = tmp_path / "out.jsonl", tmp_path / "closed.txt"
    pipeline = tcp_pipeline(
        tmp_path,
        free_port(),
        {"app": {"sink": {"type": "closing", "path": str(out), "marker": str(marker), **sink}}},
        drain_timeout_s=1,
    )
    return pipeline, out, marker


def test_a_restarted_subscriber_drains_and_closes_its_sink_at_a_graceful_stop(
    tmp_path: Path, support_env: dict[str, str]
) -> None:
    pipeline, out, marker = _setup(tmp_path, 100, busy_s=1.0)
    source = tmp_path / "data" / "events.jsonl"
    publisher = Process("run", str(pipeline), cwd=tmp_path, env=support_env)
    try:
        wait_until(lambda: len(read_envelopes(out)) == 100, 60, "the first 100 updates")
        [first] = subscriber_pids(publisher.pid)
        os.kill(first, signal.SIGKILL)
        # The supervisor starts it again; it takes over and gets new updates.
        wait_until(
            lambda: [p for p in subscriber_pids(publisher.pid) if p != first], 60, "a restart"
        )
        [second] = [p for p in subscriber_pids(publisher.pid) if p != first]
        _append(source, 100, 50)
        wait_until(
            lambda: {e["key"]["id"] for e in read_envelopes(out)} == set(range(150)),
            60,
            "updates after the restart",
        )
    finally:
        code = publisher.stop()
    assert code == 0, publisher.stderr
    # Killed by the death of the thread that forked it, it would not have closed its sink.
    assert marker.read_text().split("\n") == [f"closed {second}", ""], publisher.stderr


def test_once_waits_for_a_sink_that_is_busy_closing(
    tmp_path: Path, support_env: dict[str, str]
) -> None:
    # Closing takes three times the drain timeout, computing all along (a final refresh).
    pipeline, out, marker = _setup(tmp_path, 200, busy_s=3.0)
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, env=support_env)
    assert result.returncode == 0, result
    assert len(read_envelopes(out)) == 200
    assert marker.read_text().startswith("closed "), result.stderr


def test_once_fails_naming_the_application_whose_sink_hangs_closing(
    tmp_path: Path, support_env: dict[str, str]
) -> None:
    pipeline, _, marker = _setup(tmp_path, 10, idle_s=120.0)
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, env=support_env, timeout=60)
    assert result.returncode != 0
    assert "application app made no progress" in result.stderr
    assert not marker.exists()


def test_once_fails_naming_the_application_whose_sink_fails_to_close(
    tmp_path: Path, support_env: dict[str, str]
) -> None:
    pipeline, out, _ = _setup(tmp_path, 10, fail=True)
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, env=support_env)
    assert len(read_envelopes(out)) == 10
    assert result.returncode != 0
    assert "subscriber app/0 of application app exited with code" in result.stderr


def test_a_graceful_stop_while_its_subscribers_start_exits_0(
    tmp_path: Path, support_env: dict[str, str]
) -> None:
    pipeline, _, _ = _setup(tmp_path, 10)
    publisher = Process("run", str(pipeline), cwd=tmp_path, env=support_env)
    try:
        # SIGTERM as soon as the subscriber process exists, before it can serve.
        wait_until(lambda: subscriber_pids(publisher.pid), 60, "a subscriber process")
    finally:
        code = publisher.stop()
    assert code == 0, publisher.stderr


def test_the_old_paths_of_the_subscriber_layer_name_the_same_objects() -> None:
    """Plugins written against wormhole.plugins.{subscriber,processes,dead_letters} keep
    working: those modules name what wormhole.subscriber defines."""
    from wormhole.plugins import dead_letters as old_dead_letters
    from wormhole.plugins import processes as old_processes
    from wormhole.plugins import subscriber as old_subscriber
    from wormhole.subscriber import dead_letters, handlers, local, processes

    assert old_processes.SubscriberProcesses is processes.SubscriberProcesses
    assert old_subscriber.Handlers is handlers.Handlers
    assert old_subscriber.run_handlers is handlers.run_handlers
    assert old_subscriber.LocalSubscriber is local.LocalSubscriber
    assert old_subscriber.local_subscriber is local.local_subscriber
    for name in dead_letters.__all__:
        assert getattr(old_dead_letters, name) is getattr(dead_letters, name), name


def test_the_engine_starts_subscriber_processes_only_where_the_transport_asks(
    tmp_path: Path,
) -> None:
    """A transport gets subscriber processes from the engine when its record declares
    `subscriber_processes`, its `subscriber_args()` is not None (`spawn: false`) and the
    run is `wormhole run`; their command line carries what it returns."""
    from wormhole.core.hub import Hub
    from wormhole.core.pipeline import load_pipeline
    from wormhole.core.subscriber_launch import SubscriberLaunch
    from wormhole.plugins.components import Capabilities

    pipeline = load_pipeline(tcp_pipeline(tmp_path, free_port(), {"app": {}}))

    class Transport:
        def __init__(self, args: list[str] | None) -> None:
            self.args = args

        def subscriber_args(self) -> list[str] | None:
            return self.args

    def launch(args: list[str] | None, offers: Capabilities, local: bool = True) -> Any:
        hub = Hub(pipeline, {})
        hub.local_subscribers = local
        return SubscriberLaunch(hub, Transport(args), offers).processes

    declared = Capabilities(subscriber_processes=True)
    started = launch(["--publisher", "127.0.0.1:1"], declared)
    assert started is not None and started.extra_args() == ["--publisher", "127.0.0.1:1"]
    assert launch(None, declared) is None  # spawn: false
    assert launch([], Capabilities()) is None  # not declared: the transport's business
    assert launch([], declared, local=False) is None  # wormhole publish
