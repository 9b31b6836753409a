"""Log readers (protocol version 2): an external application's flows read by range.

A reader connects like a subscriber, says ``hello`` with ``mode: "read"``, and then asks,
one request at a time:

- ``offsets`` -> ``positions``: the log's extent and the application's stored datamarkers;
- ``read {shard, from, to}`` -> ``batch`` frames with that shard's updates of ``[from, to)``
  (each with the ``seqs`` of its updates), then ``read-end``; with ``layout: "columns"``,
  ``columns`` frames instead (the updates a column at a time, see
  :class:`wormhole.core.update.UpdateColumns`);
- ``commit {datamarkers}`` -> ``committed``: the application's datamarkers, stored durably
  at the publisher, which keeps its log from them on.

Publisher side: :class:`~wormhole.connectors.tcp.reads.ReadService` (one per publisher,
held by the server; it owns the :class:`~wormhole.connectors.tcp.range_cache.RangeCache`
its :class:`~wormhole.connectors.tcp.reads.ReaderSession` share). Reader side:
:class:`~wormhole.connectors.tcp.remote_log.TcpRemoteLog`, the ``tcp`` transport's
``remote_log`` (the Spark source's network mode uses it on executors). This module names
them all.
"""

from __future__ import annotations

from wormhole.connectors.tcp.range_cache import CACHE_UPDATES, RangeCache
from wormhole.connectors.tcp.reads import FRAME_ROWS, ReadBatch, ReaderSession, ReadService
from wormhole.connectors.tcp.remote_log import TcpRemoteLog, open_remote_log

__all__ = [
    "CACHE_UPDATES",
    "FRAME_ROWS",
    "RangeCache",
    "ReadBatch",
    "ReadService",
    "ReaderSession",
    "TcpRemoteLog",
    "open_remote_log",
]
