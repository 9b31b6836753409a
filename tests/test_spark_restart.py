"""``readStream.format("wormhole")`` through a driver killed at any moment: the driver
(Python and its JVM) is killed with SIGKILL at a chosen point of a micro-batch, then the same
query is started again on the same checkpoint, with the default trigger or with
``Trigger.AvailableNow``. Every update must land in the Parquet output exactly once, in
per-key order, and the application's datamarkers never pass what Spark committed.

The driver (tests/support/spark_source_driver.py) holds the query at the point asked for and
writes a file when it is there; the test then kills its process group. A chain kills the
driver at several points in turn on one checkpoint, each restarted driver holding at the next
point after a batch of its own; the last one runs to the end. The points:

- ``initial``: the query asked for its first offset, nothing is planned;
- ``plan``: a batch is planned (its offsets are in the checkpoint), no task started;
- ``read``: a task of a batch is reading its flow;
- ``written``: the sink wrote the batch and Spark had not recorded the commit. Killed at
  ``commit``, then that batch's ``commits/N`` removed: exactly what a kill between Spark's
  two writes leaves (the window is too short to hit with a signal);
- ``commit``: the batch is committed; Spark is handing its end to the source.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO
from tcp_support import Process

from wormhole.testing import run_cli, wait_until, write_pipeline
from wormhole.testing.helpers import free_port

KEYS = 120
ROUNDS = 20
TOTAL = KEYS * ROUNDS
SHARDS = 4
PER_TRIGGER = 100  # 24 micro-batches from an empty checkpoint
DRIVER = REPO / "tests" / "support" / "spark_source_driver.py"
# Each point is followed once by a restart with the default trigger and once with
# Trigger.AvailableNow, over the three chains: (where the driver is killed, the trigger of the
# restart that follows).
CHAINS = {
    # name: (master, how it reads, the kills in order)
    "local": (
        "local",
        "network",
        [
            ("initial", "default"),
            ("plan", "available-now"),
            ("read", "default"),
            ("written", "available-now"),
            ("commit", "default"),
        ],
    ),
    "cluster": ("cluster", "network", [("read", "available-now"), ("plan", "default")]),
    "file": (
        "local",
        "file",
        [("initial", "available-now"), ("written", "default"), ("commit", "available-now")],
    ),
}


@dataclass
class Published:
    """A publisher with every update already in its log, one external application a
    scenario."""

    pipeline: Path
    port: int
    state: Path


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Published]:
    from wormhole.connectors.tcp.ranges import TcpRemoteLog
    from wormhole.plugins.components import RemoteLogError, RemoteLogRequest

    root = tmp_path_factory.mktemp("spark-restart")
    data = root / "data"
    data.mkdir()
    with open(data / "0001.jsonl", "w") as f:
        for n in range(ROUNDS):
            for k in range(KEYS):
                f.write(json.dumps({"op": "u", "key": {"id": k}, "after": {"id": k, "n": n}}))
                f.write("\n")
    port = free_port()
    state = root / "state"
    pipeline = write_pipeline(
        root / "restart.yml",
        {
            "pipeline": "restart",
            "state_dir": str(state),
            "dataset": {"shards": SHARDS},
            "source": {"type": "filelog", "path": str(data), "poll_interval_ms": 20},
            "transport": {"type": "tcp", "listen": f"127.0.0.1:{port}", "token": "s3cret"},
            "applications": {name: {"external": True} for name in [*CHAINS, "fresh"]},
        },
    )
    publisher = Process("publish", str(pipeline), "-q", cwd=root)

    def logged() -> bool:
        remote = TcpRemoteLog(RemoteLogRequest(f"127.0.0.1:{port}", "file", {"token": "s3cret"}))
        try:
            return remote.positions().end >= TOTAL
        except RemoteLogError:
            return False

    try:
        wait_until(logged, 60, f"the publisher to log {TOTAL} updates")
        yield Published(pipeline, port, state)
    finally:
        assert publisher.stop() == 0, publisher.stderr


class Driver:
    """A Spark driver process (Python and the JVM it starts, in a process group of their
    own), its output in a file."""

    def __init__(self, log: Path, args: list[str], cwd: Path) -> None:
        self.log = log
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, str(DRIVER), *args],
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def running(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        """SIGKILL the whole driver: its Python process, its JVM, its Python workers."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=60)


def _last_committed(checkpoint: Path) -> int | None:
    commits = checkpoint / "commits"
    if not commits.exists():
        return None
    batches = [int(p.name) for p in commits.iterdir() if p.name.isdigit()]
    return max(batches, default=None)


def _offsets(checkpoint: Path, batch: int) -> dict[str, Any]:
    offsets: dict[str, Any] = json.loads(
        (checkpoint / "offsets" / str(batch)).read_text().splitlines()[-1]
    )
    return offsets


def _flow_offsets(offsets: dict[str, Any]) -> dict[int, int]:
    """Each flow's offset: ``{"<datastore>": {"<shard>": seq}}`` over the network,
    ``{"<shard>": seq}`` in the file mode."""
    flows = (
        next(iter(offsets.values())) if isinstance(next(iter(offsets.values())), dict) else offsets
    )
    return {int(shard): int(seq) for shard, seq in flows.items()}


def _done(checkpoint: Path) -> bool:
    batch = _last_committed(checkpoint)
    if batch is None:
        return False
    return set(_flow_offsets(_offsets(checkpoint, batch)).values()) == {TOTAL}


def _datamarkers(published: Published, application: str) -> dict[int, int]:
    result = run_cli("status", str(published.pipeline), "--json", cwd=published.state.parent)
    assert result.returncode == 0, result
    flows = json.loads(result.stdout)["flows"]
    return {f["shard"]: f["datamarker"] for f in flows if f["application"] == application}


def _kill_at(driver: Driver, held: Path, point: str) -> None:
    """Wait for ``driver`` to hold at ``point`` and kill it there."""
    try:
        wait_until(lambda: held.exists() or not driver.running(), 300, f"the driver at {point}")
        assert driver.running(), driver.output()
    finally:
        driver.kill()


def _back_to_written(checkpoint: Path, out: Path) -> None:
    """Killed as Spark handed batch N's end to the source: go back to the moment between
    the sink's write of batch N and Spark's record of it (no ``commits/N``, batch N+1 not
    planned yet)."""
    batch = _last_committed(checkpoint)
    assert batch is not None and (out / "_spark_metadata" / str(batch)).exists()
    for log, n in (("commits", batch), ("offsets", batch + 1)):
        for name in (str(n), f".{n}.crc"):
            (checkpoint / log / name).unlink(missing_ok=True)


def _planned_not_committed(checkpoint: Path) -> bool:
    planned = max(int(p.name) for p in (checkpoint / "offsets").iterdir() if p.name.isdigit())
    return planned != _last_committed(checkpoint)


# Which call of the source to hold at: a restarted driver first finishes what the kill
# interrupted, so its hold comes after a batch of its own.
CALLS = {"initial": 1, "plan": 2, "read": 1, "written": 2, "commit": 2}


def _kill_chain(
    tmp_path: Path, published: Published, spark: Any, chain: str, master: str = "local[2]"
) -> None:
    """Kill the driver at each point of ``chain`` in turn, each restart on the same
    checkpoint holding at the next point; then run to the end and check the output."""
    _, mode, kills = CHAINS[chain]
    work = tmp_path / chain
    work.mkdir()
    out, checkpoint = work / "out", work / "checkpoint"
    args = ["--master", master, "--application", chain, "--out", str(out)]
    args += ["--checkpoint", str(checkpoint), "--max-updates", str(PER_TRIGGER)]
    if mode == "file":
        args += ["--pipeline", str(published.pipeline)]
    else:
        args += ["--publishers", f"127.0.0.1:{published.port}", "--token", "s3cret"]

    def started(trigger: str) -> list[str]:
        return [*args, "--available-now"] if trigger == "available-now" else args

    trigger = "default"  # the first driver's: an empty checkpoint
    for n, (point, then) in enumerate(kills):
        hold = "commit" if point == "written" else point
        # A file of its own: a Python worker of a killed driver may still be running a task.
        held = work / f"held-{n}"
        pause = ["--pause-at", hold, "--pause-file", str(held), "--pause-call", str(CALLS[point])]
        # The working directory: Spark looks for data sources in every module of it.
        driver = Driver(work / f"driver-{n}-{point}.log", [*started(trigger), *pause], work)
        _kill_at(driver, held, point)
        if point == "written":
            _back_to_written(checkpoint, out)
        if point in ("plan", "read", "written"):
            # The kill left a planned batch that is not committed: the restart replays it.
            assert _planned_not_committed(checkpoint), point
        trigger = then

    last = Driver(work / "driver-last.log", started(trigger), work)
    try:
        if trigger == "available-now":
            try:
                last.process.wait(timeout=300)
            except subprocess.TimeoutExpired:
                raise AssertionError(last.output()) from None
            assert last.process.returncode == 0, last.output()
        else:
            wait_until(lambda: _done(checkpoint) or not last.running(), 300, "every batch")
            assert last.running(), last.output()
    finally:
        last.kill()
    assert _done(checkpoint), last.output()

    # Exactly once, in per-key order (Spark's reader keeps to the sink's own log).
    rows = spark.read.parquet(str(out)).select("seq", "key", "after").collect()
    seqs = sorted(r["seq"] for r in rows)
    assert seqs == list(range(TOTAL)), (len(seqs), len(set(seqs)))
    by_key: dict[int, list[tuple[int, int]]] = {}
    for r in rows:
        by_key.setdefault(json.loads(r["key"])["id"], []).append(
            (r["seq"], json.loads(r["after"])["n"])
        )
    assert {k: [n for _, n in sorted(v)] for k, v in by_key.items()} == {
        k: list(range(ROUNDS)) for k in range(KEYS)
    }
    # The application's datamarkers never pass what Spark committed.
    committed = _flow_offsets(_offsets(checkpoint, _last_committed(checkpoint) or 0))
    markers = _datamarkers(published, chain)
    assert all(markers[s] <= committed[s] for s in committed), (markers, committed)


@pytest.mark.slow
def test_a_driver_killed_at_every_point_resumes_exactly_once(
    tmp_path: Path, published: Published, spark: Any
) -> None:
    _kill_chain(tmp_path, published, spark, "local")


@pytest.mark.slow
def test_a_driver_killed_on_a_standalone_cluster_resumes_exactly_once(
    tmp_path: Path, published: Published, spark: Any, spark_cluster: Any
) -> None:
    _kill_chain(tmp_path, published, spark, "cluster", spark_cluster.master_url)


@pytest.mark.slow
def test_a_driver_killed_in_the_file_mode_resumes_exactly_once(
    tmp_path: Path, published: Published, spark: Any
) -> None:
    _kill_chain(tmp_path, published, spark, "file")


def test_a_new_reader_answers_a_replay_and_a_commit_before_any_offset(
    tmp_path: Path, published: Published, zookeeper_server: Any
) -> None:
    """What Spark may ask first of the reader of a restarted query: the partitions of a
    batch planned before the kill, or the commit of one. A new reader answers both from the
    offsets alone, with the publishers listed and through the registry (it looked up the
    publishers only when asked for an offset, and failed: no publisher of datastore ... is
    reachable)."""
    from wormhole.connectors.spark.stream import FlowRange, WormholeStreamReader, _Options

    planned = {"restart": {str(s): 0 for s in range(SHARDS)}}
    end = {"restart": {str(s): TOTAL // 2 for s in range(SHARDS)}}
    listed = {"publishers": f"127.0.0.1:{published.port}", "token": "s3cret"}
    reader = WormholeStreamReader(_Options({**listed, "application": "fresh"}))
    ranges = reader.partitions(planned, end)
    assert [(r.shard, r.start, r.end) for r in ranges if isinstance(r, FlowRange)] == [
        (s, 0, TOTAL // 2) for s in range(SHARDS)
    ]
    fresh = WormholeStreamReader(_Options({**listed, "application": "fresh"}))
    fresh.commit(end)  # stored at the publisher, as the application's datamarkers
    assert set(_datamarkers(published, "fresh").values()) == {TOTAL // 2}

    # Through the registry: a publisher of the same log registered in ZooKeeper.
    root = "/spark-restart-registry"
    pipeline = yaml.safe_load(published.pipeline.read_text())
    port = free_port()
    pipeline.update(
        registry={"type": "zookeeper", "hosts": zookeeper_server.hosts, "root": root},
        state_dir=str(tmp_path / "state"),
        transport={"type": "tcp", "listen": f"127.0.0.1:{port}", "token": "s3cret"},
    )
    registered = write_pipeline(tmp_path / "registered.yml", pipeline)
    publisher = Process("publish", str(registered), "-q", cwd=tmp_path)
    try:
        options = {
            "registry": f"zookeeper://{zookeeper_server.hosts}{root}",
            "dataset": "restart",
            "token": "s3cret",
            "application": "fresh",
        }

        def answered() -> bool:
            reader = WormholeStreamReader(_Options(options))
            try:
                return len(reader.partitions(planned, end)) == SHARDS
            except ValueError as exc:
                if "is registered" not in str(exc):  # not registered yet: ask again
                    raise
                return False
            finally:
                reader.stop()

        wait_until(answered, 60, "a new reader to plan the batch through the registry")
    finally:
        assert publisher.stop() == 0, publisher.stderr
