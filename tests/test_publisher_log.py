from __future__ import annotations

import itertools
import logging
import os
import zlib
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import fill_filesystem

from wormhole.core import publisher_log
from wormhole.core.errors import LogCorruptError, SourceError, StateError
from wormhole.core.publisher_log import PublisherLog, inspect_log, read_log_range
from wormhole.core.shard import shard_of, stable_hash
from wormhole.core.update import Update
from wormhole.plugins import framing
from wormhole.plugins.framing import HEADER_SIZE


def updates(start: int, n: int) -> list[Update]:
    return [
        Update.create(op="c", key={"id": i}, table="t", after={"id": i, "v": "x" * 20})
        for i in range(start, start + n)
    ]


def drain(plog: PublisherLog, position: int) -> list[int]:
    reader = plog.reader(position)
    ids = []
    while (batch := reader.read()) is not None:
        assert batch.first_seq + len(batch.updates) == batch.end_seq
        ids += [u.key["id"] for u in batch.updates]
    reader.close()
    return ids


def test_segments_roll_at_size_and_every_start_opens_a_new_session(tmp_path: Path) -> None:
    plog = PublisherLog(tmp_path, roll_size=4096)
    assert plog.open().session == 0
    for i in range(20):
        plog.append(updates(i * 10, 10), {"pos": i})
    plog.close()
    names = sorted(p.name for p in tmp_path.glob("log.*"))
    assert "log.0.0" in names and "log.0.1" in names, names
    assert all(n.startswith("log.0.") for n in names)

    again = PublisherLog(tmp_path, roll_size=4096)
    recovery = again.open()
    assert recovery.session == 1
    assert recovery.checkpoint == {"pos": 19}
    assert recovery.next_seq == 200
    assert (tmp_path / "log.1.0").exists()
    # Every update, in order, from any position, across segments and sessions.
    assert drain(again, 0) == list(range(200))
    assert drain(again, 137) == list(range(137, 200))
    again.append(updates(200, 5), {"pos": 20})
    assert drain(again, 195) == list(range(195, 205))
    again.close()


def test_torn_tail_is_truncated_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plog = PublisherLog(tmp_path)
    plog.open()
    plog.append(updates(0, 10), {"pos": 1})
    plog.append(updates(10, 10), {"pos": 2})
    plog.close()
    segment = tmp_path / "log.0.0"
    size = segment.stat().st_size
    with open(segment, "r+b") as f:
        f.truncate(size - 7)  # the last batch was cut short by a crash
    with caplog.at_level(logging.WARNING):
        again = PublisherLog(tmp_path)
        recovery = again.open()
    assert recovery.checkpoint == {"pos": 1}, "the torn batch must not count"
    assert recovery.next_seq == 10
    assert recovery.truncated and recovery.truncated[0].startswith("log.0.0@")
    assert "torn tail" in caplog.text
    assert drain(again, 0) == list(range(10))
    again.close()


def test_zero_filled_tail_counts_as_torn(tmp_path: Path) -> None:
    plog = PublisherLog(tmp_path)
    plog.open()
    plog.append(updates(0, 3), {"pos": 1})
    plog.close()
    with open(tmp_path / "log.0.0", "ab") as f:
        f.write(b"\0" * 4096)  # blocks allocated but never written before power loss
    again = PublisherLog(tmp_path)
    assert again.open().next_seq == 3
    again.close()


def test_crc_mismatch_in_the_middle_stops_naming_file_and_offset(tmp_path: Path) -> None:
    plog = PublisherLog(tmp_path)
    plog.open()
    plog.append(updates(0, 10), {"pos": 1})
    offset = (tmp_path / "log.0.0").stat().st_size
    plog.append(updates(10, 10), {"pos": 2})
    plog.append(updates(20, 10), {"pos": 3})
    plog.close()
    with open(tmp_path / "log.0.0", "r+b") as f:
        f.seek(offset + HEADER_SIZE + 5)
        byte = f.read(1)
        f.seek(offset + HEADER_SIZE + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(LogCorruptError) as err:
        PublisherLog(tmp_path).open()
    assert err.value.path.endswith("log.0.0")
    assert err.value.offset == offset
    assert f"offset {offset}" in str(err.value) and "CRC mismatch" in str(err.value)
    # Nothing was truncated: the damaged file is left for the operator.
    assert (tmp_path / "log.0.0").stat().st_size > offset


def test_garbage_collection_removes_only_segments_every_flow_passed(tmp_path: Path) -> None:
    plog = PublisherLog(tmp_path, roll_size=4096)
    plog.open()
    for i in range(30):
        plog.append(updates(i * 10, 10), {"pos": i})
    segments = [(s.name, s.first_seq, s.end_seq) for s in plog.segments]
    assert len(segments) >= 4
    upto = segments[2][1] + 1  # inside the third segment
    removed = plog.collect_garbage(upto)
    assert removed == [segments[0][0], segments[1][0]]
    assert not (tmp_path / segments[0][0]).exists()
    assert (tmp_path / segments[2][0]).exists()
    assert plog.first_seq == segments[2][1]
    assert drain(plog, plog.first_seq)[-1] == 299
    with pytest.raises(LookupError, match="older than the oldest retained"):
        plog.reader(0).read()
    # The active segment is never collected, even when every flow is at the end.
    plog.collect_garbage(plog.next_seq)
    assert [s.name for s in plog.segments] == [segments[-1][0]]
    # keep_rolled retains passed segments for replay.
    plog.close()


def test_keep_rolled_retains_passed_segments(tmp_path: Path) -> None:
    plog = PublisherLog(tmp_path, roll_size=4096)
    plog.open()
    for i in range(30):
        plog.append(updates(i * 10, 10), {"pos": i})
    before = len(plog.segments)
    removed = plog.collect_garbage(plog.next_seq, keep=2)
    assert len(removed) == before - 1 - 2
    plog.close()


def test_inspect_reads_extent_without_changing_the_log(tmp_path: Path) -> None:
    plog = PublisherLog(tmp_path, roll_size=4096)
    plog.open()
    for i in range(12):
        plog.append(updates(i * 10, 10), None)
    sizes = {p.name: p.stat().st_size for p in tmp_path.glob("log.*")}
    info = inspect_log(tmp_path)
    assert (info.first_seq, info.next_seq) == (0, 120)
    assert {p.name: p.stat().st_size for p in tmp_path.glob("log.*")} == sizes
    plog.close()


def test_an_unwritable_log_directory_is_a_state_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StateError, match="or set state_dir to another directory"):
        PublisherLog(blocker / "log").open()


def test_shard_hash_is_crc32_of_canonical_json() -> None:
    key = {"b": 2, "a": "x"}
    assert stable_hash(key) == zlib.crc32(b'{"a":"x","b":2}')
    assert shard_of(key, 16) == zlib.crc32(b'{"a":"x","b":2}') % 16
    # Member order in the source never changes the shard.
    assert shard_of({"a": "x", "b": 2}, 16) == shard_of(key, 16)
    assert shard_of({"rider": 42}, 16) == zlib.crc32(b'{"rider":42}') % 16


def test_full_disk_append_leaves_no_partial_record(small_filesystem: Path) -> None:
    plog = PublisherLog(small_filesystem / "log")
    plog.open()
    plog.append(updates(0, 5), {"pos": 1})
    segment = small_filesystem / "log" / "log.0.0"
    filler = small_filesystem / "filler"
    fill_filesystem(filler)
    size = segment.stat().st_size
    with pytest.raises(OSError) as err:
        plog.append(updates(5, 200), {"pos": 2})
    assert err.value.errno == 28  # ENOSPC, from the real filesystem
    assert segment.stat().st_size == size, "a partial record was left behind"
    filler.unlink()
    plog.append(updates(5, 200), {"pos": 2})
    plog.close()
    again = PublisherLog(small_filesystem / "log")
    assert again.open().next_seq == 205
    assert drain(again, 0) == list(range(205))
    again.close()


def test_a_flipped_length_in_the_middle_is_corruption_not_a_torn_tail(tmp_path: Path) -> None:
    plog = PublisherLog(tmp_path)
    plog.open()
    offsets = []
    for i in range(5):
        offsets.append((tmp_path / "log.0.0").stat().st_size)
        plog.append(updates(i * 10, 10), {"pos": i})
    plog.close()
    size = (tmp_path / "log.0.0").stat().st_size
    with open(tmp_path / "log.0.0", "r+b") as f:
        f.seek(offsets[1] + 4)  # the length field of batch 2 of 5: now it runs past the end
        f.write(b"\xff\xff\x00\x00")
    with pytest.raises(LogCorruptError) as err:
        PublisherLog(tmp_path).open()
    assert err.value.offset == offsets[1]
    assert "valid record at offset" in str(err.value)
    assert (tmp_path / "log.0.0").stat().st_size == size, "committed batches were cut"


def test_a_truncated_rolled_segment_is_an_error_not_a_loop(tmp_path: Path) -> None:
    plog = PublisherLog(tmp_path, roll_size=4096)
    plog.open()
    for i in range(20):
        plog.append(updates(i * 10, 10), {"pos": i})
    plog.close()
    again = PublisherLog(tmp_path, roll_size=4096)
    again.open()
    victim = again.segments[1]
    with open(victim.path, "r+b") as f:
        f.truncate(victim.path.stat().st_size - 100)
    reader = again.reader(0)
    with pytest.raises(
        LogCorruptError, match=r"corrupt record at offset|ends inside a record|missing data"
    ):
        for _ in range(100):
            assert reader.read() is not None
    again.close()


# A segment roll with log.fsync off: the old segment's tail must reach the disk before the
# new segment's header, and open() must notice when it did not (a log written before that
# ordering, or a segment damaged since).
def _record_durability_events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """("sync", file name) for every fsync/fdatasync and ("create", name) for every os.open,
    in call order: a power loss cannot run here, the order that decides what survives can."""
    events: list[tuple[str, str]] = []
    real_fsync, real_fdatasync, real_open = os.fsync, os.fdatasync, os.open

    def name_of(fd: int) -> str:
        return Path(os.readlink(f"/proc/self/fd/{fd}")).name

    def fsync(fd: int) -> None:
        events.append(("sync", name_of(fd)))
        real_fsync(fd)

    def fdatasync(fd: int) -> None:
        events.append(("sync", name_of(fd)))
        real_fdatasync(fd)

    def open_(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        events.append(("create", Path(path).name))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "open", open_)
    return events


def test_a_roll_makes_the_old_segment_durable_before_the_new_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plog = PublisherLog(tmp_path, roll_size=4096, fsync=False)
    plog.open()
    events = _record_durability_events(monkeypatch)
    while len(plog.segments) < 2:
        plog.append(updates(plog.next_seq, 10), {"pos": plog.next_seq})
    assert ("sync", "log.0.0") in events
    assert events.index(("sync", "log.0.0")) < events.index(("create", "log.0.1")), events
    plog.close()


def test_a_new_session_makes_the_recovered_segment_durable_before_its_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    crashed = PublisherLog(tmp_path, fsync=False)
    crashed.open()
    crashed.append(updates(0, 10), {"pos": 1})  # in the page cache only; then the crash
    events = _record_durability_events(monkeypatch)
    again = PublisherLog(tmp_path, fsync=False)
    again.open()
    assert ("sync", "log.0.0") in events
    assert events.index(("sync", "log.0.0")) < events.index(("create", "log.1.0")), events
    again.close()
    crashed.close()


@pytest.mark.parametrize("cut", ["at a record boundary", "inside a record"])
def test_a_rolled_segment_that_lost_its_tail_is_reported_at_open(tmp_path: Path, cut: str) -> None:
    plog = PublisherLog(tmp_path, roll_size=4096, fsync=False)
    plog.open()
    while len(plog.segments) < 3:
        plog.append(updates(plog.next_seq, 10), {"pos": plog.next_seq})
    old = plog.segments[0]
    assert old.index
    last_offset = old.index[-1][2]
    plog.close()
    # What a crash leaves when log.0.1's header reached the disk before log.0.0's last batch.
    with open(old.path, "r+b") as f:
        f.truncate(last_offset if cut == "at a record boundary" else last_offset + 30)
    sizes = {p.name: p.stat().st_size for p in tmp_path.glob("log.*")}
    with pytest.raises(StateError) as err:
        PublisherLog(tmp_path, roll_size=4096).open()
    message = str(err.value)
    assert "log.0.0" in message and "log.0.1" in message, message
    assert "restore" in message.lower(), message
    # Nothing was cut, and no new session was started over the damage.
    assert {p.name: p.stat().st_size for p in tmp_path.glob("log.*")} == sizes


def test_open_accepts_every_roll_and_session_boundary_of_an_intact_log(tmp_path: Path) -> None:
    for _session in range(3):
        plog = PublisherLog(tmp_path, roll_size=4096, fsync=False)
        plog.open()
        for i in range(12):
            plog.append(updates(plog.next_seq, 10), {"pos": i})
        plog.close()
    plog = PublisherLog(tmp_path, roll_size=4096)
    assert plog.open().next_seq == 360
    assert drain(plog, 0) == list(range(360))
    plog.close()


def test_a_rolled_segment_with_a_zero_filled_tail_is_a_gap_not_corruption(
    tmp_path: Path,
) -> None:
    plog = PublisherLog(tmp_path, roll_size=4096, fsync=False)
    plog.open()
    while len(plog.segments) < 2:
        plog.append(updates(plog.next_seq, 10), {"pos": plog.next_seq})
    old = plog.segments[0]
    assert old.index
    last_offset = old.index[-1][2]
    plog.close()
    # Blocks allocated for the last batch but never written before power loss.
    size = old.path.stat().st_size
    with open(old.path, "r+b") as f:
        f.seek(last_offset)
        f.write(b"\0" * (size - last_offset + (2 << 20)))
    with pytest.raises(StateError, match=r"log\.0\.0 ends at seq .* log\.0\.1 starts"):
        PublisherLog(tmp_path, roll_size=4096).open()


# Records are bounded on write: recovery takes a record longer than framing.MAX_RECORD for a
# torn one, and the frame's u32 length cannot hold 4 GiB. The tests set both bounds small.
SMALL_RECORD = 2048


def big_updates(start: int, n: int, width: int = 200) -> list[Update]:
    return [
        Update.create(op="c", key={"id": i}, table="t", after={"id": i, "v": "x" * width})
        for i in range(start, start + n)
    ]


def record_headers(path: Path) -> list[tuple[int, int, int, int]]:
    """(kind, first, count, payload length) of every record of a segment."""
    out = []
    with open(path, "rb") as f:
        data = f.read()
    offset = 0
    while offset < len(data):
        _m, _v, kind, length, _crc, first, count = framing.HEADER.unpack_from(data, offset)
        out.append((kind, first, count, length))
        offset += framing.HEADER_SIZE + length
    return out


def test_a_batch_over_the_record_bound_is_recovered_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(framing, "MAX_RECORD", SMALL_RECORD)
    plog = PublisherLog(tmp_path)
    plog.max_record = SMALL_RECORD
    plog.open()
    plog.append(big_updates(0, 3), {"pos": 1})
    plog.append(big_updates(3, 40), {"pos": 2})  # about 10 KB encoded, confirmed
    assert drain(plog, 0) == list(range(43))
    plog.close()
    again = PublisherLog(tmp_path)
    recovery = again.open()
    assert recovery.truncated == [], "a confirmed batch was taken for a torn tail"
    assert (recovery.next_seq, recovery.checkpoint) == (43, {"pos": 2})
    assert drain(again, 0) == list(range(43))
    assert drain(again, 20) == list(range(20, 43))
    again.close()
    records = record_headers(tmp_path / "log.0.0")
    assert all(length <= SMALL_RECORD for _k, _f, _c, length in records)
    # In seq order, each record starting where the one before it ended.
    seqs = [(first, count) for kind, first, count, _ in records[1:]]
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(seqs))
    assert len(seqs) > 3, "the large batch was not split"


def test_a_single_update_over_the_record_bound_is_an_error_naming_it(tmp_path: Path) -> None:
    plog = PublisherLog(tmp_path, max_record=SMALL_RECORD)
    plog.open()
    plog.append(big_updates(0, 3), {"pos": 1})
    size = (tmp_path / "log.0.0").stat().st_size
    huge = Update.create(op="u", key={"id": 77}, table="public.docs", after={"body": "x" * 5000})
    with pytest.raises(SourceError) as err:
        plog.append([*big_updates(3, 2), huge], {"pos": 2})
    message = str(err.value)
    assert "public.docs" in message and '{"id":77}' in message, message
    size_of_huge = len(msgspec.json.encode(huge))
    assert f"{size_of_huge:,} bytes" in message and f"{SMALL_RECORD:,}" in message, message
    assert "source" in message, message  # the fix: leave it out of the source
    # Nothing of that batch was written or numbered.
    assert (tmp_path / "log.0.0").stat().st_size == size
    assert plog.append(big_updates(3, 2), {"pos": 3}).first_seq == 3
    assert drain(plog, 0) == list(range(5))
    plog.close()


def test_an_incomplete_split_batch_is_cut_back_to_the_batch_before_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plog = PublisherLog(tmp_path, max_record=SMALL_RECORD)
    plog.open()
    plog.append(big_updates(0, 3), {"pos": 1})
    before = (tmp_path / "log.0.0").stat().st_size
    plog.append(big_updates(3, 40), {"pos": 2})
    plog.close()
    records = record_headers(tmp_path / "log.0.0")
    assert len(records) >= 2 + 3
    # A crash after the first two records of the split batch were written: they are whole,
    # but the batch's checkpoint (in its last record) never reached the disk.
    cut = before + sum(framing.HEADER_SIZE + length for *_, length in records[2:4])
    with open(tmp_path / "log.0.0", "r+b") as f:
        f.truncate(cut)
    with caplog.at_level(logging.WARNING):
        again = PublisherLog(tmp_path, max_record=SMALL_RECORD)
        recovery = again.open()
    assert (recovery.next_seq, recovery.checkpoint) == (3, {"pos": 1})
    assert recovery.truncated == [f"log.0.0@{before}"]
    assert "incomplete batch" in caplog.text
    assert (tmp_path / "log.0.0").stat().st_size == before
    # The source resumes before the batch and sends it again under the same seqs.
    again.append(big_updates(3, 40), {"pos": 2})
    assert drain(again, 0) == list(range(43))
    again.close()


def test_an_incomplete_split_batch_with_a_torn_last_record_is_cut_back_whole(
    tmp_path: Path,
) -> None:
    plog = PublisherLog(tmp_path, max_record=SMALL_RECORD)
    plog.open()
    plog.append(big_updates(0, 3), {"pos": 1})
    before = (tmp_path / "log.0.0").stat().st_size
    plog.append(big_updates(3, 40), {"pos": 2})
    plog.close()
    with open(tmp_path / "log.0.0", "r+b") as f:
        f.truncate((tmp_path / "log.0.0").stat().st_size - 10)
    again = PublisherLog(tmp_path, max_record=SMALL_RECORD)
    recovery = again.open()
    assert (recovery.next_seq, recovery.checkpoint) == (3, {"pos": 1})
    assert recovery.truncated == [f"log.0.0@{before}"]
    assert (tmp_path / "log.0.0").stat().st_size == before
    again.close()


def test_the_record_bound_holds_at_the_real_limits() -> None:
    gib = 1 << 30
    # The default is what recovery accepts, and well inside the frame's u32 length.
    assert publisher_log.DEFAULT_MAX_RECORD == framing.MAX_RECORD < 1 << 32
    # Batches of several GiB (the u32 overflow) split into records within the bound.
    sizes = [600 << 20] * 7 + [5] * 1000 + [gib - 100]
    ranges = publisher_log.split_ranges(sizes, overhead=64, bound=framing.MAX_RECORD)
    assert [i for r in ranges for i in range(*r)] == list(range(len(sizes)))
    for start, stop in ranges:
        assert 64 + sum(sizes[start:stop]) + (stop - start - 1) <= framing.MAX_RECORD
    assert len(ranges) == 8
    # An update that fits no record: 5 GiB, and one byte over the bound with the overhead.
    for too_big in (5 * gib, framing.MAX_RECORD - 63):
        with pytest.raises(publisher_log.UpdateTooLarge) as err:
            publisher_log.split_ranges([10, too_big, 10], overhead=64, bound=framing.MAX_RECORD)
        assert (err.value.index, err.value.size) == (1, too_big)
    publisher_log.split_ranges([framing.MAX_RECORD - 64], overhead=64, bound=framing.MAX_RECORD)


def test_a_record_bound_recovery_would_reject_is_refused(tmp_path: Path) -> None:
    for bound in (framing.MAX_RECORD + 1, 1 << 32):
        with pytest.raises(ValueError, match="max_record"):
            PublisherLog(tmp_path, max_record=bound)


def test_offline_readers_see_a_split_batch_as_its_updates(tmp_path: Path) -> None:
    plog = PublisherLog(tmp_path, max_record=SMALL_RECORD)
    plog.open()
    plog.append(big_updates(0, 3), {"pos": 1})
    plog.append(big_updates(3, 40), {"pos": 2})
    info = inspect_log(tmp_path)
    assert (info.first_seq, info.next_seq) == (0, 43)
    assert [seq for seq, _ in read_log_range(tmp_path, 2, 30)] == list(range(2, 30))
    assert [u.key["id"] for _, u in read_log_range(tmp_path, 0, 43)] == list(range(43))
    plog.close()
