"""The file log source: streams of JSON-lines files or LogWriter logs, read side by side."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from wormhole.connectors.filelog.jsonl import JsonlReader, is_complete_line
from wormhole.connectors.filelog.logwriter import LogWriterReader
from wormhole.connectors.filelog.options import FilelogOptions
from wormhole.connectors.filelog.positions import natural_key
from wormhole.connectors.filelog.rejects import Rejects
from wormhole.connectors.filelog.stream import Stream, later_files
from wormhole.core.errors import LogCorruptError, SourceError
from wormhole.core.update import Update
from wormhole.plugins.components import SourceBatch, SourceContext
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

_header_decoder = msgspec.json.Decoder(FileHeader)


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
        self.rejects: Rejects | None = None
        self.jsonl: JsonlReader | None = None
        self.logwriter: LogWriterReader | None = None

    # ------------------------------------------------------------------ open
    def open(self, context: SourceContext, checkpoint: Any) -> None:
        self.context = context
        rejects = self.rejects = Rejects(context.state_dir)
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
        self.jsonl = JsonlReader(self.options, rejects)
        self.logwriter = LogWriterReader(self.options, rejects, self.seen)

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
            later = later_files(files, name)
            handle = self._handle(stream)
            if handle is None:  # the file vanished or is still empty
                if later:
                    self._advance(stream, later)
                    continue
                return None
            size = os.fstat(handle.fileno()).st_size
            if stream.offset < size:
                reader = self.logwriter if stream.kind == "logwriter" else self.jsonl
                assert reader is not None
                result = reader.read(stream, handle, size, bool(later))
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
                complete = b"\n" in rest or is_complete_line(rest)
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
