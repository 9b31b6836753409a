"""An example third-party Wormhole plugin.

Registers, through the ``wormhole`` entry-point group:

* a ``csv`` sink writing ``op,table,key,after`` rows (fsynced before the batch
  is acknowledged), and
* a ``key-range`` filter keeping updates whose integer key column lies in
  ``[low, high]``.
"""

from __future__ import annotations

import csv
import io
import os

from pydantic import Field

from wormhole.core.update import Update
from wormhole.plugins.components import ComponentSpec, Options, SinkContext
from wormhole.plugins.hookspecs import hookimpl


class CsvOptions(Options):
    """Append updates to a CSV file."""

    path: str = Field(description="output file; may contain {application} and {subscriber}")
    header: bool = Field(True, description="write a header row to a new file")


class CsvSink:
    def __init__(self, options: CsvOptions) -> None:
        self.options = options
        self.fd = -1

    def open(self, context: SinkContext) -> None:
        path = self.options.path.format(
            application=context.application, subscriber=context.subscriber
        )
        new = not os.path.exists(path)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if new and self.options.header:
            os.write(self.fd, b"op,table,key,after\r\n")

    def write(self, updates: list[Update]) -> None:
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        for u in updates:
            writer.writerow([u.op, u.table, _key_text(u), bytes(u.after).decode()])
        os.write(self.fd, buffer.getvalue().encode())
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _key_text(update: Update) -> str:
    return ";".join(f"{k}={v}" for k, v in sorted(update.key.items()))


class KeyRangeOptions(Options):
    """Keep updates whose key column ``column`` is an integer within [low, high]."""

    column: str
    low: int
    high: int


def key_range(options: KeyRangeOptions):  # type: ignore[no-untyped-def]
    column, low, high = options.column, options.low, options.high

    def keep(updates: list[Update]) -> list[Update]:
        return [u for u in updates if low <= u.key.get(column, low - 1) <= high]

    return keep


@hookimpl
def wormhole_sinks() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            kind="sink",
            name="csv",
            factory=CsvSink,
            options=CsvOptions,
            description="Append op,table,key,after rows to a CSV file.",
        )
    ]


@hookimpl
def wormhole_filters() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            kind="filter",
            name="key-range",
            factory=key_range,
            options=KeyRangeOptions,
            description="Keep updates whose integer key column lies in [low, high].",
        )
    ]
