from __future__ import annotations

import logging
import zlib
from pathlib import Path

import pytest
from conftest import fill_filesystem

from wormhole.core.errors import LogCorruptError
from wormhole.core.framing import HEADER_SIZE
from wormhole.core.publisher_log import PublisherLog, inspect_log
from wormhole.core.shard import shard_of, stable_hash
from wormhole.core.update import Update


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
    from wormhole.core.errors import StateError

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StateError, match="choose a writable state_dir"):
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
