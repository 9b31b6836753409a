"""Dead letters: the ``on_error`` policies that give up on a batch, and replaying or purging
what they kept.

With ``applications.<app>.on_error: {policy: dead_letter}`` a batch the sink still
rejects after ``retries`` retries is split in halves, left half first, until the
rejected updates are isolated (:class:`GuardedSink`). Each rejected update goes to the
application's dead-letter log (:mod:`wormhole.subscriber.dead_letter_log`: its format, per-key
parking, reading it), durably, before the batch is acknowledged; everything else is written to
the sink and the flow moves on. With ``policy: stop`` the subscriber stops at the update instead.

A subscriber library guards its sink with :func:`guard_sink` (``Handlers.serve_sink`` and the
in-process subscriber do); ``wormhole dead-letters`` replays and purges with :func:`replay` and
:func:`purge`. The log's names are importable from here too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from wormhole.core.backoff import Backoff
from wormhole.core.errors import WormholeError
from wormhole.core.update import Update
from wormhole.subscriber.dead_letter_log import (
    DIRECTORY,
    KIND_ENTRY,
    KIND_REMOVED,
    KIND_START,
    DeadLetterHook,
    DeadLetterLog,
    Entry,
    KeyId,
    Removed,
    Start,
    count_dead_letters,
    dead_letter_hooks,
    dead_letter_recorded,
    identity_of,
    key_of,
    log_path,
    read_dead_letters,
)
from wormhole.subscriber.dead_letter_log import _encode as _encode

log = logging.getLogger("wormhole.dead_letters")


# ------------------------------------------------------------- the policy
class RetryStopped(Exception):
    """The subscriber stopped while a batch was being retried (it is not acknowledged)."""


class GuardedSink:
    """Write batches to a sink under an application's ``on_error`` policy ``dead_letter``
    or ``stop`` (policy ``retry`` needs none of this: the caller retries until it passes).

    A batch is tried, then retried ``retries`` times with backoff. If it still fails it is
    split in halves, left first, each half tried once, until single updates are isolated;
    a single update gets its own ``retries`` retries and is then rejected: recorded in the
    dead-letter log (``dead_letter``), or the subscriber stops naming it (``stop``; every
    update before it was written, none after). Left-first splitting keeps each key's
    updates in order. A :class:`WormholeError` from the sink is fatal as with ``retry``.
    """

    def __init__(
        self,
        sink: Any,
        application: str,
        policy: str,
        retries: int,
        first_backoff: float,
        max_backoff: float,
        state_dir: Path,
        stop: threading.Event,
        datastore: Callable[[], str] | None = None,
    ) -> None:
        self.sink = sink
        self.datastore = datastore
        """With a registry: the datastore of the batch in hand (flows are per datastore)."""
        self._in_hand = ""
        self.application = application
        self.policy = policy
        self.retries = retries
        self.first_backoff = first_backoff
        self.max_backoff = max_backoff
        self.stop = stop
        self.dead_letters = (
            DeadLetterLog(state_dir, application) if policy == "dead_letter" else None
        )
        if self.dead_letters is not None:
            self.dead_letters.watch()
            self.dead_letters.refresh()

    # The sink's other methods pass through (``open``/``close``), so this can stand in for it.
    def open(self, context: Any) -> None:
        self.sink.open(context)

    def close(self) -> None:
        try:
            self.sink.close()
        finally:
            if self.dead_letters is not None:
                self.dead_letters.close()

    def write(self, updates: list[Update]) -> None:
        dead = self.dead_letters
        if dead is not None:
            self._in_hand = self.datastore() if self.datastore is not None else ""
            if dead.changed():
                # Entries another subscriber of the application added for a flow this one
                # took over, or removed by a replay: waits for a replay of one key at most.
                dead.refresh()
            updates = self._park(updates)
        if not updates:
            return
        error = self._attempt(updates, self.retries)
        if error is not None:
            self._isolate(updates, error)

    def _park(self, updates: list[Update]) -> list[Update]:
        """Send the updates of parked keys to the log behind their key's dead letters;
        the others, in order."""
        dead = self.dead_letters
        if dead is None or not dead.parked:
            return updates
        parked = dead.parked
        datastore = self._in_hand
        if not any(key_of(u, datastore) in parked for u in updates):
            return updates
        with dead.locked():  # parked keys as of now: a replay may just have freed some
            keep: list[Update] = []
            park: list[Update] = []
            for u in updates:
                (park if key_of(u, datastore) in dead.parked else keep).append(u)
            if park:
                dead.add([(u, "parked behind a dead letter of its key") for u in park], datastore)
                log.info(
                    "%s: %d updates of keys with dead letters parked in %s",
                    self.application,
                    len(park),
                    dead.path,
                )
        return keep

    def _attempt(self, updates: list[Update], retries: int) -> Exception | None:
        """Write, retrying ``retries`` times; the last error, or None once written."""
        backoff = None
        attempt = 0
        while True:
            try:
                self.sink.write(updates)
                return None
            except WormholeError:
                raise
            except Exception as exc:
                if attempt >= retries:
                    return exc
                attempt += 1
                if backoff is None:
                    backoff = Backoff(
                        log, first=self.first_backoff, cap=self.max_backoff, stop=self.stop
                    )
                if not backoff.wait(
                    "%s: sink failed to write %d updates (%s: %s); retry %d of %d in %.2fs",
                    self.application,
                    len(updates),
                    type(exc).__name__,
                    exc,
                    attempt,
                    retries,
                ):
                    raise RetryStopped(
                        f"{self.application}: stopped while retrying a batch"
                    ) from exc

    def _isolate(self, updates: list[Update], error: Exception) -> None:
        if len(updates) == 1:
            self._reject(updates[0], error)
            return
        middle = len(updates) // 2
        for half in (updates[:middle], updates[middle:]):
            half = self._park(half)  # the left half may have parked a key of this one
            if not half:
                continue
            failed = self._attempt(half, self.retries if len(half) == 1 else 0)
            if failed is not None:
                self._isolate(half, failed)

    def _reject(self, update: Update, error: Exception) -> None:
        reason = f"{type(error).__name__}: {error}"
        flow = f"datastore {self._in_hand} shard" if self._in_hand else "shard"
        where = (
            f"table {update.table} key {_encode(update.key).decode()} position "
            f"{update.position or update.logical or '?'} ({flow} {update.shard})"
        )
        if self.dead_letters is None:
            raise WormholeError(
                f"application {self.application}: the sink rejected the update of {where} "
                f"after {self.retries} retries: {reason}; on_error policy stop: the subscriber "
                f"stops (its datamarker stays before this update). Fix the sink or the update, "
                f"or set on_error.policy: dead_letter, and start it again"
            ) from error
        with self.dead_letters.locked():
            added = self.dead_letters.add([(update, reason)], self._in_hand)
        log.warning(
            "%s: the sink rejected the update of %s after %d retries (%s); recorded as dead "
            "letter %s in %s, and its key is parked until it is replayed or purged",
            self.application,
            where,
            self.retries,
            reason,
            added[0].id if added else "(already recorded)",
            self.dead_letters.path,
        )


def guard_sink(
    sink: Any,
    app: Any,
    state_dir: Path,
    stop: threading.Event,
    datastore: Callable[[], str] | None = None,
) -> Any:
    """``sink``, or a :class:`GuardedSink` around it when ``app.on_error`` gives up on
    batches (policy ``dead_letter`` or ``stop``)."""
    on_error = app.on_error
    if on_error.policy == "retry":
        return sink
    return GuardedSink(
        sink,
        app.name,
        on_error.policy,
        on_error.attempts_after_first,
        on_error.backoff_ms / 1000.0,
        on_error.max_backoff_ms / 1000.0,
        state_dir,
        stop,
        datastore,
    )


# ------------------------------------------------------------------ replay
class ReplayResult(msgspec.Struct):
    replayed: list[int]
    """Ids delivered to the sink and removed from the log."""
    failed: list[tuple[int, str]]
    """Per key that is still parked: the id the sink rejected again, and why."""


def replay(dead: DeadLetterLog, sink: Any, ids: set[int] | None = None) -> ReplayResult:
    """Deliver parked keys to ``sink``, each key's entries in order, and remove what it took.

    ``ids``: only the keys of these entries (each key from its first entry: a key's later
    updates never go before its earlier ones). A key whose entry the sink rejects again stays
    parked from that entry on; the other keys go on. The log is held exclusively while a key
    is replayed, so a running subscriber parks new updates of that key behind it (or, once
    the key is free, writes them to its sink after the replayed ones).
    """
    result = ReplayResult([], [])
    dead.refresh()
    keys = [key for key, key_ids in dead.parked.items() if ids is None or ids.intersection(key_ids)]
    for key in keys:
        # One key at a time under the lock: subscribers wait for one key's replay at most.
        with dead.locked():
            pending = [dead.entries[i] for i in dead.parked.get(key, [])]
            if not pending:
                continue  # purged meanwhile
            error: tuple[int, str] | None = None
            try:
                sink.write([e.update for e in pending])
                done = pending
            except WormholeError:
                raise
            except Exception:
                # One at a time, to free what the sink takes up to the one it rejects.
                done = []
                for entry in pending:
                    try:
                        sink.write([entry.update])
                    except WormholeError:
                        raise
                    except Exception as exc:
                        error = (entry.id, f"{type(exc).__name__}: {exc}")
                        break
                    done.append(entry)
            if done:
                dead.remove([e.id for e in done], "replayed")
                result.replayed.extend(e.id for e in done)
            if error is not None:
                result.failed.append(error)
    return result


def purge(dead: DeadLetterLog, ids: set[int] | None) -> list[int]:
    """Remove entries (every one with ``ids`` None); the ids removed."""
    with dead.locked():
        chosen = [i for i in dead.entries if ids is None or i in ids]
        dead.remove(chosen, "purged")
    return chosen


__all__ = [
    "DIRECTORY",
    "KIND_ENTRY",
    "KIND_REMOVED",
    "KIND_START",
    "DeadLetterHook",
    "DeadLetterLog",
    "Entry",
    "GuardedSink",
    "KeyId",
    "Removed",
    "ReplayResult",
    "RetryStopped",
    "Start",
    "count_dead_letters",
    "dead_letter_hooks",
    "dead_letter_recorded",
    "guard_sink",
    "identity_of",
    "key_of",
    "log_path",
    "purge",
    "read_dead_letters",
    "replay",
]
