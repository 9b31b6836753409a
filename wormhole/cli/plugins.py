"""``wormhole plugins``: every component by kind, with the distribution that provides it."""

from __future__ import annotations

import argparse
import json
from typing import Any

from wormhole.cli.shared import EXIT_OK
from wormhole.plugins.components import KINDS
from wormhole.plugins.hookspecs import hookimpl

PLURALS = {"registry": "registries"}


@hookimpl(tryfirst=True)
def wormhole_commands(commands: Any) -> None:
    plugins = commands.add_parser("plugins", help="list components by kind and their distribution")
    plugins.add_argument("--json", action="store_true", help="with option schemas, as JSON")
    plugins.set_defaults(func=cmd_plugins)


def cmd_plugins(args: argparse.Namespace) -> int:
    from wormhole.plugins.manager import default_registry

    registry = default_registry()
    if args.json:
        print(
            json.dumps(
                {
                    kind: {
                        name: {
                            "distribution": r.distribution,
                            "version": r.version,
                            "description": r.spec.description,
                            "options": r.spec.options.model_json_schema(),
                        }
                        for name, r in sorted(registry.components[kind].items())
                    }
                    for kind in KINDS
                },
                indent=2,
            )
        )
        return EXIT_OK
    for kind in KINDS:
        print(f"{PLURALS.get(kind, kind.replace('_', ' ') + 's')}:")
        entries = sorted(registry.components[kind].items())
        if not entries:
            print("  (none)")
        width = max((len(name) for name, _ in entries), default=0)
        for name, registered in entries:
            dist = f"{registered.distribution} {registered.version}".strip()
            print(f"  {name:<{width}}  [{dist}]  {registered.spec.description}")
    return EXIT_OK
