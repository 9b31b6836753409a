"""``wormhole backfill``: re-read a table in key-order chunks while the stream flows
(``--list`` the backfills, ``--cancel ID`` one)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from wormhole.cli.shared import (
    EXIT_OK,
    load,
    of_estimate,
    pipeline_command,
    print_backfills,
)
from wormhole.core import backfill as bf
from wormhole.core.deployment import application_names
from wormhole.core.errors import BackfillError
from wormhole.core.pipeline import Pipeline
from wormhole.observability.status import read_live_status
from wormhole.plugins.hookspecs import hookimpl


@hookimpl(tryfirst=True)
def wormhole_commands(commands: Any) -> None:
    backfill = pipeline_command(
        commands,
        "backfill",
        "re-read a table in key-order chunks while the stream flows, for every "
        "application or one (--list, --cancel ID)",
        cmd_backfill,
    )
    backfill.add_argument("--table", help="the table, as schema.table")
    backfill.add_argument(
        "--where", help="SQL condition on the table's rows: only those are backfilled"
    )
    backfill.add_argument("--app", help="only this application receives the rows")
    backfill.add_argument(
        "--chunk-size", type=int, help="rows per chunk (default: the file's backfill.chunk_size)"
    )
    backfill.add_argument(
        "--pause-ms", type=int, help="pause between chunks (default: backfill.pause_ms)"
    )
    backfill.add_argument(
        "--wait", action="store_true", help="follow the backfill to its end (exit 1 unless done)"
    )
    backfill.add_argument("--list", action="store_true", help="every backfill and its progress")
    backfill.add_argument("--cancel", type=int, metavar="ID", help="stop a backfill")
    backfill.add_argument("--json", action="store_true", help="--list as JSON")


def cmd_backfill(args: argparse.Namespace) -> int:
    pipeline = load(args.pipeline)
    if args.list:
        requests = bf.summary(pipeline.state_dir)
        if args.json:
            print(json.dumps(requests))
        else:
            print_backfills(requests, every=True)
        return EXIT_OK
    if args.cancel is not None:
        return _cancel(pipeline, args.cancel)
    if not args.table:
        raise BackfillError(
            "name the table to backfill (--table schema.table), or use --list or --cancel ID"
        )
    if args.app is not None:
        names, where = application_names(pipeline)
        if args.app not in names:
            raise BackfillError(
                f"--app {args.app}: no such application in {where or pipeline.file}; the "
                f"applications are: {', '.join(sorted(names))}"
            )
    chunk_size = pipeline.backfill.chunk_size if args.chunk_size is None else args.chunk_size
    pause_ms = pipeline.backfill.pause_ms if args.pause_ms is None else args.pause_ms
    if not 1 <= chunk_size <= 1_000_000 or not 0 <= pause_ms <= 3_600_000:
        raise BackfillError(
            f"--chunk-size {chunk_size} --pause-ms {pause_ms}: a chunk holds 1 to 1,000,000 "
            f"rows and the pause is 0 to 3,600,000 ms"
        )
    plan = _plan(pipeline, args.table, args.where)
    store = bf.BackfillStore(pipeline.state_dir)
    try:
        request = store.add(plan.table, plan.where, args.app, chunk_size, pause_ms, plan.estimate)
        about = "" if plan.estimate is None else f", about {plan.estimate:,} rows"
        print(f"{request.describe()} queued (id {request.id}{about})")
        if read_live_status(pipeline.state_dir) is None:
            print(
                f"  the publisher is not running: it starts the backfill when it runs "
                f"(wormhole run {pipeline.file})"
            )
        if not args.wait:
            return EXIT_OK
        return _wait_for_backfill(store, request.id)
    finally:
        store.close()


def _cancel(pipeline: Pipeline, request_id: int) -> int:
    if not bf.BackfillStore.exists(pipeline.state_dir):
        raise BackfillError(f"--cancel {request_id}: {pipeline.state_dir} holds no backfills")
    store = bf.BackfillStore(pipeline.state_dir)
    try:
        request = store.cancel(request_id)
    finally:
        store.close()
    print(f"{request.describe()} cancelled after {request.rows:,} rows")
    return EXIT_OK


def _plan(pipeline: Pipeline, table: str, where: str | None) -> Any:
    """The source's plan for backfilling ``table`` (an error for a source that cannot)."""
    created: Any = pipeline.source.create()
    source = created
    if not pipeline.source.capabilities_of(source).backfill:
        raise BackfillError(
            f"source.type {pipeline.source.type}: this source cannot backfill tables: it "
            f"reads a log of changes, not tables it could read again. Backfills need a "
            f"database source (postgres, mysql)"
        )
    try:
        return source.backfill_plan(pipeline.name, table, where)
    finally:
        created.close()


def _wait_for_backfill(store: Any, request_id: int) -> int:
    """Follow a backfill to its end: 0 when done, 1 when cancelled or failed."""
    import time

    next_line = 0.0
    while True:
        request = store.get(request_id)
        if request is None:
            return 1
        if request.state in ("done", "cancelled", "failed"):
            why = f": {request.error}" if request.error else ""
            print(
                f"{request.describe()} {request.state}: {request.rows:,} rows emitted, "
                f"{request.read:,} read, {request.dropped:,} dropped as changed meanwhile, "
                f"{request.chunks:,} chunks{why}"
            )
            return EXIT_OK if request.state == "done" else 1
        now = time.monotonic()
        if now >= next_line:
            next_line = now + 5.0
            total = of_estimate(request.read, request.estimate, "of about")
            print(f"  {request.state}: {request.read:,} rows read{total}", flush=True)
        time.sleep(0.2)
