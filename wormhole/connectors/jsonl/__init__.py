"""The ``jsonl`` sink: the update envelope, one JSON object per line, fsynced before ack."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from pathlib import Path
from typing import Literal

from pydantic import Field

from wormhole.core.errors import SinkError
from wormhole.core.update import Update, encode_envelopes
from wormhole.plugins.components import (
    ComponentSpec,
    ComponentUse,
    Options,
    SinkContext,
    offer,
    template_problems,
)
from wormhole.plugins.debezium import DebeziumEncoder, DebeziumFields, encode_lines

log = logging.getLogger("wormhole.jsonl")


class _FileOptions(Options):
    path: str = Field(
        description="output file; may contain {application} and {subscriber} (0-based)"
    )
    fsync: bool = Field(True, description="fsync each batch before acknowledging it")


class JsonlOptions(DebeziumFields, _FileOptions):
    """Append the update envelope of every update to a file (or, with ``envelope:
    debezium``, Debezium's change events)."""

    # (DebeziumFields first: the file's own options come first in lists of them.)
    lines: Literal["value", "record"] = Field(
        "value",
        description="envelope debezium: each line a message's value (what debezium-json "
        'readers take; tombstones left out), or record: {"topic", "key", "value"}',
    )


class _SharedFile:
    """One append-only descriptor per file, shared by the subscribers of this process."""

    files: dict[str, _SharedFile] = {}
    registry_lock = threading.Lock()

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.lock = threading.Lock()
        self.users = 0

    @classmethod
    def acquire(cls, path: str) -> _SharedFile:
        key = os.path.realpath(path)
        with cls.registry_lock:
            shared = cls.files.get(key)
            if shared is None:
                parent = Path(path).parent
                parent.mkdir(parents=True, exist_ok=True)
                created = not os.path.exists(path)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
                if created:
                    os.fsync(fd)
                    fd_dir = os.open(parent, os.O_RDONLY)
                    try:
                        os.fsync(fd_dir)
                    finally:
                        os.close(fd_dir)
                shared = cls.files[key] = cls(key, fd)
                shared.repair_tail()
            shared.users += 1
            return shared

    def repair_tail(self) -> None:
        """Cut a partial last line: a write interrupted by a crash, never acknowledged."""
        with self.lock:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            try:
                size = os.fstat(self.fd).st_size
                if size == 0 or os.pread(self.fd, 1, size - 1) == b"\n":
                    return
                end = size
                keep = 0
                while end > 0:
                    start = max(0, end - (1 << 16))
                    chunk = os.pread(self.fd, end - start, start)
                    cut = chunk.rfind(b"\n")
                    if cut >= 0:
                        keep = start + cut + 1
                        break
                    end = start
                os.ftruncate(self.fd, keep)
                os.fsync(self.fd)
                log.warning(
                    "%s: removed a partial last line (%d bytes) left by an interrupted write; "
                    "it was never acknowledged and is delivered again",
                    self.path,
                    size - keep,
                )
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    def release(self) -> None:
        with self.registry_lock:
            self.users -= 1
            if self.users == 0:
                del self.files[self.path]
                os.close(self.fd)


class JsonlSink:
    def __init__(self, options: JsonlOptions) -> None:
        self.options = options
        self.file: _SharedFile | None = None
        self.debezium: DebeziumEncoder | None = None

    def open(self, context: SinkContext) -> None:
        try:
            path = self.options.path.format(
                application=context.application, subscriber=context.subscriber
            )
        except (KeyError, IndexError, ValueError) as exc:
            raise SinkError(
                f"applications.{context.application}.sink.path: {self.options.path!r} has an "
                f"unknown placeholder ({exc}); use {{application}} or {{subscriber}}"
            ) from exc
        if self.options.envelope == "debezium":
            self.debezium = DebeziumEncoder(self.options, context.pipeline)
        try:
            self.file = _SharedFile.acquire(path)
        except OSError as exc:
            raise SinkError(
                f"applications.{context.application}.sink.path: cannot open {path!r} for "
                f"appending ({exc}); fix the path or its permissions"
            ) from exc

    def write(self, updates: list[Update]) -> None:
        if not updates or self.file is None:
            return
        if self.debezium is not None:
            data = encode_lines(
                self.debezium.messages(updates), values_only=self.options.lines == "value"
            )
        else:
            data = encode_envelopes(updates)
        if not data:
            return
        shared = self.file
        # The file lock orders whole batches between processes sharing the file.
        with shared.lock:
            fcntl.flock(shared.fd, fcntl.LOCK_EX)
            try:
                size = os.fstat(shared.fd).st_size
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(shared.fd, view) :]
                    if self.options.fsync:
                        os.fdatasync(shared.fd)
                except OSError:
                    # Leave no partial line behind: the retry writes the whole batch again.
                    os.ftruncate(shared.fd, size)
                    raise
            finally:
                fcntl.flock(shared.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self.file is not None:
            self.file.release()
            self.file = None


def check_use(options: JsonlOptions, use: ComponentUse) -> list[str]:
    """The path's placeholders, before any subscriber opens it."""
    hint = "use {application} or {subscriber}"
    return template_problems(use, "path", options.path, hint, application="a", subscriber=0)


wormhole_sinks = offer(
    ComponentSpec(
        kind="sink",
        name="jsonl",
        factory=JsonlSink,
        options=JsonlOptions,
        check=check_use,
        description="Append update envelopes to a JSON-lines file (fsync before ack).",
    )
)
