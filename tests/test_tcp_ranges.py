"""Log readers (protocol version 2) against a real ``wormhole publish`` process: an
external application's positions, one flow's range [from, to), commits through the
publisher, and the refusals a reader can meet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tcp_support import Process

from wormhole.connectors.tcp import protocol as p
from wormhole.connectors.tcp.ranges import TcpRemoteLog
from wormhole.plugins.components import RemoteLogError, RemoteLogRequest
from wormhole.testing import run_cli, wait_until, write_pipeline
from wormhole.testing.helpers import free_port


def _write(path: Path, keys: int, rounds: range) -> None:
    with open(path, "a") as f:
        for n in rounds:
            for k in range(keys):
                row = {"id": k, "n": n}
                f.write(json.dumps({"op": "u", "key": {"id": k}, "after": row}) + "\n")


def _flat(remote: TcpRemoteLog, shard: int, start: int, end: int) -> list[tuple[int, Any]]:
    return [
        (seq, update)
        for seqs, updates in remote.read(shard, start, end)
        for seq, update in zip(seqs, updates, strict=True)
    ]


def _remote(port: int, app: str = "lake", **options: str) -> TcpRemoteLog:
    return TcpRemoteLog(RemoteLogRequest(f"127.0.0.1:{port}", app, dict(options)))


class _Publisher:
    def __init__(
        self,
        tmp_path: Path,
        token: str = "",
        audit: bool = True,
        tls: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        self.port = free_port()
        (tmp_path / "data").mkdir(exist_ok=True)
        self.data = tmp_path / "data" / "items.jsonl"
        self.pipeline = write_pipeline(
            tmp_path / "ranges.yml",
            {
                "pipeline": "ranges",
                "state_dir": str(tmp_path / "state"),
                "source": {
                    "type": "filelog",
                    "path": str(tmp_path / "data"),
                    "poll_interval_ms": 20,
                },
                "transport": {
                    "type": "tcp",
                    "listen": f"127.0.0.1:{self.port}",
                    "token": token,
                    **({"tls": tls} if tls else {}),
                },
                "delivery": {"datamarker_interval_ms": 50},
                "applications": {
                    "lake": {"external": True},
                    # Not external; it has no subscriber here, so it holds the log back.
                    **({"audit": {"sink": {"type": "null"}}} if audit else {}),
                },
                **extra,
            },
        )
        self.tmp = tmp_path
        self.process = Process("publish", str(self.pipeline), "-q", cwd=tmp_path)

    def wait_for(self, end: int, **options: str) -> None:
        def there() -> bool:
            try:
                return _remote(self.port, **options).positions().end >= end
            except RemoteLogError:
                return False

        wait_until(there, 60, f"the publisher log to reach {end}")

    def status(self) -> dict[str, Any]:
        result = run_cli("status", str(self.pipeline), "--json", cwd=self.tmp)
        assert result.returncode == 0, result
        return dict(json.loads(result.stdout))

    def stop(self) -> None:
        assert self.process.stop() == 0, self.process.stderr


@pytest.fixture
def publisher(tmp_path: Path) -> Any:
    pub = _Publisher(tmp_path, token="s3cret")
    try:
        yield pub
    finally:
        pub.stop()


def test_a_reader_reads_each_flow_by_range_and_commits_through_the_publisher(
    publisher: _Publisher,
) -> None:
    _write(publisher.data, 50, range(0, 40))
    publisher.wait_for(2000, token="s3cret")
    remote = _remote(publisher.port, token="s3cret")
    positions = remote.positions()
    assert (positions.first, positions.end, positions.shards) == (0, 2000, 16)
    assert positions.datastore == "ranges"
    assert set(positions.datamarkers.values()) <= {0}

    # Every flow's range, read separately, adds up to the log: each update once, in order.
    seen: dict[int, list[int]] = {}
    total = 0
    for shard in range(16):
        updates = list(_flat(remote, shard, 0, 2000))
        seqs = [seq for seq, _ in updates]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        for _, update in updates:
            assert update.shard == shard
            seen.setdefault(update.key["id"], []).append(json.loads(bytes(update.after))["n"])
        total += len(updates)
    assert total == 2000
    assert seen == {k: list(range(40)) for k in range(50)}

    # A part of a range: exactly the updates of the shard with from <= seq < to.
    part = [seq for seq, _ in _flat(remote, 3, 500, 900)]
    assert part == [seq for seq, u in _flat(remote, 3, 0, 2000) if 500 <= seq < 900]
    assert list(_flat(remote, 3, 700, 700)) == []

    # Commits are the application's datamarkers: stored, shown by status, never moved back.
    assert remote.commit({s: 1000 for s in range(16)}) == {s: 1000 for s in range(16)}
    assert remote.commit({0: 400, 1: 1500}) == {**{s: 1000 for s in range(16)}, 1: 1500}
    assert remote.positions().datamarkers[1] == 1500
    flows = {
        f["shard"]: f["datamarker"]
        for f in publisher.status()["flows"]
        if f["application"] == "lake"
    }
    assert flows == {**{s: 1000 for s in range(16)}, 1: 1500}


def test_a_reader_is_refused_with_a_reason_it_can_act_on(publisher: _Publisher) -> None:
    _write(publisher.data, 10, range(0, 2))
    publisher.wait_for(20, token="s3cret")
    with pytest.raises(RemoteLogError, match="authentication failed: wrong token"):
        _remote(publisher.port, token="nope").positions()
    with pytest.raises(
        RemoteLogError, match=r"not an external application 'audit'.*external: true"
    ):
        _remote(publisher.port, app="audit", token="s3cret").positions()
    with pytest.raises(
        RemoteLogError, match=r"unknown application 'nobody'.*external ones here: lake"
    ):
        _remote(publisher.port, app="nobody", token="s3cret").positions()
    remote = _remote(publisher.port, token="s3cret")
    with pytest.raises(RemoteLogError, match=r"point past the end of the publisher log \(20\)"):
        remote.commit({0: 5000})
    with pytest.raises(RemoteLogError, match=r"bad read: shard 99"):
        list(_flat(remote, 99, 0, 10))
    with pytest.raises(RemoteLogError, match=r"updates 20 to 39 are not in the publisher log"):
        list(_flat(remote, 0, 0, 40))
    # Nothing was committed by the refused requests.
    assert remote.positions().datamarkers == {s: 0 for s in range(16)}


def test_an_unreachable_publisher_is_named() -> None:
    port = free_port()
    with pytest.raises(RemoteLogError, match=rf"cannot reach the publisher at 127.0.0.1:{port}"):
        _remote(port).positions()


def test_a_range_no_longer_retained_names_the_missing_positions(tmp_path: Path) -> None:
    # Small segments: once the reader commits, the publisher collects those behind it.
    pub = _Publisher(tmp_path, audit=False, log={"roll_size": 4096})
    try:
        _write(pub.data, 100, range(0, 5))
        pub.wait_for(500)
        _write(pub.data, 100, range(5, 10))  # in a segment of its own
        pub.wait_for(1000)
        remote = _remote(pub.port)
        assert remote.positions().first == 0
        remote.commit({s: 500 for s in range(16)})
        wait_until(lambda: remote.positions().first > 0, 60, "the log to be collected")
        first = remote.positions().first
        assert first <= 500
        with pytest.raises(
            RemoteLogError,
            match=rf"shard 2: updates 0 to {first - 1} are no longer retained "
            rf"\(the publisher log starts at {first}\).*new checkpoint",
        ):
            list(_flat(remote, 2, 0, 500))
        # What is retained still reads.
        assert all(u.shard == 2 for _, u in _flat(remote, 2, first, 500))
    finally:
        pub.stop()


def test_subscribers_still_speak_version_1_and_readers_version_2() -> None:
    assert p.SUBSCRIBE_VERSION == 1 and p.READ_VERSION == 2 and p.VERSIONS == (1, 2)
    assert p.preamble() == b"WORMHOLE\x00\x01"


def test_the_range_cache_keeps_what_it_has_when_full_and_makes_room_from_old_entries() -> None:
    from wormhole.connectors.tcp.ranges import RangeCache

    cache = RangeCache(capacity=10, seconds=3600)
    cache.put(0, (6, {0: "a"}), 6)
    cache.put(6, (12, {0: "b"}), 6)  # no room: not kept, and the older entry stays
    assert cache.get(0) == (6, {0: "a"}) and cache.get(6) is None
    cache.seconds = 0.0  # every entry is now old enough to make room
    cache.put(6, (12, {0: "b"}), 6)
    assert cache.get(0) is None and cache.get(6) == (12, {0: "b"})


def test_a_reader_speaks_mutual_tls_and_a_reader_without_its_certificate_is_turned_away(
    tmp_path: Path,
) -> None:
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    tls = {"cert": str(cert), "key": str(key), "client_ca": str(cert)}
    pub = _Publisher(tmp_path, token="t", tls=tls)
    options = {"token": "t", "tls.ca": str(cert), "tls.cert": str(cert), "tls.key": str(key)}
    try:
        _write(pub.data, 10, range(0, 3))
        pub.wait_for(30, **options)
        remote = _remote(pub.port, **options)
        assert remote.commit({0: 30}) == {**{s: 0 for s in range(16)}, 0: 30}
        assert sum(len(seqs) for seqs, _ in remote.read(1, 0, 30)) > 0
        no_client_cert = {"token": "t", "tls.ca": str(cert)}
        with pytest.raises(RemoteLogError, match=r"check options tls\.ca.*tls\.cert and tls\.key"):
            _remote(pub.port, **no_client_cert).positions()
        with pytest.raises(RemoteLogError, match=r"if the publisher uses TLS.*give option tls\.ca"):
            _remote(pub.port, token="t").positions()  # plaintext
    finally:
        pub.stop()


def _columns(remote: TcpRemoteLog, shard: int, start: int, end: int) -> list[tuple[Any, ...]]:
    """A columns read, value by value: (seq, op, table, key, after)."""
    out = []
    for chunk in remote.read_columns(shard, start, end):
        seqs = list(chunk.seqs())
        values = []
        for index in (0, 1, 2, 4):  # op, table, key, after
            sizes = list(memoryview(bytes(chunk.lengths[index])).cast("i"))
            data, at, column = bytes(chunk.data[index]), 0, []
            for size in sizes:
                column.append(data[at : at + size].decode())
                at += size
            values.append(column)
        out += list(zip(seqs, *values, strict=True))
    return out


def test_columns_reads_hold_what_row_reads_hold_and_readers_side_by_side_share_the_work(
    tmp_path: Path,
) -> None:

    # A short tail in memory: most of the range is decoded from the log files.
    publisher = _Publisher(tmp_path, token="s3cret", log={"tail_updates": 100})
    try:
        _check_columns_against_rows(publisher)
    finally:
        publisher.stop()


def _check_columns_against_rows(publisher: _Publisher) -> None:
    import threading

    _write(publisher.data, 50, range(0, 40))
    publisher.wait_for(2000, token="s3cret")
    remote = _remote(publisher.port, token="s3cret")

    def as_rows(shard: int, start: int, end: int) -> list[tuple[Any, ...]]:
        return [
            (seq, u.op, u.table, json.dumps(u.key, separators=(",", ":")), bytes(u.after).decode())
            for seq, u in _flat(remote, shard, start, end)
        ]

    # Every flow read side by side (as a micro-batch's tasks do), whole and in parts cut
    # inside publisher-log batches: the same updates, values and seqs as a read of rows.
    got: dict[tuple[int, int, int], list[tuple[Any, ...]]] = {}
    ranges = [(s, a, b) for s in range(16) for a, b in ((0, 2000), (7, 1234), (1234, 1999))]

    def read(part: list[tuple[int, int, int]]) -> None:
        for key in part:
            got[key] = _columns(_remote(publisher.port, token="s3cret"), *key)

    threads = [threading.Thread(target=read, args=(ranges[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(got) == len(ranges)
    for key in ranges:
        assert got[key] == as_rows(*key), key
    assert sum(len(got[(s, 0, 2000)]) for s in range(16)) == 2000


def test_a_read_in_an_unknown_layout_is_refused(publisher: _Publisher) -> None:
    _write(publisher.data, 10, range(0, 2))
    publisher.wait_for(20, token="s3cret")
    remote = _remote(publisher.port, token="s3cret")
    with pytest.raises(RemoteLogError, match=r"bad read: layout 'sideways' \(rows or columns\)"):
        list(remote._range(0, 0, 20, "sideways"))


def test_a_columns_read_from_a_publisher_that_answers_rows_is_made_columns_by_the_reader() -> None:
    """A publisher from before ``layout`` ignores it and answers ``batch`` frames. No such
    publisher is installed here: a socket speaking its side of the protocol stands in."""
    import socket
    import threading

    from wormhole.connectors.tcp.ranges import ReadBatch
    from wormhole.core.update import Update

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    updates = [Update.create(op="u", key={"id": i}, table="t", after={"n": i}) for i in range(5)]

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            p.read_preamble(conn)
            p.read_frame(conn, 1 << 20)  # hello
            welcome = p.Welcome(
                version=2, publisher="old", pipeline="x", shards=1, heartbeat_ms=1000
            )
            conn.sendall(p.encode(p.WELCOME, welcome))
            kind, read = p.read_frame(conn, 1 << 20)
            assert kind == p.READ and read.layout == "columns"
            batch = ReadBatch(id=1, first=10, end=15, seqs=list(range(10, 15)), updates=updates)
            conn.sendall(p.encode(p.BATCH, batch))
            done = p.ReadEnd(shard=0, start=10, end=15, updates=5)
            conn.sendall(p.encode(p.READ_END, done))
            p.read_frame(conn, 1 << 20)  # bye

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        rows = _columns(_remote(port), 0, 10, 15)
    finally:
        thread.join(30)
        listener.close()
    assert rows == [(10 + i, "u", "t", f'{{"id":{i}}}', f'{{"n":{i}}}') for i in range(5)]


def _side_by_side(capacity: int) -> None:
    import threading

    from wormhole.connectors.tcp.ranges import RangeCache

    cache = RangeCache(capacity=capacity, seconds=3600)
    made = []
    gate = threading.Event()

    def make() -> tuple[tuple[int, dict[int, Any]], int | None]:
        made.append(1)
        gate.wait(30)
        return (7, {s: f"part {s}" for s in range(4)}), 1

    results: list[Any] = []

    def read(shard: int) -> None:
        results.append(cache.get_or_make(0, shard, make))

    threads = [threading.Thread(target=read, args=(s,)) for s in range(4)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(cache.making) == 1, 10, "one reader making")
    gate.set()
    for thread in threads:
        thread.join(30)
    assert results == [(7, {s: f"part {s}" for s in range(4)})] * 4 and made == [1]
    # Every shard took its part: nothing is held, nothing is pending.
    assert cache.entries == {} and cache.weight == 0 and cache.making == {}
    # Not kept: the next reader makes it again.
    cache.get_or_make(0, 0, make)
    assert len(made) == 2


def test_readers_of_one_batch_side_by_side_make_it_once_kept_or_not() -> None:
    _side_by_side(100)  # kept until every shard took its part
    _side_by_side(0)  # no room: the waiters still share what was made


def test_the_cache_drops_an_entry_once_its_shards_took_their_parts_or_it_is_old() -> None:
    from wormhole.connectors.tcp.ranges import RangeCache

    cache = RangeCache(capacity=10, seconds=3600)
    cache.put(0, (6, {1: "a", 2: "b"}), 6)
    cache.put(6, (12, {1: "c"}), 6)  # no room: not kept, and the older entry stays
    assert cache.get(6) is None and cache.get(0, shard=1) == (6, {1: "a", 2: "b"})
    assert cache.get(0, shard=2) is not None and cache.get(0) is None  # both parts taken
    cache.put(6, (12, {1: "c"}), 6)  # room again
    assert cache.weight == 6
    # A reader that failed midway never takes its part: the entry goes once old, on the next
    # request, or by the timer when no request comes.
    quiet = RangeCache(capacity=10, seconds=0.05)
    quiet.put(0, (6, {1: "a", 2: "b"}), 6)
    assert quiet.get(0, shard=1) is not None
    wait_until(lambda: not quiet.entries, 10, "the timer to drop the old entry")
    assert quiet.weight == 0
    # Dropping old entries looks at the old ones only: many entries, quickly.
    many = RangeCache(capacity=1 << 30, seconds=3600)
    for first in range(20_000):
        many.put(first, (first + 1, {0: "x"}), 1)
    assert len(many.entries) == 20_000


def test_columns_frames_hold_at_most_8192_updates_even_from_a_larger_batch(
    tmp_path: Path,
) -> None:
    from wormhole.connectors.tcp.ranges import FRAME_ROWS

    # One shard: a publisher-log batch's part is the whole batch, thousands of updates.
    pub = _Publisher(tmp_path, audit=False, dataset={"shards": 1})
    try:
        _write(pub.data, 1000, range(0, 20))
        pub.wait_for(20_000)
        chunks = list(_remote(pub.port).read_columns(0, 0, 20_000))
    finally:
        pub.stop()
    assert max(c.rows for c in chunks) == FRAME_ROWS == 8192
    seqs = [seq for c in chunks for seq in c.seqs()]
    assert seqs == list(range(20_000))
