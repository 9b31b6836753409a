"""``wormhole run`` and ``wormhole publish``: run a pipeline (with its subscribers, or only
the publisher) until stopped, or ``--once`` to the source's current end."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from types import FrameType
from typing import Any

from wormhole.cli.shared import (
    EXIT_INCOMPLETE,
    EXIT_OK,
    PIPELINE_HELP,
    load,
    report_error,
)
from wormhole.core.errors import Stopped
from wormhole.core.pipeline import MetricsSettings, Pipeline
from wormhole.core.publisher import Publisher, RunSummary, tune_gc
from wormhole.plugins.hookspecs import hookimpl
from wormhole.plugins.metrics_endpoint import parse_listen

EPILOG = (
    "exit status: 0 when stopped or done; 2 on an error (named on an `error:` line); 3 when "
    "stopped (SIGINT, SIGTERM) before the end of --once, saying what was left (run it again "
    "to deliver the rest); 128+N on a second signal N."
)


@hookimpl(tryfirst=True)
def wormhole_commands(commands: Any) -> None:
    for name, help_text, once_help in (
        (
            "run",
            "run a pipeline until stopped (or --once)",
            "deliver everything the source holds now to every application, then exit",
        ),
        (
            "publish",
            "run only the publisher; subscribers connect to it (tcp transport)",
            "as for run",
        ),
    ):
        command = commands.add_parser(
            name,
            help=help_text,
            description=f"{help_text[0].upper()}{help_text[1:]}.",
            epilog=EPILOG,
        )
        command.add_argument("pipeline", help=PIPELINE_HELP)
        command.add_argument("--once", action="store_true", help=once_help)
        command.add_argument("-q", "--quiet", action="store_true", help="no summary")
        command.add_argument("--json", action="store_true", help="print the summary as JSON")
        command.add_argument(
            "--metrics",
            metavar="HOST:PORT",
            help="serve Prometheus metrics here (instead of the file's metrics.listen; "
            "subscriber processes `run` starts use the ports after it)",
        )
        command.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    pipeline = load(args.pipeline)
    _metrics_option(pipeline, args.metrics)
    publisher = Publisher(pipeline, once=args.once, local_subscribers=args.command == "run")
    signals = {"count": 0}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        signals["count"] += 1
        if signals["count"] > 1:
            # State on disk is always consistent; a second signal need not wait.
            os._exit(128 + signum)
        logging.getLogger("wormhole").info(
            "%s: draining and persisting datamarkers (again to exit at once)",
            signal.Signals(signum).name,
        )
        publisher.request_stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, lambda signum, frame: publisher.request_reload())
    tune_gc()
    try:
        summary = publisher.run()
    except Stopped as exc:
        if not args.once:
            raise
        # Stopped while starting: nothing was delivered, the end was not reached.
        report_error(f"error: run --once stopped before its end: {exc}; run it again")
        return EXIT_INCOMPLETE
    if args.json:
        print(json.dumps(_summary_json(summary)))
    elif not args.quiet:
        _print_summary(summary)
    if summary.complete is False:
        report_error(f"error: {_incomplete_text(summary)}")
        return EXIT_INCOMPLETE
    return EXIT_OK


def _metrics_option(pipeline: Pipeline, address: str | None) -> None:
    """``--metrics HOST:PORT``: serve metrics there (over the file's ``metrics.listen``)."""
    if address is None:
        return
    flows = pipeline.metrics.flows if pipeline.metrics is not None else True
    pipeline.metrics = MetricsSettings(parse_listen(address, "--metrics"), flows)


def _print_summary(summary: RunSummary, out: Any = sys.stdout) -> None:
    print(
        f"pipeline {summary.pipeline}: {summary.source_updates:,} updates read from the source "
        f"in {summary.elapsed:.2f}s ({summary.rate:,.0f} updates/s); publisher log at "
        f"{summary.log_end:,}",
        file=out,
    )
    width = max([len("application")] + [len(n) for n in summary.applications])
    print(f"  {'application':<{width}}  {'updates':>12}  {'datamarker':>12}  {'lag':>10}", file=out)
    for app in summary.applications.values():
        print(
            f"  {app.name:<{width}}  {app.updates:>12,}  {app.datamarker:>12,}  {app.lag:>10,}",
            file=out,
        )
    if summary.truncated:
        print(f"  recovered torn tails: {', '.join(summary.truncated)}", file=out)
    if summary.removed_segments:
        print(f"  garbage-collected: {', '.join(summary.removed_segments)}", file=out)
    if summary.complete:
        print("  complete: every application acknowledged the end position", file=out)
    elif summary.complete is False:
        print(f"  incomplete: {_incomplete_text(summary)}", file=out)


def _incomplete_text(summary: RunSummary) -> str:
    """What an interrupted ``run --once`` left undone, in one line."""
    left = []
    if summary.source_left:
        left.append("the source was not read to its end position")
    left += [
        f"{name}: {count:,} updates not acknowledged"
        for name, count in summary.applications_left.items()
    ]
    return (
        f"run --once stopped before its end ({'; '.join(left) or 'nothing left'}); "
        f"run it again to deliver the rest"
    )


def _summary_json(summary: RunSummary) -> dict[str, Any]:
    return {
        "pipeline": summary.pipeline,
        "elapsed": summary.elapsed,
        "source_updates": summary.source_updates,
        "log_end": summary.log_end,
        "applications": {
            a.name: {"updates": a.updates, "datamarker": a.datamarker, "lag": a.lag}
            for a in summary.applications.values()
        },
        "truncated": summary.truncated,
        "removed_segments": summary.removed_segments,
        "log_bytes_read": summary.log_bytes_read,
        "caravans": {"merges": summary.caravan_merges, "splits": summary.caravan_splits},
        "complete": summary.complete,
        "remaining": {"source": summary.source_left, "applications": summary.applications_left}
        if summary.once
        else None,
    }
