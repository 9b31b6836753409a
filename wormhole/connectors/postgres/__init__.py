"""The ``postgres`` source and position mapper (needs the ``postgres`` extra: psycopg2)."""

from __future__ import annotations

from typing import Any

from wormhole.connectors.postgres.options import PostgresOptions
from wormhole.plugins.components import ComponentSpec, NoOptions
from wormhole.plugins.hookspecs import hookimpl


def _source(options: PostgresOptions) -> Any:
    from wormhole.connectors.postgres.source import PostgresSource

    return PostgresSource(options)


class PostgresPositionMapper:
    """Native ``<commit LSN>:<index>`` <-> logical ``<commit LSN>``.

    A logical position names a whole transaction; mapped back it means "before
    the first change of that transaction".
    """

    def to_logical(self, native: str) -> str:
        return native.partition(":")[0]

    def to_native(self, logical: str) -> str:
        return f"{logical.partition(':')[0]}:-1"


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
