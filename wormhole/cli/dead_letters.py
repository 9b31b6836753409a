"""``wormhole dead-letters``: list, show, replay or purge the updates an application's sink
rejected (``on_error: {policy: dead_letter}``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from wormhole.cli.shared import EXIT_OK, load, pipeline_command
from wormhole.core.deployment import application_names
from wormhole.core.errors import WormholeError
from wormhole.core.pipeline import Pipeline
from wormhole.plugins.hookspecs import hookimpl
from wormhole.subscriber import dead_letters as dl

ACTIONS = (
    ("list", "the application's dead letters, oldest first"),
    ("show", "one dead letter in full: error, position, flow, time and the update"),
    (
        "replay",
        "deliver them again through the application's sink, in order per key; "
        "removes what it takes",
    ),
    ("purge", "remove dead letters without delivering them (--id ID or --yes for all)"),
)

ID_HELP = {
    "replay": "(repeatable); replay takes its whole key",
    "purge": "(repeatable); the others stay",
}
"""The actions taking ``--id``: what it does in each."""


@hookimpl(tryfirst=True)
def wormhole_commands(commands: Any) -> None:
    dead = commands.add_parser(
        "dead-letters",
        help="list, show, replay or purge the updates an application's sink rejected "
        "(on_error: {policy: dead_letter})",
    )
    actions = dead.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, help_text in ACTIONS:
        command = pipeline_command(actions, action, help_text, cmd_dead_letters)
        command.add_argument("--app", required=True, help="the application")
        if action == "show":
            command.add_argument("id", type=int, help="the dead letter's id")
        if action == "list":
            command.add_argument("--json", action="store_true", help="print the list as JSON")
        if action in ID_HELP:
            command.add_argument(
                "--id", type=int, action="append", help=f"only this dead letter {ID_HELP[action]}"
            )
        if action == "purge":
            command.add_argument("--yes", action="store_true", help="purge every dead letter")
        if action == "replay":
            command.add_argument(
                "--instance", type=int, default=0, help="open the sink as this subscriber number"
            )


def cmd_dead_letters(args: argparse.Namespace) -> int:
    pipeline = load(args.pipeline)
    name = args.app
    names, _ = application_names(pipeline)
    dead = dl.DeadLetterLog(pipeline.state_dir, name)
    if name not in names and not dead.path.exists():
        raise WormholeError(
            f"application {name} is not in {pipeline.file} and has no dead-letter log in "
            f"{pipeline.state_dir}; the applications are: {', '.join(sorted(names))}"
        )
    try:
        action = {"list": _list, "show": _show, "purge": _purge, "replay": _replay}[args.action]
        return action(args, pipeline, dead)
    finally:
        dead.close()


def _show(args: argparse.Namespace, pipeline: Pipeline, dead: dl.DeadLetterLog) -> int:
    dead.refresh()
    entry = dead.entries.get(args.id)
    if entry is None:
        raise WormholeError(
            f"application {args.app} has no dead letter {args.id} in {dead.path} "
            f"(`wormhole dead-letters list {args.pipeline} --app {args.app}` lists them)"
        )
    print(json.dumps(_row(entry), indent=2))
    return EXIT_OK


def _list(args: argparse.Namespace, pipeline: Pipeline, dead: dl.DeadLetterLog) -> int:
    dead.refresh()
    entries = list(dead.entries.values())
    if args.json:
        print(json.dumps([_row(e) for e in entries]))
        return EXIT_OK
    parked = sum(1 for e in entries if e.parked_behind)
    print(
        f"application {args.app}: {len(entries)} dead letters ({parked} parked behind "
        f"another of their key) in {dead.path}"
    )
    for e in entries:
        why = f"parked behind {e.parked_behind}" if e.parked_behind else e.error
        key = json.dumps(e.key, separators=(",", ":"))
        flow = f"{e.datastore}/{e.shard}" if e.datastore else str(e.shard)
        print(
            f"  {e.id:>6}  shard {flow:<4} {e.table} {key} at "
            f"{e.position or e.logical or '?'}: {why}"
        )
    return EXIT_OK


def _purge(args: argparse.Namespace, pipeline: Pipeline, dead: dl.DeadLetterLog) -> int:
    if not args.id and not args.yes:
        raise WormholeError(
            "purge: name the dead letters to remove (--id ID, repeatable) or remove "
            "them all with --yes; what is purged is never delivered"
        )
    removed = dl.purge(dead, set(args.id) if args.id else None)
    print(f"application {args.app}: purged {len(removed)} dead letters")
    return EXIT_OK


def _replay(args: argparse.Namespace, pipeline: Pipeline, dead: dl.DeadLetterLog) -> int:
    from wormhole.core.registry import subscriber_application
    from wormhole.subscriber.handlers import open_sink

    name = args.app
    app = subscriber_application(pipeline, name, "wormhole.Subscriber")
    assert app.sink is not None
    sink = open_sink(app.sink, pipeline, app, args.instance)
    try:
        result = dl.replay(dead, sink, set(args.id) if args.id else None)
    finally:
        sink.close()
    print(
        f"application {name}: replayed {len(result.replayed)} dead letters through its sink"
        f"; {len(dead.entries)} left"
    )
    for entry_id, error in result.failed:
        print(f"  dead letter {entry_id} rejected again (its key stays parked): {error}")
    return EXIT_OK if not result.failed else 1


def _row(entry: Any) -> dict[str, Any]:
    import datetime

    import msgspec

    from wormhole.core.update import envelope

    return {
        "id": entry.id,
        "datastore": entry.datastore or None,
        "shard": entry.shard,
        "table": entry.table,
        "key": entry.key,
        "position": entry.position,
        "logical": entry.logical,
        "error": entry.error,
        "parked_behind": entry.parked_behind or None,
        "time": datetime.datetime.fromtimestamp(entry.ts_ms / 1000, datetime.UTC).isoformat(),
        "update": json.loads(msgspec.json.encode(envelope(entry.update))),
    }
