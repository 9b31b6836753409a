"""Sinks (subscriber-side writers) and publisher-side filters."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from wormhole.core.update import Update


@dataclass
class SinkContext:
    """Where a sink instance runs: one per subscriber of an application."""

    pipeline: str
    application: str
    subscriber: int
    subscribers: int
    state_dir: Path
    log: logging.Logger


@runtime_checkable
class Sink(Protocol):
    """The subscriber-side writer of one application."""

    def open(self, context: SinkContext) -> None:
        """Open files or connections. Raise SinkError for a problem retrying cannot fix."""

    def write(self, updates: list[Update]) -> None:
        """Make ``updates`` durable, in order; the batch is acknowledged when this returns.

        Raising retries the same batch (with backoff); raising
        :class:`wormhole.core.errors.SinkError` stops the pipeline with its message.
        Updates may repeat after a crash (at-least-once): write idempotently by key.
        """

    def close(self) -> None:
        """Flush and release."""


# --------------------------------------------------------------------- filters
@runtime_checkable
class Filter(Protocol):
    """A publisher-side filter: updates it drops never leave the publisher."""

    def __call__(self, updates: list[Update]) -> list[Update]:
        """The updates to keep, in their order. Datamarkers advance past dropped ones."""
