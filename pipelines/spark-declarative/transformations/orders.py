"""Spark Declarative Pipelines over a Wormhole external application.

``wormhole_updates`` is a streaming table: every update of the application, appended once per
update (the stream's offsets are the application's datamarkers, kept in the checkpoints under
the spec's ``storage``). ``wormhole_current`` is a materialized view derived from it: the live
row of every key, recomputed by each run.
"""

from pathlib import Path

from pyspark import pipelines as dp
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from wormhole.connectors.spark import register
from wormhole.core.pipeline import load_pipeline

# `spark-pipelines` gives each transformation module its Spark Connect session as `spark`, and
# imports it with this directory as the working directory.
session: SparkSession = globals()["spark"]
register(session)  # the `wormhole` format, in the Spark Connect server's Python workers

PIPELINE = Path(session.conf.get("spark.wormhole.pipeline", "wormhole.yml")).resolve()
APPLICATION = session.conf.get("spark.wormhole.application", "analytics")
# The server's Python workers do not run in this directory: give them absolute paths.
STATE_DIR = Path(load_pipeline(PIPELINE).state_dir).resolve()


@dp.table(comment="Every update of the Wormhole application, in publisher-log order per key.")
def wormhole_updates() -> DataFrame:
    return (
        session.readStream.format("wormhole")
        .option("pipeline", str(PIPELINE))
        .option("application", APPLICATION)
        .option("stateDir", str(STATE_DIR))
        .load()
    )


@dp.materialized_view(comment="The live row of every key: its newest update, unless a delete.")
def wormhole_current() -> DataFrame:
    updates = session.read.table("wormhole_updates")
    # A truncate removes the rows of its table written before it (it reaches every shard).
    truncated = (
        updates.where("op = 't'").groupBy("table", "shard").agg(F.max("seq").alias("truncated"))
    )
    # Aggregates, not a window function: with a window over `wormhole_updates`, Spark 4.3 lost
    # the view's dependency on the table once the table existed, and ran the view first.
    newest = (
        updates.where("op != 't'")
        .groupBy("table", "shard", "key")
        .agg(
            F.max("seq").alias("seq"),
            F.max_by("op", "seq").alias("op"),
            F.max_by("after", "seq").alias("row"),
        )
    )
    return (
        newest.join(truncated, ["table", "shard"], "left")
        .where("op != 'd' AND (truncated IS NULL OR seq > truncated)")
        .select("table", "key", "row", "seq")
    )
