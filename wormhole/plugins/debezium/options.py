"""The options of a component that writes Debezium's format, and the records it makes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from wormhole.plugins.components import Options

VERSION = "3.6.3.Final"
"""The Debezium release whose format is written (``source.version``)."""

UNAVAILABLE = "__debezium_unavailable_value"
"""Debezium's placeholder for a TOASTed value an update left unchanged."""

_UNCHANGED_TOAST = "__unchanged_toast__"


class DebeziumFields(Options):
    """Options of a component that can write Debezium's format (mix into its options)."""

    def describes_updates(self) -> bool:
        return self.envelope == "debezium"

    def marks_transactions(self) -> bool:
        return self.envelope == "debezium" and self.transaction_metadata

    envelope: Literal["wormhole", "debezium"] = Field(
        "wormhole",
        description="wormhole: the update envelope; debezium: Debezium's change events "
        "(see docs/debezium.md)",
    )
    schemas: bool = Field(
        False,
        description="envelope debezium: each key and value as {schema, payload}, as "
        "JsonConverter's schemas.enable",
    )
    topic_prefix: str | None = Field(
        None,
        description="envelope debezium: Debezium's topic.prefix (the source's name and the "
        "first part of each topic <prefix>.<schema>.<table>); default: the pipeline's name",
    )
    tombstones: bool = Field(
        True,
        description="envelope debezium: a message with a null value after each delete, as "
        "Debezium's tombstones.on.delete",
    )
    decimal_handling_mode: Literal["precise", "double", "string"] = Field(
        "precise", description="envelope debezium: as Debezium's decimal.handling.mode"
    )
    time_precision_mode: Literal["adaptive", "adaptive_time_microseconds", "connect"] = Field(
        "adaptive", description="envelope debezium: as Debezium's time.precision.mode"
    )
    binary_handling_mode: Literal["bytes", "base64", "base64-url-safe", "hex"] = Field(
        "bytes", description="envelope debezium: as Debezium's binary.handling.mode"
    )
    transaction_metadata: bool = Field(
        False,
        description="envelope debezium: each event's transaction block and BEGIN/END events "
        "on <prefix>.transaction, as Debezium's provide.transaction.metadata (see "
        "docs/debezium.md: with several shards, BEGIN and END come from the flows of the "
        "transaction's first and last update)",
    )
    truncates: bool = Field(
        False,
        description="envelope debezium: write a truncate as an op t event (key null), as "
        "Debezium does when skipped.operations leaves t out; off: none, its default",
    )

    @model_validator(mode="after")
    def _transactions_need_debezium(self) -> DebeziumFields:
        if self.transaction_metadata and self.envelope != "debezium":
            raise ValueError(
                "transaction_metadata is Debezium's transaction block and BEGIN/END events: "
                "set envelope: debezium as well, or leave transaction_metadata out"
            )
        return self


@dataclass(frozen=True)
class Message:
    """One Debezium record: the key and value as JSON bytes (``None`` value: a tombstone)."""

    topic: str
    key: bytes | None
    value: bytes | None
