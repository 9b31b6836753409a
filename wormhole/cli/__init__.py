"""The ``wormhole`` command: run, publish, subscribe, validate, plugins, status, top, forget,
apps, dead-letters, backfill, and the commands plugins add.

Each command is a module of this package holding its arguments and its handler; it adds
itself to the command line through the ``wormhole_commands`` hook, the one plugins use for
theirs. What commands share is in :mod:`wormhole.cli.shared`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys

from wormhole.cli.shared import (
    EXIT_OK,
    EXIT_USAGE,
    CommandLine,
    JsonFormatter,
    errors_as_json,
    report_error,
)
from wormhole.core.errors import ConfigError, Stopped, WormholeError, file_problem
from wormhole.plugins.events import count_errors

COMMANDS = (
    "wormhole.cli.run",
    "wormhole.cli.subscribe",
    "wormhole.cli.validate",
    "wormhole.cli.plugins",
    "wormhole.cli.status",
    "wormhole.cli.top",
    "wormhole.cli.forget",
    "wormhole.cli.apps",
    "wormhole.cli.dead_letters",
    "wormhole.cli.backfill",
)
"""The built-in commands, in the order ``wormhole --help`` lists them (before plugins')."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wormhole",
        description="Change data capture and reliable pub-sub: database logs to ordered, "
        "sharded, acknowledged streams of key-value updates.",
    )
    from wormhole.plugins.manager import DISTRIBUTION, builtin_version, default_registry

    parser.add_argument(
        "--version",
        action="version",
        version=f"wormhole {builtin_version()} ({DISTRIBUTION}, Python {sys.version.split()[0]})",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("WORMHOLE_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
        help="log level (default: $WORMHOLE_LOG_LEVEL or info); subscribers started by "
        "`run` inherit it",
    )
    parser.add_argument(
        "--log-format",
        default=os.environ.get("WORMHOLE_LOG_FORMAT", "text"),
        choices=["text", "json"],
        help="log lines as text, or as one JSON object a line (time, level, logger, message); "
        "default: $WORMHOLE_LOG_FORMAT or text; subscribers started by `run` inherit it",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    pm = default_registry().pm
    # The built-in commands are plugins of the same hook as a connector's (`wormhole
    # search`, say). Their implementations are marked tryfirst, and pluggy calls those
    # last registered first: registered in reverse, they come in COMMANDS' order.
    for name in reversed(COMMANDS):
        if pm.get_plugin(name) is None:
            pm.register(importlib.import_module(name), name=name)
    pm.hook.wormhole_commands(commands=commands, cli=CommandLine())
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except WormholeError as exc:  # a plugin that fails to load
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    args = parser.parse_args(argv)
    _configure_logging(args)
    try:
        code: int = args.func(args)
        return code
    except ConfigError as exc:
        report_error(exc.render())
        return EXIT_USAGE
    except Stopped as exc:  # a stop asked for while starting: not a failure
        logging.getLogger("wormhole").info("%s", exc)
        return EXIT_OK
    except WormholeError as exc:
        report_error(f"error: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Output piped into `head` and the like: not an error.
        sys.stderr.close()
        return EXIT_OK
    except OSError as exc:
        if exc.filename is None:
            raise
        # A file-system error no code path above named: still the path and the fix.
        logging.getLogger("wormhole").debug("file-system error", exc_info=True)
        problem = file_problem(exc.filename, exc, "use")
        report_error(f"error: {problem}")
        return problem.exit_code


def _configure_logging(args: argparse.Namespace) -> None:
    """Log level and format for this process and the subscriber processes it starts."""
    import faulthandler

    # `kill -USR1 PID` prints every thread's stack to stderr: what a stuck process is doing.
    # (Not where stderr is no real file: main() called in-process with it captured.)
    with contextlib.suppress(ValueError, OSError, AttributeError):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    level = "debug" if args.verbose else args.log_level
    os.environ["WORMHOLE_LOG_LEVEL"] = level  # for subscriber processes we start
    os.environ["WORMHOLE_LOG_FORMAT"] = args.log_format
    handler = logging.StreamHandler(sys.stderr)
    if args.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])
    count_errors()
    errors_as_json(args.log_format == "json")


__all__ = ["COMMANDS", "build_parser", "main", "report_error"]
