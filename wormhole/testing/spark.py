"""A local Spark session for tests (PySpark 4, Java 17)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from wormhole.testing.helpers import require


def start_spark(master: str = "local[2]") -> Iterator[Any]:
    """Start a SparkSession whose Python workers run this interpreter; stop it afterwards."""
    require(shutil.which("java") is not None, "Java 17 (Spark runs on the JVM)")
    try:
        from pyspark.sql import SparkSession
    except ImportError:  # pragma: no cover - reported by require
        require(False, "pyspark (pip install 'wormhole[spark]')")
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
