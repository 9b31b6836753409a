"""Generic publisher-side filters.

An application's ``filter`` mapping combines the built-in ``tables`` and ``ops``
selectors with filter plugins (``plugins: [{type: NAME, ...}]``); they apply in
that order. This module compiles that into one callable over a batch, and
registers the built-in ``sample`` filter plugin.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
from pydantic import Field

from wormhole.core.errors import FilterError
from wormhole.core.expressions import Expression
from wormhole.core.shard import stable_hash
from wormhole.core.update import Update
from wormhole.plugins.components import ComponentSpec, Options
from wormhole.plugins.hookspecs import hookimpl

BatchFilter = Callable[[list[Update]], list[Update]]
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


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
    *,
    where: str | Mapping[str, str] | None = None,
    columns: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
    application: str = "",
) -> BatchFilter | None:
    """One batch filter for an application, or None when it keeps everything.

    Order: ``tables``, ``ops``, ``where``, ``columns`` (projection), then plugins.
    """
    steps: list[BatchFilter] = []
    if tables:
        match = table_matcher(tables)
        steps.append(lambda updates: [u for u in updates if match(u.table)])
    if ops and set(ops) != {"c", "u", "d", "r", "t"}:
        wanted = frozenset(ops)
        steps.append(lambda updates: [u for u in updates if u.op in wanted])
    if where:
        steps.append(_where_step(where, application))
    if columns:
        steps.append(_columns_step(columns, application))
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


def application_filter(config: Any) -> BatchFilter | None:
    """The publisher-side filter of an application (its validated configuration,
    :class:`wormhole.core.pipeline.Application`): ``tables``, ``ops``, ``where``, ``columns``
    and filter plugins, in one function over a batch (None when it keeps everything). The
    publisher applies it to each caravan batch; a transport whose subscribers read unfiltered
    data (``kafka``) applies the same filter on the subscriber side."""
    plugins = [component.create() for component in config.filters]
    return compile_filter(
        config.tables,
        config.ops,
        plugins,
        where=config.where,
        columns=config.columns,
        application=config.name,
    )


def _per_table(spec: Any) -> Callable[[str], Any]:
    """A lookup of a per-table setting: one value for every table, or a mapping of table
    name (or glob) to value (None where no entry matches)."""
    if not isinstance(spec, Mapping):
        return lambda table: spec
    entries = [(table_matcher([pattern]), value) for pattern, value in spec.items()]
    exact = dict(spec)
    cache: dict[str, Any] = {}

    def lookup(table: str) -> Any:
        if table not in cache:
            found = exact.get(table)
            if found is None:
                found = next((v for m, v in entries if m(table)), None)
            cache[table] = found
        return cache[table]

    return lookup


def _row(raw: Any) -> dict[str, Any] | None:
    data = bytes(raw)
    if data == b"null":
        return None
    row = _decode(data)
    return row if isinstance(row, dict) else None


def _where_step(spec: str | Mapping[str, str], application: str) -> BatchFilter:
    compiled: dict[str, Expression] = {}
    expression_for = _per_table(spec)
    checked: set[str] = set()

    def expression(table: str) -> Expression | None:
        text = expression_for(table)
        if text is None:
            return None
        if text not in compiled:
            compiled[text] = Expression(text)
        return compiled[text]

    def check(expr: Expression, table: str, row: dict[str, Any]) -> None:
        if table in checked:
            return
        checked.add(table)
        missing = sorted(c for c in expr.columns if c not in row and c not in ("_table", "_op"))
        if missing:
            raise FilterError(
                application,
                f"applications.{application}.filter.where: {', '.join(map(repr, missing))} "
                f"{'is not a column' if len(missing) == 1 else 'are not columns'} of table "
                f"{table} (its columns: {', '.join(row)}); fix the expression",
            )

    def keep(u: Update) -> bool:
        if u.op == "t":
            return True
        expr = expression(u.table)
        if expr is None:
            return True
        after = _row(u.after)
        before = _row(u.before)
        if after is None and before is None:
            return True
        if after is not None:  # a full row: the table's columns are known
            check(expr, u.table, after)
        for row in (after, before):
            # A delete with only the key in its old image cannot be judged: kept. An
            # update is kept when either image matches, so a row that leaves the set
            # is seen leaving.
            if row is None or not expr.columns <= row.keys() | {"_table", "_op"}:
                if row is before and u.op == "d":
                    return True
                continue
            row["_table"], row["_op"] = u.table, u.op
            if expr(row):
                return True
        return False

    return lambda updates: [u for u in updates if keep(u)]


def _columns_step(
    spec: Sequence[str] | Mapping[str, Sequence[str]], application: str
) -> BatchFilter:
    columns_for = _per_table(spec if isinstance(spec, Mapping) else list(spec))
    checked: set[str] = set()

    def project(raw: Any, wanted: Sequence[str], table: str) -> Any:
        row = _row(raw)
        if row is None:
            return raw
        if table not in checked:
            checked.add(table)
            missing = [c for c in wanted if c not in row]
            if missing and len(row) > len(missing):  # not a key-only image
                raise FilterError(
                    application,
                    f"applications.{application}.filter.columns: "
                    f"{', '.join(map(repr, missing))} not in table {table} (its columns: "
                    f"{', '.join(row)}); fix the list",
                )
        return msgspec.Raw(_encode({c: row[c] for c in wanted if c in row}))

    def step(updates: list[Update]) -> list[Update]:
        out = []
        for u in updates:
            wanted = columns_for(u.table)
            if wanted is None or u.op == "t":
                out.append(u)
                continue
            # Updates are shared by every application: project into a copy.
            out.append(
                msgspec.structs.replace(
                    u,
                    before=project(u.before, wanted, u.table),
                    after=project(u.after, wanted, u.table),
                )
            )
        return out

    return step


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
