"""UpdateColumns: a flow's updates a column at a time (log readers' ``columns`` frames and
the Spark source's Arrow batches), checked against the updates they were made from."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wormhole.connectors.tcp import protocol as p
from wormhole.core.update import (
    COLUMN_STRINGS,
    NO_TS,
    NULL,
    ColumnRow,
    Update,
    UpdateColumns,
    columns_of,
    split_columns,
)

text = st.text(max_size=12)  # any Unicode: the columns hold UTF-8 bytes, not characters
row = st.dictionaries(st.text(max_size=4), st.integers() | text, max_size=3)


@st.composite
def updates(draw: Any) -> list[Update]:
    out = []
    for _ in range(draw(st.integers(0, 40))):
        out.append(
            Update.create(
                op=draw(st.sampled_from(["c", "u", "d", "r", "t"])),
                key={"id": draw(st.integers(-5, 5) | text)},
                table=draw(text),
                after=draw(st.none() | row),
                before=draw(st.none() | row),
                position=draw(text),
                logical=draw(text),
                ts_ms=draw(st.none() | st.integers(-(1 << 62), 1 << 62)),
                shard=draw(st.integers(0, 4)),
            )
        )
        out[-1].audience = draw(st.sampled_from(["", "", "lake", "other"]))
    return out


def rows_of(columns: UpdateColumns) -> list[tuple[Any, ...]]:
    """The columns read back value by value (the reference the fast paths must match)."""
    lengths = [list(memoryview(bytes(b)).cast("i")) for b in columns.lengths]
    values: list[list[bytes]] = []
    for sizes, data in zip(lengths, columns.data, strict=True):
        blob, at, column = bytes(data), 0, []
        for size in sizes:
            column.append(blob[at : at + size])
            at += size
        assert at == len(blob)
        values.append(column)
    seqs = list(memoryview(bytes(columns.seq)).cast("q"))
    ts = list(memoryview(bytes(columns.ts_ms)).cast("q"))
    return [
        (seqs[i], ts[i], *(values[c][i] for c in range(len(COLUMN_STRINGS))))
        for i in range(columns.rows)
    ]


def expected(seq: int, u: Update) -> tuple[Any, ...]:
    return (
        seq,
        NO_TS if u.ts_ms is None else u.ts_ms,
        u.op.encode(),
        u.table.encode(),
        msgspec.json.encode(u.key),
        b"" if u.before == NULL else bytes(u.before),
        b"" if u.after == NULL else bytes(u.after),
        u.position.encode(),
        u.logical.encode(),
    )


@settings(max_examples=200, deadline=None)
@given(updates(), st.integers(0, 1 << 40))
def test_a_batch_split_by_shard_holds_each_shards_updates_in_order(
    batch: list[Update], first: int
) -> None:
    for application in (None, "lake"):
        parts = split_columns(first, batch, application)
        for shard in range(5):
            want = [
                expected(seq, u)
                for seq, u in enumerate(batch, first)
                if u.shard == shard
                and (application is None or not u.audience or u.audience == application)
            ]
            got = rows_of(parts[shard]) if shard in parts else []
            assert got == want
        # Decoded from the log without the key's dictionary, the columns are the same bytes.
        light = msgspec.json.decode(msgspec.json.encode(batch), type=list[ColumnRow])
        assert {s: rows_of(c) for s, c in split_columns(first, light, application).items()} == {
            s: rows_of(c) for s, c in parts.items()
        }


@settings(max_examples=100, deadline=None)
@given(updates(), st.data())
def test_columns_slice_concatenate_and_cross_a_frame_unchanged(
    batch: list[Update], data: Any
) -> None:
    columns = columns_of(range(len(batch)), batch)
    rows = rows_of(columns)
    start = data.draw(st.integers(0, len(batch)))
    stop = data.draw(st.integers(start, len(batch)))
    assert rows_of(columns.slice(start, stop)) == rows[start:stop]
    joined = UpdateColumns.concat([columns.slice(0, start), columns.slice(start, len(batch))])
    assert rows_of(joined) == rows
    frame = p.encode_columns(3, 10, 20, columns)
    head, decoded = p.decode_columns(frame[5:])
    assert (head.shard, head.first, head.end, head.rows) == (3, 10, 20, len(batch))
    assert rows_of(decoded) == rows


def test_a_columns_frame_that_does_not_add_up_is_refused() -> None:
    batch = [Update.create(op="c", key={"id": i}, table="t", after={"id": i}) for i in range(3)]
    frame = p.encode_columns(0, 0, 3, columns_of(range(3), batch))[5:]
    with pytest.raises(p.ProtocolError, match="buffers do not add up"):
        p.decode_columns(frame[:-1])
    head_size = int.from_bytes(frame[:4], "big")
    head = msgspec.json.decode(frame[4 : 4 + head_size])
    head["buffers"][2], head["buffers"][4] = head["buffers"][2] + 4, head["buffers"][4] - 4
    bad = msgspec.json.encode(head)
    with pytest.raises(p.ProtocolError, match="column op"):
        p.decode_columns(len(bad).to_bytes(4, "big") + bad + frame[4 + head_size :])
    with pytest.raises(p.ProtocolError, match="malformed columns frame"):
        p.decode_columns(b"\x00\x00\x00\x09not json!")


def test_the_spark_source_names_the_flow_of_columns_that_are_not_text() -> None:
    from wormhole.connectors.spark.ranges import _arrow_batches

    batch = [Update.create(op="c", key={"id": 1}, table="t", after={"id": 1})]
    good = columns_of([5], batch)
    (arrow,) = _arrow_batches(iter([good]), 3, "ds", "publisher h:1, flow 3 of [0, 9)")
    assert arrow.to_pylist()[0]["after"] == '{"id":1}' and arrow.to_pylist()[0]["seq"] == 5
    data = list(good.data)
    data[1] = b"\xff"  # table ("t"): one byte that is not UTF-8
    bad = UpdateColumns(
        1,
        good.seq,
        good.ts_ms,
        good.lengths,
        tuple(data),
    )
    with pytest.raises(ValueError, match=r"publisher h:1, flow 3 of \[0, 9\): the columns"):
        list(_arrow_batches(iter([bad]), 3, "ds", "publisher h:1, flow 3 of [0, 9)"))


def test_a_ts_ms_outside_64_bits_is_refused_naming_its_table() -> None:
    batch = [Update.create(op="c", key={"id": 1}, table="rides", after={"id": 1}, ts_ms=1 << 63)]
    with pytest.raises(ValueError, match=r"table 'rides' has ts_ms 9223372036854775808"):
        split_columns(0, batch)
