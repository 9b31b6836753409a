"""One line never stops the filelog source: a line (or LogWriter record) that is not an
update is skipped and kept in the state_dir's rejects file, with a warning and the metric;
``on_decode_error: stop`` stops at it after delivering what precedes it."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
from test_filelog import read_all

from wormhole.connectors.filelog import FilelogOptions, FilelogSource
from wormhole.connectors.filelog.rejects import REJECTS_FILE
from wormhole.core.errors import SourceError
from wormhole.plugins.components import SourceContext
from wormhole.plugins.events import REJECTED
from wormhole.plugins.framing import KIND_MESSAGES, frame
from wormhole.publish import LogWriter


def open_source(path: Path, state: Path, checkpoint: Any = None, **options: Any) -> FilelogSource:
    source = FilelogSource(FilelogOptions(path=str(path), poll_interval_ms=5, **options))
    source.open(
        SourceContext("t", state, 16, threading.Event(), logging.getLogger("test")), checkpoint
    )
    return source


def line(**fields: Any) -> bytes:
    return json.dumps(fields).encode() + b"\n"


def rejects(state: Path) -> list[dict[str, Any]]:
    path = state / REJECTS_FILE
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def counted(table: str, column: str) -> float:
    return REJECTED.labels(table, column)._value.get()


BAD = [
    (b"this is not json", "", "not a valid update line"),
    (b'{"after": {"id": 9}}', "key", "missing required field `key`"),
    (b'{"op": "x", "key": {"id": 9}, "after": {"id": 9}}', "op", "op must be one of"),
    (b'{"op": "u", "key": {"id": 9}}', "after", "op 'u' needs 'after'"),
    (b'{"key": {"id": 9}, "after": {"s": "\xff"}}', "", "invalid start byte"),
    (b'{"key": {"id": "\xfe"}, "after": {}}', "", "invalid start byte"),
]


@pytest.mark.parametrize(("bad", "column", "reason"), BAD, ids=[c or r[:8] for _, c, r in BAD])
def test_a_bad_line_is_kept_in_the_rejects_file_and_the_lines_around_it_are_delivered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: bytes, column: str, reason: str
) -> None:
    data = tmp_path / "events"
    data.mkdir()
    good = [line(key={"id": i}, after={"id": i}) for i in range(4)]
    text = good[0] + good[1] + bad + b"\n" + good[2] + good[3]
    (data / "1.jsonl").write_bytes(text)
    before = counted("events", column)
    source = open_source(data, tmp_path / "state")
    with caplog.at_level(logging.WARNING, logger="wormhole.filelog"):
        updates, checkpoint = read_all(source)
    assert [u.key["id"] for u in updates] == [0, 1, 2, 3]
    assert checkpoint["streams"][""] == ["1.jsonl", len(text)]
    offset = len(good[0] + good[1])
    [entry] = rejects(tmp_path / "state")
    assert entry["file"] == str(data / "1.jsonl")
    assert (entry["line"], entry["offset"]) == (3, offset)
    assert reason in entry["reason"]
    kept = bytes.fromhex(entry["hex"]) if "hex" in entry else entry["text"].encode()
    assert kept == bad  # lossless
    assert counted("events", column) == before + 1
    [warning] = [r.getMessage() for r in caplog.records if "recorded in" in r.getMessage()]
    assert f"{data / '1.jsonl'}: line 3 (offset {offset})" in warning
    assert "on_decode_error: stop" in warning
    # A restart from the checkpoint neither delivers nor records anything again.
    assert read_all(open_source(data, tmp_path / "state", checkpoint))[0] == []
    assert len(rejects(tmp_path / "state")) == 1


def test_on_decode_error_stop_delivers_the_lines_before_a_bad_line_then_stops(
    tmp_path: Path,
) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(line(key={"id": 1}, after={"id": 1}) + b"not json\n" + line(key={"id": 2}))
    source = open_source(path, tmp_path / "state", on_decode_error="stop")
    batch = source.read(0.05)
    assert batch is not None and [u.key["id"] for u in batch.updates] == [1]
    with pytest.raises(SourceError) as stopped:
        source.read(0.05)
    assert f"{path}: line 2 (offset" in str(stopped.value)
    assert "on_decode_error: fallback" in str(stopped.value)
    assert rejects(tmp_path / "state") == []


def _logwriter_with_a_bad_record(directory: Path, payload: bytes) -> None:
    """Messages 1-3, a record of messages 4-5 with ``payload``, then messages 6-7."""
    with LogWriter(directory, publisher_id="p", batch_size=1) as w:
        for i in range(3):
            w.publish("t", {"id": i}, {"id": i})
    (segment,) = directory.glob("log.*")
    with open(segment, "ab") as f:
        f.write(frame(KIND_MESSAGES, 4, 2, payload))
    with LogWriter(directory, publisher_id="p", batch_size=1, start_seq=6) as w:
        for i in range(5, 7):
            w.publish("t", {"id": i}, {"id": i})


def test_a_logwriter_message_that_does_not_decode_is_kept_and_the_rest_delivered(
    tmp_path: Path,
) -> None:
    good = json.dumps({"table": "t", "key": {"id": 4}, "after": {"id": 4}})
    _logwriter_with_a_bad_record(tmp_path / "s" / "pub", f'[{good}, {{"op": 7}}]'.encode())
    before = counted("pub", "op")
    updates, checkpoint = read_all(open_source(tmp_path / "s", tmp_path / "state"))
    assert [u.logical for u in updates] == ["p:1", "p:2", "p:3", "p:4", "p:6", "p:7"]
    [entry] = rejects(tmp_path / "state")
    assert entry["seq"] == 5 and entry["text"] == '{"op": 7}'
    assert counted("pub", "op") == before + 1
    assert checkpoint["seen"] == {"p": 7}


def test_a_logwriter_record_that_is_not_json_is_kept_whole_or_stops(tmp_path: Path) -> None:
    _logwriter_with_a_bad_record(tmp_path / "s" / "pub", b"\x00\xffnot json")
    updates, _ = read_all(open_source(tmp_path / "s", tmp_path / "state"))
    assert [u.logical for u in updates] == ["p:1", "p:2", "p:3", "p:6", "p:7"]
    [entry] = rejects(tmp_path / "state")
    assert entry["seq"] == 4 and entry["hex"] == b"\x00\xffnot json".hex()
    stopping = open_source(tmp_path / "s", tmp_path / "stop", on_decode_error="stop")
    batch = stopping.read(0.05)
    assert batch is not None and [u.logical for u in batch.updates] == ["p:1", "p:2", "p:3"]
    with pytest.raises(SourceError, match=r"record at offset \d+ \(seq 4\.\.\) has an undecod"):
        stopping.read(0.05)
