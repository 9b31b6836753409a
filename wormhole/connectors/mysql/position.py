"""Positions of the ``mysql`` source in the binlog, and the checkpoint they are stored as.

A change's native position is ``<binlog file>:<offset of its transaction's GTID
event>:<index in the transaction>``; its logical position is the transaction's GTID
(MariaDB ``domain-server-sequence``, MySQL ``uuid:sequence``). The checkpoint stored with
every batch is::

    {"phase": "stream", "file": F, "pos": P, "gtid_state": "0-1-41,1-2-7",
     "gtid": "0-1-42", "index": 17, "server_id": 1}

``F:P`` is the end of the last complete transaction emitted and ``gtid_state`` the GTID
position there; ``gtid``/``index`` name the transaction emitted in part (a large
transaction goes out in chunks) and the last change of it emitted. ``server_id`` is the
server whose binlog ``F:P`` is in. Inside the source a position is a
:class:`BinlogPosition`; the dict is only what the publisher log stores.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_FILE_NUMBER = re.compile(r"(\d+)$")


@dataclass(frozen=True, slots=True)
class BinlogPosition:
    """Where the stream stands after what was emitted (see the module docstring)."""

    file: str
    """The binlog file of the end of the last complete transaction emitted."""
    pos: int
    """The offset in ``file`` of that end."""
    gtid_state: str = ""
    """The GTID position there (``0-1-41,1-2-7``; MariaDB's, or the last MySQL GTID)."""
    gtid: str = ""
    """The transaction emitted in part, if any."""
    index: int = -1
    """The index of the last change emitted of ``gtid``."""
    server_id: int = 0
    """The server whose binlog ``file`` is."""

    @classmethod
    def from_checkpoint(cls, checkpoint: Mapping[str, Any], server_id: int) -> BinlogPosition:
        """The position of a stream checkpoint; ``server_id`` when it names none."""
        return cls(
            str(checkpoint["file"]),
            int(checkpoint["pos"]),
            str(checkpoint.get("gtid_state", "")),
            str(checkpoint.get("gtid", "")),
            int(checkpoint.get("index", -1)),
            int(checkpoint.get("server_id", server_id)),
        )

    def checkpoint(self) -> dict[str, Any]:
        """The checkpoint stored in the publisher log."""
        return {
            "phase": "stream",
            "file": self.file,
            "pos": self.pos,
            "gtid_state": self.gtid_state,
            "gtid": self.gtid,
            "index": self.index,
            "server_id": self.server_id,
        }


def file_number(name: str) -> int:
    """The number a binlog file name ends with (``mysql-bin.000042``: 42)."""
    match = _FILE_NUMBER.search(name)
    return int(match.group(1)) if match else 0


def gtid_state_text(state: dict[int, str]) -> str:
    """A GTID state by domain as the server writes it (``0-1-41,1-2-7``)."""
    return ",".join(state[d] for d in sorted(state))


def parse_gtid_state(text: str) -> dict[int, str]:
    """A GTID state (``0-1-41,1-2-7``) by domain; MySQL's last GTID (``uuid:sequence``,
    which belongs to no domain) as domain 0."""
    state: dict[int, str] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        state[0 if ":" in part else int(part.split("-")[0])] = part
    return state


def seen_sequences(state: dict[int, str]) -> dict[int, int]:
    """The sequence number of each domain's GTID of a GTID state (MariaDB; none of MySQL's
    ``uuid:sequence``)."""
    return {d: int(g.rsplit("-", 1)[1]) for d, g in state.items() if "-" in g and ":" not in g}
