"""Wormhole: change data capture and reliable pub-sub.

Database logs become ordered, sharded, acknowledged streams of key-value updates,
delivered to many applications at once. See ``wormhole --help`` and docs/.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from wormhole.connectors.tcp.client import Subscriber, SubscriberGaveUp, SubscriberRefused
    from wormhole.core.update import Update
    from wormhole.plugins.components import Flow
    from wormhole.publish import LogWriter

__all__ = [
    "Flow",
    "LogWriter",
    "Subscriber",
    "SubscriberGaveUp",
    "SubscriberRefused",
    "Update",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # Lazy, so `import wormhole` stays cheap for plugins and the CLI.
    if name in ("Subscriber", "SubscriberGaveUp", "SubscriberRefused"):
        from wormhole.connectors.tcp import client

        return getattr(client, name)
    if name == "Flow":
        from wormhole.plugins.components import Flow

        return Flow
    if name == "Update":
        from wormhole.core.update import Update

        return Update
    if name == "LogWriter":
        from wormhole.publish import LogWriter

        return LogWriter
    raise AttributeError(f"module 'wormhole' has no attribute {name!r}")
