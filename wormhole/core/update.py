"""The update model: one change to one key, and the envelope that sinks write.

Rows (``before`` and ``after``) travel through the publisher as raw JSON
(:class:`msgspec.Raw`). The publisher only needs the key (to pick the shard),
the table and the op (to filter); parsing every column of every row on the hot
path would cost more than everything else the publisher does. A sink or filter
that needs column values calls :meth:`Update.after_row` / :meth:`Update.before_row`.
"""

from __future__ import annotations

import bisect
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import Raw

NULL = Raw(b"null")
"""The raw JSON ``null``: what ``before``/``after`` hold when there is no row image."""

OPS = ("c", "u", "d", "r")
"""Update ops: ``c`` insert, ``u`` update, ``d`` delete, ``r`` snapshot read."""

TRUNCATE = "t"
"""A table was emptied (PostgreSQL TRUNCATE). It has an empty key and reaches every
shard: the publisher delivers one copy to each flow, in order with its updates."""

Row = dict[str, Any]

_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.decode


class Update(msgspec.Struct, kw_only=True, gc=False):
    """One change to one key, as decoded from a datastore log.

    ``before``/``after`` are raw JSON objects (``NULL`` when absent); build an
    update from Python values with :meth:`Update.create`.
    """

    op: str = "c"
    key: Row
    before: Raw = NULL
    after: Raw = NULL
    table: str = ""
    shard: int = 0
    connector: str = ""
    position: str = ""
    """The datastore's native position of this change (PG LSN, binlog file:pos, file:offset)."""
    logical: str = ""
    """A position comparable across copies of the dataset (GTID, origin LSN, publisher id:seq)."""
    txid: int | None = None
    ts_ms: int | None = None
    columns: Raw = NULL
    """The table's columns where the source knows them, as raw JSON
    ``[[name, type, optional, default], ...]`` (:class:`ColumnType`) in table order.
    ``type`` speaks PostgreSQL's vocabulary (``format_type``: ``integer``,
    ``numeric(10,2)``, ``timestamp(3) without time zone``, ``text[]``) with the values in
    its text output, or MySQL's (``COLUMN_TYPE`` in lower case, without integer display
    widths, temporal types with their precision: ``int unsigned``, ``datetime(3)``,
    ``year``) with the values as the ``mysql`` source writes them; ``optional`` is false
    for NOT NULL. A source
    encodes it once per table and reuses it (see :func:`encode_columns`); typed
    envelopes (``envelope: debezium``) read it."""
    details: Raw = NULL
    """Facts of the change particular to the source, as a raw JSON object whose keys and
    order are those of a Debezium ``source`` block from ``connector`` on, less ``name`` and
    ``ts_ms`` (PostgreSQL: ``connector, snapshot, db, sequence, ts_us, ts_ns, schema, table,
    txId, lsn, xmin, origin, origin_lsn``; MySQL: ``connector, snapshot, db, sequence, ts_us,
    ts_ns, table, server_id, gtid, file, pos, row, thread, query``); ``NULL`` where the
    source gives none."""
    transaction: Raw = NULL
    """Debezium's transaction metadata of this change, where the source was asked for it
    (``SourceContext.transaction_metadata``; see :mod:`wormhole.plugins.transactions`): a
    raw JSON array ``[block, begin, end]``: ``block`` the event's ``transaction`` block
    ``{"id", "total_order", "data_collection_order"}`` (null for a truncate), ``begin`` the
    value of the transaction's BEGIN event on its first update, ``end`` the value of its END
    event on its last, else null. ``NULL`` where the source gives none. Made before the
    updates are sharded: the orders and counts are the whole transaction's."""
    audience: str = ""
    """The one application this update is for (a backfill for one application), or empty:
    every application. Updates with an audience travel in publisher-log batches of their
    own (see :func:`for_application`)."""

    @classmethod
    def create(
        cls,
        *,
        op: str,
        key: Row,
        table: str,
        after: Row | None = None,
        before: Row | None = None,
        connector: str = "",
        position: str = "",
        logical: str = "",
        txid: int | None = None,
        ts_ms: int | None = None,
        shard: int = 0,
    ) -> Update:
        """Build an update from Python row dictionaries (encoded to raw JSON once, here)."""
        return cls(
            op=op,
            key=key,
            table=table,
            after=NULL if after is None else Raw(_json_encode(after)),
            before=NULL if before is None else Raw(_json_encode(before)),
            connector=connector,
            position=position,
            logical=logical,
            txid=txid,
            ts_ms=ts_ms,
            shard=shard,
        )

    def after_row(self) -> Row | None:
        """The row after the change, decoded (``None`` for deletes)."""
        value: Row | None = _json_decode(self.after)
        return value

    def before_row(self) -> Row | None:
        """The row before the change where the datastore provides it, decoded."""
        value: Row | None = _json_decode(self.before)
        return value


def for_application(updates: list[Update], application: str) -> list[Update]:
    """The updates meant for ``application``: all of them but those whose ``audience`` is
    another application. Such updates are only ever appended in batches of their own (a
    backfill's chunk), so looking at a batch's ends tells whether it holds any."""
    if not updates or not (updates[0].audience or updates[-1].audience):
        return updates
    return [u for u in updates if not u.audience or u.audience == application]


_row_encoder = msgspec.json.Encoder()


def snapshot_read(
    row: dict[str, Any],
    keys: list[str],
    *,
    table: str,
    connector: str,
    position: str,
    logical: str,
    ts_ms: int,
    columns: Raw = NULL,
    details: Raw = NULL,
) -> Update:
    """An op ``r`` update for one row of a database source's initial snapshot."""
    return Update(
        op="r",
        key={k: row[k] for k in keys},
        after=msgspec.Raw(_row_encoder.encode(row)),
        table=table,
        connector=connector,
        position=position,
        logical=logical,
        ts_ms=ts_ms,
        columns=columns,
        details=details,
    )


class ColumnType(msgspec.Struct, array_like=True, gc=False):
    """One column of :attr:`Update.columns`."""

    name: str
    type: str
    optional: bool = True
    default: str | None = None
    """The column's default when it is a constant, written as its values are (the
    database's text output), else None."""


_columns_encoder = msgspec.json.Encoder()
_columns_decoder = msgspec.json.Decoder(list[ColumnType])


def encode_columns(columns: list[ColumnType]) -> Raw:
    """:attr:`Update.columns` for a table (encode once per table, reuse for its updates)."""
    return Raw(_columns_encoder.encode(columns))


def decode_columns(raw: Raw) -> list[ColumnType] | None:
    """The columns of :attr:`Update.columns`, or None when the update has none."""
    if raw == NULL or not raw:
        return None
    return _columns_decoder.decode(raw)


class SourceInfo(msgspec.Struct, gc=False):
    """The ``source`` object of the update envelope (design contract)."""

    connector: str
    table: str
    txid: int | None
    position: str
    logical: str
    ts_ms: int | None


class Envelope(msgspec.Struct, gc=False):
    """The update envelope as sinks write it: one JSON object per update.

    Field order is the contract's: op, key, shard, before, after, source.
    """

    op: str
    key: Row
    shard: int
    before: Raw
    after: Raw
    source: SourceInfo


def envelope(update: Update) -> Envelope:
    """The update in the contract's envelope shape."""
    return Envelope(
        update.op,
        update.key,
        update.shard,
        update.before,
        update.after,
        SourceInfo(
            update.connector,
            update.table,
            update.txid,
            update.position,
            update.logical,
            update.ts_ms,
        ),
    )


_envelope_encoder = msgspec.json.Encoder()


def encode_envelopes(updates: list[Update]) -> bytes:
    """JSON lines of the envelopes of ``updates``, each line ending in a newline."""
    if not updates:
        return b""
    encode = _envelope_encoder.encode
    return b"\n".join([encode(envelope(u)) for u in updates]) + b"\n"


_envelope_decoder = msgspec.json.Decoder(Envelope)


def decode_envelope(line: bytes | str) -> Update:
    """Parse one envelope line back into an update (for subscribers and tests)."""
    env = _envelope_decoder.decode(line)
    src = env.source
    return Update(
        op=env.op,
        key=env.key,
        shard=env.shard,
        before=env.before,
        after=env.after,
        table=src.table,
        connector=src.connector,
        position=src.position,
        logical=src.logical,
        txid=src.txid,
        ts_ms=src.ts_ms,
    )


# ------------------------------------------------------------------ columns
COLUMN_STRINGS = ("op", "table", "key", "before", "after", "position", "logical")
"""The string columns of :class:`UpdateColumns`, in their order."""
NO_TS = -(1 << 63)
"""``ts_ms`` of an update without one, in :class:`UpdateColumns`."""

_I32 = struct.Struct("<i")
_I64 = struct.Struct("<q")
_BIG = sys.byteorder == "big"


def _little(values: array[int]) -> bytes:
    if _BIG:
        values.byteswap()
    return values.tobytes()


def _native(typecode: str, data: bytes | memoryview) -> array[int]:
    values = array(typecode)
    values.frombytes(data)
    if _BIG:
        values.byteswap()
    return values


@dataclass(slots=True)
class UpdateColumns:
    """Consecutive updates of one flow a column at a time, in the layouts a columnar engine
    (Arrow) takes without looking at each update.

    Every number is little-endian. ``seq`` holds the publisher-log seq of each update
    (int64); ``ts_ms`` its ``ts_ms`` (int64, :data:`NO_TS` for none). Each column of
    :data:`COLUMN_STRINGS` is ``lengths`` (int32, the byte length of each value) and
    ``data`` (the UTF-8 values one after the other): ``key`` is the key's JSON, ``before``
    and ``after`` the rows' raw JSON, empty where the update has none. Only the fields of
    the Spark source's schema are carried (not ``connector``, ``txid`` or ``audience``).
    """

    rows: int
    seq: bytes | memoryview
    ts_ms: bytes | memoryview
    lengths: tuple[bytes | memoryview, ...]
    data: tuple[bytes | memoryview, ...]

    def buffers(self) -> list[bytes | memoryview]:
        """``seq``, ``ts_ms``, then each string column's ``lengths`` and ``data``."""
        out = [self.seq, self.ts_ms]
        for lengths, data in zip(self.lengths, self.data, strict=True):
            out += (lengths, data)
        return out

    @classmethod
    def from_buffers(cls, rows: int, buffers: list[bytes | memoryview]) -> UpdateColumns:
        """The inverse of :meth:`buffers`; ValueError if the sizes do not add up (values
        are not decoded: UTF-8 is the consumer's to check)."""
        strings = len(COLUMN_STRINGS)
        if rows < 0 or len(buffers) != 2 + 2 * strings:
            raise ValueError(f"{len(buffers)} buffers for {rows} rows")
        if len(buffers[0]) != 8 * rows or len(buffers[1]) != 8 * rows:
            raise ValueError(f"seq or ts_ms is not {rows} int64 values")
        lengths = tuple(buffers[2::2])
        data = tuple(buffers[3::2])
        for name, size, blob in zip(COLUMN_STRINGS, lengths, data, strict=True):
            if len(size) != 4 * rows:
                raise ValueError(f"column {name}: not {rows} lengths")
            values = _native("i", size)
            if rows and (min(values) < 0 or sum(values) != len(blob)):
                raise ValueError(f"column {name}: the lengths do not add up to its data")
        return cls(rows, buffers[0], buffers[1], lengths, data)

    def seqs(self) -> array[int]:
        return _native("q", self.seq)

    def first_seq(self) -> int:
        value: int = _I64.unpack_from(self.seq, 0)[0]
        return value

    def last_seq(self) -> int:
        value: int = _I64.unpack_from(self.seq, 8 * (self.rows - 1))[0]
        return value

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.buffers())

    def slice(self, start: int, stop: int) -> UpdateColumns:
        """Rows ``start`` to ``stop - 1``."""
        start, stop = max(0, start), min(self.rows, stop)
        if start <= 0 and stop >= self.rows:
            return self
        if stop <= start:
            empty = (b"",) * len(COLUMN_STRINGS)
            return UpdateColumns(0, b"", b"", empty, empty)
        lengths_out: list[bytes | memoryview] = []
        data_out: list[bytes | memoryview] = []
        for size, blob in zip(self.lengths, self.data, strict=True):
            values = _native("i", size)
            begin = sum(values[:start])
            end = begin + sum(values[start:stop])
            lengths_out.append(memoryview(size)[4 * start : 4 * stop])
            data_out.append(memoryview(blob)[begin:end])
        return UpdateColumns(
            stop - start,
            memoryview(self.seq)[8 * start : 8 * stop],
            memoryview(self.ts_ms)[8 * start : 8 * stop],
            tuple(lengths_out),
            tuple(data_out),
        )

    @staticmethod
    def concat(parts: list[UpdateColumns]) -> UpdateColumns:
        """The rows of ``parts``, one after the other (the buffers are joined, not parsed)."""
        if len(parts) == 1:
            return parts[0]
        strings = len(COLUMN_STRINGS)
        return UpdateColumns(
            sum(p.rows for p in parts),
            b"".join(p.seq for p in parts),
            b"".join(p.ts_ms for p in parts),
            tuple(b"".join(p.lengths[i] for p in parts) for i in range(strings)),
            tuple(b"".join(p.data[i] for p in parts) for i in range(strings)),
        )


class ColumnRow(msgspec.Struct, gc=False):
    """An update as :class:`UpdateColumns` needs it, decoded from the publisher log without
    the rest: the key stays raw JSON (no dictionary is made, nor encoded again)."""

    key: Raw
    op: str = "c"
    before: Raw = NULL
    after: Raw = NULL
    table: str = ""
    shard: int = 0
    position: str = ""
    logical: str = ""
    ts_ms: int | None = None
    audience: str = ""


def _texts(values: list[str]) -> tuple[array[int], bytes]:
    """A string column's lengths (in bytes) and data, encoded in one go when all ASCII."""
    lengths = array("i", map(len, values))
    data = "".join(values).encode()
    if len(data) != sum(lengths):  # not all ASCII: lengths in bytes, value by value
        encoded = [v.encode() for v in values]
        lengths = array("i", map(len, encoded))
        data = b"".join(encoded)
    return lengths, data


def _blobs(values: list[Any]) -> tuple[array[int], bytes]:
    return array("i", map(len, values)), b"".join(values)


def _columns(
    seqs: list[int] | range, updates: list[Any]
) -> tuple[array[int], array[int], list[tuple[array[int], bytes]]]:
    """``updates`` (:class:`Update` or :class:`ColumnRow`) as native arrays and data."""
    null = NULL
    if updates and isinstance(updates[0].key, Raw):
        keys = [u.key for u in updates]
    else:
        encode = _json_encode
        keys = [encode(u.key) for u in updates]
    strings = [
        _texts([u.op for u in updates]),
        _texts([u.table for u in updates]),
        _blobs(keys),
        _blobs([b"" if u.before == null else u.before for u in updates]),
        _blobs([b"" if u.after == null else u.after for u in updates]),
        _texts([u.position for u in updates]),
        _texts([u.logical for u in updates]),
    ]
    try:
        ts = array("q", [NO_TS if u.ts_ms is None else u.ts_ms for u in updates])
    except OverflowError:
        bad = next(u for u in updates if u.ts_ms is not None and not -(1 << 63) < u.ts_ms < 1 << 63)
        raise ValueError(
            f"an update of table {bad.table!r} has ts_ms {bad.ts_ms}, outside the 64-bit "
            f"range columns carry; read it by rows"
        ) from None
    return array("q", seqs), ts, strings


def _piece(
    seq: array[int],
    ts: array[int],
    strings: list[tuple[array[int], bytes]],
    offsets: list[int],
    start: int,
    stop: int,
) -> UpdateColumns:
    """Rows ``start`` to ``stop - 1`` of whole-batch columns; ``offsets`` holds each string
    column's byte offset at ``start`` and is moved on to ``stop``."""
    lengths_out: list[bytes | memoryview] = []
    data_out: list[bytes | memoryview] = []
    for i, (lengths, data) in enumerate(strings):
        begin = offsets[i]
        end = begin + sum(lengths[start:stop])
        offsets[i] = end
        lengths_out.append(_little(lengths[start:stop]))
        data_out.append(memoryview(data)[begin:end])
    return UpdateColumns(
        stop - start,
        _little(seq[start:stop]),
        _little(ts[start:stop]),
        tuple(lengths_out),
        tuple(data_out),
    )


def columns_of(seqs: list[int] | range, updates: list[Any]) -> UpdateColumns:
    """``updates`` (``seqs[i]`` the seq of ``updates[i]``) as :class:`UpdateColumns`."""
    seq, ts, strings = _columns(seqs, updates)
    return _piece(seq, ts, strings, [0] * len(strings), 0, len(updates))


def split_columns(
    first_seq: int, updates: list[Any], application: str | None = None
) -> dict[int, UpdateColumns]:
    """A publisher-log batch's updates (seqs from ``first_seq``) by shard, as columns; with
    ``application``, only the updates meant for it (see :func:`for_application`).

    The batch is ordered by shard once (stably: each shard's updates keep their order) and
    made columns once; each shard's columns are then a run of them.
    """
    seqs: list[int] | range = range(first_seq, first_seq + len(updates))
    if application is not None:
        kept = [
            (seq, u)
            for seq, u in zip(seqs, updates, strict=True)
            if not u.audience or u.audience == application
        ]
        seqs = [seq for seq, _ in kept]
        updates = [u for _, u in kept]
    if not updates:
        return {}
    shards = [u.shard for u in updates]
    if shards.count(shards[0]) != len(shards):
        order = sorted(range(len(shards)), key=shards.__getitem__)
        updates = [updates[i] for i in order]
        seqs = [seqs[i] for i in order]
        shards = [shards[i] for i in order]
    seq, ts, strings = _columns(seqs, updates)
    offsets = [0] * len(strings)
    out: dict[int, UpdateColumns] = {}
    start = 0
    while start < len(shards):
        shard = shards[start]
        stop = bisect.bisect_right(shards, shard, start)
        out[shard] = _piece(seq, ts, strings, offsets, start, stop)
        start = stop
    return out
