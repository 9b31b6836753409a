"""Registries: where the publishers, applications and subscribers of a dataset meet."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from wormhole.core.errors import StateError


@dataclass(frozen=True)
class PublisherEntry:
    """One live publisher of a dataset, as registered."""

    datastore: str
    """Which part of the dataset it publishes (the pipeline file's ``datastore``)."""
    address: str = ""
    """Where subscribers reach it (``host:port``; empty until its transport listens, or
    when its transport has no address: subscribers then read elsewhere)."""
    shards: int = 16
    protocol: int = 0
    """The subscriber protocol version it speaks (0: not applicable)."""
    transport: str = ""
    host: str = ""
    pid: int = 0
    started_ms: int = 0
    copy: str = ""
    """Which copy of the datastore it reads (multiple-copy delivery; "" for the only one)."""

    @property
    def node(self) -> str:
        """Its name among the dataset's publishers: ``datastore`` or ``datastore@copy``."""
        return f"{self.datastore}@{self.copy}" if self.copy else self.datastore


@dataclass(frozen=True)
class SubscriberEntry:
    """One live subscriber of an application, as registered."""

    instance: str
    order: int = 0
    """Registration order: the assignment spreads flows over subscribers in this order."""
    host: str = ""
    pid: int = 0


@dataclass(frozen=True)
class ServingClaim:
    """Which copy serves an application's flows of one datastore (multiple-copy delivery)."""

    copy: str
    epoch: int
    """Grows with every claim of (application, datastore): a fencing token."""
    host: str = ""
    pid: int = 0


@dataclass(frozen=True)
class SharedDatamarker:
    """A flow's datamarker as every copy of its datastore understands it: every update of
    the flow at or before ``version`` (the mapper's version of the update at ``logical``)
    was handled. Written by the serving copy under its claim's ``epoch``."""

    logical: str
    version: tuple[int, ...]
    epoch: int = 0


@dataclass(frozen=True)
class InvalidEntry:
    """Registry data that could not be read: where it is and what is wrong with it."""

    path: str
    reason: str


class DatastoreHeld(StateError):
    """Another publisher's registration holds the datastore (``register_publisher``)."""

    def __init__(
        self, message: str, holder: PublisherEntry | None, path: str, expiry_s: float
    ) -> None:
        super().__init__(message)
        self.holder = holder
        """The registration found (None if unreadable)."""
        self.path = path
        self.expiry_s = expiry_s
        """How long a dead holder's registration can outlive it (a session timeout)."""


class ApplicationStore(Protocol):
    """A dataset's applications as registry data, shared by all its publishers (a part of
    :class:`DatasetRegistry`: :meth:`DatasetRegistry.application_store`)."""

    def seed_applications(self, raw: dict[str, Any]) -> bool:
        """Store the pipeline file's applications if the dataset has none registered yet
        and was never seeded (its first publisher); True if it did."""

    def applications(self) -> dict[str, dict[str, Any] | InvalidEntry]:
        """The registered applications: name -> the application's mapping, as in the file."""

    def watch_applications(
        self, fn: Callable[[dict[str, dict[str, Any] | InvalidEntry]], None]
    ) -> None:
        """``fn(applications)`` with the registered applications, now and on every change."""

    def put_application(self, name: str, raw: dict[str, Any]) -> None:
        """Register (or replace) one application."""

    def remove_application(self, name: str) -> bool:
        """Remove an application and its subscribers' registrations; False if there was no
        such application."""

    def application_path(self, name: str) -> str:
        """Where an application lives, for messages: ``zookeeper HOSTS node PATH``."""


class ServingClaims(Protocol):
    """Serving claims and shared datamarkers, for multiple-copy delivery (a part of
    :class:`DatasetRegistry`: :meth:`DatasetRegistry.serving_claims`)."""

    def claim_serving(self, application: str, datastore: str, copy: str) -> int | None:
        """Become the copy serving ``application``'s flows of ``datastore``: the claim's
        epoch (greater than every earlier claim's), or None if another copy holds it. The
        claim lasts until released, or until this process's registration lapses (session
        loss): it is never taken again behind the caller's back."""

    def release_serving(self, application: str, datastore: str, epoch: int) -> None:
        """Give up the claim made with ``epoch`` (nothing if it is not held any more)."""

    def watch_serving(
        self, application: str, datastore: str, fn: Callable[[ServingClaim | None], None]
    ) -> Callable[[], None]:
        """``fn(claim)`` with the current claim (None: no copy serves), now and at each
        change; returns what ends the watch (``fn`` is not called after it returns)."""

    def load_datamarkers(self, application: str, datastore: str) -> dict[int, SharedDatamarker]:
        """The shared datamarkers of ``application``'s flows of ``datastore``, by shard."""

    def save_datamarkers(
        self,
        application: str,
        datastore: str,
        epoch: int,
        datamarkers: dict[int, SharedDatamarker],
    ) -> bool:
        """Store them (merged over the stored ones, by shard) if and only if this process
        still holds the claim made with ``epoch``, atomically with that check. False if it
        does not (fenced): nothing is written."""


class DatasetRegistry(Protocol):
    """Where the publishers, applications and subscribers of a dataset find each other.

    Every registry keeps the dataset's membership: live publishers and their status, live
    subscribers, and the connection itself. Two parts are optional, each offered through a
    method that returns it or None: :class:`ApplicationStore` (applications as registry
    data) and :class:`ServingClaims` (multiple-copy delivery).

    The built-in ``file`` registry is the pipeline file itself: one publisher, applications
    from the file (no store), subscribers not tracked, no serving claims. ``zookeeper``
    keeps everything in ZooKeeper (ephemeral nodes for publishers and subscribers, watches
    for changes) and offers both parts.

    Watch callbacks are called once with the current value when the watch is set, then on
    every change, from a thread of the registry's: they must not block. A registry survives
    losing its connection: entries are registered again and watches fire again once it is
    back; meanwhile the last values stand.
    """

    def open(self, dataset: str, stop: threading.Event) -> None:
        """Connect, retrying with backoff (a clear message naming where it connects) until
        connected or ``stop`` is set; a configuration that can never work raises
        ``ConfigError`` at once. Stopped, it may raise
        :class:`wormhole.core.errors.Stopped` or return (the caller then raises it)."""

    def describe(self) -> str:
        """Where it is, for messages: ``zookeeper 10.0.0.1:2181/wormhole``."""

    def close(self) -> None:
        """Unregister what this process registered and disconnect."""

    def watch_connection(self, fn: Callable[[bool], None]) -> None:
        """``fn(False)`` as soon as the registry connection is interrupted (claims may be
        lost meanwhile), ``fn(True)`` when it is back."""

    # the parts a registry may offer
    def application_store(self) -> ApplicationStore | None:
        """The dataset's applications as registry data; None when they are the pipeline
        file's."""

    def serving_claims(self) -> ServingClaims | None:
        """Serving claims and shared datamarkers; None when the registry cannot offer
        multiple-copy delivery."""

    # publishers
    def register_publisher(self, entry: PublisherEntry) -> None:
        """Claim ``entry.datastore`` for this process, or update the entry it already
        holds. Raises :class:`DatastoreHeld` naming the holder if another registration
        holds it."""

    def release_publisher(self, datastore: str, holder: PublisherEntry) -> bool:
        """Remove ``holder``'s registration of ``datastore`` (if it is still that one):
        for a holder known to be dead. True if it was removed."""

    def watch_publishers(self, fn: Callable[[list[PublisherEntry]], None]) -> None:
        """``fn(entries)`` with the live publishers of the dataset, by datastore."""

    def publish_status(self, datastore: str, status: dict[str, Any]) -> None:
        """Share a publisher's live status (flows, datamarkers, owners) for ``status``.

        A status reports on now: a registry that brings its registrations back after losing
        them (a session expiry) does not bring back a status published before the loss; it
        is shared again at the next call (publishers call this about once a second)."""

    def statuses(self) -> dict[str, dict[str, Any]]:
        """Every live publisher's last shared status, by datastore."""

    # subscribers
    def register_subscriber(self, application: str, entry: SubscriberEntry) -> None:
        """Register one live subscriber of ``application`` (ConfigError if unknown)."""

    def unregister_subscriber(self, application: str, instance: str) -> None: ...

    def watch_subscribers(
        self, application: str, fn: Callable[[list[SubscriberEntry]], None]
    ) -> Callable[[], None]:
        """``fn(entries)`` with the application's live subscribers in registration order,
        now and at each change; returns what ends the watch (``fn`` is not called after it
        returns)."""
