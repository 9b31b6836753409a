"""The update model: one change to one key, and the envelope that sinks write.

Rows (``before`` and ``after``) travel through the publisher as raw JSON
(:class:`msgspec.Raw`). The publisher only needs the key (to pick the shard),
the table and the op (to filter); parsing every column of every row on the hot
path would cost more than everything else the publisher does. A sink or filter
that needs column values calls :meth:`Update.after_row` / :meth:`Update.before_row`.
"""

from __future__ import annotations

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
    )


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
