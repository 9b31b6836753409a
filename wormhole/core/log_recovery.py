"""Opening the publisher log: the session file, recovery of the newest segment (a torn tail or
an incomplete batch is cut back) and the check that every rolled segment ends where the next
one starts. See :mod:`wormhole.core.publisher_log`.
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path
from typing import BinaryIO

import msgspec

from wormhole.core.errors import LogCorruptError, StateError
from wormhole.core.segment import Segment, SegmentHeader
from wormhole.core.segment_format import (
    BATCH_KINDS,
    KIND_BATCH,
    KIND_SEGMENT,
    batch_times,
    index_path,
    read_header,
)
from wormhole.plugins.framing import Record, TornTail, fsync_directory, read_records

log = logging.getLogger("wormhole.publisher_log")

_header_decoder = msgspec.json.Decoder(SegmentHeader)


def read_session_file(directory: Path) -> int:
    """The last session number used (-1 for none)."""
    path = directory / ".session"
    try:
        return int(path.read_text().strip() or -1)
    except FileNotFoundError:
        return -1
    except ValueError as exc:
        raise StateError(f"{path} does not hold a session number; remove it") from exc


def write_session_file(directory: Path, session: int) -> None:
    path = directory / ".session"
    tmp = path.with_suffix(".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(f"{session}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise StateError(
            f"cannot write {path}: {exc.strerror}; make the state_dir writable"
        ) from exc


def check_continuity(directory: Path, segments: list[Segment]) -> None:
    """Each rolled segment must end where the next one starts.

    A segment's header is written only after the segment before it is durable, but a log
    written without that ordering (or damaged since) can hold a later segment whose
    predecessor lost its tail in a crash; readers would fail on that gap much later.
    """
    for older, newer in itertools.pairwise(segments):
        end, whole, size = older.end, older.whole, older.size
        if end == newer.first_seq:
            continue
        cut = (
            f" ({older.name} holds whole records only up to byte {whole} of {size})"
            if whole != size
            else ""
        )
        if end < newer.first_seq:
            what = (
                f"updates {end} to {newer.first_seq - 1} are missing (what a crash leaves "
                f"when {newer.name} reached the disk before the end of {older.name}, "
                f"possible with log.fsync: false)"
            )
        else:
            what = "the two segments overlap, so they do not belong to the same log"
        raise StateError(
            f"publisher log {directory}: {older.name} ends at seq {end} but the "
            f"next segment {newer.name} starts at seq {newer.first_seq}{cut}; {what}. "
            f"Restore {older.name} from a copy, or start over with a new state_dir; to "
            f"keep the later segments and accept the loss, move {older.name} and every "
            f"segment before it out of {directory}"
        )


def recover_segment(
    session: int, roll: int, path: Path, truncated: list[str]
) -> tuple[Segment, bytes, int] | None:
    """Recover the newest segment: read every record, cut a torn tail or an incomplete batch
    (naming it in ``truncated``), make it durable and index it. Returns it, the checkpoint
    after its last batch and the seq after its last update; None (and the file removed) when
    even its header was torn.
    """
    with open(path, "r+b") as f:
        scan = _SegmentScan(path)
        cut = scan.read(f)
        if scan.incomplete is not None:
            cut = scan.drop_incomplete()
        if cut is not None:
            f.truncate(cut)
            f.flush()
            truncated.append(f"{path.name}@{cut}")
        # With log.fsync off this segment may be in the page cache only; it must be on
        # disk before the new session's first segment is, or a crash leaves a gap.
        os.fsync(f.fileno())
    if scan.header is None:
        path.unlink()
        index_path(path).unlink(missing_ok=True)
        fsync_directory(str(path.parent))
        return None
    first_seq, header_crc, header_end = read_header(path)
    segment = Segment(path, session, roll, first_seq, header_end, [], header_crc)
    if scan.index:
        segment.appended(scan.index)
    segment.write_index()
    return segment, scan.checkpoint, scan.next_seq


class _SegmentScan:
    """What reading a segment's records found: its header, the checkpoint after its last
    complete batch, the seq after its last update and the index entries of its batches."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.header: SegmentHeader | None = None
        self.checkpoint = b"null"
        self.next_seq = 0
        self.index: list[tuple[int, int, int, int, int]] = []  # first, count, bytes, kind, max ts
        # (offset, index length, next_seq) where the parts of a batch began, until its last
        # record arrives: the parts alone are a batch that was never confirmed.
        self.incomplete: tuple[int, int, int] | None = None

    def read(self, f: BinaryIO) -> int | None:
        """Read every record of ``f``; the offset of a torn tail to cut (None: none)."""
        path = self.path
        try:
            for record in read_records(f, str(path)):
                if self.header is None:
                    self._begin(record)
                elif record.kind in BATCH_KINDS:
                    self._batch(record)
        except TornTail as torn:
            log.warning(
                "%s: torn tail at offset %d (%s); truncating %d bytes left by an interrupted write",
                path,
                torn.offset,
                torn.reason,
                os.fstat(f.fileno()).st_size - torn.offset,
            )
            return torn.offset
        return None

    def _begin(self, record: Record) -> None:
        if record.kind != KIND_SEGMENT:
            raise LogCorruptError(str(self.path), 0, "segment does not start with its header")
        self.header = _header_decoder.decode(record.payload)
        self.checkpoint = bytes(self.header.checkpoint)
        self.next_seq = self.header.first_seq

    def _batch(self, record: Record) -> None:
        if record.first != self.next_seq:
            raise LogCorruptError(
                str(self.path),
                record.offset,
                f"batch starts at seq {record.first}, expected {self.next_seq}",
            )
        raw_checkpoint, times = batch_times(record.payload)
        if record.kind == KIND_BATCH:
            self.checkpoint = bytes(raw_checkpoint)
            self.incomplete = None
        elif self.incomplete is None:
            self.incomplete = (record.offset, len(self.index), self.next_seq)
        self.index.append(
            (record.first, record.count, record.end - record.offset, record.kind, times)
        )
        self.next_seq = record.first + record.count

    def drop_incomplete(self) -> int:
        """Forget the parts of the batch whose last record is missing; the offset to cut."""
        assert self.incomplete is not None
        offset, kept, resume = self.incomplete
        log.warning(
            "%s: an incomplete batch from seq %d at offset %d (its last record, which "
            "carries the checkpoint, is missing); truncating it: it was never "
            "confirmed, so the source sends it again",
            self.path,
            resume,
            offset,
        )
        del self.index[kept:]
        self.next_seq = resume
        return offset
