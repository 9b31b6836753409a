"""Moved to :mod:`wormhole.subscriber.dead_letters` (the log itself:
:mod:`wormhole.subscriber.dead_letter_log`). Kept for plugins that import it from here."""

from __future__ import annotations

from wormhole.subscriber.dead_letters import *  # noqa: F403
from wormhole.subscriber.dead_letters import __all__ as __all__
