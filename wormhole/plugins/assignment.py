"""Assignment: which subscriber of an application owns which flow.

Pure functions, shared by every transport: flow ``s`` of an application belongs
to its subscriber ``s % n`` of ``n`` (sessions in joining order with the tcp
transport, ``--instance`` numbers with kafka). The split is even, and a flow
moves only when the number of subscribers changes.

Part of the plugin contract: the hub divides flows among the sessions a transport
attaches with :func:`spread`, and a transport whose subscribers pick their own shards
(``kafka``: ``--instance N``) must pick them with :func:`shards_of` to agree with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

S = TypeVar("S")


def shards_of(instance: int, subscribers: int, shards: int) -> list[int]:
    """The shards subscriber ``instance`` of ``subscribers`` owns."""
    return [shard for shard in range(shards) if shard % subscribers == instance]


def spread(
    datastore: str,
    shards: int,
    datastores: Mapping[str, int],
    registered: Sequence[str],
    sessions: Sequence[S],
    instance_of: Callable[[S], str],
) -> list[S | None]:
    """The owner of each of ``datastore``'s flows when an application reads many datastores.

    The flows of every datastore in ``datastores`` (datastore -> shards), in (datastore,
    shard) order, are dealt in turn over the application's subscribers: those the registry
    lists (``registered``, registration order) that are connected here, then connected
    sessions it does not list, in joining order. When every subscriber is connected to every
    publisher, each publisher computes its part of one even split: with 2 datastores x 16
    shards and 3 subscribers each owns 10 or 11 flows. With one datastore and no registered
    subscribers this is :func:`owners`.
    """
    listed = set(registered)
    by_instance: dict[str, S] = {}
    for session in sessions:
        by_instance.setdefault(instance_of(session), session)
    order = [by_instance[i] for i in registered if i in by_instance]
    order += [s for s in sessions if instance_of(s) not in listed]
    if not order:
        return [None] * shards
    offset = sum(n for name, n in datastores.items() if name < datastore)
    n = len(order)
    return [order[(offset + shard) % n] for shard in range(shards)]
