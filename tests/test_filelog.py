from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import fill_filesystem

from wormhole.connectors.filelog import FilelogOptions, FilelogSource
from wormhole.core.errors import SourceError
from wormhole.plugins.components import SourceContext
from wormhole.publish import LogWriter


def open_source(path: Path, checkpoint: Any = None, **options: Any) -> FilelogSource:
    source = FilelogSource(FilelogOptions(path=str(path), poll_interval_ms=5, **options))
    source.open(
        SourceContext("t", path, 16, threading.Event(), logging.getLogger("test")), checkpoint
    )
    return source


def read_all(source: FilelogSource) -> tuple[list[Any], Any]:
    updates: list[Any] = []
    checkpoint = None
    while (batch := source.read(0.05)) is not None:
        updates += batch.updates
        checkpoint = batch.checkpoint
    return updates, checkpoint


def line(**fields: Any) -> str:
    return json.dumps(fields) + "\n"


def test_files_are_read_in_natural_name_order_with_table_from_directory(tmp_path: Path) -> None:
    riders = tmp_path / "riders"
    riders.mkdir()
    for n in (10, 2, 1):
        (riders / f"{n}.jsonl").write_text(line(key={"id": n}, after={"id": n}))
    source = open_source(riders)
    updates, checkpoint = read_all(source)
    assert [u.key["id"] for u in updates] == [1, 2, 10]
    assert {u.table for u in updates} == {"riders"}
    assert updates[0].position == "1.jsonl:0" and updates[0].connector == "filelog"
    assert checkpoint["streams"][""] == ["10.jsonl", len(line(key={"id": 10}, after={"id": 10}))]


def test_the_last_file_is_tailed_and_a_partial_line_waits(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    first = line(table="t", key={"id": 1}, after={"id": 1})
    path.write_text(first + '{"table": "t", "key": {"id": 2}, "af')
    source = open_source(path)
    updates, _ = read_all(source)
    assert [u.key["id"] for u in updates] == [1]
    with open(path, "a") as f:
        f.write('ter": {"id": 2}}\n' + line(table="t", op="d", key={"id": 1}))
    updates, checkpoint = read_all(source)
    assert [(u.op, u.key["id"]) for u in updates] == [("c", 2), ("d", 1)]
    # A delete without a before image carries the key columns, per the envelope contract.
    assert updates[1].before_row() == {"id": 1}
    # A restart from the checkpoint reads nothing again.
    again = open_source(path, checkpoint)
    assert read_all(again)[0] == []


def test_a_complete_last_line_without_newline_is_read(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(
        line(key={"id": 1}, after={"id": 1}) + json.dumps({"key": {"id": 2}, "after": {"id": 2}})
    )
    source = open_source(path)
    end = source.capture_end()
    updates, _ = read_all(source)
    assert [u.key["id"] for u in updates] == [1, 2]
    assert source.reached(end)


def test_a_malformed_line_stops_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(
        line(key={"id": 1}, after={"id": 1}) + "\n" + '{"key": {"id": 2}, "after": [1}\n'
    )
    source = open_source(path, on_decode_error="stop")
    batch = source.read(0.05)
    assert batch is not None and [u.key["id"] for u in batch.updates] == [1]
    with pytest.raises(SourceError) as err:
        read_all(source)
    message = str(err.value)
    assert f"{path}: line 3 (offset" in message
    assert "not a valid update line" in message


def test_positions_are_each_lines_byte_offset_with_or_without_blank_lines(
    tmp_path: Path,
) -> None:
    lines = [line(key={"id": i}, after={"id": i, "pad": "x" * i}) for i in range(50)]
    for name, text in (("plain", "".join(lines)), ("blanks", "\n".join(lines) + " \n")):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(text)
        updates, _ = read_all(open_source(path))
        assert [u.key["id"] for u in updates] == list(range(50))
        data = path.read_bytes()
        for u in updates:
            offset = int(u.position.rsplit(":", 1)[1])
            assert json.loads(data[offset:].split(b"\n", 1)[0])["key"] == u.key, name


def test_an_object_split_across_two_lines_is_an_error(tmp_path: Path) -> None:
    """Each line must be a whole update, even where two lines would parse joined."""
    path = tmp_path / "events.jsonl"
    path.write_text(
        line(key={"id": 1}, after={"id": 1}) + '{"key": {"id": 2}\n"after": {"id": 2}}\n'
    )
    with pytest.raises(SourceError, match=r"line 2 .*not a valid update line"):
        read_all(open_source(path, on_decode_error="stop"))
    # Two updates on one line and one update across the next two: as many objects as lines.
    path.write_text(
        line(key={"id": 1}, after={"id": 1}).strip()
        + ","
        + line(key={"id": 2}, after={"id": 2})
        + '{"key": {"id": 3}\n"after": {"id": 3}}\n'
    )
    with pytest.raises(SourceError, match=r"line 1 .*not a valid update line"):
        read_all(open_source(path, on_decode_error="stop"))


def test_an_update_without_after_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(line(op="u", key={"id": 1}))
    with pytest.raises(SourceError, match=r"line 1 .*op 'u' needs 'after'"):
        read_all(open_source(path, on_decode_error="stop"))


def test_a_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="does not exist; create it"):
        open_source(tmp_path / "nowhere")


def test_logwriter_messages_carry_publisher_id_and_sequence(tmp_path: Path) -> None:
    with LogWriter(tmp_path / "pub", publisher_id="gps", roll_size=2048, batch_size=7) as w:
        for i in range(100):
            assert w.publish("rider_location", {"rider": i}, {"rider": i, "seq": 0}) == i + 1
    names = sorted(p.name for p in (tmp_path / "pub").glob("log.*"))
    assert len(names) > 1 and all(n.startswith("log.0.") for n in names), "rolled by size"
    updates, _ = read_all(open_source(tmp_path))
    assert [u.key["rider"] for u in updates] == list(range(100))
    assert updates[0].logical == "gps:1" and updates[-1].logical == "gps:100"
    assert updates[0].table == "rider_location"


def test_a_publisher_restarted_from_its_checkpoint_is_delivered_once(tmp_path: Path) -> None:
    pub = tmp_path / "streams" / "pub"
    with LogWriter(pub, publisher_id="gps") as w:
        for i in range(50):
            w.publish("t", {"id": i}, {"id": i})
    # The application's last checkpoint was seq 30: it re-publishes 31.. on restart.
    with LogWriter(pub, publisher_id="gps", start_seq=31) as w:
        assert w.session == 1
        for i in range(30, 80):
            w.publish("t", {"id": i}, {"id": i})
    assert sorted(p.name for p in pub.glob("log.*")) == ["log.0.0", "log.1.0"]
    updates, _ = read_all(open_source(tmp_path / "streams"))
    assert [u.key["id"] for u in updates] == list(range(80))


def test_two_publishers_writing_the_same_stream_deliver_each_message_once(tmp_path: Path) -> None:
    streams = tmp_path / "streams"
    a = LogWriter(streams / "host-a", publisher_id="gps", batch_size=10)
    b = LogWriter(streams / "host-b", publisher_id="gps", batch_size=13)
    for i in range(200):
        a.publish("t", {"id": i}, {"id": i})
        if i < 150:  # host b falls behind, then dies
            b.publish("t", {"id": i}, {"id": i})
    a.close()
    b.close()
    source = open_source(streams)
    updates, checkpoint = read_all(source)
    assert [u.key["id"] for u in updates] == list(range(200))
    assert checkpoint["seen"] == {"gps": 200}
    # After a restart from the checkpoint, new messages (from either host) continue once.
    with LogWriter(streams / "host-b", publisher_id="gps", start_seq=151) as w:
        for i in range(150, 220):
            w.publish("t", {"id": i}, {"id": i})
    updates, _ = read_all(open_source(streams, checkpoint))
    assert [u.key["id"] for u in updates] == list(range(200, 220))


def test_a_torn_logwriter_tail_waits_then_is_skipped_once_rolled(tmp_path: Path) -> None:
    pub = tmp_path / "s" / "pub"
    with LogWriter(pub, publisher_id="p") as w:
        for i in range(10):
            w.publish("t", {"id": i}, {"id": i})
    with open(pub / "log.0.0", "ab") as f:
        f.write(b"WH\x01\x04\xff\xff")  # the writer died mid-record
    source = open_source(tmp_path / "s")
    assert [u.key["id"] for u in read_all(source)[0]] == list(range(10))
    with LogWriter(pub, publisher_id="p") as w:  # the publisher comes back: new session
        assert w.next_seq == 11
        w.publish("t", {"id": 10}, {"id": 10})
    assert [u.key["id"] for u in read_all(source)[0]] == [10]


def test_a_delete_has_no_after_image(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(line(op="d", key={"id": 1}, after={"id": 1, "name": "old"}))
    (update,) = read_all(open_source(path))[0]
    assert update.after_row() is None
    assert update.before_row() == {"id": 1, "name": "old"}
    with pytest.raises(ValueError, match="a delete has no row after the change"):
        LogWriter(tmp_path / "pub", publisher_id="p").publish("t", {"id": 1}, {"id": 1}, op="d")


def test_once_end_is_not_reached_before_a_resumed_logwriter_stream_is_read(
    tmp_path: Path,
) -> None:
    pub = tmp_path / "s" / "pub"
    with LogWriter(pub, publisher_id="p", batch_size=10) as w:
        for i in range(50):
            w.publish("t", {"id": i}, {"id": i})
    source = open_source(tmp_path / "s", batch_bytes=512)
    batch = source.read(0.1)
    assert batch is not None and len(batch.updates) < 50
    checkpoint = batch.checkpoint
    # A new run resumes from that checkpoint: the end is not reached until the
    # rest of the LogWriter file has been read (the stream is not open yet).
    again = open_source(tmp_path / "s", checkpoint)
    end = again.capture_end()
    assert not again.reached(end)
    rest, _ = read_all(again)
    assert [u.key["id"] for u in batch.updates + rest] == list(range(50))
    assert again.reached(end)


def test_logwriter_on_a_full_disk_leaves_no_half_record(small_filesystem: Path) -> None:
    pub = small_filesystem / "pub"
    writer = LogWriter(pub, publisher_id="p", batch_size=10_000)
    filler = small_filesystem / "filler"
    fill_filesystem(filler)
    for i in range(300):
        writer.publish("t", {"id": i}, {"id": i, "pad": "y" * 100})
    with pytest.raises(OSError):
        writer.flush()
    filler.unlink()
    assert writer.flush() == 300  # the retry appends cleanly
    writer.close()
    updates, _ = read_all(open_source(small_filesystem))
    assert [u.key["id"] for u in updates] == list(range(300))


def test_one_publishers_sequence_continued_in_another_stream_is_delivered_whole(
    tmp_path: Path,
) -> None:
    streams = tmp_path / "streams"
    with LogWriter(streams / "a-host1", publisher_id="gps", batch_size=10) as w:
        for i in range(100):
            w.publish("t", {"id": i % 7}, {"id": i % 7, "n": i})
    # host1 failed; host2 took over and continued the sequence at 101.
    with LogWriter(streams / "b-host2", publisher_id="gps", start_seq=101, batch_size=10) as w:
        for i in range(100, 200):
            w.publish("t", {"id": i % 7}, {"id": i % 7, "n": i})
    updates, checkpoint = read_all(open_source(streams, batch_bytes=512))
    assert [u.after_row()["n"] for u in updates] == list(range(200))  # type: ignore[index]
    assert checkpoint["seen"] == {"gps": 200}
