"""The primary key each published table had, at points of the WAL.

pgoutput's Relation message flags the replica identity columns. With ``REPLICA
IDENTITY DEFAULT`` they are the primary key as it was at that point of the WAL,
and with ``USING INDEX`` the index's columns: the key needs nothing else. With
``FULL`` every column is flagged and with ``NOTHING`` none, so the message does not
say which columns are the primary key. The catalog says it only for the table as it
is now, which is not the table as it was if the table was altered or dropped since
the change was made.

So the source records, for each relation OID, the columns of each version of the
table it met (name, type, typmod, as the Relation message lists them) and the
primary key that version had. Entries come from the catalog in the slot's exported
snapshot (exact at the slot's start), from DEFAULT Relation messages (exact), and
from the catalog read while a Relation message arrives and the catalog still
describes the same columns and replica identity. The history is a JSON file in the
state directory, so a later run that decodes old WAL finds what an earlier run saw.

With the schema trigger (see ``schema_trigger``), every DDL writes the table's version
into the WAL at the DDL's own position: these *in-band* entries are exact at every point
of the WAL and are kept apart from the others (``in_band``), ordered by (commit LSN, the
message's index in its transaction, counted with the changes).
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

Columns = list[tuple[str, int, int]]
"""(name, type oid, typmod) of each column, in column order."""


class Entry(msgspec.Struct, array_like=True):
    lsn: int
    """The commit LSN of the transaction whose Relation message (or snapshot) this describes."""
    identity: str
    columns: Columns
    primary_key: list[str]
    """Empty when the table had no primary key."""
    index: int = -1
    """In-band entries: the message's index in its transaction (the changes and the schema
    trigger's messages are counted together); a change at a greater index comes after it."""
    in_band: bool = False
    """Written into the WAL by the schema trigger (exact at its position). An in-band entry
    whose ``identity`` is empty records the table's drop."""
    published: bool = False
    """In-band entries: the source's publication published the table after the DDL."""

    def same_version(self, other: Entry) -> bool:
        return (
            self.identity == other.identity
            and self.columns == other.columns
            and self.primary_key == other.primary_key
        )


_decode = msgspec.json.Decoder(dict[str, list[Entry]]).decode
_encode = msgspec.json.Encoder().encode


class SchemaHistory:
    """Entries per relation OID, in WAL order; saved to ``path`` by :meth:`save`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[int, list[Entry]] = {}
        self.in_band: dict[int, list[Entry]] = {}
        self.dirty = False
        if path.exists():
            for oid, found in _decode(path.read_bytes()).items():
                self.entries[int(oid)] = [e for e in found if not e.in_band]
                in_band = [e for e in found if e.in_band]
                if in_band:
                    self.in_band[int(oid)] = in_band

    def reset(self, entries: dict[int, Entry]) -> None:
        """Start over (a new slot): the tables as they are at its start."""
        self.entries = {oid: [entry] for oid, entry in entries.items()}
        self.in_band = {}
        self.dirty = True

    def record_in_band(self, oid: int, entry: Entry) -> None:
        """Add a version the schema trigger wrote at (``entry.lsn``, ``entry.index``); a
        replay of the same WAL adds nothing."""
        found = self.in_band.setdefault(oid, [])
        at = (entry.lsn, entry.index)
        index = len(found)
        while index and (found[index - 1].lsn, found[index - 1].index) > at:
            index -= 1
        if index and (found[index - 1].lsn, found[index - 1].index) == at:
            if found[index - 1].same_version(entry):
                return
            found[index - 1] = entry
        else:
            found.insert(index, entry)
        self.dirty = True

    def prune(self, confirmed: int) -> None:
        """Forget in-band entries no change still to be decoded can need: the slot resends
        nothing that commits before ``confirmed``, so of the entries before it only the
        newest is kept, and none of a table whose newest entry there is its drop."""
        for oid, found in list(self.in_band.items()):
            older = 0
            while older < len(found) and found[older].lsn < confirmed:
                older += 1
            stale = older - 1 if older and found[older - 1].identity else older
            if stale > 0:
                del found[:stale]
                self.dirty = True
            if not found:
                del self.in_band[oid]

    def published(self, oid: int) -> bool:
        """Whether the source's publication published the table when it was last seen."""
        in_band = self.in_band.get(oid)
        if in_band:
            return in_band[-1].published
        return bool(self.entries.get(oid))

    def in_band_at(self, oid: int, lsn: int, index: int) -> Entry | None:
        """The version the schema trigger recorded last at or before index ``index`` of the
        transaction that commits at ``lsn`` (a change there comes after it), if any."""
        for entry in reversed(self.in_band.get(oid, ())):
            if entry.lsn < lsn or (entry.lsn == lsn and entry.index <= index):
                return entry
        return None

    def record(self, oid: int, entry: Entry) -> None:
        """Add a version of the table, unless it is the version already in force at its LSN."""
        found = self.entries.setdefault(oid, [])
        index = len(found)
        while index and found[index - 1].lsn > entry.lsn:
            index -= 1
        if index and found[index - 1].same_version(entry):
            return
        if index and found[index - 1].lsn == entry.lsn:
            found[index - 1] = entry
        else:
            found.insert(index, entry)
        self.dirty = True

    def with_columns(self, oid: int, lsn: int, columns: Columns) -> Entry | None:
        """The newest entry at or before ``lsn`` with these columns, else the oldest after it."""
        later = None
        for entry in reversed(self.entries.get(oid, ())):
            if entry.columns == columns:
                if entry.lsn <= lsn:
                    return entry
                later = entry
        return later

    def nearest(self, oid: int, lsn: int) -> list[Entry]:
        """Every entry of ``oid``: the newest at or before ``lsn`` first, then those after it."""
        found = self.entries.get(oid, [])
        before = [e for e in found if e.lsn <= lsn]
        return before[::-1] + [e for e in found if e.lsn > lsn]

    def save(self) -> None:
        """Write the history if it changed: to a new file, then renamed over the old one."""
        if not self.dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(self.path.name + ".new")
        with open(temporary, "wb") as out:
            merged = {oid: list(found) for oid, found in self.entries.items()}
            for oid, found in self.in_band.items():
                merged.setdefault(oid, []).extend(found)
            out.write(_encode({str(oid): found for oid, found in merged.items()}))
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, self.path)
        self.dirty = False
