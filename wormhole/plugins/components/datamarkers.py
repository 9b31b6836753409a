"""Datamarkers and the stores that keep them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class Datamarker:
    """Every update of flow (application, shard) before ``position`` was processed."""

    application: str
    shard: int
    position: int
    logical: str = ""


@runtime_checkable
class DatamarkerStore(Protocol):
    """Durable storage of datamarkers (the built-in one: SQLite in the state dir)."""

    def open(self, pipeline: str, state_dir: Path) -> None: ...

    def load(self) -> dict[tuple[str, int], Datamarker]:
        """Every stored datamarker, by (application, shard)."""

    def save(self, datamarkers: Iterable[Datamarker]) -> None:
        """Persist durably before returning."""

    def forget(self, application: str) -> int:
        """Delete every datamarker of ``application`` durably (``wormhole forget``); return
        how many there were. Called only for an application that is not running."""

    def get_meta(self, key: str) -> str | None: ...

    def set_meta(self, key: str, value: str) -> None: ...

    def close(self) -> None: ...
