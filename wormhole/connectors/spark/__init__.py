"""Spark: the ``spark`` sink (Parquet + current-state tables) and the ``wormhole`` stream
source for ``spark.readStream`` (needs the ``spark`` extra: pyspark and pyarrow).

``register(spark)`` makes ``spark.readStream.format("wormhole")`` available; see
:mod:`wormhole.connectors.spark.stream`.
"""

from __future__ import annotations

from typing import Any

from wormhole.connectors.spark.sink import SparkSinkOptions
from wormhole.plugins.components import ComponentSpec
from wormhole.plugins.hookspecs import hookimpl


def _sink(options: SparkSinkOptions) -> Any:
    from wormhole.connectors.spark.sink import SparkSink

    return SparkSink(options)


def register(spark: Any) -> None:
    """Make ``spark.readStream.format("wormhole")`` and ``spark.read.format("wormhole")``
    available in this SparkSession (classic, or Spark Connect as in ``spark-pipelines``)."""
    from wormhole.connectors.spark.connect import accept_metrics_in_command_streams
    from wormhole.connectors.spark.stream import register as register_source

    register_source(spark)
    accept_metrics_in_command_streams(spark)


@hookimpl
def wormhole_sinks() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            kind="sink",
            name="spark",
            factory=_sink,
            options=SparkSinkOptions,
            description="Append updates to Parquet (by table and date); current-state tables "
            "and SQL transforms in Spark.",
        )
    ]
