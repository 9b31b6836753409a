"""The TCP transport with real processes and sockets."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import ssl
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import assert_complete_in_order
from tcp_support import (
    LibrarySubscriber,
    Process,
    RawSubscriber,
    publisher_end,
    tcp_pipeline,
)

from wormhole.connectors.tcp import protocol as p
from wormhole.core.datamarkers import read_datamarkers
from wormhole.core.hub import Frame
from wormhole.publish import LogWriter
from wormhole.testing import ThrottlingProxy, free_port, read_envelopes, run_cli, wait_until


def write_riders(directory: Path, riders: int, seconds: int, start: int = 0, pad: int = 0) -> None:
    with LogWriter(directory, publisher_id="gps", batch_size=2000) as writer:
        for second in range(start, start + seconds):
            for rider in range(riders):
                after: dict[str, Any] = {"rider": rider, "seq": second}
                if pad:
                    after["pad"] = "x" * pad
                writer.publish("rider_location", {"rider": rider}, after)


def envelopes_of(updates: list[Any]) -> list[dict[str, Any]]:
    return [{"key": u.key, "after": u.after_row()} for u in updates]


def all_acknowledged(state: Path, applications: list[str], shards: int, end: int) -> bool:
    markers = read_datamarkers(state)
    return all(
        (markers.get((app, s)) is not None and markers[(app, s)].position >= end)
        for app in applications
        for s in range(shards)
    )


def test_run_starts_subscriber_processes_and_delivers_every_update_once_in_order(
    tmp_path: Path,
) -> None:
    (tmp_path / "data" / "gps").mkdir(parents=True)
    pipeline = tcp_pipeline(
        tmp_path,
        0,
        {
            "history": {
                "sink": {"type": "jsonl", "path": str(tmp_path / "history.jsonl")},
                "subscribers": 2,
            },
            "latest": {"sink": {"type": "latest", "path": str(tmp_path / "latest.db")}},
        },
    )
    run = Process("run", str(pipeline), cwd=tmp_path)
    try:
        # The updates are written once both subscriber processes of history have joined
        # (on a loaded machine one of them can start late, and a first one alone would
        # take every flow): two processes then append to one file.
        wait_until(
            lambda: "joined application history (2 subscribers)" in run.stderr,
            60,
            "both subscriber processes of history to join",
        )
        write_riders(tmp_path / "data" / "gps", 500, 20)
        wait_until(
            lambda: len(read_envelopes(tmp_path / "history.jsonl")) >= 500 * 20,
            60,
            "every update in history.jsonl",
        )
        assert run.stop() == 0, run.stderr
    finally:
        run.kill()
    history = read_envelopes(tmp_path / "history.jsonl")
    # Two processes append to one file: a shard moves between them only after its
    # old owner confirmed, so per-rider order holds and nothing repeats.
    assert_complete_in_order(history, 500, 20, duplicates_allowed=False)
    # Then run --once: nothing left, both applications at the end.
    result = run_cli("run", str(pipeline), "--once", "--json", cwd=tmp_path)
    assert result.returncode == 0, result
    summary = json.loads(result.stdout)
    assert summary["applications"]["history"]["lag"] == 0
    assert summary["applications"]["latest"]["lag"] == 0
    assert read_envelopes(tmp_path / "history.jsonl") == history


def test_library_subscriber_gets_notices_and_flows_and_retries_a_failing_handler(
    tmp_path: Path,
) -> None:
    port = free_port()
    (tmp_path / "data").mkdir()
    pipeline = tcp_pipeline(tmp_path, port, {"search": {}}, token="s3cret")
    publisher = Process("publish", str(pipeline), cwd=tmp_path)
    failures = {"left": 2}
    seen: list[Any] = []
    flows: set[int] = set()
    notices: list[tuple[list[int], list[int]]] = []
    try:
        from wormhole import Subscriber

        wait_until(lambda: _listening(port), 30, "the publisher to listen")
        sub = Subscriber(app="search", publishers=[f"127.0.0.1:{port}"], token="s3cret")

        @sub.on_shard_notice
        def notice(assigned: list[int], revoked: list[int]) -> None:
            notices.append((assigned, revoked))

        @sub.on_updates
        def handle(flow: Any, batch: list[Any]) -> None:
            if failures["left"]:
                failures["left"] -= 1
                raise RuntimeError("index temporarily unavailable")
            assert all(u.shard == flow.shard for u in batch)
            flows.add(flow.shard)
            seen.extend(batch)

        thread = threading.Thread(target=sub.run, daemon=True)
        thread.start()
        write_riders(tmp_path / "data" / "gps", 100, 10)
        wait_until(lambda: len(seen) >= 1000, 60, "every update")
        sub.stop()
        thread.join(30)
        assert not thread.is_alive()
    finally:
        publisher.stop()
    assert notices[0] == (list(range(16)), [])
    assert notices[-1] == ([], list(range(16))), "leaving gives every shard back"
    assert flows == set(range(16))
    assert failures["left"] == 0
    assert_complete_in_order(envelopes_of(seen), 100, 10, duplicates_allowed=True)
    assert "handler failed on" in "".join(publisher.stderr) or len(seen) >= 1000


def test_run_async_serves_until_cancelled(tmp_path: Path) -> None:
    port = free_port()
    write_riders(tmp_path / "data" / "gps", 50, 4)
    pipeline = tcp_pipeline(tmp_path, port, {"a": {}})
    publisher = Process("publish", str(pipeline), cwd=tmp_path)
    try:
        from wormhole import Subscriber

        wait_until(lambda: _listening(port), 30, "the publisher to listen")
        got: list[Any] = []

        async def main() -> None:
            sub = Subscriber(app="a", publishers=f"127.0.0.1:{port}")
            sub.on_batch(got.extend)
            task = asyncio.create_task(sub.run_async())
            while len(got) < 200:
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        publisher.stop()
    assert len(got) == 200


@pytest.mark.parametrize("how", ["kill -9", "SIGSTOP"])
def test_a_lost_subscribers_shards_move_to_the_survivor_within_two_heartbeat_timeouts(
    tmp_path: Path, how: str
) -> None:
    port = free_port()
    (tmp_path / "data").mkdir()
    timeout_ms = 1500
    history = tmp_path / "history.jsonl"
    pipeline = tcp_pipeline(
        tmp_path,
        port,
        {"history": {"sink": {"type": "jsonl", "path": str(history)}}},
        heartbeat_ms=300,
        heartbeat_timeout_ms=timeout_ms,
    )
    publisher = Process("publish", str(pipeline), cwd=tmp_path)
    victim = None
    survivor = None
    try:
        wait_until(lambda: _listening(port), 30, "the publisher to listen")
        survivor = LibrarySubscriber(
            "history", port, heartbeat_ms=300, heartbeat_timeout_ms=timeout_ms
        ).start()
        wait_until(lambda: survivor.owned() == set(range(16)), 30, "the survivor to own all")
        victim = Process(
            "subscribe", str(pipeline), "--app", "history", "--instance", "1", cwd=tmp_path
        )
        wait_until(lambda: len(survivor.owned()) == 8, 30, "the victim to take half the shards")
        victim_shards = set(range(16)) - survivor.owned()
        write_riders(tmp_path / "data" / "gps", 400, 30)
        wait_until(lambda: history.exists() and history.stat().st_size > 0, 30, "victim output")
        if how == "kill -9":
            victim.proc.send_signal(signal.SIGKILL)
        else:
            victim.proc.send_signal(signal.SIGSTOP)
        lost_at = time.monotonic()
        wait_until(lambda: survivor.owned() == set(range(16)), 10, "the shards to move")
        moved_at = next(
            t
            for t, assigned, _ in survivor.notices
            if t >= lost_at and set(assigned) & victim_shards
        )
        assert moved_at - lost_at < 2 * timeout_ms / 1000, f"took {moved_at - lost_at:.2f}s"
        wait_until(
            lambda: all_acknowledged(tmp_path / "state", ["history"], 16, 12000),
            60,
            "every update acknowledged",
        )
        if how == "SIGSTOP":
            victim.proc.send_signal(signal.SIGCONT)
    finally:
        if survivor is not None:
            survivor.stop()
        if victim is not None:
            victim.kill()
        publisher.stop()
    # The victim's file holds what it processed; the survivor holds the rest. A kill -9
    # can leave a torn last line, never acknowledged: the sink cuts it when it reopens.
    data = history.read_bytes()
    history.write_bytes(data[: data.rfind(b"\n") + 1])
    combined = read_envelopes(history) + envelopes_of(survivor.updates)
    by_rider: dict[int, list[dict[str, Any]]] = {}
    for e in combined:
        by_rider.setdefault(e["key"]["rider"], []).append(e)
    ordered = [e for rider in sorted(by_rider) for e in by_rider[rider]]
    assert_complete_in_order(ordered, 400, 30, duplicates_allowed=True)


def test_kill_9_of_the_publisher_then_a_restart_resumes_every_subscriber(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "data").mkdir()
    history = tmp_path / "history.jsonl"
    pipeline = tcp_pipeline(
        tmp_path,
        port,
        {"history": {"sink": {"type": "jsonl", "path": str(history)}, "subscribers": 2}},
    )
    publisher = Process("publish", str(pipeline), cwd=tmp_path)
    subscribers = [
        Process("subscribe", str(pipeline), "--app", "history", "--instance", str(i), cwd=tmp_path)
        for i in range(2)
    ]
    gps = tmp_path / "data" / "gps"
    try:
        write_riders(gps, 500, 20)
        wait_until(lambda: history.exists() and history.stat().st_size > 100_000, 60, "progress")
        publisher.proc.send_signal(signal.SIGKILL)
        publisher.wait()
        write_riders(gps, 500, 20, start=20)
        publisher = Process("publish", str(pipeline), cwd=tmp_path)
        wait_until(
            lambda: all_acknowledged(tmp_path / "state", ["history"], 16, 20000),
            90,
            "every update acknowledged after the restart",
        )
    finally:
        for s in subscribers:
            assert s.stop() == 0, s.stderr
        assert publisher.stop() == 0, publisher.stderr
    assert "reconnecting in" in "".join(s.stderr for s in subscribers)
    assert_complete_in_order(read_envelopes(history), 500, 40, duplicates_allowed=True)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _raw(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def _closed_by_peer(sock: socket.socket, timeout: float = 10) -> bytes:
    """Everything the publisher sent before closing the connection."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass  # closed with unread data (or by a TLS handshake failure): closed all the same
    sock.close()
    return data


def _hello(app: str = "a", token: str = "s3cret") -> bytes:
    return p.preamble() + p.encode(
        p.HELLO, p.Hello(version=p.SUBSCRIBE_VERSION, application=app, instance="raw", token=token)
    )


def test_bad_connections_are_closed_one_by_one_while_others_are_served(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "data").mkdir()
    pipeline = tcp_pipeline(
        tmp_path, port, {"a": {}}, token="s3cret", heartbeat_ms=200, heartbeat_timeout_ms=800
    )
    publisher = Process("publish", str(pipeline), cwd=tmp_path)
    good = None
    try:
        wait_until(lambda: _listening(port), 30, "the publisher to listen")
        good = LibrarySubscriber("a", port, token="s3cret").start()
        write_riders(tmp_path / "data" / "gps", 100, 2)
        wait_until(lambda: len(good.updates) == 200, 30, "the good subscriber's first updates")

        sock = _raw(port)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _closed_by_peer(sock) == b""

        sock = _raw(port)
        sock.sendall(p.PREAMBLE + struct.pack(">H", 99))
        assert b"protocol version 99 is not supported" in _closed_by_peer(sock)

        sock = _raw(port)
        sock.sendall(_hello(token="guess"))
        assert b"authentication failed: wrong token" in _closed_by_peer(sock)

        sock = _raw(port)
        sock.sendall(_hello(app="nope"))
        assert b"unknown application 'nope'" in _closed_by_peer(sock)

        sock = _raw(port)
        sock.sendall(_hello())
        sock.sendall(struct.pack(">IB", 50_000_000, p.ACK))  # oversize frame
        assert b"oversize frame" in _closed_by_peer(sock)

        sock = _raw(port)
        sock.sendall(_hello())
        sock.sendall(struct.pack(">IB", 5, 77) + b"junk")  # garbage frame type
        assert b"unknown frame type 77" in _closed_by_peer(sock)

        sock = _raw(port)
        sock.sendall(_hello())  # then silence: a half-open connection
        started = time.monotonic()
        _closed_by_peer(sock, timeout=30)
        assert time.monotonic() - started < 5

        # The good subscriber was served throughout.
        write_riders(tmp_path / "data" / "gps", 100, 2, start=2)
        wait_until(lambda: len(good.updates) == 400, 30, "the good subscriber's later updates")
        assert good.error is None
    finally:
        if good is not None:
            good.stop()
        publisher.stop()
    log = publisher.stderr
    assert "not a Wormhole subscriber" in log
    assert "refusing subscriber" in log and "wrong token" in log
    assert "missed heartbeats" in log


def test_a_refused_subscriber_reports_the_reason_and_exits_non_zero(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "data").mkdir()
    app = {"a": {"sink": {"type": "null"}}}
    pipeline = tcp_pipeline(tmp_path, port, app, token="s3cret")
    publisher = Process("publish", str(pipeline), cwd=tmp_path)
    try:
        wait_until(lambda: _listening(port), 30, "the publisher to listen")
        wrong = tcp_pipeline(tmp_path, port, app, token="wrong")
        result = run_cli("subscribe", str(wrong), "--app", "a", cwd=tmp_path, timeout=60)
    finally:
        publisher.stop()
    assert result.returncode == 2, result
    assert "refused a: authentication failed: wrong token" in result.stderr


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_subscriber_that_stops_reading_gets_backpressure_and_others_keep_pace(
    tmp_path: Path,
) -> None:
    port = free_port()
    (tmp_path / "data").mkdir()
    pipeline = tcp_pipeline(
        tmp_path,
        port,
        {"fast": {}, "slow": {"sink": {"type": "null"}}},
        heartbeat_timeout_ms=120_000,  # stay connected: this is about backpressure
    )
    # A small in-memory tail makes the bound visible: the stalled application's
    # caravan falls back to reading the log from disk.
    text = pipeline.read_text() + "log: {tail_updates: 20000}\n"
    pipeline.write_text(text)
    publisher = Process("publish", str(pipeline), cwd=tmp_path)
    slow = None
    fast = None
    try:
        wait_until(lambda: _listening(port), 30, "the publisher to listen")
        slow = Process("subscribe", str(pipeline), "--app", "slow", cwd=tmp_path)
        fast = LibrarySubscriber("fast", port).start()
        wait_until(lambda: fast.owned() == set(range(16)), 30, "the fast subscriber to join")
        wait_until(lambda: "joined application slow" in publisher.stderr, 30, "slow to join")
        slow.proc.send_signal(signal.SIGSTOP)  # stops reading its socket
        baseline = _rss_kib(publisher.pid)
        peak = baseline
        total = 300 * 1000
        writer = threading.Thread(
            target=write_riders, args=(tmp_path / "data" / "gps", 1000, 300), kwargs={"pad": 900}
        )
        started = time.monotonic()
        writer.start()
        deadline = time.monotonic() + 120
        while len(fast.updates) < total:
            peak = max(peak, _rss_kib(publisher.pid))
            assert time.monotonic() < deadline, f"fast got {len(fast.updates)} of {total}"
            time.sleep(0.05)
        fast_seconds = time.monotonic() - started
        writer.join()
        log_bytes = sum(f.stat().st_size for f in (tmp_path / "state" / "log").glob("log.*"))
        growth_mib = (peak - baseline) / 1024
        print(
            f"fast: {total / fast_seconds:,.0f} updates/s while slow was stalled; "
            f"publisher RSS {baseline / 1024:.0f} MiB -> peak {peak / 1024:.0f} MiB "
            f"with {log_bytes / 2**20:.0f} MiB in the publisher log"
        )
        # Holding the stalled application's share would take more than the log itself (its
        # updates as Python objects, several times more). What the publisher holds instead is
        # bounded by the in-memory tail and the credits, not by the log: seen 94 to 152 MiB on
        # a loaded machine, whatever the allocator keeps, against 322 MiB through the log.
        assert log_bytes > 300 * 2**20
        assert growth_mib < log_bytes / 2**20 / 2, (
            f"publisher RSS grew {growth_mib:.0f} MiB, against {log_bytes / 2**20:.0f} MiB "
            f"through the publisher log"
        )
        markers = read_datamarkers(tmp_path / "state")
        assert max(m.position for (a, _), m in markers.items() if a == "slow") < total
        slow.proc.send_signal(signal.SIGCONT)
        wait_until(
            lambda: all_acknowledged(tmp_path / "state", ["fast", "slow"], 16, total),
            120,
            "the slow application to catch up",
        )
    finally:
        if slow is not None:
            slow.proc.send_signal(signal.SIGCONT)
            slow.stop()
        if fast is not None:
            fast.stop()
        publisher.stop()
    assert_complete_in_order(envelopes_of(fast.updates), 1000, 300, duplicates_allowed=False)


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_tls_connections_and_a_plaintext_client_is_turned_away(
    tmp_path: Path, certificate: tuple[Path, Path]
) -> None:
    cert, key = certificate
    write_riders(tmp_path / "data" / "gps", 200, 5)
    tls = {"cert": str(cert), "key": str(key), "ca": str(cert)}
    pipeline = tcp_pipeline(
        tmp_path,
        0,
        {"history": {"sink": {"type": "jsonl", "path": str(tmp_path / "h.jsonl")}}},
        tls=tls,
        token="t",
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    assert "(TLS)" in result.stderr
    assert_complete_in_order(read_envelopes(tmp_path / "h.jsonl"), 200, 5, duplicates_allowed=False)

    port = free_port()
    pipeline = tcp_pipeline(tmp_path, port, {"lib": {}}, tls=tls, token="t")
    publisher = Process("publish", str(pipeline), cwd=tmp_path)
    try:
        wait_until(lambda: _listening(port), 30, "the publisher to listen")
        sock = _raw(port)
        sock.sendall(_hello(app="lib", token="t"))  # no TLS
        assert b'"shards"' not in _closed_by_peer(sock), "a plaintext client was welcomed"

        context = ssl.create_default_context(cafile=str(cert))
        lib = LibrarySubscriber("lib", port, token="t", tls=context).start()
        wait_until(lambda: len(lib.updates) == 1000, 30, "updates over TLS")
        lib.stop()
    finally:
        publisher.stop()
    assert "closing connection from" in publisher.stderr


def test_a_subscriber_follows_a_restarted_publisher_to_its_new_port(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    history = tmp_path / "h.jsonl"
    pipeline = tcp_pipeline(tmp_path, 0, {"h": {"sink": {"type": "jsonl", "path": str(history)}}})
    address = tmp_path / "state" / "publisher.addr"
    publisher = Process("publish", str(pipeline), cwd=tmp_path)
    subscriber = None
    try:
        wait_until(address.exists, 30, "the publisher's address file")
        first = address.read_text().strip()
        subscriber = Process("subscribe", str(pipeline), "--app", "h", cwd=tmp_path)
        write_riders(tmp_path / "data" / "gps", 100, 2)
        wait_until(lambda: len(read_envelopes(history)) == 200, 30, "delivery on the first port")
        assert publisher.stop() == 0
        publisher = Process("publish", str(pipeline), cwd=tmp_path)
        wait_until(
            lambda: address.exists() and address.read_text().strip() not in ("", first),
            30,
            "a new port",
        )
        write_riders(tmp_path / "data" / "gps", 100, 2, start=2)
        wait_until(lambda: len(read_envelopes(history)) >= 400, 60, "delivery on the new port")
    finally:
        if subscriber is not None:
            assert subscriber.stop() == 0, subscriber.stderr
        publisher.stop()
    assert_complete_in_order(read_envelopes(history), 100, 4, duplicates_allowed=True)


@pytest.mark.parametrize("max_batch_frame", ["256KiB", "64MiB"], ids=["split", "whole"])
def test_a_batch_that_takes_longer_than_the_heartbeat_timeout_to_send_arrives_over_a_slow_link(
    tmp_path: Path, max_batch_frame: str
) -> None:
    port = free_port()
    riders, seconds = 2000, 3
    # About 6.5 MB of updates in one publisher-log batch, through a link of 2 MiB/s.
    # Loopback socket buffers absorb about 3 MB at once, so one write of the whole
    # batch would wait on the link for well over the heartbeat timeout, with bytes
    # moving all along. "split": sent as frames of 256 KiB, which a subscriber that
    # accepts no larger frame takes; "whole": one frame, which only a timeout on lack
    # of progress (not on the whole write) lets through.
    write_riders(tmp_path / "data" / "gps", riders, seconds, pad=1000)
    pipeline = tcp_pipeline(
        tmp_path,
        port,
        {"wide": {}},
        source_options={"batch_bytes": "16MiB"},
        heartbeat_ms=200,
        heartbeat_timeout_ms=1000,
        max_batch_frame=max_batch_frame,
    )
    publisher = Process("publish", str(pipeline), cwd=tmp_path)
    subscriber = None
    try:
        wait_until(lambda: _listening(port), 30, "the publisher to listen")
        with ThrottlingProxy(f"127.0.0.1:{port}", rate=2 * 2**20) as proxy:
            subscriber = LibrarySubscriber(
                "wide",
                proxy.port,
                heartbeat_ms=200,
                heartbeat_timeout_ms=1000,
                max_frame=256 * 1024 if max_batch_frame == "256KiB" else 1 << 30,
            ).start()
            wait_until(
                lambda: len(subscriber.updates) >= riders * seconds,
                60,
                "every update through the slow link",
            )
            subscriber.stop()
    finally:
        if subscriber is not None:
            subscriber.stop()
        publisher.stop()
    assert_complete_in_order(
        envelopes_of(subscriber.updates), riders, seconds, duplicates_allowed=True
    )


def test_a_batch_over_the_frame_limit_is_split_between_updates_with_datamarkers_last() -> None:
    from wormhole.core.update import Update

    updates = [
        Update.create(op="c", key={"id": i}, table="t", after={"id": i, "pad": "x" * 300})
        for i in range(100)
    ]
    huge = Update.create(op="c", key={"id": 100}, table="t", after={"pad": "y" * 20_000})
    limit = 4096
    pieces = p.encode_batches(7, 1000, 1101, 55, {3: 1101}, [*updates, huge], limit)
    assert len(pieces) > 1
    received = []
    for i, (data, count) in enumerate(pieces):
        length, kind = struct.unpack(">IB", data[:5])
        assert kind == p.BATCH and length + 4 == len(data)
        body = msgspec.json.decode(data[5:], type=p.BatchFrame)
        assert (body.id, body.first, body.end, body.appended_ns) == (7 + i, 1000, 1101, 55)
        assert body.datamarkers == ({3: 1101} if i == len(pieces) - 1 else {})
        assert count == len(body.updates)
        if huge not in body.updates:
            assert len(data) <= limit
        received.extend(body.updates)
    assert received == [*updates, huge]
    # A batch under the limit is one frame, as before.
    [(whole, count)] = p.encode_batches(1, 0, 3, 0, {0: 3}, updates[:3], limit)
    assert count == 3 and whole == p.encode(
        p.BATCH,
        p.BatchFrame(id=1, first=0, end=3, appended_ns=0, datamarkers={0: 3}, updates=updates[:3]),
    )


def test_a_session_is_not_idle_while_a_frame_is_between_its_queue_and_in_flight(
    tmp_path: Path,
) -> None:
    with publisher_end(tmp_path, shards=2) as (_, _, server):
        client = RawSubscriber(server.address, "a")
        client.notice()
        [session] = server.sessions
        # Hold the sender after it took the frame off its queue, before it is recorded
        # as sent: a drain that saw "idle" here would stop with the frame unacknowledged.
        taken = threading.Event()
        release = threading.Event()
        encode = session._batch

        def held(frame: Any) -> bytes:
            taken.set()
            release.wait(30)
            return encode(frame)

        session._batch = held  # type: ignore[method-assign]
        try:
            assert session.deliver(Frame("a", [], {0: 0}, 0, 0), threading.Event())
            assert taken.wait(30)
            assert not session.idle(), "idle while a frame is on its way out"
        finally:
            release.set()
        batch = client.read(p.BATCH)
        assert not session.idle(), "idle before the frame was acknowledged"
        client.ack(batch)
        wait_until(session.idle, 30, "the acknowledgement")
        client.leave()


def test_a_frame_built_before_a_revoke_cannot_move_the_flow_past_updates_its_subscriber_dropped(
    tmp_path: Path,
) -> None:
    from wormhole.core.caravan import Caravan
    from wormhole.core.publisher_log import Batch
    from wormhole.core.update import Update

    batch = Batch.of(
        0,
        [
            Update.create(op="c", key={"id": i}, table="t", after={"id": i}, shard=i % 2)
            for i in range(4)
        ],
    )
    # Datamarkers held back (sent every N updates or T ms) as long as the test runs.
    held = {"datamarker_updates": 1_000_000, "datamarker_interval_ms": 600_000}
    with publisher_end(tmp_path, shards=2, **held) as (hub, app, server):
        a = RawSubscriber(server.address, "a")
        assert a.notice().assigned == [0, 1]
        [session_a] = server.sessions
        caravan = Caravan(hub, None, threading.Event(), [app])  # type: ignore[arg-type]
        b: list[RawSubscriber] = []

        def revoke_meanwhile(updates: list[Any]) -> list[Any]:
            # The caravan calls the filter after its snapshot of the shards' owners and
            # before it hands the frame over: B joins here, and shard 1 is revoked from
            # A while A's frame for it is being built.
            if not b:
                b.append(RawSubscriber(server.address, "a"))
                wait_until(lambda: app.revoking.get(1) is session_a, 30, "the revoke")
            return updates

        app.filter = revoke_meanwhile
        # One batch for one application, as the caravan's reading loop does it.
        assert caravan._dispatch(app, batch)
        a.ack(a.read(p.BATCH))  # the held-back datamarkers that precede a revoke: none yet
        assert a.notice().revoked == [1]
        stale = a.read(p.BATCH)
        # Built before the revoke: A ignores its updates of shard 1, no longer its own.
        assert [u.shard for u in stale.updates] == [0, 1, 0, 1]
        a.ack(stale)
        assert b[0].notice().assigned == [1]
        b[0].leave()  # before it handled anything of shard 1
        assert a.notice() == p.Notice(id=3, assigned=[1], revoked=[], datamarkers={1: 0})

        # Held-back datamarkers go out (a stop drains this way), and the caravan hands
        # A the batch again for shard 1; A has not processed it when it acks the first.
        session_a.flush()
        flushed = a.read(p.BATCH)
        assert caravan._dispatch(app, batch)
        assert app.flows[1].delivered == 4
        a.ack(flushed)
        wait_until(lambda: app.flows[0].datamarker == 4, 30, "the acknowledgement")
        assert app.flows[1].datamarker == 0, (
            "shard 1's datamarker moved past updates A dropped and has not processed since: "
            "they are lost if A goes now"
        )
        again = a.read(p.BATCH)
        assert [u.shard for u in again.updates] == [1, 1]
        a.ack(again)
        session_a.flush()
        a.ack(a.read(p.BATCH))
        wait_until(lambda: app.flows[1].datamarker == 4, 30, "shard 1 once A handled it")
        a.leave()
