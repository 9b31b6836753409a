"""The ``search`` sink: a Tantivy index (and an OpenSearch bulk client) kept in step with tables.

Workloads are JSON-lines files read by the ``filelog`` source; the index is checked
against the final table computed from the workload. OpenSearch cannot run on this
machine (no network, no package), so the OpenSearch tests use ``FakeOpenSearch``
below, a small real HTTP server on a loopback port that stands in for it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from tcp_support import Process

from wormhole.connectors.filelog import natural_name
from wormhole.connectors.search import SearchOptions, make_sink, query, tantivy_engine
from wormhole.connectors.search.opensearch import OpenSearchUnavailable
from wormhole.core.datamarkers import read_datamarkers
from wormhole.core.errors import SinkError
from wormhole.core.update import Update
from wormhole.plugins.components import SinkContext
from wormhole.plugins.versions import version_number, version_of
from wormhole.publish import LogWriter
from wormhole.testing import run_cli, wait_until, write_pipeline

FIELDS = {"name": "text", "city": "string", "age": "i64", "vip": "bool", "joined": "date"}
IDS = {"users": "user:{id}"}
WORDS = ["ada", "grace", "alan", "edsger", "barbara", "donald", "frances", "ken", "tony", "radia"]
CITIES = ["lisbon", "osaka", "quito", "nairobi"]

Table = dict[tuple[str, int], dict[str, Any]]


# ----------------------------------------------------------------- workloads
def _row(rng: random.Random, key: int, generation: int) -> dict[str, Any]:
    return {
        "id": key,
        "name": f"{rng.choice(WORDS)} {rng.choice(WORDS)} g{generation}",
        "city": rng.choice(CITIES),
        "age": rng.randrange(18, 90),
        "vip": rng.random() < 0.2,
        "joined": f"2024-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}T08:00:00Z",
    }


def workload(keys: int, changes: int, seed: int) -> list[dict[str, Any]]:
    """Inserts of every key of users and orders, then random updates, deletes and re-inserts."""
    rng = random.Random(seed)
    lines: list[dict[str, Any]] = []
    live: dict[tuple[str, int], int] = {}
    for key in range(keys):
        lines.append({"table": "users", "op": "c", "key": {"id": key}, "after": _row(rng, key, 0)})
        live[("users", key)] = 0
    for key in range(keys // 4):
        after = {"id": key, "total": key * 3, "note": f"order {key}"}
        lines.append({"table": "orders", "op": "c", "key": {"id": key}, "after": after})
        live[("orders", key)] = 0
    for _ in range(changes):
        table = "users" if rng.random() < 0.85 else "orders"
        key = rng.randrange(keys if table == "users" else keys // 4)
        if (table, key) in live and rng.random() < 0.25:
            lines.append({"table": table, "op": "d", "key": {"id": key}})
            del live[(table, key)]
            continue
        op = "u" if (table, key) in live else "c"
        generation = live.get((table, key), -1) + 1
        live[(table, key)] = generation
        if table == "users":
            after = _row(rng, key, generation)
        else:
            after = {"id": key, "total": rng.randrange(1000), "note": f"order {key} g{generation}"}
        lines.append({"table": table, "op": op, "key": {"id": key}, "after": after})
    return lines


def final_table(lines: list[dict[str, Any]]) -> Table:
    table: Table = {}
    for line in lines:
        key = (line["table"], line["key"]["id"])
        if line["op"] == "d":
            table.pop(key, None)
        else:
            table[key] = line["after"]
    return table


def write_lines(path: Path, lines: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))


def indexed(path: Path) -> Table:
    """Every live row in the index, by (table, id); fails on a document that appears twice."""
    hits = query(path, "*", limit=1_000_000)
    table: Table = {}
    for hit in hits:
        key = (hit.table, hit.row["id"])
        assert key not in table, f"{key} is in the index twice"
        expected_id = (
            f"user:{hit.row['id']}" if hit.table == "users" else f'orders:{{"id":{key[1]}}}'
        )
        assert hit.id == expected_id
        table[key] = hit.row
    return table


def search_pipeline(tmp_path: Path, name: str = "search", **sink: Any) -> Path:
    return write_pipeline(
        tmp_path / f"{name}.yml",
        {
            "pipeline": name,
            "state_dir": str(tmp_path / f"state-{name}"),
            "source": {"type": "filelog", "path": str(tmp_path / "data"), "poll_interval_ms": 20},
            "delivery": {"datamarker_interval_ms": 50},
            "applications": {
                "find": {
                    "sink": {
                        "type": "search",
                        "path": str(tmp_path / "index" / "{application}"),
                        "fields": FIELDS,
                        "ids": IDS,
                        **sink,
                    }
                },
                "audit": {"sink": {"type": "jsonl", "path": str(tmp_path / "audit.jsonl")}},
            },
        },
    )


def acknowledged(state: Path, application: str, end: int) -> bool:
    markers = read_datamarkers(state)
    return all(
        markers.get((application, s)) is not None and markers[(application, s)].position >= end
        for s in range(16)
    )


def context(application: str = "find", subscribers: int = 1) -> SinkContext:
    return SinkContext(
        "test", application, 0, subscribers, Path("."), logging.getLogger("test.search")
    )


def pg(op: str, key: int, lsn: int, index: int = 0, shard: int = 0, **row: Any) -> Update:
    """An update as the postgres source makes it (commit LSN, index in the transaction)."""
    commit = f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"
    return Update.create(
        op=op,
        key={} if op == "t" else {"id": key},
        table="users",
        after=None if op in ("d", "t") else {"id": key, **row},
        before={"id": key} if op == "d" else None,
        connector="postgres",
        position=f"{commit}:{index}",
        logical=commit,
        shard=shard,
    )


# ------------------------------------------------------------------ versions
def test_versions_follow_each_sources_positions() -> None:
    def v(**fields: Any) -> Any:
        return version_of(Update.create(key={"id": 1}, table="t", after={"id": 1}, **fields))

    # PostgreSQL: (commit LSN, index + 1); a snapshot read sorts before any change at its LSN.
    assert v(op="u", connector="postgres", position="1/A0:3", logical="1/A0") == (0x1_0000_00A0, 4)
    assert v(op="r", connector="postgres", position="0/16B3748:901", logical="0/16B3748") == (
        0x16B3748,
        0,
    )
    assert v(op="r", connector="postgres", position="0/100:90000", logical="0/100") < v(
        op="u", connector="postgres", position="0/100:0", logical="0/100"
    )
    # MariaDB: (GTID sequence, index + 1); the snapshot's GTID position gives its lowest sequence.
    assert v(op="u", connector="mysql", position="bin.000002:4:1", logical="0-1-42") == (42, 2)
    assert v(op="r", connector="mysql", position="bin.000002:4:7", logical="0-1-41,1-2-7") == (7, 0)
    assert v(op="u", connector="mysql", position="b.1:4:0", logical="3E11FA47-71CA:23") is None
    # JSON-lines files: natural file order, then the offset.
    lines = [
        f"{name}:{offset}" for name in ("2.jsonl", "10.jsonl", "a/1.jsonl") for offset in (5, 40)
    ]
    versions = [v(op="c", connector="filelog", position=p, logical=p) for p in lines]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert natural_name("log.9.0") < natural_name("log.10.0") < natural_name("log.10.0b")
    assert natural_name("a") < natural_name("a1") < natural_name("b")
    # LogWriter logs: the publisher's sequence number.
    assert v(op="c", connector="filelog", position="gps/log.0.0:24", logical="gps:17") == (17,)
    # Other sources, or positions that do not parse: not comparable.
    assert v(op="c", connector="counter", position="7", logical="7") is None
    assert v(op="c", connector="postgres", position="garbage", logical="") is None
    # One number for OpenSearch's external versions, in the same order.
    assert version_number((0x16B3748, 4)) == (0x16B3748 << 16) | 4
    assert (
        version_number((0x16B3748, 4))
        < version_number((0x16B3748, 5))
        < version_number((0x16B3749, 0))
    )
    assert version_number((17,)) == 17
    assert version_number((1 << 47, 0)) is None and version_number((1, 1 << 16)) is None
    assert version_number(versions[0]) is None and version_number(None) is None


# ------------------------------------------------------------ with real runs
def test_the_index_holds_exactly_the_live_rows_and_answers_queries(tmp_path: Path) -> None:
    first = workload(keys=400, changes=1500, seed=1)
    write_lines(tmp_path / "data" / "0001.jsonl", first)
    pipeline = search_pipeline(tmp_path)
    result = run_cli("run", str(pipeline), "--once", "--json", cwd=tmp_path)
    assert result.returncode == 0, result
    assert json.loads(result.stdout)["applications"]["find"]["updates"] == len(first)
    index = tmp_path / "index" / "find"
    expected = final_table(first)
    assert indexed(index) == expected

    users = {k[1]: row for k, row in expected.items() if k[0] == "users"}
    # A word of the text field; an exact string; an integer range; a boolean; a date range.
    word = next(iter(users.values()))["name"].split()[0]
    assert {h.row["id"] for h in query(index, word, limit=10_000)} == {
        i for i, r in users.items() if word in r["name"].split()
    }
    assert {h.row["id"] for h in query(index, "city:osaka", limit=10_000)} == {
        i for i, r in users.items() if r["city"] == "osaka"
    }
    assert {h.row["id"] for h in query(index, "age:[30 TO 39]", limit=10_000)} == {
        i for i, r in users.items() if 30 <= r["age"] <= 39
    }
    assert {h.row["id"] for h in query(index, "vip:true AND _table:users", limit=10_000)} == {
        i for i, r in users.items() if r["vip"]
    }
    march = query(index, "joined:[2024-03-01T00:00:00Z TO 2024-04-01T00:00:00Z}", limit=10_000)
    assert {h.row["id"] for h in march} == {
        i for i, r in users.items() if r["joined"].startswith("2024-03-")
    }
    assert len(query(index, "_table:orders", limit=10_000)) == sum(
        1 for k in expected if k[0] == "orders"
    )

    # A later run applies only what was added: more updates, deletes and re-inserts.
    second = workload(keys=400, changes=800, seed=2)[400 + 100 :]
    write_lines(tmp_path / "data" / "0002.jsonl", second)
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    assert indexed(index) == final_table(first + second)


def _subscriber_of(run_pid: int, application: str) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == run_pid and b"subscribe" in cmdline and application.encode() in cmdline:
            return int(entry.name)
    return None


def test_kill_9_of_the_sink_subscriber_mid_stream_then_its_restart_leave_the_index_right(
    tmp_path: Path,
) -> None:
    lines = workload(keys=1200, changes=9000, seed=3)
    chunks = [lines[i : i + 200] for i in range(0, len(lines), 200)]
    data = tmp_path / "data" / "0001.jsonl"
    write_lines(data, chunks[0])
    pipeline = search_pipeline(tmp_path)
    index = tmp_path / "index" / "find"
    killed = threading.Event()

    def produce() -> None:
        for n, chunk in enumerate(chunks[1:], 1):
            if n == len(chunks) // 2:
                killed.wait(60)  # the second half only once the sink's subscriber is killed
            write_lines(data, chunk)
            time.sleep(0.02)  # a producer with a pace of its own, not a synchronisation

    run = Process("run", str(pipeline), cwd=tmp_path)
    producer = threading.Thread(target=produce)
    try:
        wait_until(lambda: _subscriber_of(run.pid, "find") is not None, 30, "the subscriber")
        victim = _subscriber_of(run.pid, "find")
        assert victim is not None
        wait_until(
            lambda: (index / "meta.json").exists() and len(query(index, "*", limit=10)) > 0,
            30,
            "the first documents in the index",
        )
        producer.start()
        # Killed while the first half is still being written and indexed.
        wait_until(lambda: len(query(index, "*", limit=2000)) >= 900, 30, "more documents")
        os.kill(victim, signal.SIGKILL)
        killed.set()
        wait_until(lambda: _subscriber_of(run.pid, "find") not in (None, victim), 30, "the restart")
        producer.join()
        end = len(lines)
        wait_until(lambda: acknowledged(tmp_path / "state-search", "find", end), 60, "the end")
    finally:
        killed.set()
        if producer.is_alive():
            producer.join()
        code = run.stop()
    assert code == 0, run.stderr
    assert "subscriber find/0 exited with code -9; restarting" in run.stderr
    assert indexed(index) == final_table(lines)


def test_a_replay_from_older_datamarkers_does_not_regress_any_document(tmp_path: Path) -> None:
    lines = workload(keys=300, changes=1200, seed=4)
    half = len(lines) // 2
    write_lines(tmp_path / "data" / "0001.jsonl", lines[:half])
    write_lines(tmp_path / "data" / "0002.jsonl", lines[half:])
    pipeline = search_pipeline(tmp_path)
    assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
    index = tmp_path / "index" / "find"
    expected = final_table(lines)
    assert indexed(index) == expected

    # The same first file, at the same positions, delivered again from the earliest datamarker:
    # what a subscriber restarting from an old datamarker sees. The state at that point differs
    # from the final table, so a last-write-wins index would go back to it.
    older = final_table(lines[:half])
    assert any(expected.get(k) != row for k, row in older.items())
    assert any(k not in expected for k in older), "the replay has no deleted row to bring back"
    replay = tmp_path / "replay"
    write_lines(replay / "data" / "0001.jsonl", lines[:half])
    replay_pipeline = write_pipeline(
        tmp_path / "replay.yml",
        {
            **json.loads(json.dumps(_load_yaml(pipeline))),
            "state_dir": str(replay / "state"),
            "source": {"type": "filelog", "path": str(replay / "data")},
        },
    )
    result = run_cli("run", str(replay_pipeline), "--once", "--json", cwd=tmp_path)
    assert result.returncode == 0, result
    assert json.loads(result.stdout)["applications"]["find"]["updates"] == half
    assert indexed(index) == expected


def _load_yaml(path: Path) -> dict[str, Any]:
    import yaml

    loaded: dict[str, Any] = yaml.safe_load(path.read_text())
    return loaded


# ---------------------------------------------------- fed to the sink directly
def test_truncates_tombstones_and_older_versions_fed_to_the_sink(tmp_path: Path) -> None:
    options = SearchOptions.model_validate(
        {"path": str(tmp_path / "{application}"), "fields": {"name": "text"}, "ids": IDS}
    )
    path = tmp_path / "find"
    sink = make_sink(options)
    sink.open(context())

    def live() -> dict[int, str]:
        return {h.row["id"]: h.row["name"] for h in query(path, "*", limit=100)}

    sink.write([pg("c", k, 0x100, k, shard=k % 2, name=f"v1 {k}") for k in range(6)])
    sink.write([pg("u", 1, 0x200, shard=1, name="v2 1"), pg("d", 2, 0x200, 1, shard=0)])
    assert live() == {0: "v1 0", 1: "v2 1", 3: "v1 3", 4: "v1 4", 5: "v1 5"}
    # Older versions after newer ones: an update and a deleted row's insert are skipped.
    sink.write([pg("u", 1, 0x100, 1, shard=1, name="v1 1"), pg("c", 2, 0x100, 2, name="v1 2")])
    assert live() == {0: "v1 0", 1: "v2 1", 3: "v1 3", 4: "v1 4", 5: "v1 5"}
    # The same version again (a redelivered batch) is applied again: same result.
    sink.write([pg("u", 1, 0x200, shard=1, name="v2 1")])
    assert live()[1] == "v2 1"
    # A truncate reaches each shard; this copy removes shard 1's rows only, and a later row
    # of the same batch stays.
    sink.write([pg("t", 0, 0x300, shard=1), pg("c", 7, 0x300, 1, shard=1, name="v3 7")])
    assert live() == {0: "v1 0", 4: "v1 4", 7: "v3 7"}
    # After a restart: a replay of rows older than the truncate stays out, a replayed copy of
    # the truncate keeps the newer row, and newer rows go in.
    sink.close()
    sink = make_sink(options)
    sink.open(context())
    sink.write(
        [
            pg("c", 3, 0x100, 3, shard=1, name="v1 3"),
            pg("t", 0, 0x300, shard=1),
            pg("u", 5, 0x400, shard=1, name="v4 5"),
        ]
    )
    assert live() == {0: "v1 0", 4: "v1 4", 5: "v4 5", 7: "v3 7"}
    # An update whose positions are not comparable (another connector): last write wins.
    other = Update.create(
        op="u", key={"id": 5}, table="users", after={"id": 5, "name": "x"}, connector="other"
    )
    sink.write([other])
    assert live()[5] == "x"
    # A template that names a column the update lacks is a fatal, clear error.
    bad = make_sink(
        SearchOptions.model_validate(
            {"path": str(tmp_path / "bad"), "ids": {"users": "user:{email}"}}
        )
    )
    bad.open(context())
    with pytest.raises(SinkError, match=r"ids\.users: template 'user:\{email\}' uses column"):
        bad.write([pg("d", 1, 0x500)])
    bad.close()
    sink.close()


def test_values_are_typed_and_ones_that_do_not_fit_stay_in_the_row_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    options = SearchOptions.model_validate({"path": str(tmp_path / "i"), "fields": FIELDS})
    sink = make_sink(options)
    sink.open(context())
    rows = [
        {"id": 1, "name": "Ada", "age": "36", "vip": "t", "joined": "2024-03-05 10:00:00+00"},
        {"id": 2, "name": ["Grace", "Hopper"], "age": 85.0, "vip": 1, "joined": 1709633000000},
        {"id": 3, "name": 42, "age": "old", "vip": "maybe", "joined": "soon", "city": None},
    ]
    sink.write([pg("c", r["id"], 0x100, r["id"], **r) for r in rows])
    path = tmp_path / "i"

    def ids(text: str) -> list[int]:
        return sorted(h.row["id"] for h in query(path, text))

    assert ids("age:[30 TO 90]") == [1, 2]
    assert ids("vip:true") == [1, 2] and ids("vip:false") == []
    assert ids("joined:[2024-03-05T00:00:00Z TO 2024-03-06T00:00:00Z}") == [1, 2]
    assert ids("hopper") == [2] and ids("name:42") == [3]
    assert query(path, '_id:"users:{\\"id\\":3}"')[0].row == {
        **rows[2],
        "id": 3,
    }
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("column age: 'old' is not a i64 value, so it is not indexed" in w for w in warnings)
    assert any("column joined: 'soon' is not a date value" in w for w in warnings)
    sink.close()
    # The fields are part of the index: other fields need a new index.
    changed = make_sink(
        SearchOptions.model_validate({"path": str(path), "fields": {"age": "text"}})
    )
    with pytest.raises(
        SinkError, match=r"sink\.fields: the index in .* was built with other fields"
    ):
        changed.open(context())


# ----------------------------------------------------------------- the CLI
def test_wormhole_search_prints_rows_and_its_errors_exit_2(tmp_path: Path) -> None:
    pipeline = search_pipeline(tmp_path)
    (tmp_path / "data").mkdir()
    before = run_cli("search", str(pipeline), "find", "ada", cwd=tmp_path)
    assert before.returncode == 2 and "no search index here yet" in before.stderr, before

    lines = workload(keys=60, changes=100, seed=5)
    write_lines(tmp_path / "data" / "0001.jsonl", lines)
    assert run_cli("run", str(pipeline), "--once", cwd=tmp_path).returncode == 0
    users = {k[1]: r for k, r in final_table(lines).items() if k[0] == "users"}
    target = next(iter(users.values()))
    word = target["name"].split()[1]

    result = run_cli("search", str(pipeline), "find", f"name:{word}", "--limit", "500")
    assert result.returncode == 0, result
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(
        i for i, r in users.items() if word in r["name"].split()
    )
    assert all(r == users[r["id"]] for r in rows)
    exact = run_cli("search", str(pipeline), "find", f"_id:user\\:{target['id']}", "--json")
    assert exact.returncode == 0, exact
    (hit,) = [json.loads(line) for line in exact.stdout.splitlines()]
    assert hit["id"] == f"user:{target['id']}" and hit["table"] == "users"
    assert hit["row"] == target and hit["score"] > 0
    limited = run_cli("search", str(pipeline), "find", "*", "--limit", "3")
    assert len(limited.stdout.splitlines()) == 3
    # The Python call gives the same rows.
    assert sorted(h.row["id"] for h in query(tmp_path / "index" / "find", f"name:{word}", 500)) == [
        r["id"] for r in sorted(rows, key=lambda r: r["id"])
    ]

    for args, message in [
        (["nope", "ada"], "APP: unknown application 'nope' (known: audit, find)"),
        (["audit", "ada"], "audit has sink jsonl, not a search sink (applications with one: find)"),
        (["find", "name:(ada"], "query 'name:(ada': Syntax Error"),
        (["find", "colour:red"], "Field does not exist: 'colour'"),
        (["find", "ada", "--limit", "0"], "--limit: must be at least 1"),
    ]:
        bad = run_cli("search", str(pipeline), *args, cwd=tmp_path)
        assert bad.returncode == 2, bad
        assert message in bad.stderr, bad
        assert "Traceback" not in bad.stderr


def test_bad_options_are_named_by_validate_and_two_writers_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def app(**sink: Any) -> dict[str, Any]:
        return {"sink": {"type": "search", **sink}}

    pipeline = write_pipeline(
        tmp_path / "bad.yml",
        {
            "pipeline": "bad",
            "source": {"type": "filelog", "path": "data"},
            "applications": {
                "a": app(path="i", fields={"age": "int64"}),
                "b": app(path="i", ids={"users": "user:{id!r}"}),
                "c": app(fields={"name": "text"}),
                "d": app(engine="opensearch", index="People"),
                "e": app(path="i", url="http://localhost:9200"),
                "f": app(path="i", fields={"age": "i64"}, default_fields=["age"]),
                "g": app(path="i/{subscriber}", writer_memory="1MiB"),
                "h": app(path="i", fields={"_id": "text"}, ids={"users": "users"}),
                "i": app(engine="opensearch", url="localhost:9200", writer_threads=2),
            },
        },
    )
    result = run_cli("validate", str(pipeline), cwd=tmp_path)
    assert result.returncode == 2, result
    for problem in [
        "applications.a.sink.fields.age: input should be 'text', 'string', 'keyword', 'i64'",
        "applications.b.sink.ids.users: template 'user:{id!r}': placeholder {id!r} must be a "
        "bare column name",
        "applications.c.sink.path: field required with engine: tantivy",
        "applications.d.sink.url: field required with engine: opensearch",
        "applications.d.sink.index: 'People' is not a valid index name",
        "applications.e.sink.url: only for engine: opensearch",
        "applications.f.sink.default_fields: 'age' is not a text, string or keyword field",
        "applications.g.sink.path: 'i/{subscriber}' has an unknown placeholder {subscriber}",
        "applications.g.sink.writer_memory: must be at least 15MB",
        "applications.h.sink.fields: '_id' cannot be a field name",
        "applications.h.sink.ids.users: template 'users' names no column",
        "applications.i.sink.url: 'localhost:9200' must be an http:// or https:// URL",
        "applications.i.sink.writer_threads: only for engine: tantivy",
    ]:
        assert problem in result.stderr, f"{problem!r} missing from:\n{result.stderr}"

    # subscribers: 2 would be two writers of one index: rejected as the file is read (validate too).
    write_lines(tmp_path / "data" / "0001.jsonl", workload(keys=5, changes=0, seed=6))
    two = search_pipeline(tmp_path, name="two")
    loaded = _load_yaml(two)
    loaded["applications"]["find"]["subscribers"] = 2
    write_pipeline(two, loaded)
    result = run_cli("run", str(two), "--once", cwd=tmp_path)
    assert result.returncode == 2, result
    assert (
        "applications.find.subscribers: the search sink's tantivy engine writes one index, and "
        "a Tantivy index has one writer; set subscribers: 1" in result.stderr
    ), result
    # A second writer of the same index directory is refused as well, after a wait for the
    # lock (for a killed subscriber's successor); shortened here.
    monkeypatch.setattr(tantivy_engine, "LOCK_WAIT_S", 0.3)
    holder = make_sink(SearchOptions.model_validate({"path": str(tmp_path / "shared")}))
    holder.open(context())
    try:
        other = make_sink(SearchOptions.model_validate({"path": str(tmp_path / "shared")}))
        with pytest.raises(SinkError, match="another process is writing the index"):
            other.open(context())
    finally:
        holder.close()


def test_the_example_pipeline_runs(tmp_path: Path) -> None:
    lines = workload(keys=50, changes=80, seed=7)
    write_lines(tmp_path / "users" / "0001.jsonl", lines)
    env = {
        "SEARCH_STATE": str(tmp_path / "state"),
        "SEARCH_DATA": str(tmp_path / "users"),
        "SEARCH_OUT": str(tmp_path / "out"),
    }
    example = str(REPO / "pipelines" / "search-index.yml")
    result = run_cli("run", example, "--once", cwd=tmp_path, env=env)
    assert result.returncode == 0, result
    expected = final_table(lines)
    assert indexed(tmp_path / "out" / "search" / "people") == expected
    city = run_cli("search", example, "people", "city:osaka", "--limit", "100", env=env)
    assert city.returncode == 0, city
    assert sorted(json.loads(line)["id"] for line in city.stdout.splitlines()) == sorted(
        k[1] for k, r in expected.items() if r.get("city") == "osaka"
    )


# ---------------------------------------------------------------- OpenSearch
class FakeOpenSearch:
    """Stands in for OpenSearch, which cannot run on this machine (no network, no package).

    A real HTTP server on a free loopback port, in a thread. It answers index creation,
    ``_bulk`` (index and delete actions with external versions, 409 on a version that is
    not higher, mapping errors for fields mapped without ``ignore_malformed``),
    ``_delete_by_query`` and ``_search`` the way OpenSearch does, and records every request.
    ``fail`` queues whole-request failures; ``fail_items`` makes items of the next bulk fail.
    """

    def __init__(self) -> None:
        self.indices: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.fail: list[tuple[int, dict[str, Any]]] = []
        self.fail_items: dict[str, tuple[int, dict[str, Any]]] = {}
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with fake.lock:
                    fake.requests.append((self.command, self.path, dict(self.headers), body))
                    status, answer = fake.answer(self.command, self.path, body)
                data = b"" if answer is None else json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_HEAD = do_PUT = do_POST = do_GET = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def docs(self, index: str) -> dict[str, tuple[int | None, dict[str, Any]]]:
        return dict(self.indices[index]["docs"])

    def bulk_bodies(self) -> list[list[dict[str, Any]]]:
        return [
            [json.loads(line) for line in body.splitlines()]
            for method, path, _, body in self.requests
            if path.startswith("/_bulk")
        ]

    # --------------------------------------------------------------- answers
    def answer(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        if self.fail and method != "HEAD":
            return self.fail.pop(0)
        parts = [p for p in path.split("?")[0].split("/") if p]
        if method == "HEAD" and len(parts) == 1:
            return (200 if parts[0] in self.indices else 404), None
        if method == "PUT" and len(parts) == 1:
            if parts[0] in self.indices:
                error = {"type": "resource_already_exists_exception", "reason": "exists"}
                return 400, {"error": error, "status": 400}
            self.create(parts[0], json.loads(body))
            return 200, {"acknowledged": True, "index": parts[0]}
        if method == "POST" and parts == ["_bulk"]:
            return 200, self.bulk(body)
        if method == "POST" and len(parts) == 2 and parts[1] == "_delete_by_query":
            docs = self.indices[parts[0]]["docs"]
            condition = json.loads(body)["query"]
            gone = [i for i, (_, source) in docs.items() if _matches(condition, source)]
            for doc_id in gone:
                del docs[doc_id]
            return 200, {"deleted": len(gone), "failures": []}
        if method == "POST" and len(parts) == 2 and parts[1] == "_search":
            request = json.loads(body)
            docs = sorted(self.indices[parts[0]]["docs"].items())[: request.get("size", 10)]
            hits = [{"_id": i, "_score": 1.0, "_source": source} for i, (_, source) in docs]
            return 200, {"hits": {"total": {"value": len(hits)}, "hits": hits}}
        return 400, {"error": {"type": "illegal_argument_exception", "reason": path}}

    def create(self, name: str, definition: dict[str, Any]) -> None:
        self.indices[name] = {"definition": definition, "docs": {}, "deleted": {}}

    def bulk(self, body: bytes) -> dict[str, Any]:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        items = []
        i = 0
        while i < len(lines):
            (op, action), *_ = lines[i].items()
            source = lines[i + 1] if op == "index" else None
            i += 2 if op == "index" else 1
            items.append(
                {
                    op: {
                        "_index": action["_index"],
                        "_id": action["_id"],
                        **self.apply(op, action, source),
                    }
                }
            )
        errors = any(next(iter(item.values()))["status"] >= 300 for item in items)
        return {"took": 1, "errors": errors, "items": items}

    def apply(self, op: str, action: dict[str, Any], source: Any) -> dict[str, Any]:
        doc_id = action["_id"]
        if doc_id in self.fail_items:
            status, error = self.fail_items.pop(doc_id)
            return {"status": status, "error": error}
        index = self.indices.setdefault(
            action["_index"], {"definition": {}, "docs": {}, "deleted": {}}
        )
        docs, deleted = index["docs"], index["deleted"]
        current = docs[doc_id][0] if doc_id in docs else deleted.get(doc_id)
        version = action.get("version")
        if version is not None:
            assert action.get("version_type") == "external", action
            if current is not None and version <= current:
                reason = (
                    f"[{doc_id}]: version conflict, current version [{current}] is higher or "
                    f"equal to the one provided [{version}]"
                )
                error = {"type": "version_conflict_engine_exception", "reason": reason}
                return {"status": 409, "error": error}
        if op == "delete":
            deleted[doc_id] = version
            if docs.pop(doc_id, None) is None:
                return {"status": 404, "result": "not_found", "_version": version}
            return {"status": 200, "result": "deleted", "_version": version}
        properties = index["definition"].get("mappings", {}).get("properties", {})
        for name, mapping in properties.items():
            value = source.get(name)
            if (
                mapping.get("type") == "long"
                and value is not None
                and not mapping.get("ignore_malformed")
            ):
                try:
                    int(value)
                except (TypeError, ValueError):
                    reason = f"failed to parse field [{name}] of type [long]"
                    return {
                        "status": 400,
                        "error": {"type": "mapper_parsing_exception", "reason": reason},
                    }
        created = doc_id not in docs
        docs[doc_id] = (version, source)
        deleted.pop(doc_id, None)
        return {"status": 201 if created else 200, "result": "created" if created else "updated"}


def _field(source: dict[str, Any], dotted: str) -> Any:
    value: Any = source
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _matches(condition: dict[str, Any], source: dict[str, Any]) -> bool:
    (kind, spec), *_ = condition.items()
    if kind == "term":
        ((name, value),) = spec.items()
        return bool(_field(source, name) == value)
    if kind == "range":
        ((name, bounds),) = spec.items()
        value = _field(source, name)
        return value is not None and value < bounds["lt"]
    if kind == "exists":
        return _field(source, spec["field"]) is not None
    if kind == "bool":
        ok = all(_matches(c, source) for c in spec.get("filter", []))
        must_not = spec.get("must_not")
        if must_not is not None:
            ok = ok and not _matches(must_not, source)
        if "should" in spec:
            ok = ok and sum(_matches(c, source) for c in spec["should"]) >= spec.get(
                "minimum_should_match", 1
            )
        return ok
    raise AssertionError(f"the fake does not know {kind}")


@pytest.fixture
def opensearch() -> Any:
    server = FakeOpenSearch()
    yield server
    server.stop()


def _opensearch_sink(url: str, **options: Any) -> Any:
    sink = make_sink(
        SearchOptions.model_validate(
            {"engine": "opensearch", "url": url, "fields": FIELDS, "ids": IDS, **options}
        )
    )
    sink.open(context("Find"))
    return sink


def test_opensearch_bulk_requests_use_external_versions_so_replays_never_regress(
    opensearch: FakeOpenSearch,
) -> None:
    sink = _opensearch_sink(opensearch.url, username="wormhole", password="s3cret")
    sink.write([pg("c", k, 0x100, k, shard=k % 2, name=f"v1 {k}", age=20 + k) for k in range(4)])
    sink.write(
        [
            pg("u", 1, 0x200, 0, shard=1, name="v2 1"),
            pg("u", 1, 0x200, 1, shard=1, name="v3 1"),  # one action per id and bulk: the last
            pg("d", 2, 0x200, 2),
        ]
    )
    # The index was created with a mapping from the fields, under the application's name.
    definition = opensearch.indices["find"]["definition"]
    assert definition["mappings"]["properties"]["age"] == {"type": "long", "ignore_malformed": True}
    assert definition["mappings"]["properties"]["city"] == {"type": "keyword"}
    assert definition["settings"] == {"index": {"gc_deletes": "1d"}}
    bodies = opensearch.bulk_bodies()
    assert bodies[1] == [
        {
            "index": {
                "_index": "find",
                "_id": "user:1",
                "version": (0x200 << 16) | 2,
                "version_type": "external",
            }
        },
        {
            "id": 1,
            "name": "v3 1",
            "@wormhole": {"table": "users", "shard": 1, "version": (0x200 << 16) | 2},
        },
        {
            "delete": {
                "_index": "find",
                "_id": "user:2",
                "version": (0x200 << 16) | 3,
                "version_type": "external",
            }
        },
    ]
    headers = next(h for m, p, h, _ in opensearch.requests if p == "/_bulk")
    assert headers["Content-Type"] == "application/x-ndjson"
    assert headers["Authorization"] == "Basic d29ybWhvbGU6czNjcmV0"

    def names() -> dict[str, str]:
        return {i: source["name"] for i, (_, source) in opensearch.docs("find").items()}

    assert names() == {"user:0": "v1 0", "user:1": "v3 1", "user:3": "v1 3"}
    # A replay of older updates: every action comes back 409, which counts as done.
    sink.write([pg("c", k, 0x100, k, shard=k % 2, name=f"v1 {k}", age=20 + k) for k in range(4)])
    assert names() == {"user:0": "v1 0", "user:1": "v3 1", "user:3": "v1 3"}
    # A truncate of shard 1 deletes that shard's older documents only.
    sink.write([pg("c", 5, 0x400, 0, shard=1, name="v4 5"), pg("t", 0, 0x300, 0, shard=1)])
    assert names() == {"user:0": "v1 0", "user:5": "v4 5"}
    query_body = json.loads(opensearch.requests[-1][3])
    assert {"term": {"@wormhole.shard": 1}} in query_body["query"]["bool"]["filter"]
    sink.close()


def test_opensearch_failures_retry_or_stop_as_they_should(opensearch: FakeOpenSearch) -> None:
    sink = _opensearch_sink(opensearch.url)
    batch = [pg("c", 1, 0x100, name="one", age=30)]
    # 5xx and 429, for the request or for one item: an ordinary exception, so the
    # subscriber retries the batch with backoff; the retry then succeeds.
    opensearch.fail.append((503, {"error": {"type": "unavailable", "reason": "busy"}}))
    with pytest.raises(OpenSearchUnavailable, match="HTTP 503"):
        sink.write(batch)
    opensearch.fail_items["user:1"] = (429, {"type": "es_rejected_execution_exception"})
    with pytest.raises(OpenSearchUnavailable, match="1 actions to retry"):
        sink.write(batch)
    block = {"type": "cluster_block_exception", "reason": "index read-only (disk full)"}
    opensearch.fail_items["user:1"] = (403, block)
    with pytest.raises(OpenSearchUnavailable, match="cluster_block_exception"):
        sink.write(batch)
    sink.write(batch)
    assert opensearch.docs("find")["user:1"][1]["name"] == "one"
    # A mapping error is fatal and says what to fix.
    opensearch.fail_items["user:1"] = (
        400,
        {"type": "mapper_parsing_exception", "reason": "failed to parse field [age]"},
    )
    with pytest.raises(SinkError, match=r"refused document 'user:1' .*mapper_parsing_exception"):
        sink.write([pg("u", 1, 0x200, name="one", age="thirty")])
    # Bad credentials are fatal, and so is a missing index the sink may not create.
    opensearch.fail.append((401, {"error": {"type": "security_exception", "reason": "no"}}))
    with pytest.raises(SinkError, match="check username, password or api_key"):
        sink.write(batch)
    missing = {"type": "index_not_found_exception", "reason": "no such index [find]"}
    opensearch.fail_items["user:1"] = (404, missing)
    with pytest.raises(SinkError, match=r"index 'find' does not exist .*set create_index: true"):
        sink.write(batch)
    sink.close()
    # A cluster that cannot be reached: a connection error, retried.
    stopped = FakeOpenSearch()
    url = stopped.url
    stopped.stop()
    unreachable = _opensearch_sink(url)
    with pytest.raises(OSError):
        unreachable.write(batch)
    assert not isinstance(OSError(), SinkError)
    unreachable.close()


def test_opensearch_engine_in_a_pipeline_and_wormhole_search(
    tmp_path: Path, opensearch: FakeOpenSearch
) -> None:
    # LogWriter logs: each update's version is the publisher's sequence number.
    with LogWriter(tmp_path / "data" / "app", publisher_id="app", batch_size=100) as writer:
        for key in range(40):
            writer.publish("users", {"id": key}, {"id": key, "name": f"user {key}", "age": key})
        for key in range(0, 40, 4):
            writer.publish("users", {"id": key}, None, op="d")
        for key in range(1, 40, 4):
            writer.publish("users", {"id": key}, {"id": key, "name": f"renamed {key}", "age": key})
    opensearch.create(
        "people-find",
        {"mappings": {"properties": {"age": {"type": "long", "ignore_malformed": True}}}},
    )
    pipeline = write_pipeline(
        tmp_path / "os.yml",
        {
            "pipeline": "os",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path / "data")},
            "applications": {
                "find": {
                    "sink": {
                        "type": "search",
                        "engine": "opensearch",
                        "url": opensearch.url,
                        "index": "people-{application}",
                        "ids": IDS,
                        "create_index": False,
                    },
                    "subscribers": 2,
                }
            },
        },
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    docs = opensearch.docs("people-find")
    expected = {
        f"user:{k}": (f"renamed {k}" if k % 4 == 1 else f"user {k}") for k in range(40) if k % 4
    }
    assert {i: source["name"] for i, (_, source) in docs.items()} == expected
    assert all(
        version is not None and source["@wormhole"]["version"] == version
        for version, source in docs.values()
    )
    found = run_cli("search", str(pipeline), "find", "name:renamed", "--limit", "5", "--json")
    assert found.returncode == 0, found
    hits = [json.loads(line) for line in found.stdout.splitlines()]
    assert len(hits) == 5 and all("@wormhole" not in h["row"] for h in hits)
    assert all(h["row"]["name"] == expected[h["id"]] and h["table"] == "users" for h in hits)
    request = json.loads(opensearch.requests[-1][3])
    assert request == {"query": {"query_string": {"query": "name:renamed"}}, "size": 5}
