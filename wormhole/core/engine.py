"""The engine's side of :mod:`wormhole.plugins.engine`: what a library started outside a
command (``KafkaSubscriber.from_pipeline``, the Spark data source, ``wormhole.Subscriber``
with a registry) asks of the engine. Importing this module installs it there."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

from wormhole.core.offline_log import inspect_log, read_log_range
from wormhole.core.pipeline import load_pipeline
from wormhole.core.registry import open_registry, registry_component
from wormhole.core.update import Update
from wormhole.plugins import engine
from wormhole.plugins.components import DatasetRegistry
from wormhole.plugins.views import ComponentView, PipelineView


class Engine:
    """:class:`wormhole.plugins.engine.Engine`, by the engine's own functions."""

    def load_pipeline(self, path: str | os.PathLike[str]) -> PipelineView:
        return load_pipeline(path)

    def log_range(self, log_dir: str | os.PathLike[str]) -> tuple[int, int]:
        info = inspect_log(log_dir)
        return info.first_seq, info.next_seq

    def read_log_range(
        self, log_dir: str | os.PathLike[str], start: int, end: int
    ) -> Iterator[tuple[int, Update]]:
        return read_log_range(log_dir, start, end)

    def open_registry(
        self, registry: str | ComponentView, dataset: str, stop: threading.Event
    ) -> DatasetRegistry:
        component = registry_component(registry) if isinstance(registry, str) else registry
        return open_registry(component, dataset, stop)


engine.install(Engine())
