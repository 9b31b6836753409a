"""Assignment: which subscriber of an application owns which flow.

Pure functions, shared by every transport: flow ``s`` of an application belongs
to its subscriber ``s % n`` of ``n`` (sessions in joining order with the tcp
transport, ``--instance`` numbers with kafka). The split is even, and a flow
moves only when the number of subscribers changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

S = TypeVar("S")


def owners(shards: int, subscribers: Sequence[S]) -> list[S | None]:
    """The owner of each shard's flow, by shard (None for all when there is no subscriber)."""
    if not subscribers:
        return [None] * shards
    n = len(subscribers)
    return [subscribers[shard % n] for shard in range(shards)]


def shards_of(instance: int, subscribers: int, shards: int) -> list[int]:
    """The shards subscriber ``instance`` of ``subscribers`` owns."""
    return [shard for shard in range(shards) if shard % subscribers == instance]
