"""Dead letters: updates an application's sink rejected, kept so that the flow moves on.

With ``applications.<app>.on_error: {policy: dead_letter}`` a batch the sink still
rejects after ``retries`` retries is split in halves, left half first, until the
rejected updates are isolated (:class:`GuardedSink`). Each rejected update goes to the
application's dead-letter log, durably, before the batch is acknowledged; everything
else is written to the sink and the flow moves on.

**Per-key order.** A key with a dead letter is *parked*: every later update of the same
key (same flow, same table, same key columns) goes to the dead-letter log behind it
instead of to the sink, until the key's dead letters are replayed or purged. The sink
therefore never sees a newer update of a key before an older one; other keys flow on.

**The log** is ``<state_dir>/dead-letters/<application>.log``, on the machine where the
application's sink runs. It is a sequence of length + CRC framed records
(:mod:`wormhole.plugins.framing`), each payload one JSON object:

* kind 6, ``ENTRY`` (header ``first`` = the entry's id): ``id``, ``application``,
  ``datastore`` (with a registry), ``shard``, ``table``, ``key``, ``position``,
  ``logical``, ``error``, ``ts_ms`` (when it was recorded, Unix ms), ``parked_behind`` (0
  for an update the sink rejected; else the id of the dead letter of its key it waits
  behind) and ``update`` (the update itself);
* kind 7, ``REMOVED``: ``ids`` removed by a replay (``reason: replayed``) or a purge
  (``reason: purged``), with ``ts_ms``;
* kind 8, ``START``: ``next_id``, written first when the log is emptied and started over,
  so that ids are never reused.

Every change is appended under an exclusive ``flock`` of the file and fsynced before it
returns; readers take a shared lock. A torn last record (a writer killed mid-write) is cut
off by the next writer. After a crash between recording a dead letter and acknowledging
its batch, the batch is delivered again and the same update is recorded at most once: an
entry identical to a live one (same flow, same update) is not appended again, and
readers drop any duplicate by that identity.

The log itself is here; the ``on_error`` policy that fills it (:func:`guard_sink`), and
replay and purge, are in :mod:`wormhole.subscriber.dead_letters`. The commands (``status``,
``top``, ``dead-letters``) read the log with the functions below.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from wormhole.core.errors import StateError
from wormhole.core.update import Update
from wormhole.plugins.framing import TornTail, frame, fsync_directory, read_records

log = logging.getLogger("wormhole.dead_letters")

KIND_ENTRY = 6
KIND_REMOVED = 7
KIND_START = 8

DIRECTORY = "dead-letters"


class Entry(msgspec.Struct, kw_only=True):
    """One dead letter: an update the sink rejected, or one parked behind it."""

    id: int
    application: str
    datastore: str = ""
    """With a registry: the datastore (publisher) whose flow it came from."""
    shard: int
    table: str
    key: dict[str, Any]
    position: str
    logical: str
    error: str
    ts_ms: int
    parked_behind: int = 0
    update: Update


class Removed(msgspec.Struct, kw_only=True):
    ids: list[int]
    reason: str
    ts_ms: int


class Start(msgspec.Struct, kw_only=True):
    next_id: int


_encode = msgspec.json.Encoder().encode
_entry_decoder = msgspec.json.Decoder(Entry)
_removed_decoder = msgspec.json.Decoder(Removed)
_start_decoder = msgspec.json.Decoder(Start)

KeyId = tuple[str, int, str, bytes]


def key_of(update: Update, datastore: str = "") -> KeyId:
    """What per-key order is about: the flow (datastore and shard), the table and the key
    columns."""
    return (datastore, update.shard, update.table, _encode(update.key))


def identity_of(entry: Entry) -> tuple[str, int, bytes]:
    return (entry.datastore, entry.shard, _encode(entry.update))


# ------------------------------------------------------------------ the hook
DeadLetterHook = Callable[[str, Entry], None]

dead_letter_hooks: list[DeadLetterHook] = []
"""Called with ``(application, entry)`` for every entry once it is durable in the log:
the one place a dead letter is counted (metrics append their counter here)."""


def dead_letter_recorded(application: str, entry: Entry) -> None:
    """A dead letter (or an update parked behind one) is now durable in the log."""
    for hook in dead_letter_hooks:
        try:
            hook(application, entry)
        except Exception:  # a counter must never stop the flow
            log.exception("dead-letter hook %r failed", hook)


def _count(application: str, entry: Entry) -> None:
    from wormhole.plugins.events import dead_lettered, parked

    if entry.parked_behind:
        parked(application)
    else:
        dead_lettered(application)


dead_letter_hooks.append(_count)


def log_path(state_dir: Path, application: str) -> Path:
    return state_dir / DIRECTORY / f"{application}.log"


class DeadLetterLog:
    """One application's dead-letter log; safe to share between processes (flock) and
    between threads of one process (a lock)."""

    def __init__(self, state_dir: Path, application: str) -> None:
        self.application = application
        self.path = log_path(state_dir, application)
        self.entries: dict[int, Entry] = {}
        """Live entries by id, in log order."""
        self.parked: dict[KeyId, list[int]] = {}
        """Keys with live entries, and their ids in order."""
        self._identities: dict[tuple[str, int, bytes], int] = {}
        self.next_id = 1
        self._fd = -1
        self._writable = False
        self._ino = -1
        self._offset = 0
        self._seen: tuple[int, int, int] | None = None
        self._lock = threading.RLock()

    # ------------------------------------------------------------- reading
    def _open(self, create: bool) -> bool:
        """Open the file (read-write with ``create``); False if it does not exist."""
        if self._fd >= 0 and (self._writable or not create):
            return True
        self._close_fd()
        try:
            if create:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
                fsync_directory(str(self.path.parent))
            else:
                fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StateError(
                f"cannot open the dead-letter log {self.path}: {exc}; make the state_dir "
                f"writable or choose another"
            ) from exc
        self._fd = fd
        self._writable = create
        return True

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _flock(self, create: bool, mode: int) -> bool:
        """Lock the current file: one that was replaced while waiting (a log started over)
        is let go and the new one locked. False if there is no file (or, with LOCK_NB,
        another process holds it)."""
        while True:
            if not self._open(create):
                return False
            try:
                fcntl.flock(self._fd, mode)
            except BlockingIOError:
                return False
            try:
                current = os.stat(self.path).st_ino
            except FileNotFoundError:
                current = -1
            if current == os.fstat(self._fd).st_ino:
                return True
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._close_fd()

    def _reset(self) -> None:
        self.entries.clear()
        self.parked.clear()
        self._identities.clear()
        self.next_id = 1
        self._offset = 0

    def _read_new(self) -> int | None:
        """Apply records appended since the last read; returns the offset of a torn tail
        (a writer died mid-record), or None. Caller holds a flock."""
        st = os.fstat(self._fd)
        if st.st_ino != self._ino or st.st_size < self._offset:
            self._reset()  # a log that started over
            self._ino = st.st_ino
        torn = None
        with os.fdopen(os.dup(self._fd), "rb") as f:
            try:
                for record in read_records(f, str(self.path), self._offset, st.st_size):
                    self._apply(record.kind, record.payload)
                    self._offset = record.end
            except TornTail as exc:
                torn = exc.offset
        self._seen = (st.st_ino, st.st_size, st.st_mtime_ns)
        return torn

    def _apply(self, kind: int, payload: bytes) -> None:
        if kind == KIND_ENTRY:
            entry = _entry_decoder.decode(payload)
            self.next_id = max(self.next_id, entry.id + 1)
            identity = identity_of(entry)
            if identity in self._identities:
                return  # recorded again after a crash: the first one stands
            self.entries[entry.id] = entry
            self._identities[identity] = entry.id
            self.parked.setdefault(key_of(entry.update, entry.datastore), []).append(entry.id)
        elif kind == KIND_REMOVED:
            for entry_id in _removed_decoder.decode(payload).ids:
                gone = self.entries.pop(entry_id, None)
                if gone is None:
                    continue
                self._identities.pop(identity_of(gone), None)
                key = key_of(gone.update, gone.datastore)
                ids = self.parked.get(key, [])
                with contextlib.suppress(ValueError):
                    ids.remove(entry_id)
                if not ids:
                    self.parked.pop(key, None)
        elif kind == KIND_START:
            self.next_id = max(self.next_id, _start_decoder.decode(payload).next_id)

    def refresh(self) -> None:
        """Read what other processes appended (waiting while one is changing the log)."""
        with self._lock:
            if not self._flock(False, fcntl.LOCK_SH):
                return
            try:
                self._read_new()
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def watch(self) -> None:
        """Create the file if needed and keep it open, so that :meth:`changed` is one fstat."""
        with self._lock:
            self._open(create=True)

    def changed(self) -> bool:
        """Whether the file changed since it was last read: one fstat of the open file (a
        file replaced by a log that started over has no links left), else one stat."""
        fd = self._fd
        try:
            st = os.fstat(fd) if fd >= 0 else os.stat(self.path)
        except FileNotFoundError:
            return False
        except OSError:
            return True  # closed meanwhile: read again
        if st.st_nlink == 0:
            return True
        return self._seen != (st.st_ino, st.st_size, st.st_mtime_ns)

    # ------------------------------------------------------------- writing
    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the log exclusively, up to date, a torn tail cut off: what is decided
        inside (is this key parked?) stays true until it is appended."""
        with self._lock:
            self._flock(True, fcntl.LOCK_EX)
            try:
                size = os.fstat(self._fd).st_size
                torn = self._read_new()
                if torn is not None:
                    os.ftruncate(self._fd, torn)
                    os.fsync(self._fd)
                    log.warning(
                        "%s: removed a torn last record (%d bytes) left by an interrupted "
                        "write; what it held was never acknowledged and is delivered again",
                        self.path,
                        size - torn,
                    )
                    self._read_new()
                yield
            finally:
                if self._fd >= 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _append(self, records: list[bytes]) -> None:
        data = b"".join(records)
        size = os.fstat(self._fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)
            raise StateError(f"cannot write the dead-letter log {self.path}: {exc}") from exc
        self._read_new()

    def add(self, rejected: list[tuple[Update, str]], datastore: str = "") -> list[Entry]:
        """Record updates (with why): each is parked behind the first live entry of its key,
        if there is one. Durable when this returns. Caller holds :meth:`locked`."""
        now = int(time.time() * 1000)
        records = []
        added = []
        first_of: dict[KeyId, int] = {}  # keys this call parks that had no entry
        identities: set[tuple[str, int, bytes]] = set()
        next_id = self.next_id
        for update, error in rejected:
            key = key_of(update, datastore)
            ahead = self.parked.get(key)
            behind = ahead[0] if ahead else first_of.get(key, 0)
            entry = Entry(
                id=next_id,
                application=self.application,
                datastore=datastore,
                shard=update.shard,
                table=update.table,
                key=update.key,
                position=update.position,
                logical=update.logical,
                error=error,
                ts_ms=now,
                parked_behind=behind,
                update=update,
            )
            identity = identity_of(entry)
            if identity in self._identities or identity in identities:
                continue  # already recorded (delivered again after a crash)
            identities.add(identity)
            first_of.setdefault(key, next_id)
            next_id += 1
            records.append(frame(KIND_ENTRY, entry.id, 1, _encode(entry)))
            added.append(entry)
        if records:
            self._append(records)
            for entry in added:
                dead_letter_recorded(self.application, entry)
        return added

    def remove(self, ids: list[int], reason: str) -> None:
        """Remove entries (durably); a log left empty starts over in a new file (ids go
        on from where they were). Caller holds :meth:`locked`."""
        ids = [i for i in ids if i in self.entries]
        if not ids:
            return
        payload = _encode(Removed(ids=ids, reason=reason, ts_ms=int(time.time() * 1000)))
        self._append([frame(KIND_REMOVED, 0, len(ids), payload)])
        if not self.entries:
            self._start_over()

    def _start_over(self) -> None:
        next_id = self.next_id
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, frame(KIND_START, next_id, 0, _encode(Start(next_id=next_id))))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, self.path)
        fsync_directory(str(self.path.parent))
        # Others waiting for the old file's lock find it replaced and take the new one's.
        self._close_fd()
        self._flock(True, fcntl.LOCK_EX)
        self._read_new()

    def close(self) -> None:
        with self._lock:
            self._close_fd()
            self._seen = None


def read_dead_letters(state_dir: Path, application: str) -> DeadLetterLog:
    """An application's dead-letter log, read (for ``status`` and ``dead-letters list``)."""
    dead = DeadLetterLog(state_dir, application)
    try:
        dead.refresh()
    finally:
        dead.close()
    return dead


def count_dead_letters(state_dir: Path) -> dict[str, int]:
    """Live entries per application, for every log in ``state_dir`` (``wormhole status``)."""
    directory = state_dir / DIRECTORY
    counts: dict[str, int] = {}
    if not directory.is_dir():
        return counts
    for path in sorted(directory.glob("*.log")):
        counts[path.stem] = len(read_dead_letters(state_dir, path.stem).entries)
    return counts
