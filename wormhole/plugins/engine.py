"""What a library started outside a command asks of the engine: a pipeline file loaded, a
publisher log read by range from its files, a dataset registry opened from a URL.

A plugin's hooks are handed what they need from the engine (a transport's ``PublisherView``, a
command's ``cli``, a ``SubscribeRequest``). A library that a program or another system starts
is handed nothing: ``KafkaSubscriber.from_pipeline(PATH, ...)``, the Spark data source (Spark
runs it, in executors that import it afresh), ``wormhole.Subscriber(registry=URL, ...)``. It
calls the functions of this module instead::

    from wormhole.plugins.engine import load_pipeline, log_range, read_log_range

    pipeline = load_pipeline("pipeline.yml")  # a PipelineView
    first, end = log_range(pipeline.state_dir / "log")
    for seq, update in read_log_range(pipeline.state_dir / "log", first, end): ...

The contract sits below the engine and does not import it. The engine implements
:class:`Engine` and installs it here (:func:`install`) when its module,
``wormhole.core.engine``, is imported; the first call in a process where nothing imported it
yet has the plugin manager load it (:func:`wormhole.plugins.manager.load_engine`). So these
functions work the same in a command, in a program, and in a fresh process.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from wormhole.core.errors import ConfigError
from wormhole.plugins.components import DatasetRegistry, InvalidEntry

if TYPE_CHECKING:
    from wormhole.core.update import Update
    from wormhole.plugins.views import ComponentView, PipelineView

log = logging.getLogger("wormhole.registry")

LogDir = str | os.PathLike[str]
"""A publisher log's directory: ``<state_dir>/log``."""

RawApplications = dict[str, dict[str, Any] | InvalidEntry]
"""A registry's applications by name: each one's mapping as in a pipeline file, or what is
wrong with it."""


class Engine(Protocol):
    """What the engine does for a library (installed with :func:`install`)."""

    def load_pipeline(self, path: str | os.PathLike[str]) -> PipelineView:
        """See :func:`load_pipeline`."""

    def log_range(self, log_dir: LogDir) -> tuple[int, int]:
        """See :func:`log_range`."""

    def read_log_range(self, log_dir: LogDir, start: int, end: int) -> Iterator[tuple[int, Update]]:
        """See :func:`read_log_range`."""

    def open_registry(
        self, registry: str | ComponentView, dataset: str, stop: threading.Event
    ) -> DatasetRegistry:
        """See :func:`open_registry`."""


_installed: Engine | None = None


def install(engine: Engine) -> None:
    """Make ``engine`` the one the functions of this module call (the engine installs its
    own when ``wormhole.core.engine`` is imported)."""
    global _installed
    _installed = engine


def engine() -> Engine:
    """The installed engine, loaded first if nothing installed one yet."""
    if _installed is None:
        from wormhole.plugins.manager import load_engine

        load_engine()
    if _installed is None:
        raise RuntimeError("wormhole.core.engine was imported but installed no engine")
    return _installed


def load_pipeline(path: str | os.PathLike[str]) -> PipelineView:
    """The pipeline file ``path``, read and validated, as a run of it would use it (its
    components resolved through the plugins installed here). Raises
    :class:`wormhole.core.errors.ConfigError` naming every problem."""
    return engine().load_pipeline(path)


def log_range(log_dir: LogDir) -> tuple[int, int]:
    """A publisher log's extent, read from its files without recovering or locking it (the
    publisher may be running): ``(first, end)``, the oldest retained seq and the seq after the
    last update (the range a reader may ask for)."""
    return engine().log_range(log_dir)


def read_log_range(log_dir: LogDir, start: int, end: int) -> Iterator[tuple[int, Update]]:
    """``(seq, update)`` for every update of the publisher log at ``log_dir`` with
    ``start <= seq < end``, in order, read from its files without recovering or locking it
    (the publisher may be running: only whole records are read). Every shard's updates come:
    a reader of one flow keeps those of its shard (and, for an application, those whose
    ``audience`` is empty or the application). Raises ``LookupError`` naming the range when
    part of it is no longer retained, or not written yet."""
    return engine().read_log_range(log_dir, start, end)


def open_registry(
    registry: str | ComponentView, dataset: str, stop: threading.Event
) -> DatasetRegistry:
    """The dataset registry ``registry`` opened for ``dataset``: a URL ``TYPE://HOSTS/ROOT``
    (``zookeeper://zk1:2181,zk2:2181/wormhole``: a component of type ``TYPE`` with options
    ``hosts`` and ``root``), or a pipeline's component (``pipeline.dataset_registry``).
    Connects as the registry does, retrying until ``stop`` is set; raises
    :class:`wormhole.core.errors.Stopped` if it was, and ``ConfigError`` for a URL or options
    that can never work. Close it when done."""
    return engine().open_registry(registry, dataset, stop)


def wait_for_application(
    registry: DatasetRegistry, dataset: str, name: str, stopped: Callable[[], bool]
) -> RawApplications | None:
    """The registered applications once ``name`` is among them (None if ``stopped()``
    first): a subscriber may start before its dataset's first publisher has registered
    the applications. The registry must hold them (an application store); a warning is
    logged while it waits."""
    store = registry.application_store()
    if store is None:
        raise ConfigError(f"{registry.describe()} holds no applications: {name} is in the file")
    seen: dict[str, RawApplications] = {}
    arrived = threading.Event()

    def changed(raw: RawApplications) -> None:
        seen["raw"] = raw
        if name in raw:
            arrived.set()

    store.watch_applications(changed)
    started = time.monotonic()
    warn_at = started + 10.0
    while not arrived.wait(0.5):
        if stopped():
            return None
        if time.monotonic() < warn_at:
            continue
        warn_at += 30.0
        known = ", ".join(sorted(seen.get("raw", {}))) or "none"
        log.warning(
            "application %s is not registered in %s for dataset %s (registered: %s) after "
            "%.0fs; waiting for it (a publisher of %s registers its file's applications, or "
            "add it with `wormhole apps add`)",
            name,
            registry.describe(),
            dataset,
            known,
            time.monotonic() - started,
            dataset,
        )
    return seen["raw"]
