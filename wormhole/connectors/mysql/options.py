"""Options of the ``mysql`` source."""

from __future__ import annotations

from typing import Literal
from urllib.parse import unquote, urlsplit

from pydantic import Field, field_validator

from wormhole.plugins.components import Options


class MySQLOptions(Options):
    """Stream the row-based binlog of MariaDB or MySQL."""

    dsn: str = Field(
        description="server URL: mysql://USER:PASSWORD@HOST:PORT/ (the path, if any, is ignored)"
    )
    tables: list[str] | None = Field(
        None,
        description="tables to read as schema.table; shell patterns allowed (shop.*); "
        "default: every table outside the system schemas",
    )
    exclude_tables: list[str] = Field(
        default_factory=list, description="tables (or patterns) to leave out"
    )
    snapshot: Literal["initial", "never"] = Field(
        "initial",
        description="emit existing rows (op r) consistent with the binlog position, "
        "or start at the current end of the binlog",
    )
    server_id: int | None = Field(
        None,
        ge=1,
        le=4294967295,
        description="replica server id this reader registers with (unique among the "
        "server's replicas; default derived from the pipeline name)",
    )
    batch_updates: int = Field(8192, ge=1, description="changes per batch (bounds memory)")
    heartbeat_s: float = Field(
        0.5,
        gt=0,
        le=60,
        description="seconds of binlog silence after which the server "
        "sends a heartbeat (how quickly an idle stream notices a stop or --once end)",
    )
    connect_timeout_s: float = Field(10.0, gt=0, description="connect timeout")
    on_decode_error: Literal["fallback", "stop"] = Field(
        "fallback",
        description="a value the source cannot decode (bytes its column's character set "
        'does not map): deliver it as {"undecoded": HEX} with a warning (fallback), or '
        "stop the source with that message (stop)",
    )
    signal_table: str = Field(
        "wormhole.signal",
        description="schema.table where backfills write their watermarks (one row per "
        "pipeline, created on the first backfill); never emitted, whatever tables says",
    )

    @field_validator("dsn")
    @classmethod
    def _check_dsn(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("mysql", "mariadb") or not parts.hostname:
            raise ValueError("expected mysql://USER:PASSWORD@HOST:PORT/")
        return value

    @field_validator("signal_table")
    @classmethod
    def _check_signal_table(cls, value: str) -> str:
        schema, dot, table = value.partition(".")
        if not dot or not schema or not table or "." in table or "`" in value:
            raise ValueError("expected schema.table (plain names, no quotes)")
        return value

    def connection(self) -> dict[str, object]:
        """pymysql keyword arguments for the DSN."""
        parts = urlsplit(self.dsn)
        return {
            "host": parts.hostname or "127.0.0.1",
            "port": parts.port or 3306,
            "user": unquote(parts.username or "root"),
            "password": unquote(parts.password or ""),
            "connect_timeout": self.connect_timeout_s,
        }
