"""The ``filelog`` source: tails JSON-lines files and LogWriter logs.

``path`` is one file, or a directory whose files are read in name order (numbers
compared as numbers, so ``log.10.0`` follows ``log.9.0``), the last one tailed as
it grows. A directory that holds only subdirectories is a set of *streams*, one
per subdirectory (LogWriter session directories, say), read side by side.

Each file is plain JSON lines (one update per line, see the file-log line format)
or a LogWriter log (recognised by its framing). LogWriter messages carry a
publisher id and a sequence number; a message whose ``(publisher id, seq)`` was
already delivered, from any stream, is dropped, which makes a restarted
publisher or two publishers writing the same stream deliver each message once.

The checkpoint stored with every batch in the publisher log is
``{"streams": {stream: [file, offset]}, "seen": {publisher_id: last_seq}}``.

A line (or LogWriter message) that is not an update is skipped and kept in the state
dir's rejects file (see :mod:`.rejects`), or stops the source (``on_decode_error: stop``)
after what precedes it is delivered.
"""

from __future__ import annotations

from wormhole.connectors.filelog.options import FilelogOptions
from wormhole.connectors.filelog.positions import FilelogPositionMapper, natural_key, natural_name
from wormhole.connectors.filelog.source import FilelogSource
from wormhole.connectors.filelog.stream import Stream
from wormhole.plugins.components import Capabilities, log_reader

__all__ = [
    "FilelogOptions",
    "FilelogPositionMapper",
    "FilelogSource",
    "Stream",
    "natural_key",
    "natural_name",
]


wormhole_sources, wormhole_position_mappers = log_reader(
    "filelog",
    source=FilelogSource,
    options=FilelogOptions,
    description="Tail JSON-lines files or LogWriter logs (deduplicated by publisher seq).",
    capabilities=Capabilities(lag=True),
    mapper=FilelogPositionMapper,
    mapper_description="File name and offset, or LogWriter publisher seq, as per-key versions.",
)
