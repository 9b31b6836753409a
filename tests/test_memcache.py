"""The memcache sink against three real memcached servers and real wormhole processes.

The "application" in these tests caches through pymemcache's HashClient on the same
server list, as a real one would: if the sink hashed a key to another server than
the application does, the application's stale copy would survive and the tests
would see it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from pymemcache.client.hash import HashClient
from pymemcache.client.rendezvous import RendezvousHash
from tcp_support import Process

from wormhole.core.datamarkers import read_datamarkers
from wormhole.testing import run_cli, wait_until, write_pipeline
from wormhole.testing.helpers import subscriber_pids
from wormhole.testing.memcached import MemcachedServer

Row = dict[str, Any]

FAST_RETRIES = {"timeout_s": 0.3, "retries": 1, "retry_backoff_ms": 20}


# ----------------------------------------------------------------- helpers
@pytest.fixture
def servers(memcached_servers: list[MemcachedServer]) -> Iterator[list[MemcachedServer]]:
    """The session's three servers, running and empty; running again after the test."""
    for server in memcached_servers:
        server.resume()
        server.start()
        client = server.client()
        client.flush_all(noreply=False)
        client.close()
    try:
        yield memcached_servers
    finally:
        for server in memcached_servers:
            server.resume()
            server.start()


def application(servers: list[MemcachedServer]) -> HashClient:
    """How the application reaches the cache."""
    return HashClient(
        [s.address for s in servers],
        allow_unicode_keys=True,
        connect_timeout=5,
        timeout=5,
        default_noreply=False,
    )


def home_of(servers: list[MemcachedServer], key: str) -> int:
    """The index of the server the application's HashClient uses for ``key``."""
    nodes = [s.address for s in servers]
    return nodes.index(RendezvousHash(list(nodes)).get_node(key))


def where(servers: list[MemcachedServer], keys: list[str]) -> dict[str, list[int]]:
    """For each key, the indexes of the servers that hold it."""
    found: dict[str, list[int]] = {k: [] for k in keys}
    for index, server in enumerate(servers):
        client = server.client()
        for start in range(0, len(keys), 500):
            for key in client.get_many(keys[start : start + 500]):
                found[key].append(index)
        client.close()
    return found


def cached(client: HashClient, keys: list[str]) -> dict[str, Any]:
    """key -> the cached JSON value (decoded), for the keys that are present."""
    return {k: json.loads(v) for k, v in client.get_many(keys).items()}


def ttl(server: MemcachedServer, key: str) -> int:
    """The seconds ``key`` has left on ``server`` (-1: no expiry), by the meta get command."""
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        sock.sendall(f"mg {key} t\r\n".encode())
        reply = sock.recv(256).decode()
    assert reply.startswith("HD t"), f"{key!r} is not on {server.address}: {reply!r}"
    return int(reply.split()[1][1:])


def line(table: str, op: str, key: Row, after: Row | None = None, before: Row | None = None) -> str:
    update: dict[str, Any] = {"table": table, "op": op, "key": key}
    if after is not None:
        update["after"] = after
    if before is not None:
        update["before"] = before
    return json.dumps(update) + "\n"


class Database:
    """The rows a workload leaves, and the lines that describe it (filelog format)."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[Any, Row]] = {}
        self.lines: list[str] = []
        self.touched: set[tuple[str, Any]] = set()

    def upsert(self, table: str, key: str, row: Row, op: str = "") -> None:
        """Insert or update ``row``; ``op="r"`` makes it a snapshot read."""
        rows = self.tables.setdefault(table, {})
        old = rows.get(row[key])
        op = op or ("c" if old is None else "u")
        self.lines.append(line(table, op, {key: row[key]}, row, old))
        rows[row[key]] = row
        self.touched.add((table, row[key]))

    def delete(self, table: str, key: str, value: Any) -> None:
        old = self.tables[table].pop(value)
        self.lines.append(line(table, "d", {key: value}, before=old))
        self.touched.add((table, value))

    def flush_to(self, path: Path) -> int:
        """Write the pending lines to a new file, all at once; returns how many.

        The file appears whole (the source ignores dot-files), so a running source
        reads it in one batch: the tests rely on that to know what one frame holds.
        """
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}")
        partial.write_text("".join(self.lines))
        partial.rename(path)
        count = len(self.lines)
        self.lines = []
        self.touched = set()
        return count


def acknowledged(state: Path, app: str, end: int) -> bool:
    markers = read_datamarkers(state)
    return all((app, s) in markers and markers[(app, s)].position >= end for s in range(16))


def highest_datamarker(state: Path, app: str) -> int:
    return max(m.position for (a, _), m in read_datamarkers(state).items() if a == app)


def live_pipeline(tmp_path: Path, sink: dict[str, Any]) -> Path:
    return write_pipeline(
        tmp_path / "live.yml",
        {
            "pipeline": "live",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path / "data"), "poll_interval_ms": 20},
            "delivery": {"datamarker_interval_ms": 50},
            "applications": {"cache": {"sink": sink}},
        },
    )


# ------------------------------------------------------------ the workload
def test_a_workload_leaves_no_stale_key_in_delete_or_set_mode(
    tmp_path: Path, servers: list[MemcachedServer]
) -> None:
    addresses = [s.address for s in servers]
    pipeline = write_pipeline(
        tmp_path / "cache.yml",
        {
            "pipeline": "cache",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path / "data")},
            "applications": {
                "invalidate": {
                    "sink": {
                        "type": "memcache",
                        "servers": ",".join(addresses),  # one string, as ${VAR} gives it
                        "keys": {
                            "users": ["inv:user:{id}", "inv:email:{email}"],
                            "orders": "inv:order:{id}",
                            "tags": "inv:tag:{name}",
                        },
                    }
                },
                "refresh": {
                    "filter": {"tables": ["users", "orders"]},
                    "sink": {
                        "type": "memcache",
                        "servers": addresses,
                        "mode": "set",
                        "expire_s": 600,
                        "keys": {
                            "users": ["set:user:{id}", "set:email:{email}"],
                            "*": "set:{@table}:{id}",
                        },
                    },
                },
            },
        },
    )
    db = Database()
    for i in range(300):
        db.upsert("users", "id", {"id": i, "name": f"user {i}", "email": f"u{i}@x.org", "v": 0})
    for i in range(100):  # a snapshot: op r, which acts as an insert
        db.upsert("orders", "id", {"id": i, "user_id": i % 30, "status": "new"}, op="r")
    for name in ["naïve", "日本", "plain", "new york", "los angeles"]:
        db.upsert("tags", "name", {"name": name, "uses": 1})
    for i in range(20):
        db.upsert("audit", "id", {"id": i, "what": "login"})
    db.flush_to(tmp_path / "data" / "1.jsonl")
    first = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert first.returncode == 0, first

    app = application(servers)
    # Set mode stored every row, on the server the application's client reads it from.
    user_keys = [f"set:user:{i}" for i in range(300)]
    assert cached(app, user_keys) == {f"set:user:{i}": db.tables["users"][i] for i in range(300)}
    order_keys = [f"set:orders:{i}" for i in range(100)]
    assert cached(app, order_keys) == {k: db.tables["orders"][i] for i, k in enumerate(order_keys)}
    homes = where(servers, user_keys)
    assert all(homes[k] == [home_of(servers, k)] for k in user_keys)
    per_server = [sum(1 for k in user_keys if homes[k] == [i]) for i in range(3)]
    assert min(per_server) > 60, f"keys are not spread over the servers: {per_server}"
    assert all(0 < ttl(servers[home_of(servers, k)], k) <= 600 for k in user_keys[:5])

    # The application caches what it reads, and more that the workload never touches.
    before = {table: dict(rows) for table, rows in db.tables.items()}
    stale: dict[str, bytes] = {}
    for i, row in before["users"].items():
        stale[f"inv:user:{i}"] = json.dumps(row).encode()
        stale[f"inv:email:{row['email']}"] = json.dumps(row).encode()
    for i, row in before["orders"].items():
        stale[f"inv:order:{i}"] = json.dumps(row).encode()
    for name in ["naïve", "日本", "plain"]:
        stale[f"inv:tag:{name}"] = json.dumps(before["tags"][name]).encode()
    for i in range(1000, 1100):
        stale[f"inv:user:{i}"] = b'{"cached": "elsewhere"}'
    assert app.set_many(stale) == []

    for i in range(300):
        row = dict(db.tables["users"][i])
        if i % 3 == 0:
            row = {**row, "name": f"renamed {i}", "v": 1}
            db.upsert("users", "id", row)
        if i % 5 == 0:
            db.upsert("users", "id", {**row, "email": f"u{i}.new@x.org"})
        if i % 7 == 0:
            db.delete("users", "id", i)
        if i % 14 == 0:
            db.upsert("users", "id", {"id": i, "name": "back", "email": f"b{i}@x.org", "v": 2})
    for i in range(100):
        if i % 4 == 0:
            db.upsert("orders", "id", {**db.tables["orders"][i], "status": "paid"})
        if i % 9 == 0:
            db.delete("orders", "id", i)
    db.upsert("tags", "name", {"name": "naïve", "uses": 2})
    db.delete("tags", "name", "日本")
    db.upsert("tags", "name", {"name": "new york", "uses": 3})
    db.upsert("tags", "name", {"name": "los angeles", "uses": 3})
    db.upsert("audit", "id", {"id": 99, "what": "logout"})
    touched = set(db.touched)
    db.flush_to(tmp_path / "data" / "2.jsonl")
    second = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert second.returncode == 0, second

    # Delete mode: every key of a changed row is gone (the old e-mail's too); the rest stay.
    expected_gone = set()
    for table, value in touched:
        if table == "users":
            expected_gone |= {f"inv:user:{value}", f"inv:email:{before['users'][value]['email']}"}
        elif table == "orders":
            expected_gone.add(f"inv:order:{value}")
        elif table == "tags":
            expected_gone.add(f"inv:tag:{value}")
    assert len(expected_gone) > 250
    left = app.get_many(list(stale))
    assert sorted(k for k in expected_gone if k in left) == [], "stale keys survived"
    assert left == {k: v for k, v in stale.items() if k not in expected_gone}

    # Set mode: each key holds exactly the latest row; deleted rows and old e-mails are gone.
    want: dict[str, Any] = {}
    for i, row in db.tables["users"].items():
        want[f"set:user:{i}"] = row
        want[f"set:email:{row['email']}"] = row
    for i, row in db.tables["orders"].items():
        want[f"set:orders:{i}"] = row
    probe = [f"set:user:{i}" for i in range(300)] + [f"set:orders:{i}" for i in range(100)]
    probe += [f"set:email:{r['email']}" for r in before["users"].values()]
    probe += [f"set:email:{r['email']}" for r in db.tables["users"].values()]
    probe += [f"set:email:u{i}.new@x.org" for i in range(0, 300, 5)]
    assert cached(app, sorted(set(probe))) == want

    for result in (first, second):
        # One warning per table and subscriber, however many updates it skips.
        assert result.stderr.count("no key template for table audit") == 1, result
        assert result.stderr.count("skipping key 'inv:tag:new york'") == 1, result
        assert result.stderr.count("skipping key") == 1, result


# --------------------------------------------------------------- truncates
SCRIPT_SOURCE = '''
"""A source that emits the updates listed in a JSON file, in one batch.

The filelog source has no truncate op; this one passes any op through.
"""

import json

from wormhole.core.update import Update
from wormhole.plugins.components import ComponentSpec, Options, SourceBatch
from wormhole.plugins.hookspecs import hookimpl


class ScriptOptions(Options):
    path: str


class ScriptSource:
    def __init__(self, options):
        self.options = options
        self.done = False

    def open(self, context, checkpoint):
        self.done = bool(checkpoint)

    def read(self, timeout):
        if self.done:
            return None
        self.done = True
        with open(self.options.path) as f:
            listed = json.load(f)
        updates = [
            Update.create(**u, connector="script", position=str(i), logical=str(i))
            for i, u in enumerate(listed)
        ]
        return SourceBatch(updates, checkpoint=True)

    def capture_end(self):
        return True

    def reached(self, end):
        return self.done

    def confirm(self, checkpoint):
        pass

    def close(self):
        pass


@hookimpl
def wormhole_sources():
    return [ComponentSpec(kind="source", name="script", factory=ScriptSource,
                          options=ScriptOptions)]
'''


@pytest.mark.parametrize("flush", [False, True], ids=["warn", "flush"])
def test_a_truncate_warns_or_flushes_every_server(
    tmp_path: Path, servers: list[MemcachedServer], flush: bool
) -> None:
    (tmp_path / "script_source.py").write_text(SCRIPT_SOURCE)
    updates: list[dict[str, Any]] = [
        {"op": "u", "table": "users", "key": {"id": i}, "after": {"id": i, "v": 1}}
        for i in range(10)
    ]
    updates.append({"op": "t", "table": "users", "key": {}})
    updates += [
        {"op": "c", "table": "users", "key": {"id": i}, "after": {"id": i, "v": 2}}
        for i in range(100, 110)
    ]
    (tmp_path / "updates.json").write_text(json.dumps(updates))
    pipeline = write_pipeline(
        tmp_path / "truncate.yml",
        {
            "pipeline": "truncate",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "script", "path": str(tmp_path / "updates.json")},
            "applications": {
                "cache": {
                    "sink": {
                        "type": "memcache",
                        "servers": [s.address for s in servers],
                        "mode": "set",
                        "flush_on_truncate": flush,
                        "keys": {"users": "user:{id}"},
                    }
                }
            },
        },
    )
    app = application(servers)
    old = {f"user:{i}": b'{"v": 0}' for i in range(50)}
    other = {f"other:{i}": b'{"v": 0}' for i in range(30)}
    assert app.set_many({**old, **other}) == []
    assert {home_of(servers, k) for k in other} == {0, 1, 2}

    env = {"PYTHONPATH": str(tmp_path), "WORMHOLE_PLUGINS": "script_source"}
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, env=env)
    assert result.returncode == 0, result

    after_truncate = {f"user:{i}": {"id": i, "v": 2} for i in range(100, 110)}
    everything = [*old, *other, *after_truncate]
    if flush:
        # Every server was flushed (other tables' keys too); rows set after it stay.
        assert cached(app, everything) == after_truncate
        assert "truncated" not in result.stderr
    else:
        # The truncated table's keys cannot be listed: they stay, and one warning says so.
        assert cached(app, everything) == {
            **{k: {"v": 0} for k in [*old, *other]},
            **{f"user:{i}": {"id": i, "v": 1} for i in range(10)},
            **after_truncate,
        }
        assert result.stderr.count("table users was truncated") == 1, result


# ------------------------------------------------------------------ failures
def test_a_killed_subscriber_and_a_stopped_server_leave_the_cache_correct(
    tmp_path: Path, servers: list[MemcachedServer]
) -> None:
    sink = {
        "type": "memcache",
        "servers": [s.address for s in servers],
        "mode": "set",
        "keys": {"users": "user:{id}"},
        **FAST_RETRIES,
    }
    pipeline = live_pipeline(tmp_path, sink)
    state = tmp_path / "state"
    db = Database()
    run = Process("run", str(pipeline), cwd=tmp_path)
    try:
        for version in range(3):
            for i in range(400):
                db.upsert("users", "id", {"id": i, "v": version})
        end_a = db.flush_to(tmp_path / "data" / "1.jsonl")
        wait_until(lambda: acknowledged(state, "cache", end_a), 30, "the first chunk acknowledged")

        down = servers[1]
        down.stop()
        for version in (3, 4):
            for i in range(400):
                db.upsert("users", "id", {"id": i, "v": version})
        end_b = end_a + db.flush_to(tmp_path / "data" / "2.jsonl")
        wait_until(lambda: run.stderr.count("did not answer") >= 2, 30, "retries of the batch")
        # The batch reached the servers that answered, but is not acknowledged: no
        # datamarker moved past the first chunk. (They are persisted every 50 ms;
        # the retries span longer than that.)
        app = application([s for s in servers if s is not down])
        healthy = [f"user:{i}" for i in range(400) if home_of(servers, f"user:{i}") != 1]
        assert {v["v"] for v in cached(app, healthy).values()} == {4}
        assert highest_datamarker(state, "cache") == end_a

        # kill -9 the subscriber in the middle of that batch; `run` starts another.
        (victim,) = subscriber_pids(run.pid)
        seen = run.stderr.count("did not answer")
        os.kill(victim, signal.SIGKILL)
        wait_until(
            lambda: (
                "exited with code -9; restarting" in run.stderr
                and len(subscriber_pids(run.pid)) == 1
                and run.stderr.count("did not answer") > seen
            ),
            30,
            "a new subscriber retrying the batch",
        )
        assert subscriber_pids(run.pid) != [victim]
        assert highest_datamarker(state, "cache") == end_a

        down.start()  # empty: whatever it holds now, the sink wrote after it returned
        wait_until(lambda: acknowledged(state, "cache", end_b), 30, "the batch acknowledged")
        for i in range(200):
            db.upsert("users", "id", {"id": i, "v": 5})
        for i in range(200, 250):
            db.delete("users", "id", i)
        end_c = end_b + db.flush_to(tmp_path / "data" / "3.jsonl")
        wait_until(lambda: acknowledged(state, "cache", end_c), 30, "the last chunk acknowledged")
    finally:
        assert run.stop() == 0, run.stderr
    keys = [f"user:{i}" for i in range(400)]
    assert cached(application(servers), keys) == {
        f"user:{i}": row for i, row in db.tables["users"].items()
    }
    homes = where(servers, keys)
    assert sum(1 for k in keys if homes[k] == [1]) > 60, "the restarted server got its keys"
    assert all(homes[k] in ([], [home_of(servers, k)]) for k in keys)


def test_an_unresponsive_server_holds_back_the_batch_until_it_answers(
    tmp_path: Path, servers: list[MemcachedServer]
) -> None:
    sink = {
        "type": "memcache",
        "servers": [s.address for s in servers],
        "keys": {"users": "user:{id}"},
        **FAST_RETRIES,
    }
    pipeline = live_pipeline(tmp_path, sink)
    state = tmp_path / "state"
    app = application(servers)
    stale = {f"user:{i}": b"stale" for i in range(400)}
    untouched = {f"user:{i}": b"fresh" for i in range(1000, 1050)}
    assert app.set_many({**stale, **untouched}) == []
    db = Database()
    run = Process("run", str(pipeline), cwd=tmp_path)
    frozen = servers[2]
    try:
        for i in range(100):
            db.upsert("users", "id", {"id": i, "v": 1})
        end_a = db.flush_to(tmp_path / "data" / "1.jsonl")
        wait_until(lambda: acknowledged(state, "cache", end_a), 30, "the first chunk acknowledged")
        assert app.get_many([f"user:{i}" for i in range(100)]) == {}

        frozen.pause()  # accepts connections, never answers
        for i in range(100, 400):
            db.upsert("users", "id", {"id": i, "v": 1})
        end_b = end_a + db.flush_to(tmp_path / "data" / "2.jsonl")
        wait_until(lambda: run.stderr.count("did not answer") >= 2, 30, "retries of the batch")
        assert "TimeoutError" in run.stderr or "timed out" in run.stderr
        assert highest_datamarker(state, "cache") == end_a
        others = application([s for i, s in enumerate(servers) if i != 2])
        on_others = [f"user:{i}" for i in range(100, 400) if home_of(servers, f"user:{i}") != 2]
        assert others.get_many(on_others) == {}, "the servers that answered were invalidated"
        others.close()
    finally:
        frozen.resume()
    try:
        wait_until(lambda: acknowledged(state, "cache", end_b), 30, "the batch acknowledged")
    finally:
        assert run.stop() == 0, run.stderr
    on_frozen = [k for k in stale if home_of(servers, k) == 2]
    assert len(on_frozen) > 60
    assert app.get_many(list(stale)) == {}, "stale keys survived"
    assert app.get_many(list(untouched)) == untouched


# -------------------------------------------------------------- bad options
def test_bad_options_are_reported_by_path(tmp_path: Path) -> None:
    def sink(**options: Any) -> dict[str, Any]:
        return {"sink": {"type": "memcache", **options}}

    ok = {"servers": ["127.0.0.1:11211"], "keys": {"users": "user:{id}"}}
    pipeline = write_pipeline(
        tmp_path / "bad.yml",
        {
            "pipeline": "bad",
            "source": {"type": "filelog", "path": str(tmp_path)},
            "applications": {
                "port": sink(**{**ok, "servers": ["127.0.0.1:11211", "cache:99999"]}),
                "brace": sink(**{**ok, "keys": {"public.users": "user:{"}}),
                "fixed": sink(**{**ok, "keys": {"orders": ["order:{id}", "orders"]}}),
                "spec": sink(**{**ok, "keys": {"users": "user:{id:05d}"}}),
                "mode": sink(**ok, mode="upsert"),
                "expiry": sink(**ok, expire_s=60),
                "twice": sink(**{**ok, "servers": "10.0.0.1:11211, 10.0.0.1"}),
                "empty": sink(servers=[], keys={}),
                "typo": sink(**ok, server="10.0.0.1:11211"),
                "missing": sink(),
            },
        },
    )
    result = run_cli("validate", str(pipeline), cwd=tmp_path)
    assert result.returncode == 2, result
    for expected in [
        "applications.port.sink.servers[1]: 'cache:99999': the port must be a number from 1 to",
        "applications.brace.sink.keys.public.users: template 'user:{' is malformed",
        "applications.fixed.sink.keys.orders: template 'orders' names no column",
        "applications.spec.sink.keys.users: template 'user:{id:05d}': {id:05d} has a format spec",
        "applications.mode.sink.mode: input should be 'delete' or 'set'",
        "applications.expiry.sink.expire_s: applies only to mode: set",
        "applications.twice.sink.servers: '10.0.0.1' is listed twice (as '10.0.0.1:11211')",
        "applications.empty.sink.servers: list should have at least 1 item",
        "applications.empty.sink.keys: dictionary should have at least 1 item",
        "applications.typo.sink.server: unknown option (known: servers, keys, mode,",
        "applications.missing.sink.servers: field required",
        "applications.missing.sink.keys: field required",
    ]:
        assert expected in result.stderr, f"{expected!r} not in:\n{result.stderr}"


def test_a_template_naming_an_unknown_column_stops_the_run_naming_the_option(
    tmp_path: Path, servers: list[MemcachedServer]
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "1.jsonl").write_text(line("users", "c", {"id": 1}, {"id": 1, "name": "ada"}))
    pipeline = write_pipeline(
        tmp_path / "p.yml",
        {
            "pipeline": "p",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(data)},
            "applications": {
                "cache": {
                    "sink": {
                        "type": "memcache",
                        "servers": [s.address for s in servers],
                        "keys": {"users": ["user:{id}", "user_by_email:{email}"]},
                    }
                }
            },
        },
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result
    assert (
        "applications.cache.sink.keys.users: template 'user_by_email:{email}' names column "
        "'email', which the row of users at 1.jsonl:0 does not have (it has: id, name)"
    ) in result.stderr
    markers = read_datamarkers(tmp_path / "state").values()
    assert all(m.position == 0 for m in markers), "the failed batch was acknowledged"


def test_without_pymemcache_the_sink_says_what_to_install(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow" / "pymemcache"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'pymemcache'\")\n")
    pipeline = write_pipeline(
        tmp_path / "p.yml",
        {
            "pipeline": "p",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path)},
            "applications": {
                "cache": {
                    "sink": {
                        "type": "memcache",
                        "servers": "127.0.0.1:11211",
                        "keys": {"*": "{@table}:{id}"},
                    }
                }
            },
        },
    )
    env = {"PYTHONPATH": str(tmp_path / "shadow")}
    result = run_cli(
        "subscribe", str(pipeline), "--app", "cache", "--publisher", "127.0.0.1:9", env=env
    )
    assert result.returncode == 2, result
    assert "applications.cache.sink.type: the memcache sink needs the pymemcache package" in (
        result.stderr
    )
    assert "pip install 'wormhole-cdc[memcache]'" in result.stderr


# ----------------------------------------------------------- the example
def test_the_memcache_invalidation_example_runs(
    tmp_path: Path, servers: list[MemcachedServer]
) -> None:
    data = tmp_path / "shop"
    db = Database()
    for i in range(50):
        db.upsert("users", "id", {"id": i, "email": f"u{i}@x.org"})
        db.upsert("orders", "id", {"id": i, "user_id": i, "total": 5})
    db.flush_to(data / "1.jsonl")
    env = {
        "MEMCACHED_SERVERS": ",".join(s.address for s in servers),
        "MEMCACHE_DATA": str(data),
        "MEMCACHE_STATE": str(tmp_path / "state"),
    }
    example = str(REPO / "pipelines" / "memcache-invalidation.yml")
    assert run_cli("run", example, "--once", cwd=tmp_path, env=env).returncode == 0
    app = application(servers)
    profiles = [f"profile:{i}" for i in range(50)]
    assert cached(app, profiles) == {f"profile:{i}": db.tables["users"][i] for i in range(50)}
    # The application caches rows; then they change.
    stale = {f"user:{i}": b"{}" for i in range(50)}
    stale |= {f"user_by_email:u{i}@x.org": b"{}" for i in range(50)}
    stale |= {f"order:{i}": b"{}" for i in range(50)}
    assert app.set_many(stale) == []
    for i in range(0, 50, 2):
        db.upsert("users", "id", {"id": i, "email": f"new{i}@x.org"})
        db.delete("orders", "id", i)
    db.delete("users", "id", 49)
    db.flush_to(data / "2.jsonl")
    result = run_cli("run", example, "--once", cwd=tmp_path, env=env)
    assert result.returncode == 0, result
    changed = {f"user:{i}" for i in [*range(0, 50, 2), 49]}
    changed |= {f"user_by_email:u{i}@x.org" for i in [*range(0, 50, 2), 49]}
    changed |= {f"order:{i}" for i in range(0, 50, 2)}
    assert app.get_many(list(stale)) == {k: v for k, v in stale.items() if k not in changed}
    assert cached(app, profiles) == {f"profile:{i}": db.tables["users"][i] for i in range(49)}
