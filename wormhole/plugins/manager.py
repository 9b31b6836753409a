"""The plugin manager and the component registry built from it."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from collections.abc import Iterable
from typing import Any

import pluggy

from wormhole.core.errors import ConfigError, WormholeError
from wormhole.plugins import hookspecs
from wormhole.plugins.components import KINDS, ComponentSpec, Kind, Registered

log = logging.getLogger("wormhole.plugins")

BUILTIN_PLUGINS = (
    "wormhole.connectors.filelog",
    "wormhole.connectors.jsonl",
    "wormhole.connectors.null",
    "wormhole.connectors.latest",
    "wormhole.connectors.inprocess",
    "wormhole.connectors.tcp",
    "wormhole.connectors.kafka",
    "wormhole.connectors.postgres",
    "wormhole.connectors.mysql",
    "wormhole.connectors.memcache",
    "wormhole.connectors.search",
    "wormhole.connectors.spark",
    "wormhole.connectors.sqlite",
    "wormhole.connectors.pipelinefile",
    "wormhole.connectors.zookeeper",
    "wormhole.plugins.filters",
    "wormhole.observability",
)

ENGINE = "wormhole.core.engine"
"""The engine's module: importing it installs the engine's implementation of the contract's
:class:`wormhole.plugins.engine.Engine` (loaded by name, as the built-in plugins are: the
contract sits below the engine)."""


def load_engine() -> None:
    """Install the engine (import :data:`ENGINE`) if it is not installed yet: for a library
    started outside a command, in a fresh process (a Spark executor)."""
    importlib.import_module(ENGINE)


_HOOK_BY_KIND: dict[Kind, str] = {
    "source": "wormhole_sources",
    "sink": "wormhole_sinks",
    "filter": "wormhole_filters",
    "transport": "wormhole_transports",
    "position_mapper": "wormhole_position_mappers",
    "datamarker_store": "wormhole_datamarker_stores",
    "registry": "wormhole_registries",
}


class PluginError(WormholeError):
    """A plugin could not be loaded or declares something invalid."""


DISTRIBUTION = "wormhole-cdc"
"""The name Wormhole is installed under (``pip install wormhole-cdc``; on PyPI ``wormhole`` is
another project). The package and the command are ``wormhole``."""


def builtin_version() -> str:
    """The installed version of Wormhole (an install made before the distribution was
    renamed is found under its old name, ``wormhole``)."""
    for name in (DISTRIBUTION, "wormhole"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "0+unknown"  # pragma: no cover - a source checkout, not installed


def create_plugin_manager(
    autoload: bool | None = None, extra_plugins: Iterable[Any] = ()
) -> pluggy.PluginManager:
    """A plugin manager with the built-ins, entry-point plugins and ``WORMHOLE_PLUGINS``."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in BUILTIN_PLUGINS:
        pm.register(importlib.import_module(name), name=name)
    if autoload is None:
        switch = os.environ.get("WORMHOLE_DISABLE_PLUGIN_AUTOLOAD", "").strip().lower()
        autoload = switch in ("", "0", "false", "no")
    if autoload:
        try:
            pm.load_setuptools_entrypoints(hookspecs.PROJECT)
        except Exception as exc:
            raise PluginError(
                f"a plugin in the 'wormhole' entry-point group failed to load: {exc!r}; "
                f"uninstall or fix it, or set WORMHOLE_DISABLE_PLUGIN_AUTOLOAD=1"
            ) from exc
    for name in filter(None, os.environ.get("WORMHOLE_PLUGINS", "").split(",")):
        name = name.strip()
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise PluginError(
                f"WORMHOLE_PLUGINS names {name!r}, which cannot be imported: {exc}"
            ) from exc
        if not pm.is_registered(module) and pm.get_plugin(name) is None:
            pm.register(module, name=name)
    for plugin in extra_plugins:
        pm.register(plugin)
    return pm


class Registry:
    """Every component, by kind and name, with the distribution that provides it."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm
        self.components: dict[Kind, dict[str, Registered]] = {kind: {} for kind in KINDS}
        dists: dict[int, tuple[str, str]] = {}
        for plugin, distinfo in pm.list_plugin_distinfo():
            dists[id(plugin)] = (distinfo.project_name, distinfo.version)
        builtin = (DISTRIBUTION, builtin_version())
        for kind in KINDS:
            hook = getattr(pm.hook, _HOOK_BY_KIND[kind])
            for impl in hook.get_hookimpls():
                plugin_name = pm.get_name(impl.plugin) or repr(impl.plugin)
                if plugin_name in BUILTIN_PLUGINS:
                    dist = builtin
                else:
                    dist = dists.get(id(impl.plugin), (plugin_name, ""))
                try:
                    specs = impl.function()
                except Exception as exc:
                    raise PluginError(
                        f"plugin {plugin_name} ({dist[0]}) failed in {impl.function.__name__}: "
                        f"{exc!r}"
                    ) from exc
                for spec in specs or []:
                    self._add(kind, spec, plugin_name, dist)

    def _add(self, kind: Kind, spec: ComponentSpec, plugin: str, dist: tuple[str, str]) -> None:
        if not isinstance(spec, ComponentSpec) or spec.kind != kind:
            raise PluginError(
                f"plugin {plugin} ({dist[0]}) returned {spec!r} from its {kind} hook; "
                f"expected ComponentSpec(kind={kind!r}, ...)"
            )
        if spec.default and (other := self.default_name(kind)) is not None:
            raise PluginError(
                f"{kind} {spec.name!r} of {dist[0]} and {other!r} of "
                f"{self.components[kind][other].distribution} both declare themselves the "
                f"default {kind.replace('_', ' ')}; only one may"
            )
        existing = self.components[kind].get(spec.name)
        if existing is not None:
            raise PluginError(
                f"{kind} {spec.name!r} is provided twice: by {existing.distribution} and by "
                f"{dist[0]}; uninstall one of them"
            )
        self.components[kind][spec.name] = Registered(spec, dist[0], dist[1], plugin)

    def default_name(self, kind: Kind) -> str | None:
        """The component used when a pipeline file names none of this kind."""
        for name, registered in self.components[kind].items():
            if registered.spec.default:
                return name
        return None

    def names(self, kind: Kind) -> list[str]:
        return sorted(self.components[kind])

    def get(self, kind: Kind, name: str, path: str = "") -> Registered:
        try:
            return self.components[kind][name]
        except KeyError:
            known = ", ".join(self.names(kind)) or "none"
            where = f"{path}: " if path else ""
            raise ConfigError(
                f"{where}unknown {kind.replace('_', ' ')} type {name!r} (known: {known})"
            ) from None

    def create(self, kind: Kind, name: str, options: Any) -> Any:
        return self.get(kind, name).spec.factory(options)


_default: Registry | None = None


def default_registry() -> Registry:
    """The process-wide registry (built on first use)."""
    global _default
    if _default is None:
        _default = Registry(create_plugin_manager())
    return _default


def reset_default_registry() -> None:
    """Forget the process-wide registry (tests that install plugins call this)."""
    global _default
    _default = None
