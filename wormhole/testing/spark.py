"""Spark for tests (PySpark 4, Java 17): a local SparkSession, and a standalone cluster (a
master and workers started from the ``pyspark`` wheel, executors in their own JVMs)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wormhole.testing.helpers import (
    ServerProcess,
    children,
    free_port,
    require,
    start_on_free_port,
)


def start_spark(master: str = "local[2]") -> Iterator[Any]:
    """Start a SparkSession whose Python workers run this interpreter; stop it afterwards."""
    require(shutil.which("java") is not None, "Java 17 (Spark runs on the JVM)")
    try:
        from pyspark.sql import SparkSession
    except ImportError:  # pragma: no cover - reported by require
        require(False, "pyspark (pip install 'wormhole-cdc[spark]')")
        raise
    # Workers must import wormhole: they run the interpreter of this (virtual) environment.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    warehouse = tempfile.mkdtemp(prefix="wormhole-spark-")
    spark = (
        SparkSession.builder.master(master)
        .appName("wormhole-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.warehouse.dir", warehouse)
        .config("spark.driver.extraJavaOptions", f"-Djava.io.tmpdir={warehouse}")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        yield spark
    finally:
        spark.stop()
        shutil.rmtree(warehouse, ignore_errors=True)


class _Daemon(ServerProcess):
    """A Spark master or worker JVM (``spark-class`` execs ``java``: the pid is the JVM's)."""

    def __init__(self, process: subprocess.Popen[bytes], log: Path) -> None:
        self.process = process
        self.log = log


@dataclass
class SparkCluster:
    """A Spark standalone cluster on loopback: a master and its workers, each a JVM; the
    executors of an application are JVMs that the workers start, with their own Python
    workers (running this interpreter)."""

    master_url: str  # spark://127.0.0.1:PORT
    web_url: str  # the master's web UI; /json/ is its state
    directory: Path
    master: _Daemon
    workers: list[_Daemon] = field(default_factory=list)

    def state(self) -> dict[str, Any]:
        """The master's view: workers, active and completed applications."""
        with urllib.request.urlopen(f"{self.web_url}/json/", timeout=5) as response:
            state: dict[str, Any] = json.load(response)
        return state

    def alive_workers(self) -> int:
        try:
            workers = self.state()["workers"]
        except (OSError, ValueError, KeyError):
            return 0
        return sum(1 for w in workers if w.get("state") == "ALIVE")

    def executors(self) -> list[int]:
        """The pids of the executor JVMs running under the workers now."""
        return children({w.process.pid for w in self.workers}, b"CoarseGrainedExecutorBackend")

    def work_dirs(self) -> list[Path]:
        """Each worker's work directory: ``<app id>/<executor id>/`` per executor it ran."""
        return [self.directory / "work" / f"worker-{n}" for n in range(len(self.workers))]

    def kill_executor(self) -> int:
        """SIGKILL one running executor JVM; returns its pid (its worker starts another)."""
        pids = self.executors()
        if not pids:
            raise AssertionError("no executor is running")
        os.kill(pids[0], signal.SIGKILL)
        return pids[0]

    def kill_worker(self, index: int) -> None:
        """SIGKILL a worker JVM (its executors notice and exit)."""
        self.workers[index].stop(kill=True)


def _daemon_env(directory: Path, spark_home: Path) -> dict[str, str]:
    conf = directory / "conf"
    conf.mkdir(exist_ok=True)
    return {
        **os.environ,
        "SPARK_HOME": str(spark_home),
        "SPARK_CONF_DIR": str(conf),  # no spark-defaults.conf from elsewhere
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOCAL_DIRS": str(directory / "local"),
        "SPARK_LOG_DIR": str(directory / "logs"),
        "SPARK_DAEMON_MEMORY": "256m",
        "SPARK_DAEMON_JAVA_OPTS": f"-Djava.io.tmpdir={directory}",
        "PYSPARK_PYTHON": sys.executable,
    }


def _spark_home() -> Path:
    """The ``pyspark`` wheel's directory (its ``bin/`` and ``jars/``); Java and PySpark are
    required."""
    require(shutil.which("java") is not None, "Java 17 (Spark runs on the JVM)")
    try:
        import pyspark
    except ImportError:  # pragma: no cover - reported by require
        require(False, "pyspark (pip install 'wormhole-cdc[spark]')")
        raise
    return Path(pyspark.__file__).parent


def start_spark_cluster(
    workers: int = 2, cores: int = 1, memory: str = "1g"
) -> Iterator[SparkCluster]:
    """Start a standalone master and ``workers`` workers from the ``pyspark`` wheel on free
    loopback ports, work directories in a temp dir; wait until every worker is registered;
    stop them all afterwards."""
    spark_home = _spark_home()
    spark_class = spark_home / "bin" / "spark-class"
    require(spark_class.is_file(), f"{spark_class} (from the pyspark wheel)")
    directory = Path(tempfile.mkdtemp(prefix="wormhole-spark-cluster-"))
    launcher = _Launcher(spark_class, directory, _daemon_env(directory, spark_home))
    try:
        cluster = start_on_free_port(launcher.start_master)
        for n in range(workers):
            cluster.workers.append(launcher.start_worker(cluster, n, cores, memory))
        _wait_for_workers(cluster, workers)
        yield cluster
    finally:
        for daemon in reversed(launcher.daemons):
            daemon.stop(kill=True)
        shutil.rmtree(directory, ignore_errors=True)


class _Launcher:
    """Starts a cluster's daemons with ``spark-class``, each logging to ``<name>.log`` in
    ``directory``; keeps every one it started in ``daemons``."""

    def __init__(self, spark_class: Path, directory: Path, env: dict[str, str]) -> None:
        self.spark_class = spark_class
        self.directory = directory
        self.env = env
        self.daemons: list[_Daemon] = []

    def launch(self, name: str, *args: str) -> _Daemon:
        log = self.directory / f"{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                ["bash", str(self.spark_class), *args],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        daemon = _Daemon(process, log)
        self.daemons.append(daemon)
        return daemon

    def start_master(self, port: int) -> SparkCluster:
        """A master on ``port`` (and a free web UI port), once its state says ALIVE."""
        web = free_port()
        master = self.launch(
            f"master-{port}",
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--webui-port",
            str(web),
        )
        cluster = SparkCluster(
            f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{web}", self.directory, master
        )

        def answers() -> bool:
            try:
                return cluster.state().get("status") == "ALIVE"
            except (OSError, ValueError):
                return False

        master.wait_ready("Spark master", port, answers, master.log, timeout=60)
        return cluster

    def start_worker(self, cluster: SparkCluster, n: int, cores: int, memory: str) -> _Daemon:
        work = self.directory / "work" / f"worker-{n}"
        work.mkdir(parents=True)
        return self.launch(
            f"worker-{n}",
            "org.apache.spark.deploy.worker.Worker",
            "--host",
            "127.0.0.1",
            "--webui-port",
            str(free_port()),
            "--cores",
            str(cores),
            "--memory",
            memory,
            "--work-dir",
            str(work),
            cluster.master_url,
        )


def _wait_for_workers(cluster: SparkCluster, workers: int) -> None:
    """Until the master lists ``workers`` alive workers; an error naming a worker that
    exited, or after 60 s."""
    deadline = time.monotonic() + 60
    while cluster.alive_workers() < workers:
        for w in cluster.workers:
            if not w.running():
                tail = w.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"a Spark worker exited:\n{tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{workers} Spark workers did not register in 60s")
        time.sleep(0.05)  # polling the master's state: nothing to wait on


@dataclass
class SparkConnectServer:
    """A Spark Connect server on loopback (``local[2]`` inside), for clients such as
    ``spark-pipelines --remote URL``. Its Python workers run this interpreter; tables of the
    ``spark_catalog`` land under ``warehouse``."""

    url: str  # sc://127.0.0.1:PORT
    port: int
    warehouse: Path
    directory: Path
    server: _Daemon


def start_spark_connect(master: str = "local[2]") -> Iterator[SparkConnectServer]:
    """Start a Spark Connect server from the ``pyspark`` wheel (``spark-submit --class
    …SparkConnectServer``) on a free loopback port, its warehouse and logs in a temp dir; wait
    until it accepts connections; stop it afterwards."""
    spark_home = _spark_home()
    spark_submit = spark_home / "bin" / "spark-submit"
    require(spark_submit.is_file(), f"{spark_submit} (from the pyspark wheel)")
    connect_jars = list((spark_home / "jars").glob("spark-connect_*.jar"))
    require(bool(connect_jars), f"the Spark Connect server jar in {spark_home / 'jars'}")
    directory = Path(tempfile.mkdtemp(prefix="wormhole-spark-connect-"))
    env = {
        **_daemon_env(directory, spark_home),
        "SPARK_CONNECT_MODE": "0",  # spark-submit starts a server, not a Connect client
        # The launcher sizes a Connect server's JVM (the driver) with the daemon memory.
        "SPARK_DAEMON_MEMORY": "1g",
        "PYSPARK_DRIVER_PYTHON": sys.executable,
    }
    warehouse = directory / "warehouse"

    def start(port: int) -> SparkConnectServer:
        log = directory / f"server-{port}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [
                    "bash",
                    str(spark_submit),
                    "--class",
                    "org.apache.spark.sql.connect.service.SparkConnectServer",
                    "--name",
                    "wormhole-tests-connect",
                    "--master",
                    master,
                    "--conf",
                    "spark.connect.grpc.binding.address=127.0.0.1",
                    "--conf",
                    f"spark.connect.grpc.binding.port={port}",
                    "--conf",
                    "spark.ui.enabled=false",
                    "--conf",
                    "spark.sql.shuffle.partitions=4",
                    "--conf",
                    f"spark.sql.warehouse.dir={warehouse}",
                    "--conf",
                    f"spark.driver.extraJavaOptions=-Djava.io.tmpdir={directory}",
                ],
                env=env,
                cwd=directory,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        server = _Daemon(process, log)

        def answers() -> bool:
            return b"Spark Connect server started" in log.read_bytes()

        server.wait_ready("Spark Connect server", port, answers, log, timeout=120)
        return SparkConnectServer(f"sc://127.0.0.1:{port}", port, warehouse, directory, server)

    try:
        connect = start_on_free_port(start)
        try:
            yield connect
        finally:
            connect.server.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
