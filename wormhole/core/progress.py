"""Moved to :mod:`wormhole.plugins.progress` (the plugin contract); these names stay
importable from here."""

from wormhole.plugins.progress import DEFAULT_INTERVAL_S, Progress, ProgressTask

__all__ = ["DEFAULT_INTERVAL_S", "Progress", "ProgressTask"]
