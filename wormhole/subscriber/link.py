"""One connection of a subscriber to one publisher: reconnected with backoff, the flows the
publisher assigned on it, its batches handed to the subscriber's handlers.

A transport's subscriber library derives its connection from :class:`Link` and supplies only
the connection itself: ``_serve(address)`` connects, then reads frames until the connection
ends (raising why), calling :meth:`Link.take_notice` for each change of the flows assigned
and :meth:`Link.take_batch` for each batch, and sending the acknowledgements they call for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from wormhole.core.backoff import Backoff
from wormhole.core.errors import WormholeError
from wormhole.core.update import Update
from wormhole.plugins.events import reconnecting

log = logging.getLogger("wormhole.subscriber")


class LinkOwner(Protocol):
    """What a link uses of its subscriber
    (:class:`~wormhole.subscriber.connected.ConnectedSubscriber`)."""

    reconnect: bool
    max_backoff: float
    give_up_s: float | None
    processed: int
    frame_appended_ns: int
    _stop: threading.Event
    _handling: threading.Lock
    _every_link: list[Link]
    _flow_epochs: dict[Any, int]

    def _flows_changed(self, assigned: list[Any], revoked: list[Any]) -> None: ...

    def _handle_for(self, datastore: str | None, updates: list[Any]) -> None: ...


class SubscriberRefused(WormholeError):
    """The publisher refused this subscriber for a reason retrying cannot fix."""


class SubscriberGaveUp(WormholeError):
    """No session with a publisher for ``give_up_s`` seconds."""


class ConnectionClosed(Exception):
    """The session ended (the publisher said so, or the subscriber stops): connect again."""


def why(exc: BaseException) -> str:
    """A connection failure, with what it likely means where that is clear."""
    if isinstance(exc, ConnectionRefusedError):
        return (
            f"{exc} (nothing listens there: is the publisher running, and is this the address "
            f"it listens on?)"
        )
    return str(exc)


class Link:
    """One connection of a subscriber: to one publisher (trying each address in turn)."""

    lost_errors: tuple[type[BaseException], ...] = ()
    """The transport's errors that mean the connection was lost (besides OSError and
    :class:`ConnectionClosed`): the link connects again."""

    def __init__(
        self,
        owner: LinkOwner,
        datastore: str | None,
        addresses: Callable[[], list[str]],
    ) -> None:
        self.owner = owner
        self.datastore = datastore
        """The publisher's datastore, with a registry (flows are then (datastore, shard))."""
        self.addresses = addresses
        self.retry = threading.Event()
        """Set to end a wait between attempts at once: the publisher registered again (or
        the subscriber stops)."""
        owner._every_link.append(self)
        if owner._stop.is_set():
            self.retry.set()
        self.assigned: set[int] = set()
        self.epochs: dict[int, int] = {}
        """The epoch each of its shards was assigned under."""
        self._connected = False
        """The current attempt has a session (the transport sets it once welcomed)."""

    def _flow(self, shard: int) -> Any:
        return shard if self.datastore is None else (self.datastore, shard)

    def flows(self) -> set[Any]:
        return {self._flow(s) for s in self.assigned}

    def _serve(self, address: str) -> None:  # pragma: no cover - each transport defines it
        """Connect to ``address`` and serve the session until it ends (raising why); return
        when the subscriber stops."""
        raise NotImplementedError

    def run(self) -> None:
        owner = self.owner
        stop = owner._stop
        backoff = Backoff(log, first=0.2, cap=owner.max_backoff, stop=self.retry)
        lost: tuple[type[BaseException], ...] = (OSError, ConnectionClosed, *self.lost_errors)
        attempt = 0
        since = time.monotonic()
        """When this link last had a session (or began)."""
        while not stop.is_set():
            addresses = self.addresses()
            if not addresses:
                if self.datastore is not None:
                    return  # the publisher left the registry
                raise ValueError("publishers: give at least one host:port")
            address = addresses[attempt % len(addresses)]
            attempt += 1
            self._connected = False
            try:
                self._serve(address)
                backoff.reset()
            except SubscriberRefused:
                raise
            except lost as exc:
                self._lose_shards()
                if stop.is_set():
                    return
                if not owner.reconnect:
                    raise
                if self._connected:
                    backoff.reset()  # it worked until now: retry soon
                    since = time.monotonic()
                # Through a registry, publishers come and go: only a fixed address gives up.
                give_up = owner.give_up_s if self.datastore is None else None
                if give_up is not None and time.monotonic() - since >= give_up:
                    raise SubscriberGaveUp(
                        f"publisher {address}: no session for {give_up:g}s ({why(exc)}); "
                        f"giving up (give_up_s)"
                    ) from None
                reconnecting(log.name)
                if not backoff.wait("publisher %s: %s; reconnecting in %.1fs", address, why(exc)):
                    if stop.is_set():
                        return
                    backoff.reset()  # its publisher registered again: try it now
                self.retry.clear()

    def _lose_shards(self) -> None:
        if self.assigned:
            with self.owner._handling:
                revoked = sorted(self.assigned)
                self.assigned.clear()
                self.owner._flows_changed([], [self._flow(s) for s in revoked])

    # -------------------------------------------------------- processing
    def take_notice(self, assigned: list[int], revoked: list[int], epoch: int) -> None:
        """The publisher assigned and revoked shards (under ``epoch``): the subscriber's
        flows change. The transport confirms the notice once this returns."""
        owner = self.owner
        with owner._handling:
            self.assigned.update(assigned)
            self.assigned.difference_update(revoked)
            for shard in assigned:
                self.epochs[shard] = epoch
                flow = self._flow(shard)
                if epoch > owner._flow_epochs.get(flow, 0):
                    owner._flow_epochs[flow] = epoch
            owner._flows_changed(
                [self._flow(s) for s in assigned], [self._flow(s) for s in revoked]
            )

    def take_batch(
        self, updates: list[Update], datamarkers: dict[int, int], appended_ns: int
    ) -> dict[int, int]:
        """Hand a batch's updates of the flows this link holds to the handlers (retrying
        until they take them); the datamarkers to acknowledge."""
        owner = self.owner
        with owner._handling:
            assigned = self.assigned
            if self.epochs and owner._flow_epochs:
                # A flow another copy now serves under a newer epoch: this copy's frames
                # of it are dropped (fenced), so they cannot interleave with the new ones.
                epochs, newest = self.epochs, owner._flow_epochs
                assigned = {s for s in assigned if epochs.get(s, 0) >= newest.get(self._flow(s), 0)}
            if updates and any(u.shard not in assigned for u in updates):
                # Only flows this subscriber owns: others are re-sent to their owner.
                updates = [u for u in updates if u.shard in assigned]
            if updates:
                owner.frame_appended_ns = appended_ns
                owner._handle_for(self.datastore, updates)
                owner.processed += len(updates)
        return {s: pos for s, pos in datamarkers.items() if s in assigned}


__all__ = [
    "ConnectionClosed",
    "Link",
    "LinkOwner",
    "SubscriberGaveUp",
    "SubscriberRefused",
    "why",
]
