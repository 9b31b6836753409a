"""Helpers for declaring components: hook implementations made from specs, and the checks
that many components' ``check`` share.

A plugin module assigns a hook implementation to the hook's name::

    wormhole_sinks = offer(ComponentSpec(kind="sink", name="mysink", factory=MySink))

which is the same as writing the ``@hookimpl`` function that returns ``[spec]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from wormhole.plugins.components.capabilities import Capabilities
from wormhole.plugins.components.options import NoOptions
from wormhole.plugins.components.spec import ComponentSpec, ComponentUse
from wormhole.plugins.hookspecs import hookimpl

Hook = Callable[[], list[ComponentSpec]]
"""A ``wormhole_<kind>s`` hook implementation."""


def offer(*specs: ComponentSpec) -> Hook:
    """The implementation of a ``wormhole_<kind>s`` hook that returns ``specs`` (all of the
    hook's kind)."""
    kinds = {spec.kind for spec in specs}
    if len(kinds) > 1:
        raise TypeError(f"one hook offers components of one kind, not {sorted(kinds)}")

    @hookimpl
    def hook() -> list[ComponentSpec]:
        return list(specs)

    return hook


def log_reader(
    name: str,
    *,
    source: Callable[[Any], Any],
    options: type[BaseModel],
    description: str,
    capabilities: Capabilities,
    mapper: Callable[[Any], Any],
    mapper_options: type[BaseModel] = NoOptions,
    mapper_description: str,
) -> tuple[Hook, Hook]:
    """The ``wormhole_sources`` and ``wormhole_position_mappers`` implementations of a
    connector that reads a datastore's log: its source (``source``, ``options``,
    ``description``, ``capabilities``) and the position mapper of the positions it writes
    (``mapper``, ``mapper_options``, ``mapper_description``), both named ``name``: the
    ``update.connector`` of its updates, which is how updates find their mapper."""
    return (
        offer(
            ComponentSpec("source", name, source, options, description, capabilities=capabilities)
        ),
        offer(ComponentSpec("position_mapper", name, mapper, mapper_options, mapper_description)),
    )


def template_problems(
    use: ComponentUse, key: str, template: str, hint: str, **values: Any
) -> list[str]:
    """The problem with an option that is a ``str.format`` template (a path with
    ``{application}``, say), found before anything is opened: a placeholder ``values`` does
    not fill. ``hint`` says which are available."""
    try:
        template.format(**values)
    except (KeyError, IndexError, ValueError) as exc:
        return [f"{use.path}.{key}: {template!r} has an unknown placeholder ({exc}); {hint}"]
    return []


__all__ = ["Hook", "log_reader", "offer", "template_problems"]
