"""Lines and records of the ``filelog`` source that are not updates.

With ``on_decode_error: fallback`` (the default) such a line (or LogWriter record, or one
message of a record) is not delivered: it is appended to ``<state_dir>/filelog-rejects.jsonl``
and fsynced before the batch that moves the position past it is returned, so the position
never passes data that was not kept somewhere durable. A warning names the file, line,
offset and fix, and ``wormhole_source_rejected_records`` counts it. Each entry is a JSON
object: ``file``, ``offset``, ``line`` (JSON lines) or ``seq`` (LogWriter), ``reason``,
and the data as ``text`` (UTF-8) or ``hex`` (anything else). After a crash a line may be
recorded twice; ``file`` and ``offset`` tell the copies apart.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import msgspec

from wormhole.core.errors import SourceError
from wormhole.core.update import Update
from wormhole.plugins import events
from wormhole.plugins.framing import fsync_directory

log = logging.getLogger("wormhole.filelog")

REJECTS_FILE = "filelog-rejects.jsonl"
_LOGGED_PER_FILE = 10
_encode = msgspec.json.Encoder().encode
_line_decoder = msgspec.json.Decoder(Update)
_raw_list_decoder = msgspec.json.Decoder(list[msgspec.Raw])
_MISSING = re.compile(r"missing required field `(\w+)`|at `\$\.(\w+)")


class Rejects:
    """The rejects file of one source: entries are buffered, then made durable together
    (:meth:`flush`) before the batch that passes them is handed on."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / REJECTS_FILE
        self.pending: list[bytes] = []
        self.logged: dict[str, int] = {}

    def add(self, table: str, column: str, entry: dict[str, Any], data: bytes) -> None:
        """Record ``data`` (a line or a record's payload) with ``entry`` describing it;
        ``table`` and ``column`` label the metric."""
        try:
            entry["text"] = data.decode()
        except UnicodeDecodeError:
            entry["hex"] = data.hex()
        self.pending.append(_encode(entry) + b"\n")
        events.rejected_record(table, column)
        file = entry["file"]
        logged = self.logged.get(file, 0)
        if logged < _LOGGED_PER_FILE:
            self.logged[file] = logged + 1
            where = f"line {entry['line']}" if "line" in entry else f"seq {entry['seq']}"
            log.warning(
                "%s: %s (offset %d): %s; skipped and recorded in %s. Fix the producer (each "
                "line one update object), deliver the recorded data again if it matters, or "
                "set source.on_decode_error: stop to stop at such data%s",
                file,
                where,
                entry["offset"],
                entry["reason"],
                self.path,
                " (further ones of this file are only counted)"
                if logged == _LOGGED_PER_FILE - 1
                else "",
            )

    def flush(self) -> None:
        """Make the buffered entries durable (append, fsync)."""
        if not self.pending:
            return
        data = b"".join(self.pending)
        try:
            new = not self.path.exists()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            if new:
                fsync_directory(str(self.path.parent))
        except OSError as exc:
            raise SourceError(
                f"{self.path}: cannot record rejected source data ({exc.strerror}); free space "
                f"or fix the permissions of the state_dir, then run again"
            ) from exc
        self.pending.clear()


def salvage(
    rejects: Rejects,
    path: str,
    table: str,
    where: tuple[int, int, int],
    payload: bytes,
    error: str,
) -> list[Update | None]:
    """A LogWriter record (``where``: first seq, offset, last seq already delivered) whose
    payload does not decode as a whole: its messages that decode, None in place of each
    that does not (recorded in ``rejects``), or none at all if the payload is not a JSON
    array (the whole record recorded)."""
    first, offset, seen = where
    try:
        items = _raw_list_decoder.decode(payload)
    except msgspec.DecodeError:
        entry = {"file": path, "seq": first, "offset": offset}
        entry["reason"] = f"undecodable LogWriter record ({error})"
        rejects.add(table, "", entry, payload)
        return []
    out: list[Update | None] = []
    for i, item in enumerate(items):
        try:
            out.append(decode_line(bytes(item)))
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            out.append(None)
            if first + i > seen:
                entry = {"file": path, "seq": first + i, "offset": offset}
                entry["reason"] = f"undecodable LogWriter message ({exc})"
                rejects.add(table, missing_field(str(exc)), entry, bytes(item))
    return out


def utf8(data: bytes) -> bool:
    """Whether ``data`` is UTF-8 (msgspec passes other bytes through inside a raw row)."""
    if data.isascii():
        return True
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def utf8_or_raise(data: bytes) -> bytes:
    """``data``, or ``UnicodeDecodeError`` if it is not UTF-8."""
    if not data.isascii():
        data.decode()
    return data


def decode_line(line: bytes) -> Update:
    """One update line (``msgspec.DecodeError`` or ``UnicodeDecodeError`` if it is not)."""
    return _line_decoder.decode(utf8_or_raise(line))


def missing_field(error: str) -> str:
    """The key a decode error names (missing, or of the wrong type), or empty: the
    metric's ``column``."""
    found = _MISSING.search(error)
    return (found.group(1) or found.group(2)) if found else ""
