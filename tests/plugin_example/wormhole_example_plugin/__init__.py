"""An example third-party Wormhole plugin.

Registers, through the ``wormhole`` entry-point group:

* a ``csv`` sink writing ``op,table,key,after`` rows (fsynced before the batch
  is acknowledged), and
* a ``key-range`` filter keeping updates whose integer key column lies in
  ``[low, high]``, and
* a ``ledger`` source reading a file of numbered entries, with its own position
  mapper, so that replay-safe sinks can order its updates per key, and
* an ``outbox`` transport (frames as files, acknowledgements as files back) with its
  own ``wormhole subscribe`` path (:mod:`wormhole_example_plugin.outbox`), and
* a ``jsonfile`` datamarker store.
"""

from __future__ import annotations

import csv
import io
import json
import os
from typing import Any

from pydantic import Field

from wormhole.core.update import Update
from wormhole.plugins.components import (
    Capabilities,
    ComponentSpec,
    Datamarker,
    NoOptions,
    Options,
    SinkContext,
    SourceBatch,
    SourceContext,
    Version,
)
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


class LedgerOptions(Options):
    """A ledger: one JSON object per line, ``{"n": N, "table", "op", "key", "after"}``, with
    ``n`` growing along the file (a datastore's own change numbers)."""

    path: str


class LedgerSource:
    """Reads the whole ledger once; the native position of an entry is ``ledger:<n>``."""

    def __init__(self, options: LedgerOptions) -> None:
        self.options = options
        self.entries: list[dict[str, Any]] = []
        self.done = 0

    def open(self, context: SourceContext, checkpoint: Any) -> None:
        with open(self.options.path) as f:
            self.entries = [json.loads(line) for line in f if line.strip()]
        self.done = int(checkpoint or 0)

    def read(self, timeout: float) -> SourceBatch | None:
        if self.done >= len(self.entries):
            return None
        updates = [
            Update.create(
                op=e["op"],
                key=e["key"],
                after=e.get("after"),
                table=e["table"],
                connector="ledger",
                position=f"ledger:{e['n']}",
                logical=f"ledger:{e['n']}",
            )
            for e in self.entries[self.done :]
        ]
        self.done = len(self.entries)
        return SourceBatch(updates, self.done)

    def capture_end(self) -> Any:
        return len(self.entries)

    def reached(self, end: Any) -> bool:
        return self.done >= int(end)

    def confirm(self, checkpoint: Any) -> None:
        pass

    def close(self) -> None:
        pass


class LedgerPositionMapper:
    """``ledger:<n>`` is the same on every copy; an entry's version is ``(n,)``."""

    def __init__(self, options: NoOptions | None = None) -> None:
        pass

    def to_logical(self, native: str) -> str:
        return native

    def to_native(self, logical: str) -> str:
        return logical

    def version(self, update: Update) -> Version:
        return (int(update.position.rsplit(":", 1)[1]),)


@hookimpl
def wormhole_sources() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            kind="source",
            name="ledger",
            factory=LedgerSource,
            options=LedgerOptions,
            description="Numbered entries from a ledger file.",
        )
    ]


@hookimpl
def wormhole_position_mappers() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            kind="position_mapper",
            name="ledger",
            factory=LedgerPositionMapper,
            options=NoOptions,
            description="Ledger entry numbers as per-key versions.",
        )
    ]


def _outbox(options: Any) -> Any:
    from wormhole_example_plugin.outbox import OutboxTransport

    return OutboxTransport(options)


def _outbox_subscribe(request: Any) -> None:
    from wormhole_example_plugin.outbox import subscribe

    subscribe(request)


@hookimpl
def wormhole_transports() -> list[ComponentSpec]:
    from wormhole_example_plugin.outbox import OutboxOptions

    return [
        ComponentSpec(
            kind="transport",
            name="outbox",
            factory=_outbox,
            options=OutboxOptions,
            description="Frames as files in a directory, acknowledgements as files back.",
            subscribe=_outbox_subscribe,
            # `wormhole run` starts its subscribers (`subscriber_args`, `stop_subscribers`).
            capabilities=Capabilities(subscriber_processes=True),
        )
    ]


class JsonStoreOptions(Options):
    """Datamarkers in one JSON file in the state dir, replaced atomically on every save."""

    filename: str = "datamarkers.json"


class JsonDatamarkerStore:
    """A datamarker store: every save rewrites the file and fsyncs it (and its directory)
    before returning, so datamarkers on disk are never ahead of what was acknowledged."""

    def __init__(self, options: JsonStoreOptions) -> None:
        self.options = options
        self.path: Any = None
        self.data: dict[str, Any] = {"datamarkers": {}, "meta": {}}

    def open(self, pipeline: str, state_dir: Any) -> None:
        self.path = state_dir / self.options.filename
        if self.path.exists():
            self.data = json.loads(self.path.read_text())

    def load(self) -> dict[tuple[str, int], Datamarker]:
        out = {}
        for key, position in self.data["datamarkers"].items():
            application, shard = key.rsplit("/", 1)
            out[(application, int(shard))] = Datamarker(application, int(shard), position)
        return out

    def save(self, datamarkers: Any) -> None:
        for d in datamarkers:
            self.data["datamarkers"][f"{d.application}/{d.shard}"] = d.position
        self._write()

    def forget(self, application: str) -> int:
        keys = [k for k in self.data["datamarkers"] if k.rsplit("/", 1)[0] == application]
        for key in keys:
            del self.data["datamarkers"][key]
        self._write()
        return len(keys)

    def get_meta(self, key: str) -> str | None:
        value = self.data["meta"].get(key)
        return None if value is None else str(value)

    def set_meta(self, key: str, value: str) -> None:
        self.data["meta"][key] = value
        self._write()

    def close(self) -> None:
        pass

    def _write(self) -> None:
        temporary = self.path.with_name(self.path.name + ".tmp")
        with open(temporary, "w") as f:
            json.dump(self.data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


@hookimpl
def wormhole_datamarker_stores() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            kind="datamarker_store",
            name="jsonfile",
            factory=JsonDatamarkerStore,
            options=JsonStoreOptions,
            description="Datamarkers in a JSON file in the state dir.",
        )
    ]
