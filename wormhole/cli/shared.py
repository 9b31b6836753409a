"""What the commands share: loading a pipeline, exit codes, the final error line, and
output helpers."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

from wormhole.core.pipeline import READ_STATE_UNUSED, Pipeline, load_pipeline

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_INCOMPLETE = 3
"""``run --once`` stopped (SIGINT, SIGTERM) before every application had its end position."""

PIPELINE_HELP = "pipeline file (YAML)"


def pipeline_command(
    commands: Any, name: str, help: str, func: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    """Command ``name`` (a parser of ``commands``, the subparsers), run by ``func``, whose
    first argument is the pipeline file."""
    command: argparse.ArgumentParser = commands.add_parser(name, help=help)
    command.add_argument("pipeline", help=PIPELINE_HELP)
    command.set_defaults(func=func)
    return command


def load(path: str, reads_state_only: bool = False) -> Pipeline:
    """The pipeline file; a command that only reads the state dir needs no variables of the
    source, transport or sinks (their secrets)."""
    return load_pipeline(path, unused=READ_STATE_UNUSED if reads_state_only else ())


class CommandLine:
    """What a plugin's command may ask of the command line: the ``cli`` argument of the
    ``wormhole_commands`` hook (:class:`wormhole.plugins.hookspecs.CommandLine`)."""

    def load_pipeline(self, path: str) -> Pipeline:
        return load(path)


class JsonFormatter(logging.Formatter):
    """``--log-format json``: one JSON object a line with ``time`` (UTC, ISO 8601),
    ``level``, ``logger``, ``message`` and, for an exception, ``exception``."""

    def format(self, record: logging.LogRecord) -> str:
        import datetime

        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


class _Errors:
    json = False
    """``--log-format json``: the final error is a JSON log line too."""


def errors_as_json(on: bool) -> None:
    """Whether :func:`report_error` writes JSON log lines (``--log-format json``)."""
    _Errors.json = on


def report_error(text: str) -> None:
    """The command's final error on stderr: as given, or with ``--log-format json`` one JSON
    object (``level`` error, ``logger`` wormhole, ``message`` without the ``error:``)."""
    if not _Errors.json:
        print(text, file=sys.stderr)
        return
    record = logging.LogRecord("wormhole", logging.ERROR, "", 0, text.removeprefix("error: "),
                               None, None)  # fmt: skip
    print(JsonFormatter().format(record), file=sys.stderr)


def of_estimate(done: int, estimate: int | None, of: str) -> str:
    """`` of ~N`` while the work is within the estimate; past it, say so (never done > N)."""
    if not estimate:
        return ""
    if done <= estimate:
        return f" {of}{'' if of.endswith('~') else ' '}{estimate:,}"
    return f" (more than the estimated {estimate:,})"


def print_backfills(requests: list[dict[str, Any]], every: bool) -> None:
    """Backfills and their progress: ``every`` one, or those queued or running."""
    shown = [r for r in requests if every or r["state"] in ("queued", "running")]
    if not shown:
        if every:
            print("no backfills")
        return
    print("  backfills:")
    for r in shown:
        whom = r["application"] or "every application"
        where = f" where {r['where']}" if r["where"] else ""
        total = of_estimate(r["read"], r["estimate"], "of ~")
        error = f": {r['error']}" if r["error"] else ""
        print(
            f"    {r['id']:>4}  {r['state']:<9} {r['table']}{where} for {whom}: "
            f"{r['read']:,}{total} rows read, {r['rows']:,} emitted, {r['dropped']:,} dropped, "
            f"{r['chunks']:,} chunks{error}"
        )
