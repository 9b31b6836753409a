"""``wormhole top``: a live view of a running pipeline (the view itself is
:mod:`wormhole.observability.top`)."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from wormhole.cli.shared import EXIT_OK, load, pipeline_command
from wormhole.core.errors import ConfigError
from wormhole.plugins.hookspecs import hookimpl


@hookimpl(tryfirst=True)
def wormhole_commands(commands: Any) -> None:
    top = pipeline_command(
        commands,
        "top",
        "a live view: per application throughput, lag, subscribers, caravans; source lag",
        cmd_top,
    )
    top.add_argument(
        "--interval", type=float, default=2.0, help="seconds between refreshes (default 2)"
    )
    top.add_argument(
        "--once", action="store_true", help="print one frame and exit (plain text off a terminal)"
    )


def cmd_top(args: argparse.Namespace) -> int:
    from wormhole.observability import top

    if args.interval <= 0:
        raise ConfigError(f"--interval: {args.interval} must be a positive number of seconds")
    pipeline = load(args.pipeline, reads_state_only=True)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how the view ends
        top.run(pipeline, args.interval, args.once)
    return EXIT_OK
