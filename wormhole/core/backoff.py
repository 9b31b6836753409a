"""The waits of a retry loop: exponential, capped, and cut short by a stop request.

One helper for every loop that retries what failed for a reason that may pass (a
server that went away, a full disk, a sink that refused a batch)::

    backoff = Backoff(log, first=0.5, cap=10.0, stop=context.stop)
    while True:
        try:
            return connect()
        except OSError as exc:
            if not backoff.wait("cannot connect (%s); retrying in %.1fs", exc):
                raise SourceError("stopped while connecting") from exc

Each wait is logged (what is retried, why, and for how long), so a retry never
happens silently.
"""

from __future__ import annotations

import logging
import threading

from wormhole.plugins.events import retried


class Backoff:
    """Waits that start at ``first`` seconds and double up to ``cap``.

    ``stop`` ends a wait at once (``wait`` then returns False); without it the waits
    are plain sleeps. ``level`` is the level of the log line each wait writes.
    """

    def __init__(
        self,
        log: logging.Logger,
        *,
        first: float,
        cap: float,
        stop: threading.Event | None = None,
        level: int = logging.WARNING,
    ) -> None:
        self.log = log
        self.first = first
        self.cap = cap
        self.stop = stop if stop is not None else threading.Event()
        self.level = level
        self.delay = first
        """The next wait, in seconds."""

    def wait(self, message: str, *args: object) -> bool:
        """Log why the next attempt waits, wait, and double the next wait (up to ``cap``).

        ``message`` is a %-format for the log line: ``args`` fill its placeholders,
        and its last placeholder takes the delay in seconds (``retrying in %.1fs``).
        Returns False when ``stop`` was set (give up), else True (try again).
        """
        delay = self.delay
        self.log.log(self.level, message, *args, delay)
        retried(self.log.name)
        if self.stop.wait(delay):
            return False
        self.delay = min(delay * 2, self.cap)
        return True

    def reset(self) -> None:
        """The next wait is ``first`` again (what was retried worked for a while)."""
        self.delay = self.first
