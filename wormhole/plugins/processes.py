"""Moved to :mod:`wormhole.subscriber.processes`. Kept for plugins that import it from here."""

from __future__ import annotations

from wormhole.subscriber.processes import SubscriberProcesses

__all__ = ["SubscriberProcesses"]
