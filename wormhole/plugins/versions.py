"""Per-key versions of updates, derived from their source positions.

A sink that must not let a replay undo newer work (a subscriber restarting from
an older datamarker delivers again updates it already applied) keeps, for every
key, the version of the last update it applied, and skips an update whose
version is lower. :func:`version_of` gives that version: a tuple of integers,
compared element by element, that grows along each key's history.

The knowledge of what a position means belongs to the source that writes it: the
position mapper registered under the update's ``connector`` name
(:class:`wormhole.plugins.components.PositionMapper.version`) computes it, for the
built-in sources (see each connector's mapper) and for a third-party source
alike. An update whose connector has no mapper, or whose positions do not parse,
has no version: ``None``. Such updates are not comparable, so the last write wins.

:func:`version_number` packs a version into one integer below 2**63, for stores
that keep a single number per document (OpenSearch external versions).

Part of the plugin contract: a sink that writes idempotently by key (``search``,
``spark``, or a third party's) calls :func:`version_of` on each update.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError

from wormhole.core.update import Update
from wormhole.plugins.components import Version
from wormhole.plugins.manager import Registry, default_registry

_MINOR_BITS = 16
_MAJOR_LIMIT = 1 << (63 - _MINOR_BITS)

VersionFunction = Callable[[Update], Version | None]
_cache: tuple[Registry, dict[str, VersionFunction]] | None = None


def version_of(update: Update) -> Version | None:
    """The update's per-key version, or ``None`` when its positions are not comparable."""
    registry = default_registry()
    cache = _cache
    functions = cache[1] if cache is not None and cache[0] is registry else _load(registry)
    version = functions.get(update.connector)
    if version is None:
        return None
    try:
        return version(update)
    except (ValueError, IndexError):
        return None


def _load(registry: Registry) -> dict[str, VersionFunction]:
    """Each position mapper's ``version``, by connector name, built once per registry."""
    global _cache
    functions: dict[str, VersionFunction] = {}
    for name, registered in registry.components["position_mapper"].items():
        spec = registered.spec
        try:
            mapper = spec.factory(spec.options())
        except ValidationError:
            continue  # a mapper that cannot be built without its options gives no versions
        functions[name] = mapper.version
    _cache = (registry, functions)
    return functions


def is_older(version: Version | None, than: Version | None) -> bool:
    """Whether ``version`` is strictly older than ``than``; ``False`` if either is unknown."""
    return version is not None and than is not None and version < than


def version_number(version: Version | None) -> int | None:
    """The version as one integer below 2**63 that keeps its order, or ``None``.

    ``(a,)`` is ``a``; ``(a, b)`` is ``a * 2**16 + b`` when ``a < 2**47`` and
    ``b < 2**16`` (PostgreSQL: LSNs below 128 TiB of WAL and transactions of up
    to 65,535 changes; MariaDB: any realistic sequence number). Other versions
    (JSON-lines file positions, larger values) do not fit: ``None``.
    """
    if version is None or any(v < 0 for v in version):
        return None
    if len(version) == 1:
        return version[0] if version[0] < 1 << 63 else None
    if len(version) == 2:
        major, minor = version
        if major < _MAJOR_LIMIT and minor < 1 << _MINOR_BITS:
            return (major << _MINOR_BITS) | minor
    return None


__all__ = ["Version", "is_older", "version_number", "version_of"]
