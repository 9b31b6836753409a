"""``wormhole apps``: list, add, remove or move the applications of a dataset in its shared
registry."""

from __future__ import annotations

import argparse
import json
from typing import Any

from wormhole.cli.shared import EXIT_OK, load
from wormhole.core.deployment import open_shared_registry, shown_applications
from wormhole.core.errors import ConfigError, WormholeError
from wormhole.core.pipeline import Pipeline
from wormhole.plugins.hookspecs import hookimpl

NAMING_THE_REGISTRY = "pipeline file (YAML) naming the registry"


@hookimpl(tryfirst=True)
def wormhole_commands(commands: Any) -> None:
    apps = commands.add_parser(
        "apps", help="list, add or remove the applications of a dataset in its registry"
    )
    actions = apps.add_subparsers(dest="action", required=True, metavar="ACTION")
    apps_list = actions.add_parser("list", help="the registered applications")
    apps_list.add_argument("pipeline", help=NAMING_THE_REGISTRY)
    apps_list.add_argument("--json", action="store_true", help="print the list as JSON")
    add = actions.add_parser(
        "add", help="register an application for every publisher of the dataset"
    )
    add.add_argument("pipeline", help=NAMING_THE_REGISTRY)
    add.add_argument("app", help="application name")
    add.add_argument("--start", help="earliest | latest | {position: SEQ} | {time: T}")
    add.add_argument("--sink", metavar="YAML", help="sink mapping, e.g. '{type: jsonl, ...}'")
    add.add_argument("--filter", metavar="YAML", help="filter mapping, as in the file")
    add.add_argument("--subscribers", type=int, help="subscriber instances")
    add.add_argument(
        "--from-file", action="store_true", help="start from the file's applications.APP"
    )
    add.add_argument(
        "--replace", action="store_true", help="overwrite an application already registered"
    )
    remove = actions.add_parser(
        "remove", help="remove an application: its subscribers finish what they hold and leave"
    )
    remove.add_argument("pipeline", help=NAMING_THE_REGISTRY)
    remove.add_argument("app", help="application name")
    move = actions.add_parser(
        "move",
        help="multiple-copy: serve an application from another copy of its datastores",
    )
    move.add_argument("pipeline", help=NAMING_THE_REGISTRY)
    move.add_argument("app", help="application name")
    move.add_argument("copy", help="the copy to serve it from")
    apps.set_defaults(func=cmd_apps)


def cmd_apps(args: argparse.Namespace) -> int:
    pipeline = load(args.pipeline)
    what = f"wormhole apps {args.action}"
    registry = open_shared_registry(pipeline, what)
    try:
        store = registry.application_store()
        if store is None:
            raise WormholeError(
                f"{what}: {registry.describe()} holds no applications: those of "
                f"{pipeline.name} are in {pipeline.file}"
            )
        action = {"list": _list, "move": _move, "remove": _remove, "add": _add}[args.action]
        return action(args, pipeline, registry, store)
    finally:
        registry.close()


def _list(args: argparse.Namespace, pipeline: Pipeline, registry: Any, store: Any) -> int:
    shown = shown_applications(store.applications())
    if args.json:
        print(json.dumps(shown))
        return EXIT_OK
    print(f"applications of {pipeline.name} in {registry.describe()}:")
    for name, value in shown.items():
        print(f"  {name}: {json.dumps(value)}")
    return EXIT_OK


def _move(args: argparse.Namespace, pipeline: Pipeline, registry: Any, store: Any) -> int:
    import time

    name = args.app
    current = store.applications().get(name)
    if not isinstance(current, dict):
        raise WormholeError(f"no application {name!r} in {registry.describe()}")
    order = [args.copy] + [c for c in current.get("copies") or [] if c != args.copy]
    move = {"to": args.copy, "requested": int(time.time() * 1000)}
    store.put_application(name, {**current, "copies": order, "move": move})
    print(
        f"application {name}: moves to copy {args.copy} (now preferred: "
        f"{', '.join(order)}); the copy serving it hands it over once {args.copy} has "
        f"caught up"
    )
    return EXIT_OK


def _remove(args: argparse.Namespace, pipeline: Pipeline, registry: Any, store: Any) -> int:
    if not store.remove_application(args.app):
        raise WormholeError(f"no application {args.app!r} in {registry.describe()}")
    print(f"removed application {args.app}; its datamarkers are kept by each publisher")
    return EXIT_OK


def _add(args: argparse.Namespace, pipeline: Pipeline, registry: Any, store: Any) -> int:
    import yaml

    from wormhole.core.pipeline import parse_application
    from wormhole.core.registry import application_path

    name = args.app
    raw_app: dict[str, Any] = {}
    if args.from_file:
        found = (pipeline.raw.get("applications") or {}).get(name)
        if found is None:
            raise ConfigError(f"--from-file: no applications.{name} in the file", pipeline.file)
        raw_app.update(found)
    for key in ("sink", "filter"):
        text = getattr(args, key)
        if text is not None:
            value = yaml.safe_load(text)
            if not isinstance(value, dict):
                raise ConfigError(f"--{key}: must be a YAML mapping, e.g. {{type: jsonl}}")
            raw_app[key] = value
    if args.start is not None:
        raw_app["start"] = yaml.safe_load(args.start)
    if args.subscribers is not None:
        raw_app["subscribers"] = args.subscribers
    if name in store.applications() and not args.replace:
        raise WormholeError(
            f"application {name} is already registered ({application_path(registry, name)}); "
            f"remove it first, or pass --replace (a running application's changes apply "
            f"when its publishers restart)"
        )
    app, problems = parse_application(pipeline, name, raw_app, f"application {name}")
    if app is None:
        raise ConfigError(problems)
    store.put_application(name, raw_app)
    print(f"registered application {name} for every publisher of {pipeline.name}")
    return EXIT_OK
