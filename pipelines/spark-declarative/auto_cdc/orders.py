"""An Auto CDC flow from a Wormhole external application into a table with MERGE.

``orders_changes`` turns the application's updates of ``orders`` into rows with the table's
columns plus ``seq`` and ``op``; ``create_auto_cdc_flow`` applies them to ``orders`` by key, in
``seq`` order, deleting on ``op = 'd'``.
"""

from pathlib import Path

from pyspark import pipelines as dp
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from wormhole.connectors.spark import register
from wormhole.core.pipeline import load_pipeline

session: SparkSession = globals()["spark"]
register(session)

PIPELINE = Path(session.conf.get("spark.wormhole.pipeline", "wormhole.yml")).resolve()
APPLICATION = session.conf.get("spark.wormhole.application", "analytics")
STATE_DIR = Path(load_pipeline(PIPELINE).state_dir).resolve()
TABLE_FORMAT = session.conf.get("spark.wormhole.table_format", "delta")


@dp.temporary_view
def orders_changes() -> DataFrame:
    updates = (
        session.readStream.format("wormhole")
        .option("pipeline", str(PIPELINE))
        .option("application", APPLICATION)
        .option("stateDir", str(STATE_DIR))
        .load()
        .where("`table` = 'orders' AND op != 't'")
    )
    # A delete has no `after`: its `before` holds the old row (or the key columns).
    row = F.from_json(F.coalesce("after", "before"), "id INT, item STRING, qty INT")
    return updates.select("seq", "op", row.alias("row")).select("seq", "op", "row.*")


dp.create_streaming_table("orders", format=TABLE_FORMAT)

dp.create_auto_cdc_flow(
    target="orders",
    source="orders_changes",
    keys=["id"],  # the source table's primary key
    sequence_by="seq",  # the publisher-log position: per key, the order of the changes
    apply_as_deletes="op = 'd'",
    except_column_list=["seq", "op"],
    stored_as_scd_type=1,  # 2 keeps the history of each key
)
