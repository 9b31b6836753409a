"""LogWriter logs of the file log: framed records of updates, deduplicated by publisher seq."""

from __future__ import annotations

from typing import BinaryIO

import msgspec

from wormhole.connectors.filelog.options import FilelogOptions
from wormhole.connectors.filelog.rejects import Rejects, salvage, utf8_or_raise
from wormhole.connectors.filelog.stream import Stream
from wormhole.core.errors import LogCorruptError, SourceError
from wormhole.core.update import NULL, Update
from wormhole.plugins.framing import KIND_MESSAGES, TornTail, read_records

_batch_decoder = msgspec.json.Decoder(list[Update])
_encode = msgspec.json.Encoder().encode


class LogWriterReader:
    """Reads a LogWriter file of a stream from its position, dropping messages whose
    ``(publisher id, seq)`` was already delivered (``seen``, shared by every stream)."""

    def __init__(self, options: FilelogOptions, rejects: Rejects, seen: dict[str, int]) -> None:
        self.options = options
        self.rejects = rejects
        self.seen = seen
        self.stop_at_bad = options.on_decode_error == "stop"

    def read(
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
