"""Prometheus metrics: the endpoints of a running publisher and its subscribers, checked by
``promtool`` and scraped by a real Prometheus server; source lag of real PostgreSQL and
MariaDB sources; ``--log-format json``."""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from wormhole.core.pipeline import parse_pipeline
from wormhole.plugins.components import SourceContext
from wormhole.testing import free_port, run_cli, start_cli, wait_until, write_pipeline
from wormhole.testing.prometheus import check_config, check_metrics, check_rules, sample, scrape

DOCS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"


def _ports(count: int) -> int:
    """A port P with P .. P+count-1 free on 127.0.0.1."""
    for _ in range(100):
        base = free_port()
        if base + count > 65535:
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise AssertionError("no run of free ports")


def _write_rows(path: Path, first: int, count: int) -> None:
    with open(path, "a") as f:
        for i in range(first, first + count):
            f.write(
                json.dumps(
                    {
                        "table": "riders",
                        "op": "u" if i % 3 else "c",
                        "key": {"id": i % 97},
                        "after": {"id": i % 97, "n": i},
                    }
                )
                + "\n"
            )


def _pipeline(tmp_path: Path, transport: dict[str, Any], **extra: Any) -> Path:
    (tmp_path / "data" / "riders").mkdir(parents=True, exist_ok=True)
    return write_pipeline(
        tmp_path / "p.yml",
        {
            "pipeline": "m",
            "state_dir": str(tmp_path / "state"),
            "dataset": {"shards": 4},
            "source": {"type": "filelog", "path": str(tmp_path / "data" / "riders")},
            "transport": transport,
            "applications": {
                "out": {
                    "sink": {"type": "jsonl", "path": str(tmp_path / "out-{subscriber}.jsonl")},
                    "subscribers": 2,
                }
            },
            **extra,
        },
    )


def _scraped(address: str, timeout: float = 60) -> str:
    """The exposition at ``address`` once the endpoint answers."""
    found: list[str] = []

    def answers() -> bool:
        try:
            found.append(scrape(address, timeout=2))
            return True
        except OSError:
            return False

    wait_until(answers, timeout, f"metrics at {address}")
    return found[-1]


def _stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    return err


@pytest.fixture
def running(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts; stopped (SIGTERM, then waited for) afterwards."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def test_publisher_and_its_subscriber_processes_serve_metrics_promtool_accepts(
    tmp_path: Path, running: list[subprocess.Popen[str]]
) -> None:
    pipeline = _pipeline(tmp_path, {"type": "tcp", "listen": "127.0.0.1:0"})
    _write_rows(tmp_path / "data" / "riders" / "0001.jsonl", 0, 300)
    base = _ports(3)
    proc = start_cli("run", str(pipeline), "--metrics", f"127.0.0.1:{base}", cwd=tmp_path)
    running.append(proc)
    publisher = f"127.0.0.1:{base}"

    def acknowledged() -> bool:
        text = scrape(publisher) if proc.poll() is None else ""
        return (
            sample(text, "wormhole_application_acknowledged_updates_total") == 300
            and sample(text, "wormhole_application_lag_updates", application="out") == 0
            and sample(text, "wormhole_application_subscribers", application="out") == 2
        )

    _scraped(publisher)
    wait_until(acknowledged, 60, "300 updates acknowledged, as the publisher's metrics say")
    text = scrape(publisher)
    checked = check_metrics(text)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert sample(text, "wormhole_source_updates_total", table="riders", op="c") == 100
    assert sample(text, "wormhole_source_updates_total", table="riders", op="u") == 200
    assert sample(text, "wormhole_source_lag_bytes", source="filelog") == 0
    assert sample(text, "wormhole_log_end_position") == 300
    assert sample(text, "wormhole_log_segments") == 1
    assert (sample(text, "wormhole_log_bytes") or 0) > 300 * 40
    assert sample(text, "wormhole_log_first_position") == 0
    assert sample(text, "wormhole_application_lag_updates", application="out") == 0
    assert sample(text, "wormhole_application_lag_seconds", application="out") == 0
    assert sample(text, "wormhole_application_subscribers", application="out") == 2
    for shard in range(4):
        labels = {"application": "out", "shard": str(shard)}
        assert sample(text, "wormhole_flow_acknowledged_position", **labels) == 300
        assert sample(text, "wormhole_flow_lag_updates", **labels) == 0
    assert sample(text, "wormhole_caravans") == 1
    assert sample(text, "wormhole_application_caravan_lag_updates", application="out") == 0
    # Each subscriber process serves its own endpoint, on the ports after the publisher's.
    written = 0.0
    for port in (base + 1, base + 2):
        sub = _scraped(f"127.0.0.1:{port}")
        checked = check_metrics(sub)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        written += sample(sub, "wormhole_sink_updates_total", application="out") or 0
        batches = sample(sub, "wormhole_sink_write_seconds_count", application="out") or 0
        inf = sample(sub, "wormhole_sink_write_seconds_bucket", application="out", le="+Inf")
        assert inf == batches
    assert written == 300
    assert _stop(proc) is not None and proc.returncode == 0


def test_prometheus_scrapes_a_running_pipeline_and_answers_for_its_lag(
    tmp_path: Path, prometheus_server: Any, running: list[subprocess.Popen[str]]
) -> None:
    tcp_port, metrics, sub_metrics = free_port(), free_port(), free_port()
    pipeline = _pipeline(
        tmp_path,
        {"type": "tcp", "listen": f"127.0.0.1:{tcp_port}"},
        metrics={"listen": f"127.0.0.1:{metrics}"},
    )
    data = tmp_path / "data" / "riders" / "0001.jsonl"
    _write_rows(data, 0, 100)
    publisher = start_cli("publish", str(pipeline), cwd=tmp_path)
    running.append(publisher)
    subscriber = start_cli(
        "subscribe", str(pipeline), "--app", "out", "--metrics", f"127.0.0.1:{sub_metrics}",
        cwd=tmp_path,
    )  # fmt: skip
    running.append(subscriber)
    prometheus_server.scrape(f"127.0.0.1:{metrics}", f"127.0.0.1:{sub_metrics}")
    lag = 'wormhole_application_lag_updates{application="out"}'

    def value(expected: float) -> Any:
        return lambda result: len(result) == 1 and float(result[0]["value"][1]) == expected

    prometheus_server.wait_for(lag, value(0), timeout=90)
    prometheus_server.wait_for(
        'wormhole_source_updates_total{table="riders"}',
        lambda r: sum(float(x["value"][1]) for x in r) == 100,
    )
    prometheus_server.wait_for(
        'wormhole_sink_updates_total{application="out"}', value(100), timeout=60
    )
    # The subscriber stops: what is written meanwhile is behind, in updates and in time.
    assert _stop(subscriber) is not None
    _write_rows(data, 100, 50)
    prometheus_server.wait_for(lag, value(50))
    behind = prometheus_server.wait_for(
        'max(wormhole_flow_lag_seconds{application="out"})',
        lambda r: len(r) == 1 and float(r[0]["value"][1]) >= 1.0,
    )
    assert behind
    prometheus_server.wait_for('wormhole_source_lag_bytes{source="filelog"}', value(0))
    # It comes back and catches up.
    running.append(start_cli("subscribe", str(pipeline), "--app", "out", cwd=tmp_path))
    prometheus_server.wait_for(lag, value(0))
    prometheus_server.wait_for('max(wormhole_flow_lag_seconds{application="out"})', value(0))


def test_flow_series_can_be_turned_off(
    tmp_path: Path, running: list[subprocess.Popen[str]]
) -> None:
    port = free_port()
    pipeline = _pipeline(
        tmp_path,
        {"type": "inprocess"},
        metrics={"listen": f"127.0.0.1:{port}", "flows": False},
    )
    _write_rows(tmp_path / "data" / "riders" / "0001.jsonl", 0, 20)
    proc = start_cli("run", str(pipeline), cwd=tmp_path)
    running.append(proc)
    address = f"127.0.0.1:{port}"
    _scraped(address)
    wait_until(
        lambda: sample(scrape(address), "wormhole_application_acknowledged_updates_total") == 20,
        60,
        "20 updates acknowledged",
    )
    text = scrape(address)
    assert "wormhole_flow_" not in text
    assert sample(text, "wormhole_application_lag_updates", application="out") == 0
    # In-process subscribers: the sink's figures are the publisher's process's.
    assert sample(text, "wormhole_sink_updates_total", application="out") == 20


def test_a_failed_application_and_its_error_are_counted(
    tmp_path: Path, running: list[subprocess.Popen[str]]
) -> None:
    port = free_port()
    pipeline = _pipeline(tmp_path, {"type": "inprocess"}, metrics={"listen": f"127.0.0.1:{port}"})
    raw = yaml.safe_load(pipeline.read_text())
    raw["applications"]["broken"] = {
        "filter": {"where": "nosuch = 1"},
        "sink": {"type": "jsonl", "path": str(tmp_path / "broken.jsonl")},
    }
    write_pipeline(pipeline, raw)
    _write_rows(tmp_path / "data" / "riders" / "0001.jsonl", 0, 10)
    proc = start_cli("run", str(pipeline), cwd=tmp_path)
    running.append(proc)
    address = f"127.0.0.1:{port}"
    _scraped(address)

    def failed() -> bool:
        text = scrape(address)
        return sample(text, "wormhole_application_failed", application="broken") == 1

    wait_until(failed, 60, "application broken reported failed")
    text = scrape(address)
    assert sample(text, "wormhole_application_failed", application="out") == 0
    assert (sample(text, "wormhole_errors_total", logger="wormhole.hub") or 0) >= 1


def test_a_subscriber_counts_its_reconnects(
    tmp_path: Path, running: list[subprocess.Popen[str]]
) -> None:
    tcp_port, sub_metrics = free_port(), free_port()
    pipeline = _pipeline(tmp_path, {"type": "tcp", "listen": f"127.0.0.1:{tcp_port}"})
    _write_rows(tmp_path / "data" / "riders" / "0001.jsonl", 0, 10)
    publisher = start_cli("publish", str(pipeline), cwd=tmp_path)
    subscriber = start_cli(
        "subscribe", str(pipeline), "--app", "out", "--metrics", f"127.0.0.1:{sub_metrics}",
        cwd=tmp_path,
    )  # fmt: skip
    running.extend([publisher, subscriber])
    address = f"127.0.0.1:{sub_metrics}"
    wait_until(
        lambda: sample(_scraped(address), "wormhole_sink_updates_total", application="out") == 10,
        60,
        "10 updates written by the subscriber",
    )

    def reconnects() -> float:
        found = sample(scrape(address), "wormhole_reconnects_total", logger="wormhole.subscriber")
        return found or 0

    # The subscriber may have started before the publisher listened: those count too.
    before = reconnects()
    assert _stop(publisher) is not None and publisher.returncode == 0
    wait_until(lambda: reconnects() >= before + 1, 60, "the subscriber counting a reconnect")
    retries = sample(scrape(address), "wormhole_retries_total", logger="wormhole.subscriber")
    assert (retries or 0) >= 1
    running.append(start_cli("publish", str(pipeline), cwd=tmp_path))
    _write_rows(tmp_path / "data" / "riders" / "0001.jsonl", 10, 5)
    wait_until(
        lambda: sample(scrape(address), "wormhole_sink_updates_total", application="out") == 15,
        60,
        "the 5 new updates written after the reconnect",
    )


def test_a_metrics_port_in_use_is_a_clear_error_naming_the_option(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        pipeline = _pipeline(
            tmp_path, {"type": "inprocess"}, metrics={"listen": f"127.0.0.1:{port}"}
        )
        _write_rows(tmp_path / "data" / "riders" / "0001.jsonl", 0, 5)
        result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
        assert result.returncode == 2, result
        assert f"metrics.listen: cannot serve metrics on 127.0.0.1:{port}" in result.stderr
        assert "in use" in result.stderr
        result = run_cli(
            "run", str(pipeline), "--once", "--metrics", f"127.0.0.1:{port}", cwd=tmp_path
        )
        assert result.returncode == 2, result
        assert f"--metrics: cannot serve metrics on 127.0.0.1:{port}" in result.stderr
        result = run_cli(
            "subscribe", str(pipeline), "--app", "out", "--metrics", f"127.0.0.1:{port}",
            cwd=tmp_path,
        )  # fmt: skip
        assert result.returncode == 2, result
        assert "--metrics: cannot serve metrics" in result.stderr


def test_a_bad_metrics_address_is_named(tmp_path: Path) -> None:
    pipeline = _pipeline(tmp_path, {"type": "inprocess"}, metrics={"listen": "localhost"})
    result = run_cli("validate", str(pipeline), cwd=tmp_path)
    assert result.returncode == 2, result
    assert "metrics.listen" in result.stderr and "HOST:PORT" in result.stderr
    pipeline = _pipeline(tmp_path, {"type": "inprocess"})
    result = run_cli("run", str(pipeline), "--once", "--metrics", "9464", cwd=tmp_path)
    assert result.returncode == 2, result
    assert "--metrics: '9464' is not HOST:PORT" in result.stderr


# ------------------------------------------------------------------ source lag
def _open_source(text: str, state: Path) -> Any:
    pipeline = parse_pipeline(text, "lag.yml", env={})
    source = pipeline.source.create()
    context = SourceContext("lag", state, 4, threading.Event(), logging.getLogger("test"))
    source.open(context, None)
    return source


def _catch_up(source: Any, name: str = "lag_bytes", timeout: float = 60) -> dict[str, float]:
    """Read and confirm (as the tailer does once the publisher log holds a batch) until the
    source reports no lag."""
    deadline = time.monotonic() + timeout
    while True:
        batch = source.read(0.2)
        if batch is not None:
            source.confirm(batch.checkpoint)
        lag: dict[str, float] = source.lag()
        if lag.get(name) == 0:
            return lag
        assert time.monotonic() < deadline, f"{name} still {lag} after {timeout}s"


def test_postgres_source_lag_grows_with_unread_wal_and_returns_to_zero(
    tmp_path: Path, postgres_dsn: str
) -> None:
    from wormhole.testing.postgres import run_sql

    run_sql(postgres_dsn, "CREATE TABLE events (id int PRIMARY KEY, n int)")
    source = _open_source(
        f"pipeline: lag\nsource: {{type: postgres, dsn: '{postgres_dsn}', snapshot: never, "
        f"tables: [public.events]}}\napplications: {{out: {{sink: {{type: 'null'}}}}}}\n",
        tmp_path,
    )
    try:
        _catch_up(source)
        # The test cluster runs with synchronous_commit=off, where a commit returns before its
        # WAL is written, and pg_current_wal_lsn() is the write position: this transaction
        # commits synchronously so that its WAL is written (and counted) when lag() looks.
        run_sql(
            postgres_dsn,
            "SET synchronous_commit = on",
            "INSERT INTO events SELECT g, 1 FROM generate_series(1, 2000) g",
        )
        behind = source.lag()
        assert behind["lag_bytes"] > 2000 * 20, behind
        assert behind["retained_bytes"] >= behind["lag_bytes"], behind
        caught_up = _catch_up(source)
        assert caught_up["retained_bytes"] >= 0
    finally:
        source.close()


def test_postgres_source_lag_through_the_metrics_endpoint(
    tmp_path: Path, postgres_dsn: str, running: list[subprocess.Popen[str]]
) -> None:
    from wormhole.testing.postgres import run_sql

    run_sql(postgres_dsn, "CREATE TABLE events (id int PRIMARY KEY, n int)")
    port = free_port()
    pipeline = write_pipeline(
        tmp_path / "pg.yml",
        {
            "pipeline": "pg",
            "state_dir": str(tmp_path / "state"),
            "source": {
                "type": "postgres",
                "dsn": postgres_dsn,
                "tables": ["public.events"],
                "snapshot": "never",
            },
            "transport": {"type": "inprocess"},
            "metrics": {"listen": f"127.0.0.1:{port}"},
            "applications": {"out": {"sink": {"type": "null"}}},
        },
    )
    running.append(start_cli("run", str(pipeline), cwd=tmp_path))
    address = f"127.0.0.1:{port}"
    _scraped(address)
    wait_until(
        lambda: sample(scrape(address), "wormhole_source_lag_bytes", source="postgres") == 0,
        60,
        "the postgres source streaming (its slot created), caught up",
    )
    run_sql(postgres_dsn, "INSERT INTO events SELECT g, 1 FROM generate_series(1, 500) g")

    def caught_up() -> bool:
        text = scrape(address)
        return (
            sample(text, "wormhole_source_updates_total", table="public.events", op="c") == 500
            and sample(text, "wormhole_source_lag_bytes", source="postgres") == 0
        )

    wait_until(caught_up, 60, "the postgres source's lag back to 0 after 500 inserts")
    text = scrape(address)
    assert (sample(text, "wormhole_source_retained_bytes", source="postgres") or -1) >= 0
    checked = check_metrics(text)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_mariadb_source_lag_in_bytes_and_seconds(
    tmp_path: Path, mariadb_server: Any, mysql_database: str
) -> None:
    db = mysql_database
    mariadb_server.sql("CREATE TABLE events (id INT PRIMARY KEY, n INT NOT NULL)", database=db)
    source = _open_source(
        f"pipeline: lag\nsource: {{type: mysql, dsn: '{mariadb_server.dsn()}', "
        f"snapshot: never, tables: ['{db}.events'], heartbeat_s: 0.5}}\n"
        f"applications: {{out: {{sink: {{type: 'null'}}}}}}\n",
        tmp_path,
    )
    try:
        _catch_up(source)
        assert source.lag()["lag_seconds"] == 0
        values = ",".join(f"({i}, {i})" for i in range(2000))
        mariadb_server.sql(f"INSERT INTO events VALUES {values}", database=db)
        behind = source.lag()
        assert behind["lag_bytes"] > 2000 * 5, behind
        # Unread, it ages (the binlog's timestamps have one-second resolution).
        wait_until(lambda: source.lag()["lag_seconds"] >= 1, 10, "lag_seconds of 1 or more")
        caught_up = _catch_up(source)
        assert caught_up["lag_seconds"] == 0
        # Transactions on tables it does not read are no lag once read past.
        mariadb_server.sql("CREATE TABLE other (id INT PRIMARY KEY)", database=db)
        mariadb_server.sql("INSERT INTO other VALUES (1), (2), (3)", database=db)
        assert source.lag()["lag_bytes"] > 0
        _catch_up(source)
    finally:
        source.close()


def test_filelog_source_lag_counts_unread_bytes(tmp_path: Path) -> None:
    data = tmp_path / "data" / "riders"
    data.mkdir(parents=True)
    _write_rows(data / "0001.jsonl", 0, 10)
    source = _open_source(
        f"pipeline: lag\nsource: {{type: filelog, path: '{data}'}}\n"
        f"applications: {{out: {{sink: {{type: 'null'}}}}}}\n",
        tmp_path,
    )
    try:
        size = (data / "0001.jsonl").stat().st_size
        assert source.lag() == {"lag_bytes": size, "skipped_files": 0}
        _catch_up(source)
        _write_rows(data / "0002.jsonl", 10, 5)
        size = (data / "0002.jsonl").stat().st_size
        assert source.lag() == {"lag_bytes": size, "skipped_files": 0}
        _catch_up(source)
    finally:
        source.close()


# ------------------------------------------------------------------ docs
def _blocks(title: str) -> list[str]:
    """The fenced code blocks under the heading ``title`` of docs/operations.md."""
    text = DOCS.read_text()
    match = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#+ |\Z)", text, re.M | re.S)
    assert match, f"no section {title!r} in {DOCS}"
    return re.findall(r"```ya?ml\n(.*?)```", match.group(1), re.S)


def test_the_documented_alert_rules_pass_promtool(tmp_path: Path) -> None:
    (rules,) = _blocks("Alert rules")
    path = tmp_path / "rules.yml"
    path.write_text(rules)
    checked = check_rules(path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    names = [r["alert"] for g in yaml.safe_load(rules)["groups"] for r in g["rules"]]
    assert {"WormholeApplicationLagging", "WormholePostgresSlotStuck"} <= set(names)


def test_the_documented_scrape_config_passes_promtool(tmp_path: Path) -> None:
    (config,) = _blocks("Scrape configuration")
    (tmp_path / "prometheus.yml").write_text(config)
    (rules,) = _blocks("Alert rules")
    (tmp_path / "wormhole-alerts.yml").write_text(rules)
    checked = check_config(tmp_path / "prometheus.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_metric_served_is_documented(tmp_path: Path) -> None:
    documented = set(re.findall(r"^\| `(wormhole_[a-z_]+)`", DOCS.read_text(), re.M))
    served = set(
        re.findall(
            r"\b(wormhole_[a-z_]+)\b",
            "".join(
                Path(__file__).resolve().parent.parent.joinpath(module).read_text()
                for module in ("wormhole/observability/prometheus.py", "wormhole/plugins/events.py")
            ),
        )
    )
    # Names the module builds from parts: every family it yields.
    families = {n for n in served if not n.endswith("_")} - {"wormhole_source_"}
    missing = {n for n in families if n not in documented and f"{n}_total" not in documented}
    assert not missing, f"metrics missing from docs/operations.md: {sorted(missing)}"


# ------------------------------------------------------------------ logs
def test_log_format_json_writes_one_object_a_line(tmp_path: Path) -> None:
    pipeline = _pipeline(tmp_path, {"type": "inprocess"}, metrics={"listen": "127.0.0.1:0"})
    _write_rows(tmp_path / "data" / "riders" / "0001.jsonl", 0, 5)
    result = run_cli("--log-format", "json", "run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines, result
    for line in lines:
        entry = json.loads(line)
        assert {"time", "level", "logger", "message"} <= set(entry), entry
        assert entry["level"] in ("debug", "info", "warning", "error", "critical")
        assert entry["logger"].startswith("wormhole")
        assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00$", entry["time"])
    messages = [json.loads(line)["message"] for line in lines]
    assert any(m.startswith("serving metrics on http://127.0.0.1:") for m in messages), messages
