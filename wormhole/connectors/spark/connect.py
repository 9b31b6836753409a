"""Spark Connect sessions (``spark-pipelines``, ``SparkSession.builder.remote(...)``).

A Spark Connect server runs the ``wormhole`` source's Python code in its own Python workers.
Each such worker reports its (empty, unless profiling is on) profiler accumulators back to the
client as observed metrics. PySpark up to 4.3 accepts those in query results, but a
command stream (``execute_command_as_iterator``, which ``spark-pipelines run`` reads its pipeline
events from) rejects them: the run completes on the server, and the client then fails with
``[UNKNOWN_RESPONSE] Unknown response: Plan observed(__python_accumulator__=...)``
(SPARK-59135). :func:`accept_metrics_in_command_streams` makes the given session's client skip
such metrics in command streams, as the fix does.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from types import MethodType
from typing import Any

# PySpark releases whose command streams reject execution metrics.
_AFFECTED = ((4, 1), (4, 2), (4, 3))


def _release() -> tuple[int, int]:
    import pyspark

    match = re.match(r"(\d+)\.(\d+)", pyspark.__version__)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def accept_metrics_in_command_streams(spark: Any) -> bool:
    """On a Spark Connect session of an affected PySpark, make its client's command streams
    skip execution metrics instead of failing on them. Returns whether it did; a classic
    session, or a PySpark without the problem, is left as it is."""
    if not type(spark).__module__.startswith("pyspark.sql.connect") or _release() not in _AFFECTED:
        return False
    client = spark.client
    needed = (
        "_execute_plan_request_with_metadata",
        "_set_command_in_plan",
        "_execute_and_fetch_as_iterator",
    )
    if not all(hasattr(client, name) for name in needed):
        return False  # not the client this works around
    if getattr(client, "_wormhole_metrics_accepted", False):
        return True

    def execute_command_as_iterator(
        self: Any, command: Any, observations: Any = None
    ) -> Iterator[dict[str, Any]]:
        from pyspark.errors import PySparkValueError
        from pyspark.sql.connect.client.core import PlanObservedMetrics
        from pyspark.sql.metrics import PlanMetrics

        request = self._execute_plan_request_with_metadata()
        self._set_command_in_plan(request.plan, command)
        for response in self._execute_and_fetch_as_iterator(request, observations or {}):
            if isinstance(response, dict):
                yield response
            elif not isinstance(response, PlanMetrics | PlanObservedMetrics):
                raise PySparkValueError(
                    errorClass="UNKNOWN_RESPONSE", messageParameters={"response": str(response)}
                )

    client.execute_command_as_iterator = MethodType(execute_command_as_iterator, client)
    client._wormhole_metrics_accepted = True
    return True
