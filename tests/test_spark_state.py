"""The incremental current state of the ``spark`` sink: each refresh folds the change files
added since the last one into the previous state, and must give what a computation over every
change file gives (the oracle below is that computation, as the sink did it before)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from wormhole.connectors.spark import sink as spark_sink
from wormhole.connectors.spark.sink import (
    MANIFEST,
    STATE_DIR,
    _escape,
    _schema,
    read_manifest,
    refresh_current_state,
)

DAY_MS = 86_400_000
NOW_MS = 1_750_000_000_000  # the refreshes' "now" in these tests


class History:
    """Random change files for one table: upserts, deletes, truncates, replays of older
    updates (their old version, a new arrival) and updates without a version."""

    def __init__(self, root: Path, table: str, seed: int, keys: int = 30) -> None:
        self.rng = random.Random(seed)
        self.root, self.table, self.keys = root, table, keys
        self.emitted: list[dict[str, Any]] = []
        self.clock = 0  # source versions
        self.arrival = NOW_MS * 1_000_000  # the sink's clock, in ns
        self.replays = True
        self.files: list[Path] = []
        self.archive = root.parent / f"archive-{seed}"  # every file, for the oracle

    def update(self) -> dict[str, Any]:
        rng = self.rng
        roll = rng.random()
        if self.emitted and roll < 0.2 and self.replays:
            # A replay: one of the latest updates again (its older version), as after a crash.
            u = dict(rng.choice(self.emitted[-60:]))
        else:
            self.clock += 1
            key = rng.randrange(self.keys)
            shard = key % 3
            version = None if rng.random() < 0.1 else [self.clock, rng.randrange(3)]
            if roll < 0.3:
                u = {"op": "d", "key": key, "shard": shard, "after": None, "version": version}
            elif roll < 0.305:
                u = {"op": "t", "key": None, "shard": rng.randrange(3), "after": None}
                u["version"] = version
            else:
                row = {"id": key, "v": rng.randrange(1000), "s": f"x{self.clock}"}
                op = rng.choice("cur")
                u = {"op": op, "key": key, "shard": shard, "after": row, "version": version}
            self.emitted.append(u)
        self.arrival += 1 + rng.randrange(5)
        return {**u, "arrival": self.arrival}

    def write(self, n: int, day: int = NOW_MS // DAY_MS) -> None:
        updates = [self.update() for _ in range(n)]
        columns = {
            "op": [u["op"] for u in updates],
            "key": [None if u["key"] is None else json.dumps({"id": u["key"]}) for u in updates],
            "before": [None for _ in updates],
            "after": [None if u["after"] is None else json.dumps(u["after"]) for u in updates],
            "shard": [u["shard"] for u in updates],
            "position": ["" for _ in updates],
            "logical": ["" for _ in updates],
            "ts_ms": [day * DAY_MS for _ in updates],
            "version": [u["version"] for u in updates],
            "arrival": [u["arrival"] for u in updates],
        }
        date = spark_sink._date(day)
        name = f"part-{len(self.files):06d}-{self.rng.getrandbits(32):08x}.parquet"
        directory = self.root / "changes" / f"table={_escape(self.table)}" / f"date={date}"
        directory.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pydict(columns, schema=_schema()), directory / name)
        self.archive.mkdir(parents=True, exist_ok=True)
        shutil.copy(directory / name, self.archive / f"{date}-{name}")
        self.files.append(directory / name)


def oracle(spark: Any, archive: Path) -> dict[int, dict[str, Any]]:
    """The live rows from every change file, computed as the sink did before it was
    incremental: each key's newest update, keys deleted or cut by a truncate dropped."""
    from pyspark.sql import functions as F

    changes = spark.read.parquet(str(archive))
    order = F.struct(F.col("version"), F.col("arrival"))
    latest = (
        changes.where(F.col("op") != "t")
        .groupBy("key")
        .agg(F.max_by(F.struct("op", "after", "shard", "version", "arrival"), order).alias("u"))
        .select("u.*")
    )
    truncates = (
        changes.where(F.col("op") == "t")
        .groupBy("shard")
        .agg(F.max("version").alias("_cut"), F.max("arrival").alias("_cut_arrival"))
    )
    live = (
        latest.join(truncates, ["shard"], "left")
        .where(
            F.col("_cut_arrival").isNull()
            | F.when(
                F.col("_cut").isNotNull() & F.col("version").isNotNull(),
                F.col("version") > F.col("_cut"),
            ).otherwise(F.col("arrival") > F.col("_cut_arrival"))
        )
        .where(F.col("op") != "d")
    )
    rows = [json.loads(r["after"]) for r in live.select("after").collect()]
    return {r["id"]: r for r in rows}


def current(spark: Any, root: Path, table: str) -> dict[int, dict[str, Any]]:
    rows = spark.read.parquet(str(root / "current" / table)).collect()
    return {int(r["id"]): {**r.asDict(), "id": int(r["id"])} for r in rows}


def test_incremental_refreshes_equal_a_recompute_over_every_change(
    tmp_path: Path, spark: Any
) -> None:
    root = tmp_path / "lake"
    histories = [History(root, name, seed) for seed, name in enumerate(["a", "public.b", "c 1"])]
    for round_ in range(4):
        for history in histories:
            for _ in range(history.rng.randrange(1, 4)):
                history.write(history.rng.randrange(5, 60))
        assert refresh_current_state(spark, root, now_ms=NOW_MS) == 3
        for history in histories:
            expected = oracle(spark, history.archive)
            assert current(spark, root, history.table) == expected, (round_, history.table)
            manifest = read_manifest(root / "current" / history.table)
            assert manifest is not None
            assert len(manifest["files"]) == len(history.files)
    # The state holds one row per key (deleted ones too) and one per truncated shard, not
    # the history.
    state = spark.read.parquet(str((root / "current" / "a").resolve() / STATE_DIR))
    assert state.count() <= histories[0].keys + 3
    # Spark reads current/<table> as the table's columns alone.
    assert set(spark.read.parquet(str(root / "current" / "a")).columns) <= {"id", "v", "s"}


def test_a_refresh_that_stops_midway_leaves_the_previous_state(
    tmp_path: Path, spark: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "lake"
    history = History(root, "t", seed=7)
    history.write(80)
    refresh_current_state(spark, root, now_ms=NOW_MS)
    before = oracle(spark, history.archive)
    assert current(spark, root, "t") == before
    manifest = read_manifest(root / "current" / "t")

    history.write(80)

    def crash(target: Path, version: Path) -> None:
        raise RuntimeError("the refresh stops here")

    # Everything is written; only the switch to the new version is missing.
    monkeypatch.setattr(spark_sink, "_point", crash)
    with pytest.raises(RuntimeError, match="stops here"):
        refresh_current_state(spark, root, now_ms=NOW_MS)
    assert current(spark, root, "t") == before
    assert read_manifest(root / "current" / "t") == manifest
    leftovers = [p for p in (root / "current").iterdir() if p.name.startswith(".t.")]
    assert len(leftovers) == 2  # the previous version and the unfinished one

    monkeypatch.undo()
    refresh_current_state(spark, root, now_ms=NOW_MS)
    assert current(spark, root, "t") == oracle(spark, history.archive) != before
    versions = [p for p in (root / "current").iterdir() if p.name.startswith(".t.")]
    assert [p.name for p in versions] == [(root / "current" / "t").readlink().name]


def test_retention_expires_old_change_partitions_and_keeps_the_state(
    tmp_path: Path, spark: Any
) -> None:
    root = tmp_path / "lake"
    history = History(root, "t", seed=11)
    today = NOW_MS // DAY_MS
    for days_ago in (30, 20, 9, 8):
        history.write(60, day=today - days_ago)
    history.write(60, day=today)
    refresh_current_state(spark, root, retention_days=7, now_ms=NOW_MS)
    assert current(spark, root, "t") == oracle(spark, history.archive)
    days = sorted(p.name for p in (root / "changes" / "table=t").iterdir())
    assert days == [f"date={spark_sink._date(today)}"]

    # New changes, old and new keys; and a late update dated in an expired day, which a
    # refresh must fold in before it is expired in turn.
    history.write(60, day=today)
    history.write(20, day=today - 30)
    refresh_current_state(spark, root, retention_days=7, now_ms=NOW_MS)
    assert current(spark, root, "t") == oracle(spark, history.archive)
    assert not (root / "changes" / "table=t" / f"date={spark_sink._date(today - 30)}").exists()
    manifest = read_manifest(root / "current" / "t")
    assert manifest is not None and all(f.startswith("date=") for f in manifest["files"])
    assert (root / "current" / "t" / MANIFEST).is_file()

    # Past the retention, deletes are forgotten: the state keeps live keys and truncates.
    def deletes_before(horizon_ns: int) -> int:
        state = spark.read.parquet(str((root / "current" / "t").resolve() / STATE_DIR))
        return int(state.where(f"op = 'd' AND arrival < {horizon_ns}").count())

    later = NOW_MS + 60 * DAY_MS
    horizon_ns = (later - 7 * DAY_MS) * 1_000_000
    assert deletes_before(horizon_ns) > 0
    history.arrival, history.replays = later * 1_000_000, False
    history.write(5, day=later // DAY_MS)
    refresh_current_state(spark, root, retention_days=7, now_ms=later)
    assert current(spark, root, "t") == oracle(spark, history.archive)
    assert deletes_before(horizon_ns) == 0
