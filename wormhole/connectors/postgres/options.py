"""Options of the ``postgres`` source."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from wormhole.plugins.components import Options


class HeartbeatOptions(Options):
    """Write to a small table now and then, so an idle database's slot keeps advancing."""

    table: str = Field("public.wormhole_heartbeat", description="schema-qualified table")
    interval_s: float = Field(10.0, gt=0, description="seconds between writes")


class PostgresOptions(Options):
    """Stream changes with pgoutput over the replication protocol."""

    dsn: str = Field(
        description="libpq connection string, e.g. 'host=db port=5432 dbname=app user=wormhole'"
    )
    tables: list[str] | None = Field(
        None,
        description="schema-qualified tables for the publication this source creates "
        "(default: all tables, which needs a superuser)",
    )
    publication: str | None = Field(
        None, description="publication to read (default wormhole_<pipeline>; created if missing)"
    )
    slot: str | None = Field(None, description="replication slot (default wormhole_<pipeline>)")
    snapshot: Literal["initial", "never"] = Field(
        "initial", description="emit existing rows (op r) before streaming, or start at the slot"
    )
    heartbeat: HeartbeatOptions | None = Field(
        None, description="heartbeat writes (idle databases)"
    )
    batch_updates: int = Field(8192, ge=1, description="changes per batch (bounds memory)")
    snapshot_readers: int = Field(
        2,
        ge=1,
        le=64,
        description="connections that read the initial snapshot at once, all in the slot's "
        "exported snapshot, each a range of a table's pages (PostgreSQL 14 or later)",
    )
    on_decode_error: Literal["fallback", "stop"] = Field(
        "fallback",
        description="a text value that is not UTF-8 (a SQL_ASCII database): deliver it as "
        '{"undecoded": HEX} with a warning (fallback), or stop the source naming it (stop)',
    )
    schema_trigger: bool = Field(
        False,
        description="install (if missing) the event trigger that writes every schema change "
        "into the WAL at its own position, so keys are exact however late the WAL is decoded "
        "(needs a superuser and PostgreSQL 14; `wormhole postgres-schema-trigger` installs it "
        "by hand)",
    )
    schema_events: bool = Field(
        False,
        description="deliver each schema change of a published table that the schema trigger "
        "recorded as an insert into the table wormhole.schema_changes (needs the trigger)",
    )
    status_interval_s: float = Field(
        10.0, gt=0, description="how often the confirmed position is reported to the server"
    )

    @property
    def heartbeat_tables(self) -> frozenset[str]:
        if self.heartbeat is None:
            return frozenset()
        table = self.heartbeat.table
        return frozenset({table if "." in table else f"public.{table}"})
