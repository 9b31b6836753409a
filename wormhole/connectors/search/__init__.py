"""The ``search`` sink: a full-text index kept in step with its tables.

Inserts, updates and snapshot reads (ops ``c``, ``u``, ``r``) upsert a document,
deletes (``d``) remove it, and a truncate (``t``, one copy per shard) removes the
table's documents of that shard. Each document has an id from a per-table
template (``user:{id}``), the configured fields indexed by type, and the whole
row stored as JSON, so that a query returns rows.

Writes are idempotent by key and version: every update's version comes from its
source positions (:mod:`wormhole.plugins.versions`), and an update older than what
the index holds for its document is skipped, so a replay from an older
datamarker never takes a document back to an older row, nor brings back a
deleted one.

Engines: ``tantivy`` (default), an embedded index in a directory, committed
before ``write`` returns; ``opensearch``, an OpenSearch or Elasticsearch cluster
through the ``_bulk`` API with external versions. Query with
``wormhole search PIPELINE APP QUERY`` or :func:`query`.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

from wormhole.connectors.search.opensearch import OpenSearchSink
from wormhole.connectors.search.options import SearchOptions
from wormhole.connectors.search.tantivy_engine import Hit, QueryError, TantivySink
from wormhole.connectors.search.tantivy_engine import query as _query_tantivy
from wormhole.core.errors import ConfigError
from wormhole.plugins.components import ComponentSpec, ComponentUse
from wormhole.plugins.hookspecs import CommandLine, hookimpl

__all__ = [
    "Hit",
    "OpenSearchSink",
    "QueryError",
    "SearchOptions",
    "TantivySink",
    "make_sink",
    "query",
    "query_application",
]


def make_sink(options: SearchOptions) -> TantivySink | OpenSearchSink:
    """The sink instance for the configured engine."""
    if options.engine == "opensearch":
        return OpenSearchSink(options)
    return TantivySink(options)


def query(path: str | os.PathLike[str], text: str, limit: int = 10) -> list[Hit]:
    """The live rows of the Tantivy index in ``path`` that match ``text``, best first.

    ``wormhole.connectors.search.query("out/search/users", "name:ada", limit=10)``
    returns a list of :class:`Hit` (``id``, ``table``, ``score``, ``row``). The
    index is opened read-only, so this works while a pipeline writes it.
    Raises :class:`QueryError` when there is no index or the query is malformed.
    """
    return _query_tantivy(path, text, limit)


def query_application(pipeline: Any, application: str, text: str, limit: int = 10) -> list[Hit]:
    """Query the index of ``application`` in a loaded pipeline (``wormhole search``)."""
    app = pipeline.applications.get(application)
    if app is None:
        known = ", ".join(sorted(pipeline.applications))
        raise ConfigError(
            f"APP: unknown application {application!r} (known: {known})", pipeline.file
        )
    if app.sink is None or app.sink.type != "search":
        searchable = sorted(
            name
            for name, a in pipeline.applications.items()
            if a.sink is not None and a.sink.type == "search"
        )
        has = f"sink {app.sink.type}" if app.sink is not None else "no sink"
        raise ConfigError(
            f"applications.{application}.sink: {application} has {has}, not a search sink "
            f"(applications with one: {', '.join(searchable) or 'none'})",
            pipeline.file,
        )
    if limit < 1:
        raise QueryError(f"--limit: must be at least 1, not {limit}")
    options: SearchOptions = app.sink.options
    if options.engine == "opensearch":
        from wormhole.connectors.search.opensearch import query as query_opensearch

        return query_opensearch(options, application, text, limit)
    assert options.path is not None
    return _query_tantivy(options.path.format(application=application), text, limit)


@hookimpl
def wormhole_sinks() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            kind="sink",
            name="search",
            factory=make_sink,
            options=SearchOptions,
            description="Keep a full-text index (Tantivy, or OpenSearch) in step with the tables.",
            check=check_use,
        )
    ]


def check_use(options: SearchOptions, use: ComponentUse) -> list[str]:
    """What ``validate`` can tell without the engine: a Tantivy index has one writer."""
    if options.engine == "tantivy" and use.subscribers > 1:
        return [
            f"applications.{use.application}.subscribers: the search sink's tantivy engine "
            f"writes one index, and a Tantivy index has one writer; set subscribers: 1 (or "
            f"use engine: opensearch, which takes any number)"
        ]
    return []


@hookimpl
def wormhole_commands(commands: Any, cli: CommandLine) -> None:
    search = commands.add_parser("search", help="query the index of an application's search sink")
    search.add_argument("pipeline", help="pipeline file (YAML)")
    search.add_argument("app", help="an application whose sink is search")
    search.add_argument("query", help="e.g. name:ada, 'ada lovelace', 'age:[30 TO 40]', '*'")
    search.add_argument("--limit", type=int, default=10, help="at most N rows (default 10)")
    search.add_argument(
        "--json", action="store_true", help="one object per row: id, table, score, row"
    )
    search.set_defaults(func=partial(_search_command, cli))


def _search_command(cli: CommandLine, args: Any) -> int:
    """``wormhole search PIPELINE APP QUERY``: the matching rows as JSON lines."""
    import json

    pipeline = cli.load_pipeline(args.pipeline)
    for hit in query_application(pipeline, args.app, args.query, args.limit):
        if args.json:
            record = {"id": hit.id, "table": hit.table, "score": hit.score, "row": hit.row}
            print(json.dumps(record))
        else:
            print(json.dumps(hit.row))
    return 0
