"""Generic publisher-side filters.

An application's ``filter`` mapping combines the built-in ``tables`` and ``ops``
selectors with filter plugins (``plugins: [{type: NAME, ...}]``); they apply in
that order. This module compiles that into one callable over a batch, and
registers the built-in ``sample`` filter plugin.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence

from pydantic import Field

from wormhole.core.shard import stable_hash
from wormhole.core.update import Update
from wormhole.plugins.components import ComponentSpec, Options
from wormhole.plugins.hookspecs import hookimpl

BatchFilter = Callable[[list[Update]], list[Update]]


def table_matcher(patterns: Sequence[str]) -> Callable[[str], bool]:
    """Match table names against exact names or shell-style globs (``public.*``)."""
    exact = {p for p in patterns if not any(c in p for c in "*?[")}
    globs = [p for p in patterns if p not in exact]
    if not globs:
        return exact.__contains__
    regex = re.compile("|".join(fnmatch.translate(p) for p in globs))
    cache: dict[str, bool] = {}

    def match(table: str) -> bool:
        hit = cache.get(table)
        if hit is None:
            hit = cache[table] = table in exact or regex.match(table) is not None
        return hit

    return match


def compile_filter(
    tables: Sequence[str] | None,
    ops: Sequence[str] | None,
    plugins: Sequence[BatchFilter] = (),
) -> BatchFilter | None:
    """One batch filter for an application, or None when it keeps everything."""
    steps: list[BatchFilter] = []
    if tables:
        match = table_matcher(tables)
        steps.append(lambda updates: [u for u in updates if match(u.table)])
    if ops and set(ops) != {"c", "u", "d", "r", "t"}:
        wanted = frozenset(ops)
        steps.append(lambda updates: [u for u in updates if u.op in wanted])
    steps.extend(plugins)
    if not steps:
        return None
    if len(steps) == 1:
        return steps[0]

    def run(updates: list[Update]) -> list[Update]:
        for step in steps:
            if not updates:
                break
            updates = step(updates)
        return updates

    return run


class SampleOptions(Options):
    """Keep a deterministic fraction of keys (every update of a kept key is kept)."""

    fraction: float = Field(gt=0, le=1, description="share of keys to keep, in (0, 1]")


def _sample(options: SampleOptions) -> BatchFilter:
    limit = int(options.fraction * (1 << 32))
    # Uses a different hash from sharding so a sample is spread over all shards.
    return lambda updates: [
        u for u in updates if (stable_hash(u.key) * 2654435761) & 0xFFFFFFFF < limit
    ]


@hookimpl
def wormhole_filters() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            kind="filter",
            name="sample",
            factory=_sample,
            options=SampleOptions,
            description="Keep a deterministic fraction of keys, with all of their updates.",
        )
    ]
