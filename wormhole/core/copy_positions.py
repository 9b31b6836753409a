"""Where a shared datamarker continues in this copy's publisher log (multiple-copy delivery).

A shared datamarker is a *version*: the position mapper's logical position of the last update
before it, the same on every copy of a datastore. :func:`locate` finds, in one copy's log, the
first update after it. :class:`CopyPositions` keeps, for each application, where the shared
datamarkers map into this copy's log, and what the log must therefore retain.
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

from wormhole.core.errors import StateError
from wormhole.core.publisher_log import PublisherLog
from wormhole.core.update import Update
from wormhole.plugins.components import SharedDatamarker
from wormhole.plugins.versions import version_of

if TYPE_CHECKING:
    from wormhole.core.copy_state import CopyState
    from wormhole.core.hub import Hub

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


STATUS_AGE_S = 1.5
"""How old another copy's status may be (each publisher shares its own about once a second).
Before it starts handing an application over, the serving copy asks that the other copy's log
had reached, when it last reported, what the serving copy had shared this long ago: writes
going on, the datamarkers shared now are always past a report a second old. The final check,
once the flows are revoked and the final datamarkers shared, asks for those exactly."""


class CopyPositions:
    """Where the shared datamarkers of each application map into this copy's publisher log:
    followed while standing by, found again on taking over, recorded while serving."""

    def __init__(self, publisher_log: PublisherLog, hub: Hub) -> None:
        self.publisher_log = publisher_log
        self.hub = hub

    def follow(self, state: CopyState, shared: dict[int, SharedDatamarker]) -> str:
        """Standby: map the shared datamarkers into this log; keep the log from them on.
        Returns why this copy cannot stand by for the application ("" if it can)."""
        state.loaded = True
        self._forget_collected(state)
        targets = {
            s: tuple(d.version)
            for s, d in shared.items()
            if s < self.hub.shards and state.mapped.get(s, ((), 0))[0] != tuple(d.version)
        }
        if not targets:
            state.ready = True
            return ""
        try:
            positions = locate(self.publisher_log, targets, max(0, self._scan_from(state, targets)))
        except Behind as exc:
            state.ready, state.why, state.behind = False, str(exc), True
            # Keep what was found, and where the scan ended: the next tick reads on from
            # there rather than the whole log again.
            state.mapped.update({s: (targets[s], seq) for s, seq in exc.found.items()})
            state.scanned = exc.scanned
            return ""
        except Gone as exc:
            state.ready, state.why, state.behind = False, str(exc), False
            return f"cannot stand by: {exc}"
        for shard, seq in positions.items():
            state.mapped[shard] = (targets[shard], seq)
        state.ready = all(s in state.mapped for s in shared if s < self.hub.shards)
        # Keep the update each shared datamarker names, so a takeover after a restart finds it.
        app = self.hub.applications.get(state.name)
        if app is not None:
            with self.hub.lock:
                for shard, (_, seq) in state.mapped.items():
                    flow = app.flows[shard]
                    flow.datamarker = flow.delivered = max(0, seq - 1)
        return ""

    def take_over(self, state: CopyState, shared: dict[int, SharedDatamarker]) -> dict[int, int]:
        """Where each shard continues in this log after the shared datamarkers ``shared``
        (shard -> seq), recorded in ``state``; raises :class:`Behind` or :class:`Gone`."""
        hints = [seq for _, seq in state.mapped.values()]
        start = min(hints) - 1 if hints else self.publisher_log.first_seq
        targets = {s: tuple(d.version) for s, d in shared.items() if s < self.hub.shards}
        positions = locate(self.publisher_log, targets, max(0, start))
        state.loaded = True
        state.mapped.update({s: (targets[s], seq) for s, seq in positions.items()})
        return positions

    def _scan_from(self, state: CopyState, targets: dict[int, Version]) -> int:
        """Where a scan for ``targets`` may start: each target's previous mapping (the new
        version is not older), or where a scan that left it pending ended."""
        starts = []
        for shard, target in targets.items():
            if shard in state.mapped:
                starts.append(state.mapped[shard][1] - 1)
            elif state.scanned is not None and target >= state.scanned[1]:
                starts.append(state.scanned[0] - 1)
            else:
                return self.publisher_log.first_seq
        return min(starts, default=self.publisher_log.first_seq)

    def _forget_collected(self, state: CopyState) -> None:
        """Drop the mappings whose named update this log no longer holds: they are looked
        up again (and refused as Gone), never reported ready from memory."""
        first = self.publisher_log.first_seq
        for shard, (_, seq) in list(state.mapped.items()):
            if seq - 1 < first:
                del state.mapped[shard]

    @staticmethod
    def retained(states: list[CopyState]) -> int | None:
        """The lowest seq of this publisher log that multiple-copy delivery needs: the
        update each shared datamarker names, wherever this copy serves or stands by (0,
        the whole log, for an application whose shared datamarkers it has not read yet).
        None when no shared datamarker needs anything."""
        floor: int | None = None
        for state in states:
            if not state.loaded:
                return 0
            for _, seq in list(state.mapped.values()):
                floor = seq - 1 if floor is None else min(floor, seq - 1)
        return floor

    def at(self, seq: int) -> tuple[str, Version] | None:
        """The logical position and version of the update at ``seq`` (None if not held)."""
        try:
            reader = self.publisher_log.reader(seq)
        except LookupError:
            return None
        try:
            batch = reader.read()
        except LookupError:
            return None
        finally:
            reader.close()
        if batch is None or not batch.updates:
            return None
        update = batch.updates[0]
        return update.logical, version(update)

    def newest(self) -> list[int] | None:
        """The version of the newest update in this copy's publisher log (None if empty)."""
        if self.publisher_log.next_seq <= self.publisher_log.first_seq:
            return None
        try:
            newest = self.at(self.publisher_log.next_seq - 1)
        except StateError:  # a source without versions: reported where it is used
            return None
        return list(newest[1]) if newest is not None else None

    def shared(self, state: CopyState, datamarkers: dict[int, int]) -> dict[int, SharedDatamarker]:
        """The datamarkers (shard -> seq) of the application ``state`` serves that moved past
        what it shared: each as the logical position and version of the update before it."""
        changed: dict[int, SharedDatamarker] = {}
        for shard, position in datamarkers.items():
            if position <= 0:
                continue
            known = self.at(position - 1)
            if known is None:
                continue
            logical, found = known
            previous = state.saved.get(shard)
            if previous is not None and tuple(previous.version) >= found:
                continue
            changed[shard] = SharedDatamarker(logical, found, state.epoch)
        return changed

    @staticmethod
    def remember_shared(state: CopyState) -> None:
        """Record the newest version shared now; forget what is older than needed."""
        newest = max((tuple(d.version) for d in state.saved.values()), default=None)
        if newest is None:
            return
        now = time.monotonic()
        state.shared_at.append((now, newest))
        keep = [i for i, (at, _) in enumerate(state.shared_at) if at <= now - STATUS_AGE_S]
        if keep:
            del state.shared_at[: keep[-1]]

    @staticmethod
    def needed(state: CopyState, age: float) -> Version | None:
        """The newest version this serving copy's shared datamarkers had reached ``age``
        seconds ago (the oldest it remembers, if it has served less long)."""
        if age <= 0 or not state.shared_at:
            return max((tuple(d.version) for d in state.saved.values()), default=None)
        cutoff = time.monotonic() - age
        older = [version for at, version in state.shared_at if at <= cutoff]
        return older[-1] if older else state.shared_at[0][1]


__all__ = ["STATUS_AGE_S", "Behind", "CopyPositions", "Gone", "Version", "locate", "version"]
