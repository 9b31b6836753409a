"""``wormhole forget``: delete the datamarkers of an application the dataset no longer has,
releasing the publisher log they hold."""

from __future__ import annotations

import argparse
from typing import Any

from wormhole.cli.shared import EXIT_OK, load, pipeline_command
from wormhole.core.deployment import application_names
from wormhole.core.errors import WormholeError
from wormhole.observability.status import read_live_status
from wormhole.plugins.hookspecs import hookimpl


@hookimpl(tryfirst=True)
def wormhole_commands(commands: Any) -> None:
    forget = pipeline_command(
        commands,
        "forget",
        "delete the datamarkers of an application removed from the pipeline file, "
        "releasing the publisher log it holds",
        cmd_forget,
    )
    forget.add_argument("app", help="an application no longer in the file")


def cmd_forget(args: argparse.Namespace) -> int:
    pipeline = load(args.pipeline)
    name = args.app
    names, registry = application_names(pipeline)
    if name in names and registry is not None:
        raise WormholeError(
            f"application {name} is still registered in {registry}: forgetting it would only "
            f"make it start again from its start point. Remove it first: wormhole apps remove "
            f"{pipeline.file} {name}"
        )
    if name in names:
        raise WormholeError(
            f"applications.{name} is still in {pipeline.file}: forgetting it would only make it "
            f"start again from its start point. Remove it from the file first (and send a "
            f"running publisher SIGHUP)"
        )
    live = read_live_status(pipeline.state_dir)
    if live is not None and name in live.get("applications", []):
        how = (
            "wait for it to apply the registry's change"
            if registry is not None
            else f"send it SIGHUP to apply {pipeline.file}"
        )
        raise WormholeError(
            f"application {name} is still served by the running publisher (pid {live['pid']}): "
            f"{how}, then forget {name}"
        )
    store = pipeline.datamarker_store.create()
    store.open(pipeline.name, pipeline.state_dir)
    try:
        count = store.forget(name)
    finally:
        store.close()
    if count == 0:
        raise WormholeError(
            f"application {name} has no stored datamarkers in {pipeline.state_dir}: nothing to "
            f"forget (`wormhole status {pipeline.file}` lists removed applications)"
        )
    print(
        f"forgot application {name}: {count} datamarkers deleted; the publisher log it held is "
        f"collected as the other flows move on"
    )
    return EXIT_OK
