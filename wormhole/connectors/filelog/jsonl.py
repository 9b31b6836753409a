"""JSON-lines files of the file log: whole lines to updates, bad lines to rejects."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import accumulate
from operator import itemgetter
from pathlib import Path
from typing import BinaryIO

import msgspec

from wormhole.connectors.filelog.options import FilelogOptions
from wormhole.connectors.filelog.rejects import Rejects, decode_line, missing_field, utf8
from wormhole.connectors.filelog.stream import Stream
from wormhole.core.errors import SourceError
from wormhole.core.update import NULL, OPS, Update

_rows_decoder = msgspec.json.Decoder(list[tuple[Update]])
"""JSON lines as ``[[line 1],[line 2],...]``: exactly one update per line."""
_OPEN_BRACE = ord("{")
_VALID_OPS = frozenset(OPS)
_PLUS_ONE = (1).__add__
_FIRST = itemgetter(0)
_encode = msgspec.json.Encoder().encode


class JsonlReader:
    """Reads a JSON-lines file of a stream from its position, a batch at a time."""

    def __init__(self, options: FilelogOptions, rejects: Rejects) -> None:
        self.options = options
        self.rejects = rejects
        self.stop_at_bad = options.on_decode_error == "stop"

    def read(
        self, stream: Stream, handle: BinaryIO, size: int, rolled: bool
    ) -> list[Update] | None:
        want = int(self.options.batch_bytes)
        start = stream.offset
        handle.seek(start)
        data = handle.read(min(want, size - start))
        end = data.rfind(b"\n")
        while end < 0 and start + len(data) < size:
            # A line longer than batch_bytes: read on until it ends.
            more = handle.read(min(want, size - start - len(data)))
            if not more:
                break
            data += more
            end = data.rfind(b"\n")
        if end < 0:
            # No newline before the end of the file: take the tail as a line only if
            # it is complete (the file was rolled past, or it parses as an object).
            if rolled or is_complete_line(data):
                data += b"\n"
                end = len(data) - 1
            else:
                return None
        data = data[: end + 1]
        updates, used = self._parse_lines(stream, data, start)
        stream.offset = start + min(used, size - start)
        return updates

    def _parse_lines(self, stream: Stream, data: bytes, start: int) -> tuple[list[Update], int]:
        """The updates of the whole lines ``data`` at ``start``, and how many of its bytes
        were handled: all, unless ``on_decode_error: stop`` met a bad line after good ones,
        which are delivered first (the next read stops at the bad line)."""
        updates: list[Update] | None = None
        used = len(data)
        if b"\n\n" not in data and data[:1] != b"\n" and utf8(data):
            # No empty lines (the usual case): one decode of the whole chunk, and the
            # lines' offsets from their lengths, without a Python step per line.
            # Each line is wrapped in its own one-item array, so a line must hold exactly
            # one object: lines that would only parse joined are rejected too.
            try:
                rows = _rows_decoder.decode(b"[[" + data[:-1].replace(b"\n", b"],[") + b"]]")
            except msgspec.DecodeError:
                pass  # a blank or bad line: the careful path below names it
            else:
                updates = list(map(_FIRST, rows))
                offsets: Iterable[int] = accumulate(
                    map(_PLUS_ONE, map(len, data.split(b"\n"))), initial=start
                )
        if updates is None:
            updates, offsets, used = self._parse_careful(stream, data, start)
            if not updates:
                return updates, used
        default_table = self.options.table or stream.directory.name
        prefix = stream.prefix
        rejected: list[int] = []
        for i, (u, off) in enumerate(zip(updates, offsets, strict=False)):  # offsets run one past
            op = u.op
            after = u.after
            problem = None
            if op not in _VALID_OPS:
                problem = "op", f"op must be one of c, u, d, r, not {op!r}"
            elif op == "d":
                # The envelope contract: a delete has no after image; before is the
                # old row where the line gives one, else the key columns.
                if u.before is NULL:
                    u.before = after if after is not NULL else msgspec.Raw(_encode(u.key))
                u.after = NULL
            elif after is NULL or memoryview(after)[0] != _OPEN_BRACE:
                problem = "after", f"op {op!r} needs 'after', the row as a JSON object"
            if problem is not None:
                if self.stop_at_bad:
                    if i == 0:
                        self._bad(stream, off, problem[1])
                    return updates[:i], off - start
                self._reject(stream, off, _line_at(data, off - start), problem[1], problem[0])
                rejected.append(i)
                continue
            if not u.table:
                u.table = default_table
            position = prefix + str(off)
            u.position = position
            u.logical = position
            u.connector = "filelog"
        if rejected:
            dropped = set(rejected)
            updates = [u for i, u in enumerate(updates) if i not in dropped]
        return updates, used

    def _parse_careful(
        self, stream: Stream, data: bytes, start: int
    ) -> tuple[list[Update], list[int], int]:
        """Lines one by one (blank or bad lines): (updates, their offsets, bytes handled)."""
        lines = data.split(b"\n")
        lines.pop()  # after the final newline
        offsets = []
        kept = []
        offset = start
        for line in lines:
            if line and not line.isspace():
                kept.append(line)
                offsets.append(offset)
            offset += len(line) + 1
        if not kept:
            return [], [], len(data)
        if utf8(data):
            try:
                rows = _rows_decoder.decode(b"[[" + b"],[".join(kept) + b"]]")
            except msgspec.DecodeError:
                pass
            else:
                return list(map(_FIRST, rows)), offsets, len(data)
        updates: list[Update] = []
        good: list[int] = []
        for line, off in zip(kept, offsets, strict=True):
            try:
                updates.append(decode_line(line))
            except (msgspec.DecodeError, UnicodeDecodeError) as exc:
                reason = f"not a valid update line ({exc})"
                if self.stop_at_bad:
                    if updates:
                        return updates, good, off - start
                    self._bad(stream, off, reason)
                self._reject(stream, off, line, reason, missing_field(str(exc)))
                continue
            good.append(off)
        return updates, good, len(data)

    def _bad(self, stream: Stream, offset: int, reason: str) -> None:
        path = stream.directory / (stream.file or "")
        line_no = _line_number(path, offset)
        raise SourceError(
            f"{path}: line {line_no} (offset {offset}): {reason}. Expected one JSON object per "
            f'line like {{"table": "t", "op": "c", "key": {{"id": 1}}, "after": {{"id": 1}}}}; '
            f"fix or remove the line, then run again (the lines before it were delivered, "
            f"nothing from it on), or set source.on_decode_error: fallback to skip such lines, "
            f"recorded in the state_dir's filelog-rejects.jsonl"
        )

    def _reject(self, stream: Stream, offset: int, line: bytes, reason: str, column: str) -> None:
        path = stream.directory / (stream.file or "")
        entry = {"file": str(path), "line": _line_number(path, offset), "offset": offset}
        entry["reason"] = reason
        self.rejects.add(self.options.table or stream.directory.name, column, entry, line)


def is_complete_line(data: bytes) -> bool:
    stripped = data.strip()
    if not stripped.startswith(b"{") or not stripped.endswith(b"}"):
        return False
    try:
        msgspec.json.decode(stripped)
    except msgspec.DecodeError:
        return False
    return True


def _line_at(data: bytes, start: int) -> bytes:
    end = data.find(b"\n", start)
    return data[start:] if end < 0 else data[start:end]


def _line_number(path: Path, offset: int) -> int:
    try:
        with open(path, "rb") as f:
            return f.read(offset).count(b"\n") + 1
    except OSError:
        return 0
