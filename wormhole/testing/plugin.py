"""The ``wormhole`` pytest plugin: fixtures for pipelines and (as they arrive) real services."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from wormhole.testing.helpers import CliResult, free_port, run_cli, write_pipeline


@pytest.fixture
def wormhole_cli(tmp_path: Path) -> Callable[..., CliResult]:
    """Run ``wormhole ARGS`` in a subprocess with the test's temp dir as working directory."""

    def run(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> CliResult:
        return run_cli(*args, cwd=tmp_path, env=env, timeout=timeout)

    return run


@pytest.fixture
def pipeline_file(tmp_path: Path) -> Callable[..., Path]:
    """Write a pipeline dict to ``<tmp>/<name>.yml``; returns its path."""

    def write(pipeline: dict[str, Any], name: str = "pipeline") -> Path:
        return write_pipeline(tmp_path / f"{name}.yml", pipeline)

    return write


@pytest.fixture(name="free_port")
def free_port_fixture() -> int:
    """A free TCP port on 127.0.0.1."""
    return free_port()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Any]:
    """A throwaway PostgreSQL cluster (wal_level=logical) for the test session."""
    from wormhole.testing.postgres import start_postgres

    yield from start_postgres()


@pytest.fixture
def postgres_dsn(postgres_server: Any) -> Iterator[str]:
    """A fresh database in the session's cluster; its DSN."""
    name = postgres_server.create_database()
    try:
        yield postgres_server.dsn(name)
    finally:
        postgres_server.drop_database(name)


@pytest.fixture(scope="session")
def mariadb_server() -> Iterator[Any]:
    """A throwaway MariaDB server with a row-based binlog for the test session."""
    from wormhole.testing.mysql import start_mariadb

    yield from start_mariadb()


@pytest.fixture
def mysql_database(mariadb_server: Any) -> Iterator[str]:
    """A fresh database on the session's MariaDB server; its name."""
    name = mariadb_server.create_database()
    try:
        yield name
    finally:
        mariadb_server.drop_database(name)


@pytest.fixture(scope="session")
def memcached_servers() -> Iterator[list[Any]]:
    """Three throwaway memcached servers on free loopback ports, for the test session."""
    from wormhole.testing.memcached import start_memcached

    generators = [start_memcached() for _ in range(3)]
    servers = [next(g) for g in generators]
    try:
        yield servers
    finally:
        for g in generators:
            g.close()


@pytest.fixture(scope="session")
def zookeeper_server() -> Iterator[Any]:
    """A throwaway standalone ZooKeeper on a free loopback port, for the test session."""
    from wormhole.testing.zookeeper import start_zookeeper

    yield from start_zookeeper()


HOSTS = ("zk", "a", "b", "sub")
"""The hosts of :func:`netns_hosts`."""


@pytest.fixture(scope="session")
def netns_hosts() -> Iterator[Any]:
    """Hosts as network namespaces (:mod:`wormhole.testing.netns`), for the test session:
    ``zk``, ``a``, ``b`` and ``sub``, a wire between every two that a test can cut, and a
    control wire from the test process to ``zk``. Needs root (skipped without; a failure
    under CI=true). A test that cuts wires heals them (``netns_hosts.heal()``) when it ends."""
    from wormhole.testing.netns import start_network

    yield from start_network(HOSTS, control=["zk"])


@pytest.fixture(scope="session")
def host_zookeeper(netns_hosts: Any) -> Iterator[Any]:
    """A throwaway ZooKeeper on host ``zk`` of :func:`netns_hosts`, for the test session."""
    from wormhole.testing.zookeeper import start_zookeeper

    yield from start_zookeeper(netns_hosts.address("zk"), netns_hosts.command("zk", []))


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """A local[2] SparkSession for the test session (start-up dominates: one per session)."""
    from wormhole.testing.spark import start_spark

    yield from start_spark()


@pytest.fixture(scope="session")
def spark_cluster() -> Iterator[Any]:
    """A Spark standalone cluster for the test session: a master and two workers (1 core,
    1 GB each) on loopback; ``master_url``, ``executors()``, ``kill_executor()``,
    ``kill_worker(i)`` (see :class:`wormhole.testing.spark.SparkCluster`)."""
    from wormhole.testing.spark import start_spark_cluster

    yield from start_spark_cluster()


@pytest.fixture(scope="session")
def spark_connect() -> Iterator[Any]:
    """A Spark Connect server (``local[2]`` inside) on a free loopback port for the test
    session: ``url`` (``sc://127.0.0.1:PORT``) for ``spark-pipelines --remote``, and
    ``warehouse``, where its tables land (see
    :class:`wormhole.testing.spark.SparkConnectServer`)."""
    from wormhole.testing.spark import start_spark_connect

    yield from start_spark_connect()


@pytest.fixture(scope="session")
def tansu() -> Iterator[Any]:
    """A throwaway Kafka-protocol broker (Tansu) for the test session, behind a relay so a
    test can cut every client connection (disconnect()/reconnect()) without losing data."""
    from wormhole.testing.kafka import start_tansu

    yield from start_tansu(relay=True)


@pytest.fixture
def tansu_s3() -> Iterator[Any]:
    """A Tansu broker that keeps its data in a local S3 server, for one test: stop() and
    start() restart the broker process, and its topics, messages and offsets survive."""
    from wormhole.testing.kafka import start_tansu

    yield from start_tansu(storage="s3")


@pytest.fixture(scope="session")
def prometheus_server() -> Iterator[Any]:
    """A throwaway Prometheus server on a free loopback port for the test session, scraping
    every second whatever ``scrape(HOST:PORT, ...)`` names; ``query(EXPR)`` asks its HTTP API
    (see :class:`wormhole.testing.prometheus.PrometheusServer`)."""
    from wormhole.testing.prometheus import start_prometheus

    yield from start_prometheus()
