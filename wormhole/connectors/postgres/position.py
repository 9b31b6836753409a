"""A position of the ``postgres`` source's stream, and the checkpoint it is stored as.

A change's native position is ``<commit LSN>:<index in its transaction>``. The stream
stands after change ``index`` of the transaction that commits at ``lsn`` (``complete``:
after the whole of it), and ``flush`` is the end LSN of the last complete transaction, the
furthest the slot may be confirmed to. The checkpoint stored with every batch is::

    {"phase": "stream", "lsn": <commit LSN of the last transaction emitted>,
     "index": <last change index emitted in it>, "complete": <whole transaction?>,
     "flush": <end LSN of the last complete transaction>}

so a restart resumes exactly, even in the middle of a large transaction that was emitted
in chunks (bounded memory). Its keys, their order and their types are those of every log
written so far: a change to them would not resume from an existing log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wormhole.connectors.postgres import pgoutput as pg


@dataclass(frozen=True, slots=True)
class StreamPosition:
    """After change ``index`` of the transaction that commits at ``lsn``."""

    lsn: int
    index: int = -1
    """-1: before the transaction's first change."""
    complete: bool = True
    """Every change of the transaction is before this position."""
    flush: int = 0
    """The end LSN of the last complete transaction."""

    @classmethod
    def start(cls, lsn: int) -> StreamPosition:
        """The position of a slot created at ``lsn``: nothing of its stream read yet."""
        return cls(lsn, -1, True, lsn)

    @classmethod
    def from_checkpoint(cls, checkpoint: Any) -> StreamPosition:
        """The position a stream checkpoint stores (``index``, ``complete`` and ``flush`` may
        be missing from older ones)."""
        lsn = checkpoint["lsn"]
        return cls(
            pg.parse_lsn(lsn),
            int(checkpoint.get("index", -1)),
            bool(checkpoint.get("complete", True)),
            pg.parse_lsn(checkpoint.get("flush", lsn)),
        )

    def checkpoint(self) -> dict[str, Any]:
        """The checkpoint that stores this position."""
        return {
            "phase": "stream",
            "lsn": pg.lsn_text(self.lsn),
            "index": self.index,
            "complete": self.complete,
            "flush": pg.lsn_text(self.flush),
        }

    def skips(self, lsn: int) -> bool:
        """Whether every change of the transaction that commits at ``lsn`` comes before
        this position (a resent transaction emitted before)."""
        return lsn < self.lsn or (lsn == self.lsn and self.complete)
