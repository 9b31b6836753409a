"""``wormhole subscribe``: one subscriber of an application, with its sink, on any machine."""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

from wormhole.cli.shared import EXIT_OK, load, pipeline_command
from wormhole.core.errors import ConfigError
from wormhole.core.publisher import tune_gc
from wormhole.core.registry import subscriber_application
from wormhole.plugins.components import SubscribeRequest
from wormhole.plugins.hookspecs import hookimpl
from wormhole.plugins.metrics_endpoint import parse_listen, serve
from wormhole.subscriber.handlers import catch_stop_signals


@hookimpl(tryfirst=True)
def wormhole_commands(commands: Any) -> None:
    subscribe = pipeline_command(
        commands,
        "subscribe",
        "run one subscriber of an application, with its sink, on any machine",
        cmd_subscribe,
    )
    subscribe.add_argument("--app", required=True, help="the application to subscribe as")
    subscribe.add_argument(
        "--publisher",
        action="append",
        metavar="HOST:PORT",
        help="publisher address (repeat for several; default: from the pipeline or state dir)",
    )
    subscribe.add_argument(
        "--instance", type=int, default=0, help="this subscriber's number (the sink's {subscriber})"
    )
    subscribe.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve this subscriber's Prometheus metrics here (sink latency, retries, ...)",
    )
    subscribe.add_argument("--exit-with-parent", type=int, metavar="PID", help=argparse.SUPPRESS)


def cmd_subscribe(args: argparse.Namespace) -> int:
    catch_stop_signals()
    if args.exit_with_parent:
        _exit_with_parent(args.exit_with_parent)
    pipeline = load(args.pipeline)
    if args.metrics is not None:
        # For the life of the process (a daemon thread): the sink's figures, retries, ...
        serve(parse_listen(args.metrics, "--metrics"))
    tune_gc()  # a subscriber decodes many short-lived objects too
    subscribe = pipeline.transport.registered.spec.subscribe
    if subscribe is None:
        raise ConfigError(
            f"transport.type: {pipeline.transport.type} has no separate subscribers; "
            f"`wormhole subscribe` needs a transport that has them",
            pipeline.file,
        )

    def sink_application(library: str) -> Any:
        return subscriber_application(pipeline, args.app, library)

    request = SubscribeRequest(
        pipeline, args.app, args.instance, args.publisher or [], sink_application
    )
    subscribe(request)
    return EXIT_OK


def _exit_with_parent(parent: int) -> None:
    """Die at once when the publisher that started us dies (even by kill -9).

    Anything this subscriber had not acknowledged is sent again to the next
    owner; carrying on alone could only write it out of order with that owner.
    """
    import ctypes
    import threading
    import time

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:  # for systems without PR_SET_PDEATHSIG
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent watch", daemon=True).start()
