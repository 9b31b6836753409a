"""Length + CRC framed records: the on-disk unit of every Wormhole log file.

A record is a 24-byte little-endian header followed by ``length`` payload bytes::

    magic u16 = 0x4857 ("WH")   version u8 = 1   kind u8
    length u32                  crc32 u32
    first u64                   count u32

``crc32`` covers the bytes of ``kind``, ``first``, ``count`` and the payload, so
a torn or flipped header is caught as surely as a damaged payload. ``first`` and
``count`` are the record's sequence range (their meaning is the log's: update
sequence numbers in the publisher log, message sequence numbers in a LogWriter
log).

Recovery reads records in order and classifies the first bad one: a record that
runs past the end of the file, or a bad record with nothing valid after it, is a
*torn tail* (the process died mid-write; truncate it); a bad record with more
data after it is *corruption* (stop and name the file and offset).

Part of the plugin contract: a plugin that keeps a log of its own (the ``filelog``
source's reject files) or reads one Wormhole writes (a LogWriter log, whose record
kinds and file header are defined here, next to the framing they use) frames and
recovers its records with these functions.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import msgspec

from wormhole.core.errors import LogCorruptError

MAGIC = 0x4857
VERSION = 1
HEADER = struct.Struct("<HBBIIQI")
HEADER_SIZE = HEADER.size  # 24
_CRC_FIELDS = struct.Struct("<BQI")
MAX_RECORD = 1 << 30

# The LogWriter file log (``wormhole.publish``, read by the ``filelog`` source): a file
# header record, then message records. The publisher log's kinds are 1, 2 and 5.
KIND_FILE_HEADER = 3
KIND_MESSAGES = 4
FILE_MAGIC = b"WH"
"""The first bytes of a LogWriter file (MAGIC, little-endian)."""


class FileHeader(msgspec.Struct):
    """The first record of a LogWriter file: whose messages it holds, and where."""

    publisher_id: str
    session: int
    roll: int


def frame(kind: int, first: int, count: int, payload: bytes) -> bytes:
    """One framed record."""
    crc = zlib.crc32(payload, zlib.crc32(_CRC_FIELDS.pack(kind, first, count)))
    return HEADER.pack(MAGIC, VERSION, kind, len(payload), crc, first, count) + payload


@dataclass(frozen=True, slots=True)
class Record:
    offset: int
    kind: int
    first: int
    count: int
    payload: bytes

    @property
    def end(self) -> int:
        return self.offset + HEADER_SIZE + len(self.payload)


class TornTail(Exception):
    """The file ends inside a record: everything from ``offset`` on is a partial write."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(reason)
        self.offset = offset
        self.reason = reason


def _check(path: str, offset: int, size: int, header: bytes, payload: bytes) -> Record:
    magic, version, kind, length, crc, first, count = HEADER.unpack(header)
    if magic != MAGIC or version != VERSION:
        raise LogCorruptError(path, offset, "bad record header")
    if zlib.crc32(payload, zlib.crc32(_CRC_FIELDS.pack(kind, first, count))) != crc:
        if offset + HEADER_SIZE + length >= size:
            # The last record of the file, fully sized but not fully persisted.
            raise TornTail(offset, "CRC mismatch in the last record")
        raise LogCorruptError(path, offset, "CRC mismatch")
    return Record(offset, kind, first, count, payload)


def _valid_record_after(f: BinaryIO, offset: int, size: int) -> int | None:
    """The offset of a whole, CRC-valid record after ``offset``, if there is one.

    A torn tail has nothing valid after it; damage in the middle of a log does
    (a flipped length byte, say, which would otherwise read as a torn record).
    """
    position = offset + 1
    marker = HEADER.pack(MAGIC, VERSION, 0, 0, 0, 0, 0)[:3]
    while position + HEADER_SIZE <= size:
        f.seek(position)
        chunk = f.read(min(1 << 20, size - position))
        found = chunk.find(marker)
        while found >= 0:
            at = position + found
            if at + HEADER_SIZE <= size:
                f.seek(at)
                header = f.read(HEADER_SIZE)
                _m, _v, kind, length, crc, first, count = HEADER.unpack(header)
                if length <= MAX_RECORD and at + HEADER_SIZE + length <= size:
                    payload = f.read(length)
                    expected = zlib.crc32(payload, zlib.crc32(_CRC_FIELDS.pack(kind, first, count)))
                    if expected == crc:
                        return at
            found = chunk.find(marker, found + 1)
        if len(chunk) < 1 << 20:
            break
        position += len(chunk) - len(marker)
    return None


def _torn(f: BinaryIO, path: str, offset: int, size: int, reason: str) -> Exception:
    after = _valid_record_after(f, offset, size)
    if after is not None:
        return LogCorruptError(path, offset, f"{reason}, with a valid record at offset {after}")
    return TornTail(offset, reason)


def _rest_is_zero(f: BinaryIO, offset: int, size: int) -> bool:
    f.seek(offset)
    while offset < size:
        chunk = f.read(min(1 << 20, size - offset))
        if not chunk or chunk.count(0) != len(chunk):
            return False
        offset += len(chunk)
    return True


def read_records(
    f: BinaryIO, path: str, start: int = 0, stop: int | None = None
) -> Iterator[Record]:
    """Records of an open file from ``start``; raises TornTail or LogCorruptError at a bad one.

    A torn tail is what an interrupted append leaves: a header cut short, a record
    whose length runs past the end of the file, a last record whose CRC fails, or
    zero-filled blocks. Anything else that fails to parse is corruption. ``stop``
    bounds the scan to bytes known to be complete (a file another thread appends to).
    """
    size = os.fstat(f.fileno()).st_size if stop is None else stop
    offset = start
    f.seek(offset)
    while offset < size:
        header = f.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE or offset + HEADER_SIZE > size:
            raise TornTail(offset, "truncated record header")
        magic, version, _kind, length, _crc, _first, _count = HEADER.unpack(header)
        if magic != MAGIC or version != VERSION:
            if _rest_is_zero(f, offset, size):
                raise TornTail(offset, "zero-filled tail")
            raise LogCorruptError(path, offset, "bad record header")
        if length > MAX_RECORD or offset + HEADER_SIZE + length > size:
            raise _torn(f, path, offset, size, "truncated record")
        payload = f.read(length)
        if len(payload) < length:
            raise _torn(f, path, offset, size, "truncated record")
        try:
            record = _check(path, offset, size, header, payload)
        except TornTail as torn:
            raise _torn(f, path, offset, size, torn.reason) from None
        yield record
        offset = record.end
        f.seek(offset)


def scan_headers(
    f: BinaryIO, path: str, start: int = 0, stop: int | None = None
) -> Iterator[Record]:
    """Record headers only (payload left empty, CRC not checked): a cheap index build.

    Payloads are verified when they are read.
    """
    size = os.fstat(f.fileno()).st_size if stop is None else stop
    offset = start
    while offset + HEADER_SIZE <= size:
        f.seek(offset)
        header = f.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE:
            return
        magic, version, kind, length, _crc, first, count = HEADER.unpack(header)
        if magic != MAGIC or version != VERSION:
            raise LogCorruptError(path, offset, "bad record header")
        if offset + HEADER_SIZE + length > size:
            return
        yield Record(offset, kind, first, count, b"")
        offset += HEADER_SIZE + length


def read_record_at(f: BinaryIO, path: str, offset: int) -> Record:
    """The one record at ``offset``, verified."""
    f.seek(offset)
    header = f.read(HEADER_SIZE)
    if len(header) < HEADER_SIZE:
        raise LogCorruptError(path, offset, "truncated record header")
    length = HEADER.unpack_from(header)[3]
    payload = f.read(length)
    if len(payload) < length:
        raise LogCorruptError(path, offset, "truncated record")
    # Not the tail of a file being recovered: any failure here is corruption.
    return _check(path, offset, 1 << 62, header, payload)


def fsync_directory(path: str) -> None:
    """Make a file creation, rename or removal in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def log_file_key(name: str) -> tuple[int, int] | None:
    """``(session, roll)`` of a ``log.<session>.<roll>`` name, or None for other names."""
    parts = name.split(".")
    if len(parts) != 3 or parts[0] != "log":
        return None
    try:
        return int(parts[1]), int(parts[2])
    except ValueError:
        return None
