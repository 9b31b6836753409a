"""Moved to :mod:`wormhole.subscriber` (the handler loop: :mod:`wormhole.subscriber.handlers`;
the in-process subscriber: :mod:`wormhole.subscriber.local`). Kept for plugins that import
it from here."""

from __future__ import annotations

from wormhole.subscriber.handlers import (
    MAX_BACKOFF,
    BatchHandler,
    Handlers,
    NoticeHandler,
    UpdatesHandler,
    catch_stop_signals,
    open_sink,
    run_handlers,
    stop_signalled,
)
from wormhole.subscriber.local import LocalSubscriber, local_subscriber

__all__ = [
    "MAX_BACKOFF",
    "BatchHandler",
    "Handlers",
    "LocalSubscriber",
    "NoticeHandler",
    "UpdatesHandler",
    "catch_stop_signals",
    "local_subscriber",
    "open_sink",
    "run_handlers",
    "stop_signalled",
]
