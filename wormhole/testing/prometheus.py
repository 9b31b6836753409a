"""A throwaway Prometheus server on a free loopback port, and ``promtool``.

Runs the Debian ``prometheus`` package's binary in a temp dir with a 1 s scrape
interval. Targets are given at any time with :meth:`PrometheusServer.scrape`: they go
into a file the server watches (``file_sd_configs``), so one server serves a whole test
session. :meth:`PrometheusServer.query` asks its HTTP API (``/api/v1/query``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wormhole.testing.helpers import ServerProcess, require, start_on_free_port

PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"


def promtool() -> str:
    """The ``promtool`` binary (skips the test without it; under CI=true, fails it)."""
    found = shutil.which("promtool") or (PROMTOOL if Path(PROMTOOL).exists() else None)
    require(found is not None, "promtool (Debian package prometheus)")
    assert found is not None
    return found


def check_metrics(exposition: str | bytes) -> subprocess.CompletedProcess[str]:
    """``promtool check metrics`` on an exposition (its lint of names, types and help)."""
    text = exposition.decode() if isinstance(exposition, bytes) else exposition
    return subprocess.run(
        [promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )


def check_rules(path: str | Path) -> subprocess.CompletedProcess[str]:
    """``promtool check rules FILE``."""
    return subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )


def check_config(path: str | Path) -> subprocess.CompletedProcess[str]:
    """``promtool check config FILE`` (the rule files it names are checked too)."""
    return subprocess.run(
        [promtool(), "check", "config", str(path)], capture_output=True, text=True, timeout=60
    )


def scrape(address: str, timeout: float = 10) -> str:
    """The exposition a ``/metrics`` endpoint at ``host:port`` serves now."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as response:
        body: bytes = response.read()
    return body.decode()


def sample(exposition: str, name: str, **labels: str) -> float | None:
    """The value of series ``name{labels}`` in an exposition (labels given must match;
    others may be present), or None if it is absent."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(exposition):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


@dataclass
class PrometheusServer(ServerProcess):
    host: str
    port: int
    directory: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def scrape(self, *addresses: str, job: str = "wormhole") -> None:
        """Scrape these ``host:port`` targets (replacing the ones given before)."""
        targets = [{"targets": list(addresses), "labels": {"job": job}}]
        temporary = self.directory / "targets.json.tmp"
        temporary.write_text(json.dumps(targets))
        temporary.replace(self.directory / "targets.json")

    def query(self, expression: str) -> list[dict[str, Any]]:
        """The result of an instant query (``data.result``: each with metric and value)."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expression})}"
        with urllib.request.urlopen(url, timeout=10) as response:
            answer = json.loads(response.read())
        assert answer["status"] == "success", answer
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def wait_for(
        self,
        expression: str,
        condition: Callable[[list[dict[str, Any]]], bool],
        timeout: float = 60,
    ) -> list[dict[str, Any]]:
        """Query until ``condition(result)`` holds; fail naming the query after ``timeout``."""
        deadline = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(expression)
            if condition(result):
                return result
            time.sleep(0.25)  # polling the server's view: it scrapes every second
        raise AssertionError(
            f"timed out after {timeout}s waiting for {expression!r}; last result: {result}"
        )

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets with their health (``/api/v1/targets``)."""
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10) as response:
            active: list[dict[str, Any]] = json.loads(response.read())["data"]["activeTargets"]
        return active


def _ready(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/-/ready", timeout=1) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def start_prometheus() -> Generator[PrometheusServer, None, None]:
    """Start a server; yields it and stops it afterwards (a generator for fixtures)."""
    binary = shutil.which("prometheus") or (PROMETHEUS if Path(PROMETHEUS).exists() else None)
    require(binary is not None, "Prometheus (Debian package prometheus)")
    assert binary is not None
    directory = Path(tempfile.mkdtemp(prefix="wormhole-prometheus-"))
    (directory / "targets.json").write_text("[]")
    (directory / "prometheus.yml").write_text(
        json.dumps(
            {
                "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "wormhole",
                        "file_sd_configs": [
                            {"files": [str(directory / "targets.json")], "refresh_interval": "1s"}
                        ],
                    }
                ],
            }
        )
    )
    started: list[PrometheusServer] = []

    def start(port: int) -> PrometheusServer:
        log = open(directory / "prometheus.log", "ab")  # noqa: SIM115 - the server owns it
        try:
            process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={directory / 'prometheus.yml'}",
                    f"--storage.tsdb.path={directory / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
            )
        finally:
            log.close()
        server = PrometheusServer("127.0.0.1", port, directory, process)
        started.append(server)
        server.wait_ready(
            "Prometheus",
            port,
            lambda: _ready("127.0.0.1", port),
            directory / "prometheus.log",
            60,
        )
        return server

    try:
        yield start_on_free_port(start)
    finally:
        for each in started:
            each.stop()
        shutil.rmtree(directory, ignore_errors=True)
