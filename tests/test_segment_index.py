"""The publisher log's segment index: a cache that never loses an update, and the time index
behind position_at_time."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from wormhole.core import offline_log
from wormhole.core.errors import StateError
from wormhole.core.publisher_log import PublisherLog, position_at_time, read_log_range
from wormhole.core.segment_format import INDEX_MAGIC, index_path
from wormhole.core.update import Update

BASE_TS = 1_700_000_000_000


def timed(start: int, n: int, ts: Callable[[int], int | None]) -> list[Update]:
    return [
        Update.create(op="c", key={"id": i}, table="t", after={"id": i}, ts_ms=ts(i))
        for i in range(start, start + n)
    ]


def write_log(root: Path, batches: int, ts: Callable[[int], int | None], sessions: int = 2) -> None:
    for _ in range(sessions):
        plog = PublisherLog(root, roll_size=4096, fsync=False)
        plog.open()
        for _ in range(batches // sessions):
            plog.append(timed(plog.next_seq, 7, ts), {"pos": plog.next_seq})
        plog.close()


def everything(root: Path) -> tuple[list[tuple[int, int, int | None]], list[int], list[int | None]]:
    plog = PublisherLog(root, roll_size=4096, fsync=False)
    plog.open()
    reader = plog.reader(0)
    read = []
    while (batch := reader.read()) is not None:
        read += [(batch.first_seq + i, u.key["id"], u.ts_ms) for i, u in enumerate(batch.updates)]
    reader.close()
    end = plog.next_seq
    plog.close()
    ranged = [u.key["id"] for _, u in read_log_range(root, 3, end - 2)]
    times = [position_at_time(root, BASE_TS + t) for t in (-5, 0, 1, 13, 200, end // 2, end + 9)]
    return read, ranged, times


def _indexes(root: Path) -> list[Path]:
    found = sorted(root.glob("index.*"))
    assert found, "no index was written"
    return found


def _remove(root: Path) -> None:
    for path in _indexes(root):
        path.unlink()


def _truncate(root: Path) -> None:
    for path in _indexes(root):
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2 + 7])


def _corrupt(root: Path) -> None:
    for path in _indexes(root):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


def _foreign(root: Path) -> None:
    # Each segment given another segment's index.
    paths = _indexes(root)
    contents = [p.read_bytes() for p in paths]
    for path, data in zip(paths, contents[1:] + contents[:1], strict=True):
        path.write_bytes(data)


def _count_decoded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The first seq of every record whose updates offline_log decodes, from now on."""
    decoded: list[int] = []
    real = offline_log._entry_updates

    def counting(f, path, entry):  # type: ignore[no-untyped-def]
        decoded.append(entry.first)
        return real(f, path, entry)

    monkeypatch.setattr(offline_log, "_entry_updates", counting)
    return decoded


@pytest.mark.parametrize("damage", [_remove, _truncate, _corrupt, _foreign])
def test_a_missing_or_damaged_index_gives_the_same_reads(
    tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    write_log(tmp_path / "a", 60, lambda i: BASE_TS + i)
    assert len(list((tmp_path / "a").glob("log.*"))) > 4
    expected = everything(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    damage(tmp_path / "b")
    assert everything(tmp_path / "b") == expected
    # Opening wrote the indexes back: the next open reads them.
    assert all(p.read_bytes()[:4] == INDEX_MAGIC for p in _indexes(tmp_path / "b"))
    assert everything(tmp_path / "b") == expected


def test_an_index_behind_its_segment_is_completed_from_the_segment(tmp_path: Path) -> None:
    """The index of a live segment lags it (or was saved before the segment grew): the records
    past it are read from the segment, by open, readers, read_log_range and position_at_time."""
    plog = PublisherLog(tmp_path, roll_size=1 << 20, fsync=False)
    plog.open()
    for _ in range(5):
        plog.append(timed(plog.next_seq, 7, lambda i: BASE_TS + i), {"pos": plog.next_seq})
    segment = plog.segments[-1]
    early = index_path(segment.path).read_bytes()
    for _ in range(20):
        plog.append(timed(plog.next_seq, 7, lambda i: BASE_TS + i), {"pos": plog.next_seq})
    index_path(segment.path).write_bytes(early)  # as if the later writes had not been made
    # The live log, read from outside.
    assert position_at_time(tmp_path, BASE_TS + 150) == 150
    assert [s for s, _ in read_log_range(tmp_path, 100, 175)] == list(range(100, 175))
    plog.close()
    index_path(segment.path).write_bytes(early)
    expected = [(s, s, BASE_TS + s) for s in range(175)]
    assert everything(tmp_path)[0] == expected


def test_an_index_ahead_of_its_segment_is_not_trusted(tmp_path: Path) -> None:
    """With log.fsync off the index can reach the disk before the segment's last records."""
    write_log(tmp_path, 40, lambda i: BASE_TS + i, sessions=1)
    plog = PublisherLog(tmp_path, roll_size=4096, fsync=False)
    plog.open()
    first = plog.segments[0]
    assert first.end_seq is not None
    plog.close()
    entries = first.load_index()
    with open(first.path, "r+b") as f:  # the last record lost, the file size kept
        f.seek(entries[-1].offset)
        f.write(b"\0" * (first.size - entries[-1].offset))
    with pytest.raises(StateError, match=r"log\.0\.0 ends at seq"):
        PublisherLog(tmp_path, roll_size=4096).open()


def test_position_at_time_reads_one_batch_of_a_long_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Times rise with a dip in every batch, and a stretch of updates carries none.
    def ts(i: int) -> int | None:
        return None if 300 <= i < 350 else BASE_TS + i - (5 if i % 7 == 3 else 0)

    write_log(tmp_path, 200, ts)
    total = 200 * 7

    def scan(target: int) -> int:
        for i in range(total):
            t = ts(i)
            if t is not None and t >= target:
                return i
        return total

    decoded = _count_decoded(monkeypatch)
    for target in [BASE_TS - 1, BASE_TS, BASE_TS + 2, BASE_TS + 299, BASE_TS + 320, BASE_TS + 777]:
        decoded.clear()
        assert position_at_time(tmp_path, target) == scan(target), target
        assert len(decoded) == 1, (target, decoded)
    decoded.clear()
    assert position_at_time(tmp_path, BASE_TS + total + 5) == total
    assert decoded == []


def test_position_at_time_without_times_and_on_an_empty_log(tmp_path: Path) -> None:
    assert position_at_time(tmp_path / "none", BASE_TS) == 0
    write_log(tmp_path / "log", 20, lambda i: None)
    assert position_at_time(tmp_path / "log", BASE_TS) is None
    _remove(tmp_path / "log")
    assert position_at_time(tmp_path / "log", BASE_TS) is None


def test_an_old_log_without_indexes_is_indexed_on_first_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_log(tmp_path, 40, lambda i: BASE_TS + i)
    _remove(tmp_path)
    decoded = _count_decoded(monkeypatch)
    before = position_at_time(tmp_path, BASE_TS + 100)
    assert len(decoded) > 1  # no time index yet: records read in order
    plog = PublisherLog(tmp_path, roll_size=4096, fsync=False)
    plog.open()
    plog.close()
    segments = sorted(tmp_path.glob("log.*"))
    assert {p.name for p in tmp_path.glob("index.*")} >= {index_path(p).name for p in segments[:-1]}
    decoded.clear()
    assert position_at_time(tmp_path, BASE_TS + 100) == before == 100
    assert len(decoded) == 1, decoded


def test_garbage_collection_deletes_an_index_with_its_segment_and_open_an_orphan(
    tmp_path: Path,
) -> None:
    write_log(tmp_path, 40, lambda i: BASE_TS + i, sessions=1)
    plog = PublisherLog(tmp_path, roll_size=4096, fsync=False)
    plog.open()
    gone = plog.segments[0]
    assert gone.index_path.exists()
    assert plog.collect_garbage(plog.segments[1].first_seq) == [gone.name]
    assert not gone.index_path.exists()
    plog.close()
    # A crash between deleting a segment and its index leaves the index alone.
    kept = sorted(tmp_path.glob("log.*"))[0]
    orphan = index_path(kept).read_bytes()
    kept.unlink()
    assert index_path(kept).read_bytes() == orphan
    again = PublisherLog(tmp_path, roll_size=4096)
    again.open()
    again.close()
    assert not index_path(kept).exists()
