"""The ``postgres`` source and position mapper (needs the ``postgres`` extra: psycopg2)."""

from __future__ import annotations

from typing import Any

from wormhole.connectors.postgres.options import PostgresOptions
from wormhole.core.update import Update
from wormhole.plugins.components import ComponentSpec, NoOptions, Version
from wormhole.plugins.hookspecs import hookimpl


def _source(options: PostgresOptions) -> Any:
    from wormhole.connectors.postgres.source import PostgresSource

    return PostgresSource(options)


class PostgresPositionMapper:
    """Native ``<commit LSN>:<index>`` <-> logical ``<commit LSN>``.

    A logical position names a whole transaction; mapped back it means "before
    the first change of that transaction".

    Versions: a change's is ``(commit LSN, index + 1)``. A snapshot read (op ``r``)
    is ``(snapshot LSN, 0)``: every key is read once, and every change streamed
    after the snapshot commits at or after that LSN, so it is newer.
    """

    def to_logical(self, native: str) -> str:
        return native.partition(":")[0]

    def to_native(self, logical: str) -> str:
        return f"{logical.partition(':')[0]}:-1"

    def version(self, update: Update) -> Version:
        lsn, _, index = update.position.rpartition(":")
        if update.op == "r":
            return (_lsn(lsn), 0)
        return (_lsn(lsn), int(index) + 1)


def _lsn(text: str) -> int:
    high, slash, low = text.partition("/")
    if not slash:
        raise ValueError(f"not an LSN: {text!r}")
    return (int(high, 16) << 32) | int(low, 16)


@hookimpl
def wormhole_sources() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            kind="source",
            name="postgres",
            factory=_source,
            options=PostgresOptions,
            description="PostgreSQL logical decoding (pgoutput), with an initial snapshot.",
        )
    ]


@hookimpl
def wormhole_position_mappers() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            kind="position_mapper",
            name="postgres",
            factory=lambda _options: PostgresPositionMapper(),
            options=NoOptions,
            description="Commit LSN plus change index <-> commit LSN (origin LSN if replicated).",
        )
    ]
