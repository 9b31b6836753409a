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

import fnmatch
import functools
import logging
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import accumulate
from operator import itemgetter
from pathlib import Path
from typing import Any, BinaryIO, Literal

import msgspec
from pydantic import ByteSize, Field

from wormhole.connectors.filelog.rejects import (
    Rejects,
    decode_line,
    missing_field,
    salvage,
    utf8,
    utf8_or_raise,
)
from wormhole.core.errors import LogCorruptError, SourceError
from wormhole.core.update import NULL, OPS, Update
from wormhole.plugins.components import (
    Capabilities,
    NoOptions,
    Options,
    SourceBatch,
    SourceContext,
    Version,
    log_reader,
)
from wormhole.plugins.framing import (
    FILE_MAGIC,
    HEADER,
    HEADER_SIZE,
    KIND_FILE_HEADER,
    KIND_MESSAGES,
    MAGIC,
    FileHeader,
    TornTail,
    read_records,
)

log = logging.getLogger("wormhole.filelog")

_batch_decoder = msgspec.json.Decoder(list[Update])
_rows_decoder = msgspec.json.Decoder(list[tuple[Update]])
"""JSON lines as ``[[line 1],[line 2],...]``: exactly one update per line."""
_header_decoder = msgspec.json.Decoder(FileHeader)
_OPEN_BRACE = ord("{")
_VALID_OPS = frozenset(OPS)
_PLUS_ONE = (1).__add__
_FIRST = itemgetter(0)


class FilelogOptions(Options):
    """Read updates from files: JSON lines, or logs written by ``wormhole.publish.LogWriter``."""

    path: str = Field(description="a file, a directory of files, or a directory of streams")
    format: Literal["auto", "jsonl", "logwriter"] = Field(
        "auto", description="file format; auto recognises LogWriter files by their framing"
    )
    table: str | None = Field(
        None, description="table for lines that name none (default: the file's directory name)"
    )
    glob: str | None = Field(
        None,
        description="read only files whose name matches this pattern, e.g. '*.jsonl' (files "
        "being written under another name, a .tmp, are then left alone); default: every "
        "file whose name does not start with a dot",
    )
    batch_bytes: ByteSize = Field(ByteSize(1 << 20), description="read at most this much per batch")
    poll_interval_ms: int = Field(100, ge=1, description="how often to look for new data")
    on_decode_error: Literal["fallback", "stop"] = Field(
        "fallback",
        description="a line (or LogWriter record) that is not an update: skip it, recorded "
        "in the state_dir's filelog-rejects.jsonl, with a warning (fallback), or stop there "
        "after delivering what precedes it (stop)",
    )


def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key comparing digit runs as numbers: log.9.0 < log.10.0, 2.jsonl < 10.jsonl."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


@functools.lru_cache(maxsize=4096)
def natural_name(name: str) -> Version:
    """A file name as integers that sort in natural order (``2.jsonl`` before ``10.jsonl``):
    each character as its code point + 1, a 0 after each run of characters, each digit run
    as its value + 1, a 0 at the end."""
    out: list[int] = []
    for i, part in enumerate(_DIGITS.split(name)):
        if i % 2:
            out.append(int(part) + 1)
        else:
            out.extend(ord(c) + 1 for c in part)
            out.append(0)
    out.append(0)
    return tuple(out)


_DIGITS = re.compile(r"(\d+)")


class FilelogPositionMapper:
    """Positions of the file log.

    JSON-lines files: ``position`` (and ``logical``) is ``<file>:<offset>``. Files are read
    in natural name order, so the version is the file name in that order
    (:func:`natural_name`) followed by the offset.

    ``LogWriter`` logs: ``logical`` is ``<publisher id>:<seq>``, the same on every copy of
    the log, and the version is ``(seq,)``. Sequence numbers are comparable within one
    publisher id, so a key should be published by one publisher (or by copies that share
    its id).
    """

    def __init__(self, options: NoOptions | None = None) -> None:
        pass

    def to_logical(self, native: str) -> str:
        raise ValueError(
            "a file-log position maps to a logical one only with its update (LogWriter logs "
            "carry it as update.logical)"
        )

    def to_native(self, logical: str) -> str:
        raise ValueError("file-log positions are not mapped between copies")

    def version(self, update: Update) -> Version:
        if update.logical != update.position:  # a LogWriter log: <publisher id>:<seq>
            return (int(update.logical.rsplit(":", 1)[1]),)
        name, colon, offset = update.position.rpartition(":")
        if not colon:
            raise ValueError(f"not a file position: {update.position!r}")
        return (*natural_name(name), int(offset))


@dataclass
class Stream:
    """One sequence of files read in order; the position is (file name, byte offset)."""

    id: str
    directory: Path
    only_file: str | None = None  # the source path is a single file
    file: str | None = None
    offset: int = 0
    handle: BinaryIO | None = None
    handle_name: str | None = None
    kind: str | None = None  # "jsonl" | "logwriter", per current file
    publisher_id: str | None = None
    prefix: str = ""
    files_cache: list[str] = field(default_factory=list)
    glob: str | None = None
    known: set[str] | None = None
    """Names listed before (None: not listed yet): a new one is news."""
    skipped: list[str] = field(default_factory=list)
    """Files that appeared with a name sorting before the file being read: never read."""

    def list_files(self) -> list[str]:
        if self.only_file is not None:
            return [self.only_file] if (self.directory / self.only_file).exists() else []
        glob = self.glob
        try:
            names = [
                e.name
                for e in os.scandir(self.directory)
                if not e.name.startswith(".")
                and (glob is None or fnmatch.fnmatchcase(e.name, glob))
                and e.is_file()
            ]
        except OSError as exc:
            raise SourceError(f"source.path: cannot list {self.directory}: {exc.strerror}") from exc
        names.sort(key=natural_key)
        if self.known is not None and self.file is not None and len(self.known) != len(names):
            self._notice_late(names)
        self.known = set(names)
        self.files_cache = names
        return names

    def _notice_late(self, names: list[str]) -> None:
        """Say so when a file appears behind the one being read: the source never goes back."""
        assert self.known is not None and self.file is not None
        current = natural_key(self.file)
        for name in names:
            if name in self.known or natural_key(name) >= current:
                continue
            self.skipped.append(name)
            log.warning(
                "%s: appeared while %s was being read, and its name sorts before it: it is "
                "never read (files are read in name order, and the source does not go back). "
                "Have the producer write so that each new file's name sorts after the last "
                "(write under a dot name or another directory, then rename), or read only "
                "final names with source.glob",
                self.directory / name,
                self.file,
            )

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
            self.handle_name = None


class FilelogSource:
    def __init__(self, options: FilelogOptions) -> None:
        self.options = options
        self.root = Path(options.path)
        self.streams: dict[str, Stream] = {}
        self.seen: dict[str, int] = {}
        self.stream_mode: bool | None = None  # directory of streams?
        self._rr = 0
        self._warned_tail: set[str] = set()
        self.context: SourceContext | None = None
        self.confirmed: dict[str, Any] = {}
        """What the publisher log holds: stream id -> [file, offset] (for :meth:`lag`)."""
        self.stop_at_bad = options.on_decode_error == "stop"
        self.rejects: Rejects | None = None

    # ------------------------------------------------------------------ open
    def open(self, context: SourceContext, checkpoint: Any) -> None:
        self.context = context
        self.rejects = Rejects(context.state_dir)
        root = self.root
        if not root.exists():
            raise SourceError(
                f"source.path: {root} does not exist; create it, or point path at the "
                f"file or directory the producer writes"
            )
        if not os.access(root, os.R_OK) or (root.is_dir() and not os.access(root, os.X_OK)):
            raise SourceError(f"source.path: {root} is not readable; fix its permissions")
        self._discover()
        if checkpoint:
            for stream_id, (name, offset) in checkpoint.get("streams", {}).items():
                stream = self.streams.get(stream_id)
                if stream is None:
                    stream = self._add_stream(stream_id)
                stream.file, stream.offset = name, int(offset)
                if not (stream.directory / name).exists():
                    raise SourceError(
                        f"source.path: {stream.directory / name} was being read (offset "
                        f"{offset}) but is gone; restore it, or remove the state_dir to start over"
                    )
            self.seen = {str(k): int(v) for k, v in checkpoint.get("seen", {}).items()}
            self.confirmed = dict(checkpoint.get("streams", {}))

    def _add_stream(self, stream_id: str) -> Stream:
        if self.root.is_file():
            stream = Stream(stream_id, self.root.parent, only_file=self.root.name)
        elif stream_id:
            stream = Stream(stream_id, self.root / stream_id)
        else:
            stream = Stream(stream_id, self.root)
        stream.glob = self.options.glob
        self.streams[stream_id] = stream
        return stream

    def _discover(self) -> None:
        root = self.root
        if root.is_file():
            if "" not in self.streams:
                self._add_stream("")
            return
        if self.stream_mode is False:
            return
        try:
            entries = [e for e in os.scandir(root) if not e.name.startswith(".")]
        except OSError as exc:
            raise SourceError(f"source.path: cannot list {root}: {exc.strerror}") from exc
        dirs = sorted((e.name for e in entries if e.is_dir()), key=natural_key)
        files = [e.name for e in entries if e.is_file()]
        if files:
            if dirs and self.stream_mode is None:
                log.warning(
                    "%s holds files and subdirectories; reading the files, ignoring %s",
                    root,
                    ", ".join(dirs),
                )
            self.stream_mode = False
            if "" not in self.streams:
                self._add_stream("")
            return
        if dirs:
            self.stream_mode = True
            for name in dirs:
                if name not in self.streams:
                    self._add_stream(name)

    # ------------------------------------------------------------------ read
    def read(self, timeout: float) -> SourceBatch | None:
        deadline = time.monotonic() + timeout
        poll = self.options.poll_interval_ms / 1000.0
        stop = self.context.stop if self.context else None
        while True:
            batch = self._read_once()
            if batch is not None:
                return batch
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if stop is not None:
                if stop.wait(min(poll, remaining)):
                    return None
            else:
                time.sleep(min(poll, remaining))

    def _read_once(self) -> SourceBatch | None:
        if self.stream_mode is not False:
            self._discover()
        streams = list(self.streams.values())
        heads = {id(s): self._peek(s) for s in streams} if len(streams) > 1 else {}
        for i in range(len(streams)):
            stream = streams[(self._rr + i) % len(streams)]
            head = heads.get(id(stream))
            if head is not None:
                # One publisher's messages may be spread over several streams (a
                # failover that continued the sequence): take the next seq from
                # whichever stream has it, so that nothing is mistaken for a duplicate.
                pid, first = head
                wanted = self.seen.get(pid, 0) + 1
                if first > wanted and any(
                    h is not None and h[0] == pid and h[1] <= wanted for h in heads.values()
                ):
                    continue
            updates = self._read_stream(stream)
            if updates is not None:
                if self.rejects is not None:
                    self.rejects.flush()  # durable before the position passes them
                self._rr = (self._rr + i + 1) % len(streams)
                return SourceBatch(updates, self._checkpoint())
        return None

    def _peek(self, stream: Stream) -> tuple[str, int] | None:
        """(publisher id, first seq) of a LogWriter stream's next record, when known."""
        if stream.file is None:
            files = stream.list_files()
            if not files:
                return None
            stream.file, stream.offset = files[0], 0
        handle = self._handle(stream)
        if stream.kind != "logwriter" or handle is None or not stream.publisher_id:
            return None
        header = os.pread(handle.fileno(), HEADER_SIZE, stream.offset)
        if len(header) < HEADER_SIZE:
            return None
        magic, _version, kind, _length, _crc, first, _count = HEADER.unpack(header)
        if magic != MAGIC or kind != KIND_MESSAGES:
            return None
        return stream.publisher_id, first

    def _checkpoint(self) -> dict[str, Any]:
        return {
            "streams": {s.id: [s.file, s.offset] for s in self.streams.values() if s.file},
            "seen": dict(self.seen),
        }

    def _read_stream(self, stream: Stream) -> list[Update] | None:
        """Updates read from the stream (possibly none, if all were duplicates), or
        None when it has nothing new."""
        while True:
            files = stream.list_files()
            if not files:
                return None
            if stream.file is None:
                stream.file, stream.offset = files[0], 0
            name = stream.file
            later = _later(files, name)
            handle = self._handle(stream)
            if handle is None:  # the file vanished or is still empty
                if later:
                    self._advance(stream, later)
                    continue
                return None
            size = os.fstat(handle.fileno()).st_size
            if stream.offset < size:
                if stream.kind == "logwriter":
                    result = self._read_logwriter(stream, handle, size, bool(later))
                else:
                    result = self._read_jsonl(stream, handle, size, bool(later))
                if result is not None:
                    return result
            if later and stream.offset >= size:
                self._advance(stream, later)
                continue
            if later and stream.offset < size:
                # An unreadable tail in a file that has been rolled past.
                log.warning(
                    "%s: skipping %d bytes of incomplete data at offset %d at the end of a "
                    "rolled file",
                    stream.directory / name,
                    size - stream.offset,
                    stream.offset,
                )
                self._advance(stream, later)
                continue
            return None

    def _advance(self, stream: Stream, later: list[str]) -> None:
        stream.close()
        stream.file, stream.offset = later[0], 0
        stream.kind = None

    def _handle(self, stream: Stream) -> BinaryIO | None:
        assert stream.file is not None
        if stream.handle is not None and stream.handle_name == stream.file:
            return stream.handle
        stream.close()
        path = stream.directory / stream.file
        try:
            handle = open(path, "rb")  # noqa: SIM115 - kept open while tailing
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SourceError(f"source.path: cannot read {path}: {exc.strerror}") from exc
        magic = handle.read(len(FILE_MAGIC))
        if not magic:
            handle.close()
            return None
        fmt = self.options.format
        kind = "logwriter" if magic == FILE_MAGIC else "jsonl"
        if fmt != "auto" and fmt != kind:
            kind = fmt
        if kind == "logwriter":
            try:
                record = next(read_records(handle, str(path), 0))
            except (TornTail, StopIteration):
                handle.close()
                return None
            except LogCorruptError as exc:
                raise SourceError(str(exc)) from exc
            if record.kind != KIND_FILE_HEADER:
                raise SourceError(f"{path}: a LogWriter file must start with its header record")
            stream.publisher_id = _header_decoder.decode(record.payload).publisher_id
            if stream.offset == 0:
                stream.offset = record.end
        stream.kind = kind
        stream.handle, stream.handle_name = handle, stream.file
        rel = path.relative_to(self.root) if self.root.is_dir() else Path(path.name)
        stream.prefix = f"{rel}:"
        return handle

    # ------------------------------------------------------------- jsonl
    def _read_jsonl(
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
            if rolled or _is_complete_line(data):
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
        assert self.rejects is not None
        path = stream.directory / (stream.file or "")
        entry = {"file": str(path), "line": _line_number(path, offset), "offset": offset}
        entry["reason"] = reason
        self.rejects.add(self.options.table or stream.directory.name, column, entry, line)

    # --------------------------------------------------------- logwriter
    def _read_logwriter(
        self, stream: Stream, handle: BinaryIO, size: int, rolled: bool
    ) -> list[Update] | None:
        want = int(self.options.batch_bytes)
        path = str(stream.directory / (stream.file or ""))
        pid = stream.publisher_id or ""
        seen = self.seen.get(pid, 0)
        out: list[Update] = []
        consumed = 0
        read_any = False
        try:
            for record in read_records(handle, path, stream.offset, size):
                read_any = True
                stream.offset = record.end
                consumed += len(record.payload)
                if record.kind != KIND_MESSAGES:
                    continue
                if record.first > seen + 1 and out:
                    # A gap: end the batch here, so the next read can take the
                    # missing messages from another stream first.
                    stream.offset = record.offset
                    break
                last = record.first + record.count - 1
                if last > seen:
                    try:
                        messages = self._messages(
                            stream, pid, record.first, record.offset, record.payload, seen
                        )
                    except SourceError:
                        if not out:
                            raise
                        # on_decode_error: stop: what precedes the record goes out first.
                        stream.offset = record.offset
                        break
                    out.extend(messages)
                    seen = last
                if consumed >= want:
                    break
        except TornTail:
            pass  # a record still being written (or, in a rolled file, skipped by the caller)
        except LogCorruptError as exc:
            raise SourceError(
                f"{exc}. The LogWriter file is damaged; nothing after offset {exc.offset} "
                f"was delivered"
            ) from exc
        if not read_any:
            return None
        if pid:
            self.seen[pid] = max(seen, self.seen.get(pid, 0))
        return out

    def _messages(
        self, stream: Stream, pid: str, first: int, offset: int, payload: bytes, seen: int
    ) -> list[Update]:
        try:
            updates: list[Update | None] = list(_batch_decoder.decode(utf8_or_raise(payload)))
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            if self.stop_at_bad:
                raise SourceError(
                    f"{stream.directory / (stream.file or '')}: record at offset {offset} "
                    f"(seq {first}..) has an undecodable payload ({exc}); nothing from it on "
                    f"was delivered. Fix the program that wrote it, or set "
                    f"source.on_decode_error: fallback to skip what does not decode, recorded "
                    f"in the state_dir's filelog-rejects.jsonl"
                ) from exc
            assert self.rejects is not None
            updates = salvage(
                self.rejects,
                str(stream.directory / (stream.file or "")),
                self.options.table or stream.directory.name,
                (first, offset, seen),
                payload,
                str(exc),
            )
        if first <= seen:
            updates = updates[seen - first + 1 :]
            first = seen + 1
        position = f"{stream.prefix}{offset}"
        default_table = self.options.table or stream.directory.name
        out: list[Update] = []
        for i, u in enumerate(updates):
            if u is None:
                continue
            out.append(u)
            u.connector = "filelog"
            u.position = position
            u.logical = f"{pid}:{first + i}"
            if not u.table:
                u.table = default_table
            if u.op == "d":
                if u.before is NULL:
                    u.before = msgspec.Raw(_encode(u.key))
                u.after = NULL
        return out

    # ------------------------------------------------------------- --once
    def capture_end(self) -> Any:
        self._discover()
        end = {}
        for stream in self.streams.values():
            files = stream.list_files()
            if files:
                last = files[-1]
                try:
                    end[stream.id] = [last, (stream.directory / last).stat().st_size]
                except FileNotFoundError:
                    continue
        return end

    def reached(self, end: Any) -> bool:
        for stream_id, (name, size) in end.items():
            stream = self.streams.get(stream_id)
            if stream is None or stream.file is None:
                return False
            here, there = natural_key(stream.file), natural_key(name)
            if here > there or (here == there and stream.offset >= size):
                continue
            if here == there and self._incomplete_tail(stream, size):
                continue
            return False
        return True

    def _incomplete_tail(self, stream: Stream, size: int) -> bool:
        """Bytes between the position and ``size`` that are not (yet) a whole update."""
        if size - stream.offset > int(self.options.batch_bytes):
            return False  # more than one batch left: the reader is not done yet
        path = stream.directory / (stream.file or "")
        with open(path, "rb") as f:
            kind = stream.kind
            if kind is None:  # not opened by the reader yet: look at the file itself
                head = f.read(len(FILE_MAGIC))
                kind = "logwriter" if head == FILE_MAGIC else "jsonl"
                if self.options.format != "auto":
                    kind = self.options.format
            if kind == "logwriter":
                # Complete only if a whole record (CRC checked) starts at the position.
                try:
                    complete = any(True for _ in read_records(f, str(path), stream.offset, size))
                except TornTail:
                    complete = False
                except LogCorruptError as exc:
                    raise SourceError(str(exc)) from exc
            else:
                f.seek(stream.offset)
                rest = f.read(size - stream.offset)
                complete = b"\n" in rest or _is_complete_line(rest)
        if complete:
            return False
        if str(path) not in self._warned_tail:
            self._warned_tail.add(str(path))
            log.warning(
                "%s: %d bytes at offset %d are not a complete update yet; left for a later run",
                path,
                size - stream.offset,
                stream.offset,
            )
        return True

    def confirm(self, checkpoint: Any) -> None:
        """Files are the producer's: nothing to release; the position is kept for
        :meth:`lag`."""
        self.confirmed = checkpoint.get("streams", {})

    def lag(self) -> dict[str, float]:
        """For metrics (called at scrape time, from another thread): ``lag_bytes``, bytes
        of the files not yet in the publisher log."""
        confirmed = self.confirmed
        unread = 0
        for stream in list(self.streams.values()):
            file, offset = confirmed.get(stream.id) or (None, 0)
            key = natural_key(file) if file is not None else None
            if stream.only_file is not None:
                names = [stream.only_file]
            else:
                try:
                    names = [e.name for e in os.scandir(stream.directory) if e.is_file()]
                except OSError:
                    continue
            for name in names:
                if name.startswith(".") and stream.only_file is None:
                    continue
                try:
                    size = (stream.directory / name).stat().st_size
                except OSError:
                    continue
                here = natural_key(name)
                if key is None or here > key:
                    unread += size
                elif here == key:
                    unread += max(0, size - int(offset))
        skipped = sum(len(stream.skipped) for stream in list(self.streams.values()))
        return {"lag_bytes": float(unread), "skipped_files": float(skipped)}

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()


_encode = msgspec.json.Encoder().encode


def _later(files: list[str], name: str) -> list[str]:
    key = natural_key(name)
    return [f for f in files if natural_key(f) > key]


def _is_complete_line(data: bytes) -> bool:
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


wormhole_sources, wormhole_position_mappers = log_reader(
    "filelog",
    source=FilelogSource,
    options=FilelogOptions,
    description="Tail JSON-lines files or LogWriter logs (deduplicated by publisher seq).",
    capabilities=Capabilities(lag=True),
    mapper=FilelogPositionMapper,
    mapper_description="File name and offset, or LogWriter publisher seq, as per-key versions.",
)
