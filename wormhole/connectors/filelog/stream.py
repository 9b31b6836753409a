"""One stream of the file log: a sequence of files read in name order."""

from __future__ import annotations

import fnmatch
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from wormhole.connectors.filelog.positions import natural_key
from wormhole.core.errors import SourceError

log = logging.getLogger("wormhole.filelog")


@dataclass
class Stream:
    """One sequence of files read in order; the position is (file name, byte offset)."""

    id: str
    directory: Path
    only_file: str | None = None  # the source path is a single file
    file: str | None = None
    offset: int = 0
    handle: BinaryIO | None = None
    handle_name: str | None = None
    kind: str | None = None  # "jsonl" | "logwriter", per current file
    publisher_id: str | None = None
    prefix: str = ""
    files_cache: list[str] = field(default_factory=list)
    glob: str | None = None
    known: set[str] | None = None
    """Names listed before (None: not listed yet): a new one is news."""
    skipped: list[str] = field(default_factory=list)
    """Files that appeared with a name sorting before the file being read: never read."""

    def list_files(self) -> list[str]:
        if self.only_file is not None:
            return [self.only_file] if (self.directory / self.only_file).exists() else []
        glob = self.glob
        try:
            names = [
                e.name
                for e in os.scandir(self.directory)
                if not e.name.startswith(".")
                and (glob is None or fnmatch.fnmatchcase(e.name, glob))
                and e.is_file()
            ]
        except OSError as exc:
            raise SourceError(f"source.path: cannot list {self.directory}: {exc.strerror}") from exc
        names.sort(key=natural_key)
        if self.known is not None and self.file is not None and len(self.known) != len(names):
            self._notice_late(names)
        self.known = set(names)
        self.files_cache = names
        return names

    def _notice_late(self, names: list[str]) -> None:
        """Say so when a file appears behind the one being read: the source never goes back."""
        assert self.known is not None and self.file is not None
        current = natural_key(self.file)
        for name in names:
            if name in self.known or natural_key(name) >= current:
                continue
            self.skipped.append(name)
            log.warning(
                "%s: appeared while %s was being read, and its name sorts before it: it is "
                "never read (files are read in name order, and the source does not go back). "
                "Have the producer write so that each new file's name sorts after the last "
                "(write under a dot name or another directory, then rename), or read only "
                "final names with source.glob",
                self.directory / name,
                self.file,
            )

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
            self.handle_name = None


def later_files(files: list[str], name: str) -> list[str]:
    """The files of ``files`` whose names sort after ``name``."""
    key = natural_key(name)
    return [f for f in files if natural_key(f) > key]
