"""The ``spark`` sink: updates appended to Parquet, and a current-state table per source
table maintained by Spark, with optional SQL transforms.

Layout under ``path``::

    changes/table=<table>/date=<YYYY-MM-DD>/part-<...>.parquet   every update, appended
    current/<table>/                                             the live rows (Spark)
    transforms/<name>/                                           each transform's result (Spark)

**Appending.** Each batch becomes one Parquet file per (table, date), written to
a temporary name, fsynced and renamed into place before the batch is
acknowledged: a crash leaves whole files only. The date is the update's
``ts_ms`` (UTC), or the day it was written when the source gave none. Columns:
``op, key, before, after`` (JSON text), ``shard, position, logical, ts_ms``,
``version`` (the per-key version, :mod:`wormhole.plugins.versions`) and
``arrival`` (when this sink wrote it, for updates without a version).

**Current state.** A refresh folds the change files added since the previous one
(each version's manifest names the files it folded in) into the previous state:
each key's newest update (highest version, then latest arrival; deletes kept,
so a replayed older update cannot revive a key) and each shard's newest
truncate. Keys whose newest update is a delete or older than a truncate of its
shard are dropped, the rows' JSON is expanded into columns, and the new version
of ``current/<table>`` is switched in by renaming a symbolic link. Replays after
a crash append updates again, but versions put them in their place, so the table
converges to the source table. It runs every ``refresh_s`` seconds and when the
sink closes (the end of ``wormhole run --once``), in the first subscriber only.
``retention_days`` deletes old change partitions once folded in.

**Transforms.** ``transforms: {name: SQL}`` run after each refresh with a view
per current table (its name with ``.`` as ``_``, e.g. ``public_users``) and a
``changes`` view of every update; each result overwrites
``transforms/<name>``.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import Field

from wormhole.core.errors import SinkError, first_line
from wormhole.core.shard import canonical_key
from wormhole.core.update import Update
from wormhole.plugins.components import Options, SinkContext
from wormhole.plugins.versions import version_of

log = logging.getLogger("wormhole.spark")


class SparkSinkOptions(Options):
    """Append updates to Parquet; keep current-state tables with Spark."""

    path: str = Field(description="root directory; may contain {application}")
    master: str = Field(
        "local[*]", description="Spark master: local[*], local[2], spark://host:7077, yarn, ..."
    )
    current_state: bool = Field(True, description="maintain current/<table> with Spark")
    refresh_s: float = Field(
        60.0, ge=0, description="seconds between current-state refreshes (0: only at close)"
    )
    transforms: dict[str, str] = Field(
        default_factory=dict,
        description="name -> Spark SQL over the current tables (views named like "
        "public_users) and the `changes` view; results overwrite transforms/<name>",
    )
    spark_conf: dict[str, str] = Field(
        default_factory=dict, description="extra Spark settings (spark.executor.memory, ...)"
    )
    app_name: str = Field("wormhole", description="Spark application name")
    retention_days: int | None = Field(
        None,
        ge=0,
        description="delete change partitions (dates) older than this many days once the "
        "current state has folded them in; deletes older than that are forgotten too",
    )


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def view_name(table: str) -> str:
    """A source table's name as a Spark SQL view name: ``public.users`` -> ``public_users``."""
    return re.sub(r"[^A-Za-z0-9_]", "_", table)


def _schema() -> Any:
    import pyarrow as pa

    return pa.schema(
        [
            ("op", pa.string()),
            ("key", pa.string()),
            ("before", pa.string()),
            ("after", pa.string()),
            ("shard", pa.int32()),
            ("position", pa.string()),
            ("logical", pa.string()),
            ("ts_ms", pa.int64()),
            ("version", pa.list_(pa.int64())),
            ("arrival", pa.int64()),
        ]
    )


def _text(raw: Any) -> str | None:
    data = bytes(raw)
    return None if data == b"null" else data.decode()


class SparkSink:
    def __init__(self, options: SparkSinkOptions) -> None:
        self.options = options
        self.root = Path()
        self.context: SinkContext | None = None
        self.spark: Any = None
        self.lock = threading.Lock()
        self.last_refresh = time.monotonic()
        self.dirty = False
        self.files = 0
        self.schema: Any = None

    # ------------------------------------------------------------------ open
    def open(self, context: SinkContext) -> None:
        app = f"applications.{context.application}.sink"
        try:
            import pyarrow  # noqa: F401
            import pyspark  # noqa: F401
        except ImportError as exc:
            raise SinkError(
                f"{app}.type: spark needs pyspark and pyarrow; install the extra: "
                f"pip install 'wormhole-cdc[spark]'"
            ) from exc
        for name in self.options.transforms:
            if not _NAME.match(name):
                raise SinkError(
                    f"{app}.transforms.{name}: a transform name must be a plain identifier "
                    f"(letters, digits, _): it names the output directory"
                )
        try:
            self.root = Path(self.options.path.format(application=context.application))
        except (KeyError, IndexError, ValueError) as exc:
            raise SinkError(
                f"{app}.path: {self.options.path!r} has an unknown placeholder ({exc}); only "
                f"{{application}} is available"
            ) from exc
        try:
            (self.root / "changes").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SinkError(f"{app}.path: cannot create {self.root} ({exc})") from exc
        self.context = context
        self.schema = _schema()
        self.last_refresh = time.monotonic()

    # ----------------------------------------------------------------- write
    def write(self, updates: list[Update]) -> None:
        if not updates:
            return
        import pyarrow as pa

        arrival = time.time_ns()
        today = int(time.time() * 1000) // _DAY_MS
        groups: dict[tuple[str, int], list[Update]] = {}
        for u in updates:
            day = today if u.ts_ms is None else u.ts_ms // _DAY_MS
            group = groups.get((u.table, day))
            if group is None:
                groups[(u.table, day)] = group = []
            group.append(u)
        written: list[Path] = []
        for (table, day), group in groups.items():
            columns = {
                "op": [u.op for u in group],
                "key": [canonical_key(u.key).decode() for u in group],
                "before": [_text(u.before) for u in group],
                "after": [_text(u.after) for u in group],
                "shard": [u.shard for u in group],
                "position": [u.position for u in group],
                "logical": [u.logical for u in group],
                "ts_ms": [u.ts_ms for u in group],
                "version": [_version(u) for u in group],
                "arrival": [arrival + i for i in range(len(group))],
            }
            batch = pa.Table.from_pydict(columns, schema=self.schema)
            directory = self.root / "changes" / f"table={_escape(table)}" / f"date={_date(day)}"
            written.append(self._write_file(directory, batch))
            arrival += len(group)
        self.files += len(written)
        self.dirty = True
        context = self.context
        if (
            context is not None
            and context.subscriber == 0
            and self.options.current_state
            and self.options.refresh_s > 0
            and time.monotonic() - self.last_refresh >= self.options.refresh_s
        ):
            self.refresh()

    def _write_file(self, directory: Path, table: Any) -> Path:
        import pyarrow.parquet as pq

        directory.mkdir(parents=True, exist_ok=True)
        subscriber = self.context.subscriber if self.context else 0
        name = f"part-{time.time_ns():020d}-{subscriber}-{uuid.uuid4().hex[:12]}.parquet"
        final = directory / name
        temporary = directory / f".{name}.tmp"
        # Spark ignores files whose names start with "." or "_".
        with open(temporary, "wb") as f:
            pq.write_table(table, f, compression="snappy")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, final)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return final

    # ---------------------------------------------------------------- Spark
    def _session(self) -> Any:
        if self.spark is None:
            from pyspark.sql import SparkSession

            # Python workers run this interpreter, which can import what the rows need.
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

            builder = (
                SparkSession.builder.master(self.options.master)
                .appName(self.options.app_name)
                .config("spark.ui.showConsoleProgress", "false")
            )
            for key, value in self.options.spark_conf.items():
                builder = builder.config(key, value)
            self.spark = builder.getOrCreate()
        return self.spark

    def refresh(self) -> None:
        """Fold the new change files into current/<table>, then run the transforms."""
        self.last_refresh = time.monotonic()
        if not self.options.current_state or not any((self.root / "changes").rglob("*.parquet")):
            return
        with self.lock:
            started = time.monotonic()
            spark = self._session()
            tables = refresh_current_state(
                spark, self.root, retention_days=self.options.retention_days
            )
            if self.options.transforms:
                spark.read.parquet(str(self.root / "changes")).createOrReplaceTempView("changes")
            for name, sql in self.options.transforms.items():
                try:
                    result = spark.sql(sql)
                except Exception as exc:  # Spark's AnalysisException, ParseException, ...
                    app = self.context.application if self.context else "?"
                    raise SinkError(
                        f"applications.{app}.sink.transforms.{name}: Spark cannot run it "
                        f"({first_line(exc)}); fix the SQL (the current tables are views "
                        f"named like public_orders, every update is the view `changes`)"
                    ) from exc
                _replace_dir(self.root / "transforms" / name, result)
            self.dirty = False
            log.info(
                "current state of %d table(s) refreshed in %.1fs",
                tables,
                time.monotonic() - started,
            )

    def close(self) -> None:
        context = self.context
        try:
            if context is not None and context.subscriber == 0 and self.dirty:
                self.refresh()
        finally:
            # A session this sink started is left to the process (getOrCreate shares it).
            self.context = None


# The current state's bookkeeping, inside each version of current/<table> (Spark skips
# names that start with "_"): every key's newest update, and the manifest of the change
# files that the version folds in.
STATE_DIR = "_wormhole_state"
MANIFEST = "_wormhole_manifest.json"
_MANIFEST_FORMAT = 1
_CHANGE_COLUMNS = (
    "op string, key string, before string, after string, shard int, position string, "
    "logical string, ts_ms bigint, version array<bigint>, arrival bigint"
)
_STATE_COLUMNS = ("op", "key", "after", "shard", "version", "arrival")


def refresh_current_state(
    spark: Any,
    root: Path,
    sample: int = 2000,
    retention_days: int | None = None,
    now_ms: int | None = None,
) -> int:
    """Bring ``root/current/<table>`` up to date with ``root/changes``; returns the table count.

    Each table's state is its previous version plus the change files added since (its
    manifest names the files it folded in). A table without a manifest is computed from
    every change file. With ``retention_days``, change files older than that many days are
    deleted once folded in (see :func:`expire_changes`).
    """
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    horizon_ns = None if retention_days is None else (now_ms - retention_days * _DAY_MS) * 10**6
    tables = change_tables(root / "changes")
    for table, directory in tables.items():
        _refresh_table(spark, root, table, directory, sample, horizon_ns)
        if (root / "current" / table).exists():
            current = spark.read.parquet(str(root / "current" / table))
            current.createOrReplaceTempView(view_name(table))
    if retention_days is not None:
        expire_changes(root, retention_days, now_ms)
    return len(tables)


def change_tables(changes: Path) -> dict[str, Path]:
    """Each table's directory under ``changes``, by table name (Hive-style unescaped)."""
    out: dict[str, Path] = {}
    if changes.is_dir():
        for entry in sorted(changes.iterdir()):
            if entry.name.startswith("table=") and entry.is_dir():
                out[_unescape(entry.name[len("table=") :])] = entry
    return out


def _change_files(directory: Path) -> list[str]:
    """The change files of a table, as ``date=<day>/<name>`` (temporary files excluded)."""
    return sorted(
        f"{day.name}/{f.name}"
        for day in directory.iterdir()
        if day.name.startswith("date=") and day.is_dir()
        for f in day.iterdir()
        if f.name.endswith(".parquet") and not f.name.startswith((".", "_"))
    )


def read_manifest(target: Path) -> dict[str, Any] | None:
    """The manifest of the current version of ``current/<table>``, or None (no version yet,
    or one written before the manifest existed: the next refresh starts from scratch)."""
    try:
        manifest = json.loads((target / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != _MANIFEST_FORMAT:
        return None
    return manifest


def _refresh_table(
    spark: Any, root: Path, table: str, directory: Path, sample: int, horizon_ns: int | None
) -> None:
    target = root / "current" / table
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_unfinished_versions(target)
    manifest = read_manifest(target)
    files = _change_files(directory)
    present = set(files)
    consumed = set(manifest["files"]) & present if manifest is not None else set()
    new = [f for f in files if f not in consumed]
    if not new and (manifest is not None or not files):
        return  # nothing was added since: the current version stands
    rows = None
    if manifest is not None:
        # Read through the resolved version: the link may be swapped while Spark reads.
        rows = spark.read.parquet(str(target.resolve() / STATE_DIR)).select(*_STATE_COLUMNS)
    if new:
        added = (
            spark.read.schema(_CHANGE_COLUMNS)
            .parquet(*(str(directory / f) for f in new))
            .select(*_STATE_COLUMNS)
        )
        rows = added if rows is None else rows.unionByName(added)
    assert rows is not None
    version = target.with_name(f".{target.name}.{time.time_ns()}.{uuid.uuid4().hex[:6]}")
    _newest_state(rows, horizon_ns).write.parquet(str(version / STATE_DIR))
    _write_live_rows(spark, version, sample)
    _write_json(
        version / MANIFEST,
        {
            "format": _MANIFEST_FORMAT,
            "table": table,
            "files": sorted(consumed | set(new)),
            "refreshed_ms": int(time.time() * 1000),
        },
    )
    _point(target, version)


def _newest_state(rows: Any, horizon_ns: int | None) -> Any:
    """Each key's newest update and each shard's newest truncate among ``rows``, without
    what is forgotten past the retention horizon."""
    from pyspark.sql import functions as F

    # Each key's newest update: the highest version, then the latest arrival (deletes
    # included, so that a replayed older update cannot bring a deleted key back) ...
    order = F.struct(F.col("version"), F.col("arrival"))
    latest = (
        rows.where(F.col("op") != "t")
        .groupBy("key")
        .agg(F.max_by(F.struct(*(c for c in _STATE_COLUMNS if c != "key")), order).alias("u"))
        .select("key", "u.*")
    )
    # ... and, per shard, the newest truncate: its highest version and latest arrival.
    cuts = (
        rows.where(F.col("op") == "t")
        .groupBy("shard")
        .agg(F.max("version").alias("version"), F.max("arrival").alias("arrival"))
        .select(
            F.lit("t").alias("op"),
            F.lit(None).cast("string").alias("key"),
            F.lit(None).cast("string").alias("after"),
            "shard",
            "version",
            "arrival",
        )
    )
    state = latest.unionByName(cuts)
    if horizon_ns is not None:
        # Past the retention, a delete (or a row cut by a truncate) is forgotten.
        state = _with_live(state).where(
            (F.col("op") == "t") | F.col("_live") | (F.col("arrival") >= horizon_ns)
        )
        state = state.select(*_STATE_COLUMNS)
    return state


def _write_live_rows(spark: Any, version: Path, sample: int) -> None:
    """The table's rows (the live keys' newest values) as Parquet in ``version``, next to
    the state written there."""
    from pyspark.sql import functions as F

    kept = spark.read.parquet(str(version / STATE_DIR))
    live = _with_live(kept).where(F.col("_live")).select("after", "arrival")
    # The columns: inferred on the driver from the newest rows (a column added by an
    # ALTER TABLE shows there first), then parsed in the JVM.
    newest = live.orderBy(F.col("arrival").desc()).select("after").limit(sample)
    texts = [r[0] for r in newest.collect()]
    if texts:
        schema = spark.read.json(spark.sparkContext.parallelize(texts)).schema
        frame = live.select(F.from_json("after", schema).alias("r")).select("r.*")
    else:
        frame = spark.createDataFrame([], "id string")
    frame.write.mode("append").parquet(str(version))


def _with_live(state: Any) -> Any:
    """``state`` with a ``_live`` column: the key's newest update is not a delete and is
    newer than the last truncate of its shard (by version when both have one, else by
    arrival)."""
    from pyspark.sql import functions as F

    cuts = state.where(F.col("op") == "t").select(
        "shard", F.col("version").alias("_cut"), F.col("arrival").alias("_cut_arrival")
    )
    keys = state.where(F.col("op") != "t").join(cuts, ["shard"], "left")
    after_cut = F.col("_cut_arrival").isNull() | F.when(
        F.col("_cut").isNotNull() & F.col("version").isNotNull(),
        F.col("version") > F.col("_cut"),
    ).otherwise(F.col("arrival") > F.col("_cut_arrival"))
    live = keys.withColumn("_live", after_cut & (F.col("op") != "d"))
    return live.select(*_STATE_COLUMNS, "_live").unionByName(
        state.where(F.col("op") == "t").withColumn("_live", F.lit(False))
    )


def expire_changes(root: Path, retention_days: int, now_ms: int | None = None) -> int:
    """Delete the change files of days more than ``retention_days`` before today (UTC) that
    the current state has folded in; returns how many. A file that no manifest names yet
    (written after the last refresh) is kept for the next one."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    oldest = f"date={_date(now_ms // _DAY_MS - retention_days)}"
    removed = 0
    for table, directory in change_tables(root / "changes").items():
        manifest = read_manifest(root / "current" / table)
        if manifest is None:
            continue
        for name in manifest["files"]:
            day = name.split("/", 1)[0]
            if day < oldest:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(directory / name)
                    removed += 1
        for day in directory.iterdir():
            if day.name < oldest and day.name.startswith("date="):
                with contextlib.suppress(OSError):
                    day.rmdir()  # only once empty
    return removed


def _write_json(path: Path, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())


def _replace_dir(target: Path, frame: Any) -> None:
    """Write a DataFrame as Parquet into a new directory, then point ``target`` at it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_unfinished_versions(target)
    version = target.with_name(f".{target.name}.{time.time_ns()}.{uuid.uuid4().hex[:6]}")
    frame.write.mode("overwrite").parquet(str(version))
    _point(target, version)


def _point(target: Path, version: Path) -> None:
    """Make the symbolic link ``target`` point at ``version``, by a rename: readers see the
    old version or the new one, never none. The old version is then removed."""
    _fsync_tree(version)
    old = os.readlink(target) if target.is_symlink() else None
    if target.exists() and not target.is_symlink():  # a directory from an older layout
        shutil.rmtree(target)
    link = target.with_name(f".{target.name}.link")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(link)
    os.symlink(version.name, link)
    os.replace(link, target)
    _fsync_dir(target.parent)
    if old is not None:
        with contextlib.suppress(OSError):
            shutil.rmtree(target.parent / old)


def _remove_unfinished_versions(target: Path) -> None:
    """Remove versions of ``target`` that no link points at: left by a refresh that stopped
    before it switched the link."""
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.\d+\.[0-9a-f]{{6}}$")
    current = os.readlink(target) if target.is_symlink() else None
    if not target.parent.is_dir():
        return
    for entry in target.parent.iterdir():
        if pattern.match(entry.name) and entry.name != current:
            shutil.rmtree(entry, ignore_errors=True)


def _fsync_tree(directory: Path) -> None:
    for path, _dirs, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(path, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(path))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _escape(value: str) -> str:
    # Hive-style partition values: escape what Spark would (it unescapes %XX).
    return re.sub(r"[^A-Za-z0-9._-]", lambda m: f"%{ord(m.group()):02X}", value)


def _unescape(value: str) -> str:
    # As Spark's partition discovery reads them back.
    return re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), value)


_DAY_MS = 86_400_000


@functools.lru_cache(maxsize=64)
def _date(day: int) -> str:
    return datetime.datetime.fromtimestamp(day * 86_400, datetime.UTC).strftime("%Y-%m-%d")


def _version(update: Update) -> list[int] | None:
    version = version_of(update)
    return None if version is None else list(version)
