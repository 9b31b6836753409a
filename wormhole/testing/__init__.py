"""Test helpers for Wormhole and for plugin authors.

Installed as a pytest plugin (entry point ``pytest11``), so its fixtures are
available in any project that installs Wormhole:

* ``wormhole_cli`` runs the ``wormhole`` command in a subprocess;
* ``pipeline_file`` writes a pipeline (a dict) to a YAML file;
* ``free_port`` returns a free loopback TCP port;
* :func:`wait_until` polls a condition with a deadline (never a bare sleep);
* :func:`read_envelopes` parses a ``jsonl`` sink's output;
* :class:`ThrottlingProxy` sits between two ends of a TCP connection to make the
  link slow, stall it or cut it (fault injection).

Fixtures that start real services (PostgreSQL, MariaDB, ZooKeeper, memcached,
a Kafka-protocol broker, Prometheus) live here as connectors arrive. When a service cannot
be started, :func:`require` skips the test, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

from wormhole.testing.helpers import (
    CliResult,
    free_port,
    read_envelopes,
    require,
    run_cli,
    start_cli,
    wait_until,
    write_pipeline,
)
from wormhole.testing.proxy import ThrottlingProxy

__all__ = [
    "CliResult",
    "ThrottlingProxy",
    "free_port",
    "read_envelopes",
    "require",
    "run_cli",
    "start_cli",
    "wait_until",
    "write_pipeline",
]
