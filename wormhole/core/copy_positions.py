"""Where a shared datamarker continues in this copy's publisher log (multiple-copy delivery).

A shared datamarker is a *version*: the position mapper's logical position of the last update
before it, the same on every copy of a datastore. :func:`locate` finds, in one copy's log, the
first update after it.
"""

from __future__ import annotations

import bisect

from wormhole.core.errors import StateError
from wormhole.core.publisher_log import PublisherLog
from wormhole.core.update import Update
from wormhole.plugins.versions import version_of

Version = tuple[int, ...]


class Behind(StateError):
    """This copy's publisher log has not reached a shared datamarker yet."""

    def __init__(
        self,
        message: str,
        found: dict[int, int] | None = None,
        scanned: tuple[int, Version] | None = None,
    ) -> None:
        super().__init__(message)
        self.found = found or {}
        """The targets that were found meanwhile (shard -> seq)."""
        self.scanned = scanned
        """The seq the scan reached and the version before it: every target still pending
        is at or after that version, so a later scan for them may start at ``seq - 1``."""


class Gone(StateError):
    """A shared datamarker is older than this copy's publisher log: it cannot serve from it
    without skipping updates."""


def version(update: Update) -> Version:
    found = version_of(update)
    if found is None:
        raise StateError(
            f"multiple-copy delivery: updates of {update.connector or 'this source'} carry no "
            f"position comparable across copies (position {update.position!r}, logical "
            f"{update.logical!r}); use a source whose position mapper gives versions "
            f"(MariaDB GTIDs, LogWriter logs, PostgreSQL commit LSNs)"
        )
    return tuple(found)


def locate(publisher_log: PublisherLog, targets: dict[int, Version], start: int) -> dict[int, int]:
    """For each target version, the first seq of this publisher log, at or after ``start``,
    whose update's version is greater (the log's end when none is, as long as the log
    holds the target's own update). Raises :class:`Behind` for targets the log has not
    reached, :class:`Gone` for targets older than where the scan starts."""
    pending = sorted(targets.items(), key=lambda item: item[1])
    found: dict[int, int] = {}
    if not pending:
        return found
    first_seq = publisher_log.first_seq
    start = max(start, first_seq)
    reader = publisher_log.reader(start)
    last: Version | None = None
    try:
        while pending:
            batch = reader.read()
            if batch is None:
                break
            if not batch.updates:
                continue
            if last is None:
                head = version(batch.updates[0])
                if head > pending[0][1]:
                    shard, target = pending[0]
                    raise Gone(
                        f"the shared datamarker of shard {shard} (version {target}) is older "
                        f"than this copy's publisher log from seq {start} (version {head}): "
                        f"this copy does not hold the updates after it"
                    )
            versions = [version(u) for u in batch.updates]
            last = versions[-1]
            while pending and pending[0][1] < last:
                shard, target = pending.pop(0)
                found[shard] = batch.first_seq + bisect.bisect_right(versions, target)
        if pending and last is not None and last >= pending[-1][1]:
            # The log ends exactly at the targets' own updates: serve from its end.
            for shard, _ in pending:
                found[shard] = publisher_log.next_seq
            pending = []
        scanned = (reader.position, last) if last is not None else None
    finally:
        reader.close()
    if pending:
        shard, target = pending[-1]
        raise Behind(
            f"this copy's publisher log has not reached the shared datamarker of shard {shard} "
            f"(version {target}; its newest update: {last})",
            found,
            scanned,
        )
    return found


__all__ = ["Behind", "Gone", "Version", "locate", "version"]
