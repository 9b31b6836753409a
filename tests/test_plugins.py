from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from wormhole.testing import run_cli, write_pipeline

EXAMPLE = Path(__file__).parent / "plugin_example"


@pytest.fixture(scope="module")
def example_plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example third-party plugin package, really installed (pip) into a site dir."""
    site = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--target",
            str(site),
            str(EXAMPLE),
        ],
        check=True,
        capture_output=True,
        cwd=build,
    )
    assert list(site.glob("wormhole_example_plugin-0.1.0.dist-info"))
    return site


def site_env(site: Path) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


def test_plugins_lists_built_ins_by_kind_with_their_distribution() -> None:
    result = run_cli("plugins", env={"WORMHOLE_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert result.returncode == 0, result
    out = result.stdout
    for kind in (
        "sources:",
        "sinks:",
        "filters:",
        "transports:",
        "position mappers:",
        "datamarker stores:",
    ):
        assert kind in out
    sinks = out.split("sinks:")[1].split("filters:")[0]
    assert "jsonl" in sinks and "[wormhole-cdc 0.1.0]" in sinks
    listing = json.loads(run_cli("plugins", "--json").stdout)
    assert listing["source"]["filelog"]["distribution"] == "wormhole-cdc"
    assert "path" in listing["source"]["filelog"]["options"]["properties"]


def test_the_built_in_commands_come_through_the_hook_plugins_use() -> None:
    """Each built-in command is a ``wormhole_commands`` plugin, as the search connector's
    ``wormhole search`` is; the built-ins are listed first, in their order, and a parser built
    again in the same process has each command once."""
    import argparse

    from wormhole.cli import COMMANDS, build_parser
    from wormhole.plugins.manager import default_registry

    def command_names() -> list[str]:
        parser = build_parser()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return list(sub.choices)

    names = command_names()
    hook = default_registry().pm.hook.wormhole_commands
    plugins = {default_registry().pm.get_name(impl.plugin) for impl in hook.get_hookimpls()}
    assert {*COMMANDS, "wormhole.connectors.search"} <= plugins
    built_in = ["run", "publish", "subscribe", "validate", "plugins", "status", "top", "forget"]
    built_in += ["apps", "dead-letters", "backfill"]
    assert names[: len(built_in)] == built_in
    assert "search" in names[len(built_in) :]
    assert command_names() == names


def test_a_third_party_plugin_package_runs_from_a_pipeline_file(
    tmp_path: Path, example_plugin_site: Path
) -> None:
    env = site_env(example_plugin_site)
    listed = run_cli("plugins", env=env)
    assert listed.returncode == 0, listed
    assert "csv" in listed.stdout and "[wormhole-example-plugin 0.1.0]" in listed.stdout
    assert "key-range" in listed.stdout

    data = tmp_path / "data" / "users"
    data.mkdir(parents=True)
    (data / "1.jsonl").write_text(
        "".join(
            json.dumps({"key": {"id": i}, "after": {"id": i, "name": f"u{i}"}}) + "\n"
            for i in range(20)
        )
    )
    pipeline = write_pipeline(
        tmp_path / "p.yml",
        {
            "pipeline": "plug",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path / "data" / "users")},
            "applications": {
                "export": {
                    "filter": {
                        "plugins": [{"type": "key-range", "column": "id", "low": 5, "high": 9}]
                    },
                    "sink": {"type": "csv", "path": str(tmp_path / "export.csv")},
                }
            },
        },
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, env=env)
    assert result.returncode == 0, result
    with open(tmp_path / "export.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["key"] for r in rows] == [f"id={i}" for i in range(5, 10)]
    assert json.loads(rows[0]["after"]) == {"id": 5, "name": "u5"}
    assert {r["table"] for r in rows} == {"users"}

    # The plugin's options are validated like the built-ins'.
    bad = write_pipeline(
        tmp_path / "bad.yml",
        {
            "pipeline": "plug",
            "source": {"type": "filelog", "path": "x"},
            "applications": {"export": {"sink": {"type": "csv", "path": "x.csv", "quote": "all"}}},
        },
    )
    result = run_cli("validate", str(bad), env=env)
    assert result.returncode == 2
    assert "applications.export.sink.quote: unknown option (known: path, header)" in result.stderr

    # With autoload off, the entry point is not loaded and the type is unknown.
    result = run_cli(
        "validate", str(pipeline), env={**env, "WORMHOLE_DISABLE_PLUGIN_AUTOLOAD": "1"}
    )
    assert result.returncode == 2
    known = "(known: jsonl, latest, memcache, null, search, spark)"
    assert f"unknown sink type 'csv' {known}" in result.stderr


def test_two_plugins_claiming_one_name_is_an_error_naming_both(tmp_path: Path) -> None:
    (tmp_path / "clash.py").write_text(
        "from wormhole.plugins.components import ComponentSpec\n"
        "from wormhole.plugins.hookspecs import hookimpl\n"
        "from wormhole.connectors.null import NullSink\n"
        "@hookimpl\n"
        "def wormhole_sinks():\n"
        "    return [ComponentSpec('sink', 'jsonl', NullSink)]\n"
    )
    result = run_cli(
        "plugins",
        env={"PYTHONPATH": str(tmp_path), "WORMHOLE_PLUGINS": "clash"},
    )
    assert result.returncode == 2, result
    assert "sink 'jsonl' is provided twice: by wormhole-cdc and by clash" in result.stderr


def test_an_unimportable_plugin_module_is_named(tmp_path: Path) -> None:
    result = run_cli("plugins", env={"WORMHOLE_PLUGINS": "no_such_module_here"})
    assert result.returncode == 2
    assert "WORMHOLE_PLUGINS names 'no_such_module_here', which cannot be imported" in result.stderr


def test_a_third_party_source_with_its_own_position_mapper_gets_replay_safe_search(
    tmp_path: Path, example_plugin_site: Path
) -> None:
    """The search sink orders a plugin source's updates per key through the plugin's own
    position mapper: a replay of older entries does not regress the index."""
    from test_search import FIELDS, IDS, final_table, indexed, workload

    env = site_env(example_plugin_site)
    lines = [{**line, "n": n} for n, line in enumerate(workload(keys=200, changes=800, seed=9))]
    half = len(lines) // 2

    def run(name: str, entries: list[dict[str, object]]) -> None:
        ledger = tmp_path / f"{name}.ledger"
        ledger.write_text("".join(json.dumps(e) + "\n" for e in entries))
        pipeline = write_pipeline(
            tmp_path / f"{name}.yml",
            {
                "pipeline": name,
                "state_dir": str(tmp_path / f"state-{name}"),
                "source": {"type": "ledger", "path": str(ledger)},
                "transport": {"type": "inprocess"},
                "applications": {
                    "find": {
                        "sink": {
                            "type": "search",
                            "path": str(tmp_path / "index"),
                            "fields": FIELDS,
                            "ids": IDS,
                        }
                    }
                },
            },
        )
        result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, env=env)
        assert result.returncode == 0, result

    run("all", lines)
    expected = final_table(lines)
    assert indexed(tmp_path / "index") == expected
    older = final_table(lines[:half])
    assert any(expected.get(k) != row for k, row in older.items())
    # The first half again, from a fresh state: a subscriber replaying from old datamarkers.
    run("replay", lines[:half])
    assert indexed(tmp_path / "index") == expected


def test_a_third_party_transport_runs_its_own_subscribers(
    tmp_path: Path, example_plugin_site: Path
) -> None:
    """`wormhole run` starts subscriber processes for a plugin transport that declares
    `subscriber_processes` (the engine starts them, not the transport), and `wormhole
    subscribe` runs them through the transport's own `subscribe`."""
    env = site_env(example_plugin_site)
    data = tmp_path / "data"
    data.mkdir()
    (data / "1.jsonl").write_text(
        "".join(
            json.dumps({"key": {"id": i % 7}, "after": {"id": i % 7, "n": i}}) + "\n"
            for i in range(300)
        )
    )
    out = tmp_path / "out.jsonl"
    pipeline = write_pipeline(
        tmp_path / "p.yml",
        {
            "pipeline": "outbox",
            "state_dir": str(tmp_path / "state"),
            "dataset": {"shards": 4},
            "source": {"type": "filelog", "path": str(data)},
            "transport": {"type": "outbox", "path": str(tmp_path / "outbox")},
            "applications": {"copy": {"sink": {"type": "jsonl", "path": str(out)}}},
        },
    )
    result = run_cli("run", str(pipeline), "--once", "--json", cwd=tmp_path, env=env)
    assert result.returncode == 0, result
    assert json.loads(result.stdout)["applications"]["copy"]["lag"] == 0
    from wormhole.testing import read_envelopes

    ns: dict[int, list[int]] = {}
    for e in read_envelopes(out):
        ns.setdefault(e["key"]["id"], []).append(e["after"]["n"])
    assert ns == {k: list(range(k, 300, 7)) for k in range(7)}


def test_the_public_names_of_the_package_import() -> None:
    import wormhole

    for name in wormhole.__all__:
        assert getattr(wormhole, name) is not None, name
    flow = wormhole.Flow("search", 3)
    assert (flow.application, flow.shard) == ("search", 3)


def test_a_third_party_datamarker_store_keeps_the_datamarkers(
    tmp_path: Path, example_plugin_site: Path
) -> None:
    """A run resumes from the datamarkers a plugin store kept, and status and forget use it."""
    from wormhole.testing import read_envelopes

    env = site_env(example_plugin_site)
    data = tmp_path / "data"
    data.mkdir()

    def append(start: int, count: int) -> None:
        with open(data / "1.jsonl", "a") as f:
            for i in range(start, start + count):
                f.write(json.dumps({"key": {"id": i}, "after": {"id": i}}) + "\n")

    def pipeline(*apps: str) -> Path:
        return write_pipeline(
            tmp_path / "p.yml",
            {
                "pipeline": "store",
                "state_dir": str(tmp_path / "state"),
                "dataset": {"shards": 4},
                "source": {"type": "filelog", "path": str(data)},
                "transport": {"type": "inprocess"},
                "delivery": {"store": {"type": "jsonfile"}},
                "applications": {
                    a: {"sink": {"type": "jsonl", "path": str(tmp_path / f"{a}.jsonl")}}
                    for a in apps
                },
            },
        )

    append(0, 50)
    assert run_cli("run", str(pipeline("a", "b")), "--once", cwd=tmp_path, env=env).returncode == 0
    stored = json.loads((tmp_path / "state" / "datamarkers.json").read_text())
    assert sum(stored["datamarkers"][f"a/{s}"] for s in range(4)) > 0
    append(50, 25)
    assert run_cli("run", str(pipeline("a", "b")), "--once", cwd=tmp_path, env=env).returncode == 0
    assert [e["key"]["id"] for e in read_envelopes(tmp_path / "a.jsonl")] == list(range(75))
    status = json.loads(
        run_cli("status", str(pipeline("a")), "--json", cwd=tmp_path, env=env).stdout
    )
    assert [r["application"] for r in status["removed_applications"]] == ["b"]
    assert run_cli("forget", str(pipeline("a")), "b", cwd=tmp_path, env=env).returncode == 0
    stored = json.loads((tmp_path / "state" / "datamarkers.json").read_text())
    assert not any(k.startswith("b/") for k in stored["datamarkers"])


LIBRARY = """
import json, sys, threading
from wormhole.core.errors import ConfigError
from wormhole.plugins.engine import load_pipeline, log_range, open_registry, read_log_range

ENGINE = ("wormhole.core.engine", "wormhole.core.pipeline", "wormhole.core.offline_log",
          "wormhole.core.registry")
engine_before = sorted(m for m in sys.modules if m in ENGINE)
pipeline = load_pipeline(sys.argv[1])
app = pipeline.applications["analytics"]
log = pipeline.state_dir / "log"
first, end = log_range(log)
rows = [[seq, u.key["id"], u.shard] for seq, u in read_log_range(log, 2, end)]
try:
    list(read_log_range(log, 0, end + 3))
    past = ""
except LookupError as exc:
    past = str(exc)
registry = open_registry(sys.argv[2], pipeline.name, threading.Event())
seen, live = threading.Event(), []

def changed(entries):
    live[:] = [[e.datastore, e.address] for e in entries]
    if entries:
        seen.set()

registry.watch_publishers(changed)
seen.wait(30)
registry.close()
try:
    open_registry("nosuch://h:1/x", pipeline.name, threading.Event())
    bad = ""
except ConfigError as exc:
    bad = str(exc)
print(json.dumps({
    "engine_before": engine_before,
    "pipeline": [pipeline.name, pipeline.shards, pipeline.datastore, app.external],
    "range": [first, end], "rows": rows, "past": past, "live": live, "bad": bad,
}))
"""


def test_a_library_started_outside_a_command_reaches_the_engine_through_the_contract(
    tmp_path: Path, zookeeper_server: Any
) -> None:
    """What KafkaSubscriber.from_pipeline, the Spark data source (in a fresh executor) and
    wormhole.Subscriber(registry=...) use, in a fresh process that imports only the contract:
    a pipeline file loaded, the publisher log's extent and a range of it read from its files,
    and a registry opened from a URL; the engine is loaded on first use, not by the import."""
    from wormhole.core.publisher_log import PublisherLog
    from wormhole.core.registry import open_registry, registry_component
    from wormhole.core.update import Update
    from wormhole.plugins.components import PublisherEntry

    state = tmp_path / "state"
    pipeline = write_pipeline(
        tmp_path / "lib.yml",
        {
            "pipeline": "lib",
            "state_dir": str(state),
            "dataset": {"shards": 4},
            "source": {"type": "filelog", "path": str(tmp_path / "data")},
            "applications": {"analytics": {"external": True}},
        },
    )
    plog = PublisherLog(state / "log")
    plog.open()
    written = [
        Update.create(op="c", key={"id": i}, table="t", after={"id": i}, shard=i % 4)
        for i in range(6)
    ]
    plog.append(written, {"pos": 1})
    plog.close()
    url = f"zookeeper://{zookeeper_server.hosts}/library"
    publisher = open_registry(registry_component(url), "lib", threading.Event())
    try:
        publisher.register_publisher(PublisherEntry(datastore="lib", address="127.0.0.1:7001"))
        result = subprocess.run(
            [sys.executable, "-c", LIBRARY, str(pipeline), url],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "WORMHOLE_DISABLE_PLUGIN_AUTOLOAD": "1"},
        )
    finally:
        publisher.close()
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["engine_before"] == []
    assert out["pipeline"] == ["lib", 4, "lib", True]
    assert out["range"] == [0, 6]
    assert out["rows"] == [[i, i, written[i].shard] for i in range(2, 6)]
    assert "updates 6 to 8 are not in the log" in out["past"]
    assert out["live"] == [["lib", "127.0.0.1:7001"]]
    assert "unknown registry type 'nosuch'" in out["bad"]
