"""Reading a publisher log from outside the publisher: ``wormhole status``, the Spark source
and ``start: {time: ...}`` read its files without recovering or locking it (it may be live).

Only whole records are read, through each segment's index (:mod:`wormhole.core.segment_format`) and,
past it, the segment's record headers.
"""

from __future__ import annotations

import bisect
import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from wormhole.core.errors import LogCorruptError
from wormhole.core.segment_format import (
    BATCH_KINDS,
    KIND_BATCH,
    NO_TS,
    UNKNOWN_TS,
    Entry,
    load_entries,
    read_header,
)
from wormhole.core.update import Update
from wormhole.plugins.framing import Record, log_file_key, read_record_at, scan_headers

_updates_only_decoder = msgspec.json.Decoder(tuple[Any, list[Update]])


@dataclass
class LogInfo:
    """What ``wormhole status`` shows of a publisher log, read without changing it."""

    directory: Path
    segments: list[tuple[str, int, int]]  # (name, first_seq, size)
    first_seq: int
    next_seq: int


def inspect_log(directory: str | os.PathLike[str]) -> LogInfo:
    """Read a publisher log's extent without recovering or locking it (it may be live).

    Reads each segment's header record and the index of the newest segment holding a batch;
    a segment whose header is damaged is left out, and a damaged record ends its segment.
    """
    root = Path(directory)
    segments: list[tuple[str, int, int]] = []
    paths = []
    next_seq = 0
    for first, path in _offline_paths(root, tolerate_corrupt=True):
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            continue
        segments.append((path.name, first, size))
        paths.append(path)
        next_seq = max(next_seq, first)
    for path in reversed(paths):
        try:
            opened = _offline_entries(path)
        except LogCorruptError:
            opened = None
            entries = _entries_until_damage(path)
        else:
            entries = []
            if opened is not None:
                opened[0].close()
                entries = opened[1]
        ends = [e.first + e.n_updates for e in entries if e.kind == KIND_BATCH]
        if ends:
            next_seq = max(next_seq, ends[-1])
            break
    first_seq = segments[0][1] if segments else 0
    return LogInfo(root, segments, first_seq, next_seq)


def _entries_until_damage(path: Path) -> list[Entry]:
    """The entries of a damaged segment's records before the damage, from their headers."""
    try:
        with open(path, "rb") as f:
            headers: list[Record] = []
            with contextlib.suppress(LogCorruptError):
                headers.extend(scan_headers(f, str(path)))
    except FileNotFoundError:
        return []
    return [
        Entry(r.first, r.count, r.offset, 0, r.kind, UNKNOWN_TS)
        for r in headers
        if r.kind in BATCH_KINDS
    ]


def _offline_entries(path: Path) -> tuple[BinaryIO, list[Entry]] | None:
    """Segment ``path`` open, with the entries of its whole records (from its index and, past
    it, its record headers), read without recovering or locking the log; None if the segment
    was garbage-collected meanwhile."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - the caller closes it
    except FileNotFoundError:
        return None
    try:
        fd = f.fileno()
        _, header_crc, header_end = read_header(path)
        entries, _, _ = load_entries(path, fd, header_crc, header_end, os.fstat(fd).st_size)
    except BaseException:
        f.close()
        raise
    return f, entries


def _offline_paths(root: Path, tolerate_corrupt: bool = False) -> list[tuple[int, Path]]:
    """``(first seq, path)`` of each segment of a log, oldest first; with
    ``tolerate_corrupt``, a segment whose header record is damaged is left out."""
    if not root.is_dir():
        return []
    found = sorted(
        (key, p) for p in root.glob("log.*") if (key := log_file_key(p.name)) is not None
    )
    paths = []
    for _, path in found:
        try:
            paths.append((read_header(path)[0], path))
        except FileNotFoundError:
            continue
        except LogCorruptError:
            if not tolerate_corrupt:
                raise
    return paths


def read_log_range(
    directory: str | os.PathLike[str], start: int, end: int
) -> Iterator[tuple[int, Update]]:
    """``(seq, update)`` for every update with ``start <= seq < end``, read without
    recovering or locking the log (it may be live; only complete records are read).

    Raises LookupError when part of the range was already garbage-collected.
    """
    root = Path(directory)
    covered = start
    paths = _offline_paths(root)
    for i, (_, path) in enumerate(paths):
        if covered >= end:
            return
        if i + 1 < len(paths) and paths[i + 1][0] <= covered:
            continue  # the range starts in a later segment
        opened = _offline_entries(path)
        if opened is None:
            continue
        f, entries = opened
        with f:
            at = max(0, bisect.bisect_right(entries, (covered, 1 << 62)) - 1)
            for entry in entries[at:]:
                if entry.n_updates == 0:
                    continue
                last = entry.first + entry.n_updates
                if last <= covered:
                    continue
                if entry.first >= end:
                    break
                if entry.first > covered:
                    raise LookupError(
                        f"publisher log {root}: updates {covered} to {entry.first - 1} are no "
                        f"longer retained (garbage-collected)"
                    )
                for k, update in enumerate(_entry_updates(f, path, entry)):
                    seq = entry.first + k
                    if covered <= seq < end:
                        yield seq, update
                covered = min(last, end)
    if covered < end:
        raise LookupError(
            f"publisher log {root}: updates {covered} to {end - 1} are not in the log "
            f"(not written yet, or garbage-collected)"
        )


def _entry_updates(f: BinaryIO, path: Path, entry: Entry) -> list[Update]:
    _, updates = _updates_only_decoder.decode(read_record_at(f, str(path), entry.offset).payload)
    return list(updates)


def position_at_time(directory: str | os.PathLike[str], ts_ms: int) -> int | None:
    """The position of the first retained update whose source time (``ts_ms``) is at or
    after ``ts_ms``; the end of the log if none is (or if the log holds no update yet: a new
    pipeline starts at the beginning); None if updates are retained but none carries a time.

    Each segment's time index (the largest ``ts_ms`` so far at each record) is searched for
    the first record that reaches ``ts_ms``, and only that record is read; records the index
    does not cover yet (a segment written before indexes were, or the newest records of a
    live segment) are read in order.
    """
    timed = False
    end = 0
    for _, path in _offline_paths(Path(directory)):
        opened = _offline_entries(path)
        if opened is None:
            continue
        f, entries = opened
        with f:
            if not entries:
                continue
            last_end = entries[-1].first + entries[-1].n_updates
            if last_end > entries[0].first:  # seqs run on, so the segment holds updates
                end = max(end, last_end)
            # Entries past the index (UNKNOWN_TS, the largest value) sort last.
            i = bisect.bisect_left(entries, ts_ms, key=lambda e: e.max_ts)
            if i and entries[i - 1].max_ts != NO_TS:
                timed = True
            for entry in entries[i:]:
                if entry.n_updates == 0:
                    continue
                for k, update in enumerate(_entry_updates(f, path, entry)):
                    if update.ts_ms is None:
                        continue
                    timed = True
                    if update.ts_ms >= ts_ms:
                        return entry.first + k
    return end if timed or end == 0 else None
