"""The Wormhole plugin hooks: the whole extension surface, in one module.

A plugin is a module (or object) with functions decorated ``@hookimpl`` whose
names are the hooks below. Built-in connectors are plugins like any other: they
register through these same hooks. Third-party plugins are found through the
``wormhole`` entry-point group::

    [project.entry-points.wormhole]
    myplugin = "myplugin.wormhole_plugin"

Each ``wormhole_<kind>s`` hook returns a list of
:class:`wormhole.plugins.components.ComponentSpec` of that kind; the registry
collects them from every plugin. Two plugins that declare the same kind and name
are an error naming both distributions. A hook that only returns specs can be made
from them: ``wormhole_sinks = offer(ComponentSpec(...))``
(:func:`wormhole.plugins.components.offer`; several built-ins declare theirs so).

Set ``WORMHOLE_DISABLE_PLUGIN_AUTOLOAD=1`` to load no entry points (built-ins
still load) and ``WORMHOLE_PLUGINS=mod1,mod2`` to load plugin modules by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import pluggy

if TYPE_CHECKING:
    from wormhole.plugins.components import ComponentSpec
    from wormhole.plugins.views import PipelineView

PROJECT = "wormhole"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def wormhole_sources() -> list[ComponentSpec]:
    """Sources (tailers) this plugin provides: readers of a datastore log.

    Called once when the registry is built. Return ``ComponentSpec(kind="source", ...)``
    entries whose factory builds an object following
    :class:`wormhole.plugins.components.Source`.
    """
    return []


@hookspec
def wormhole_sinks() -> list[ComponentSpec]:
    """Sinks this plugin provides: subscriber-side writers.

    The factory builds a :class:`wormhole.plugins.components.Sink`; it is called
    once per subscriber of each application that names it.
    """
    return []


@hookspec
def wormhole_filters() -> list[ComponentSpec]:
    """Publisher-side filters this plugin provides.

    Used from an application's ``filter: {plugins: [{type: NAME, ...}]}``. The
    factory builds a callable ``(list[Update]) -> list[Update]``
    (:class:`wormhole.plugins.components.Filter`).
    """
    return []


@hookspec
def wormhole_transports() -> list[ComponentSpec]:
    """Transports this plugin provides: how flows reach subscribers."""
    return []


@hookspec
def wormhole_position_mappers() -> list[ComponentSpec]:
    """Position mappers: native <-> logical positions for one kind of datastore.

    The spec's ``name`` is the connector name whose positions it maps
    (``update.connector``).
    """
    return []


@hookspec
def wormhole_datamarker_stores() -> list[ComponentSpec]:
    """Datamarker stores: where flows' acknowledged positions are persisted."""
    return []


@hookspec
def wormhole_registries() -> list[ComponentSpec]:
    """Registries: where the publishers, applications and subscribers of a dataset find
    each other (:class:`wormhole.plugins.components.DatasetRegistry`)."""
    return []


class CommandLine(Protocol):
    """What a plugin's command may ask of the command line (``wormhole_commands``' ``cli``)."""

    def load_pipeline(self, path: str) -> PipelineView:
        """The pipeline file ``path``, read and validated, as a run of it would use it
        (:class:`wormhole.plugins.views.PipelineView`: ``source``, ``transport``,
        ``applications``, each component's validated ``options``). Raises
        :class:`wormhole.core.errors.ConfigError` naming every problem. Outside a command,
        :func:`wormhole.plugins.engine.load_pipeline` does the same."""


@hookspec
def wormhole_commands(commands: Any, cli: CommandLine) -> None:
    """Add subcommands to the ``wormhole`` command line.

    Called once when the command line is built. ``commands`` is the argparse
    sub-parsers object: call ``commands.add_parser(NAME, help=...)``, add arguments,
    and ``set_defaults(func=FUNCTION)``; ``FUNCTION(args)`` runs the command and
    returns its exit code. ``cli`` (:class:`CommandLine`, optional in an
    implementation's arguments) loads a pipeline file as the built-in commands do.
    Raise :class:`wormhole.core.errors.WormholeError` (or ``ConfigError``) for errors
    the user can fix: the CLI prints them without a traceback. Built-in examples: every
    command of ``wormhole/cli/`` (a module each), and ``wormhole search`` (the search
    connector). Return value ignored.
    """


@hookspec
def wormhole_pipeline_started(pipeline: PipelineView) -> None:
    """Called after the publisher opened its state and source, before delivery starts.

    ``pipeline`` is the validated pipeline, as :class:`wormhole.plugins.views.PipelineView`
    promises it.
    Return value ignored.
    """


@hookspec
def wormhole_pipeline_stopped(pipeline: PipelineView, summary: Any) -> None:
    """Called after a run ended cleanly and datamarkers were persisted.

    ``summary`` is the :class:`wormhole.core.publisher.RunSummary`. Return value ignored.
    """


@hookspec
def wormhole_publisher_opened(publisher: Any) -> None:
    """Called as a publisher's run starts, before it opens its state dir.

    ``publisher`` is the running publisher, read-only for plugins: ``pipeline`` (see
    :func:`wormhole_pipeline_started`), and, once each exists, ``hub`` (applications and
    their flows), ``publisher_log``, ``tailer``, ``caravans``, ``source``, ``backfiller``,
    and ``snapshot`` (the :class:`wormhole.core.snapshot.RunSnapshot` the publisher takes
    every datamarker interval; its ``metrics`` is the address the process serves metrics
    on, for a plugin that serves them to set). Read them when asked (a metrics scrape),
    never on the path of an update. The built-in observability plugin
    (:mod:`wormhole.observability`) serves Prometheus metrics from it. A plugin that raises
    fails the run. Return value ignored.
    """


@hookspec
def wormhole_publisher_snapshot(publisher: Any, snapshot: dict[str, Any]) -> None:
    """Called every datamarker interval (and as the run ends) with the publisher's snapshot:
    plain data (caravans, applications with their counts, rates and lag, flows, failures,
    the progress of long work), what ``wormhole status`` shows. The built-in observability
    plugin writes it to ``<state_dir>/live.json``. Do not change it. Return value ignored.
    """


@hookspec
def wormhole_publisher_closed(publisher: Any) -> None:
    """Called as a publisher's run ends, however it ends (after a failure too), once for
    every :func:`wormhole_publisher_opened`. Return value ignored.
    """
