"""``wormhole validate``: check a pipeline file (exit 2 naming each bad key)."""

from __future__ import annotations

import argparse
from typing import Any

from wormhole.cli.shared import EXIT_OK, load, pipeline_command
from wormhole.plugins.hookspecs import hookimpl


@hookimpl(tryfirst=True)
def wormhole_commands(commands: Any) -> None:
    pipeline_command(commands, "validate", "check a pipeline file", cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    pipeline = load(args.pipeline)
    apps = ", ".join(
        f"{a.name} ({a.sink.type if a.sink else 'library'} x{a.subscribers})"
        for a in pipeline.applications.values()
    )
    print(
        f"{args.pipeline}: valid. pipeline {pipeline.name}: source {pipeline.source.type}, "
        f"transport {pipeline.transport.type}, {pipeline.shards} shards, "
        f"applications: {apps}"
    )
    return EXIT_OK
