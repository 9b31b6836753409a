"""Positions of the file log, and the natural order of file names."""

from __future__ import annotations

import functools
import re
from typing import Any

from wormhole.core.update import Update
from wormhole.plugins.components import NoOptions, Version


def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key comparing digit runs as numbers: log.9.0 < log.10.0, 2.jsonl < 10.jsonl."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


@functools.lru_cache(maxsize=4096)
def natural_name(name: str) -> Version:
    """A file name as integers that sort in natural order (``2.jsonl`` before ``10.jsonl``):
    each character as its code point + 1, a 0 after each run of characters, each digit run
    as its value + 1, a 0 at the end."""
    out: list[int] = []
    for i, part in enumerate(_DIGITS.split(name)):
        if i % 2:
            out.append(int(part) + 1)
        else:
            out.extend(ord(c) + 1 for c in part)
            out.append(0)
    out.append(0)
    return tuple(out)


_DIGITS = re.compile(r"(\d+)")


class FilelogPositionMapper:
    """Positions of the file log.

    JSON-lines files: ``position`` (and ``logical``) is ``<file>:<offset>``. Files are read
    in natural name order, so the version is the file name in that order
    (:func:`natural_name`) followed by the offset.

    ``LogWriter`` logs: ``logical`` is ``<publisher id>:<seq>``, the same on every copy of
    the log, and the version is ``(seq,)``. Sequence numbers are comparable within one
    publisher id, so a key should be published by one publisher (or by copies that share
    its id).
    """

    def __init__(self, options: NoOptions | None = None) -> None:
        pass

    def to_logical(self, native: str) -> str:
        raise ValueError(
            "a file-log position maps to a logical one only with its update (LogWriter logs "
            "carry it as update.logical)"
        )

    def to_native(self, logical: str) -> str:
        raise ValueError("file-log positions are not mapped between copies")

    def version(self, update: Update) -> Version:
        if update.logical != update.position:  # a LogWriter log: <publisher id>:<seq>
            return (int(update.logical.rsplit(":", 1)[1]),)
        name, colon, offset = update.position.rpartition(":")
        if not colon:
            raise ValueError(f"not a file position: {update.position!r}")
        return (*natural_name(name), int(offset))
