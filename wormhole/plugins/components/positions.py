"""Position mappers: native <-> logical positions and per-key versions."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from wormhole.core.update import Update

Version = tuple[int, ...]
"""A per-key version: integers compared element by element, growing along each key's history."""


@runtime_checkable
class PositionMapper(Protocol):
    """What Wormhole knows about one kind of datastore's positions (the spec's ``name`` is
    the ``update.connector`` it serves): native <-> logical positions, and per-key versions.

    The registry creates one with the options model's defaults for :meth:`version`, so a
    mapper whose options need values (a server to ask) must still build without them and
    fail only in the methods that need them.
    """

    def to_logical(self, native: str) -> str:
        """The position comparable across copies of the dataset for a native position."""

    def to_native(self, logical: str) -> str:
        """This copy's native position for a logical one (before the first change there)."""

    def version(self, update: Update) -> Version | None:
        """The update's per-key version, from its ``position`` and ``logical``, or ``None``
        if its positions give none. Replay-safe sinks (search, Spark) skip an update older
        than what they hold for its key. May raise ValueError or IndexError on positions
        that do not parse (taken as ``None``)."""
