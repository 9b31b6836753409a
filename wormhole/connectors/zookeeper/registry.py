"""The ``zookeeper`` registry: the publishers, applications and subscribers of a dataset,
kept in ZooKeeper (through kazoo).

Znode layout::

    <root>/datasets/<dataset>/publishers/<node>                      ephemeral, JSON PublisherEntry fields
    <root>/datasets/<dataset>/status/<node>                          ephemeral, JSON status dict (publish_status)
    <root>/datasets/<dataset>/applications/<app>                     persistent, JSON mapping of the app (same keys as a pipeline file's applications.<app>)
    <root>/datasets/<dataset>/applications/<app>/subscribers/<instance>-<seq>   ephemeral sequential, JSON {instance, host, pid}
    <root>/datasets/<dataset>/serving/<datastore>/<app>              ephemeral, JSON ServingClaim {copy, epoch, host, pid}
    <root>/datasets/<dataset>/epochs/<datastore>/<app>               persistent counter: the last epoch handed out (JSON int)
    <root>/datasets/<dataset>/datamarkers/<datastore>/<app>          persistent, JSON {shard: {logical, version, epoch}}

where ``<node>`` is a publisher's :attr:`PublisherEntry.node`: ``<datastore>``, or
``<datastore>@<copy>`` for one copy of the datastore (multiple-copy delivery; each copy
registers and shares its status under its own node). Plus
``<root>/datasets/<dataset>/seeded``, a persistent marker created with the first
applications (:meth:`ZooKeeperRegistry.seed_applications`): a dataset is seeded from a
pipeline file once only, even when its applications were all removed since.

Ephemeral nodes go with the ZooKeeper session that created them. The registry remembers
every one it created; when the session expires and the client reconnects with a new
session, a thread of the registry's (never kazoo's state listener, which must not block)
creates them again -- except a status published before the session expired: it describes
the process before the loss (a copy that was serving, so ready to serve), and is created
again at the next :meth:`ZooKeeperRegistry.publish_status`. Watches are plain ZooKeeper watches that hand the work to the same
thread: it reads the current value, arms the watches again, and calls the watcher's
function when the value changed (and once after every reconnect, changed or not). The same
thread tells :meth:`ZooKeeperRegistry.watch_connection` watchers when the connection is
interrupted (``SUSPENDED``, ``LOST``) and back (``CONNECTED``).

Serving claims (multiple-copy delivery) are the exception: they are never created again.
A claim is made by one transaction that bumps the epochs counter (compare-and-set on its
version) and creates the serving node, so the counter moves only with a claim made; a save
of shared datamarkers is one transaction that checks the serving node's version and the
counter's version after this claim's bump (no claim since) with the write. When the
session expires the process forgets its claims; the copy learns it from
``watch_connection(False)`` and from ``watch_serving`` (the node is gone) and may claim
again, under a new epoch. A claim that cannot be checked (ZooKeeper unreachable when
saving) or whose creation was not confirmed is given up: the thread deletes its node once
ZooKeeper answers, if this session still holds it under that epoch.
"""  # noqa: E501

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from pydantic import Field, field_validator

from wormhole.core.errors import ConfigError, StateError, Stopped
from wormhole.plugins.components import (
    DatastoreHeld,
    InvalidEntry,
    Options,
    PublisherEntry,
    ServingClaim,
    SharedDatamarker,
    SubscriberEntry,
)

log = logging.getLogger("wormhole.zookeeper")

T = TypeVar("T")
Applications = dict[str, dict[str, Any] | InvalidEntry]

_UNSET: Any = object()


class ZooKeeperOptions(Options):
    """Where the registry's ZooKeeper ensemble is, and how long to wait for it."""

    hosts: str = Field(min_length=1, description="The ensemble: ``zk1:2181,zk2:2181``.")
    root: str = Field("/wormhole", description="The znode under which Wormhole keeps its data.")
    session_timeout_ms: int = Field(
        10_000,
        ge=2_000,
        description="ZooKeeper session timeout: how long after losing its connection a "
        "process's publishers and subscribers are dropped.",
    )
    connect_timeout_s: float = Field(
        15,
        gt=0,
        description="How long opening the registry (and an operation while ZooKeeper is "
        "unreachable) keeps retrying before giving up.",
    )

    @field_validator("root")
    @classmethod
    def _root_is_a_path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"must be an absolute znode path starting with '/' (not {value!r})")
        parts = value.strip("/").split("/") if value.strip("/") else []
        if any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"{value!r} is not a valid znode path")
        return value


def _check_name(what: str, name: str) -> None:
    if not name or "/" in name or name in (".", "..") or any(ord(c) < 32 for c in name):
        raise ConfigError(f"{what} {name!r} cannot be a znode name (no '/', not empty)")


def _check_node(datastore: str, copy_: str) -> None:
    """A publisher's node name ``datastore`` or ``datastore@copy`` must be unambiguous."""
    _check_name("datastore", datastore)
    if copy_:
        _check_name("copy", copy_)
    for what, name in (("datastore", datastore), ("copy", copy_)):
        if "@" in name:
            raise ConfigError(f"{what} {name!r} cannot hold '@' (it names a copy: datastore@copy)")


def _datastore_of(node: str, raw: dict[str, Any]) -> str:
    """The datastore of publisher node ``node`` (``datastore`` or ``datastore@copy``, the
    copy as the node's JSON says); ValueError if the name and the copy disagree."""
    copy_ = raw.get("copy", "")
    if not isinstance(copy_, str):
        raise ValueError(f"copy is {copy_!r}, not a str")
    if not copy_:
        return node
    datastore, at, named = node.rpartition("@")
    if not at or named != copy_ or not datastore:
        raise ValueError(f"copy {copy_!r} does not match the node's name {node!r}")
    return datastore


def _serving_claim(raw: dict[str, Any]) -> ServingClaim:
    """A serving node's JSON as a claim; ValueError naming a field of the wrong type."""
    copy_, epoch = raw.get("copy"), raw.get("epoch")
    if not isinstance(copy_, str):
        raise ValueError(f"copy is {copy_!r}, not a str")
    if not isinstance(epoch, int) or isinstance(epoch, bool):
        raise ValueError(f"epoch is {epoch!r}, not an int")
    return ServingClaim(**_field_values(ServingClaim, raw, copy=copy_, epoch=epoch))


def _encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def _decode_object(data: bytes | None) -> dict[str, Any]:
    """The JSON object in ``data``; ValueError saying what is wrong otherwise."""
    try:
        value = json.loads(data or b"")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object (a {type(value).__name__})")
    return value


def _field_values(cls: Any, raw: dict[str, Any], **fixed: Any) -> dict[str, Any]:
    """The fields of dataclass ``cls`` found in ``raw`` (unknown keys ignored), type-checked
    against the fields' defaults; ValueError naming a field of the wrong type."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in fixed:
            values[f.name] = fixed[f.name]
            continue
        if f.name not in raw:
            continue
        value = raw[f.name]
        default = f.default
        expected: type = type(default) if default is not dataclasses.MISSING else str
        if expected is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, expected)
        if not ok:
            raise ValueError(f"{f.name} is {value!r}, not a {expected.__name__}")
        values[f.name] = value
    return values


@dataclasses.dataclass
class _Owned:
    """An ephemeral node this process registered (or means to)."""

    path: str
    """The node's path; for a sequential node, the prefix until it is created."""
    data: bytes
    sequential: bool = False
    session: int | None = None
    """The session that created the node (None: not created yet, or gone with a session)."""
    synced: bool = False
    """Whether the node holds ``data``."""
    expiries: int = 0
    """How many sessions had expired when ``data`` was given (a status: see
    :meth:`ZooKeeperRegistry.publish_status`)."""


@dataclasses.dataclass(frozen=True)
class _Claim:
    """A serving claim this process made (:meth:`ZooKeeperRegistry.claim_serving`)."""

    path: str
    epoch: int
    session: int
    """The session that created the serving node: the claim goes with it."""
    version: int
    """The serving node's version when created (it is never changed)."""
    epochs_version: int
    """The epochs counter's version after this claim's bump: any later claim changes it."""


@dataclasses.dataclass
class _ConnectionWatch:
    fn: Callable[[bool], None]
    last: bool | None = None
    """What it was last told (None: nothing yet)."""


class _Watch(Generic[T]):
    """One watcher's function, the read behind it, and the last value it was given."""

    def __init__(
        self,
        registry: ZooKeeperRegistry,
        what: str,
        read: Callable[[Callable[[Any], None]], T],
        fn: Callable[[T], None],
    ) -> None:
        self.registry = registry
        self.what = what
        self.read = read
        self.fn = fn
        self.lock = threading.Lock()
        self.last: Any = _UNSET

    def trigger(self, event: Any = None) -> None:
        """A ZooKeeper watch fired (a kazoo thread): refresh from the registry's thread."""
        self.registry._schedule(self)

    def refresh(self, force: bool = False) -> None:
        with self.lock:
            value = self.read(self.trigger)
            if not force and value == self.last:
                return
            self.last = value
            try:
                self.fn(copy.deepcopy(value))
            except Exception:
                log.exception("a watcher of %s failed", self.what)


class ZooKeeperRegistry:
    """A :class:`wormhole.plugins.components.DatasetRegistry` in ZooKeeper."""

    def __init__(self, options: ZooKeeperOptions) -> None:
        self.options = options
        self.root = options.root.rstrip("/")
        self.dataset = ""
        self._client: Any = None
        self._connected = threading.Event()
        self._closed = False
        # The ephemeral nodes of this process: by datastore, by datastore, by (app, instance).
        self._publishers: dict[str, _Owned] = {}
        self._statuses: dict[str, _Owned] = {}
        self._subscribers: dict[tuple[str, str], _Owned] = {}
        self._orphans: list[str] = []
        """Nodes of ours that could not be deleted when unregistered (ZooKeeper was away)."""
        self._writes = threading.RLock()
        """Held while creating or updating this process's nodes (callers and the thread)."""
        self._watches: list[_Watch[Any]] = []
        self._cond = threading.Condition()
        self._pending: dict[int, _Watch[Any]] = {}
        self._reconnected = False
        self._resync = False
        self._thread: threading.Thread | None = None
        self._warned: set[tuple[str, int]] = set()
        # Serving claims (multiple-copy delivery): never made again after a session loss.
        self._claims_lock = threading.Lock()
        self._claims: dict[tuple[str, str], _Claim] = {}
        """The claims this process holds, by (application, datastore)."""
        self._abandoned: list[tuple[str, int, int]] = []
        """Serving nodes (path, epoch, session) this process gave up while it could not
        reach ZooKeeper, or may have created without hearing so: the thread deletes them
        (if still this session's, under that epoch) once it can."""
        self._parents: set[str] = set()
        """Parent paths of claims known to exist."""
        self._connection_watchers: list[_ConnectionWatch] = []
        self._connection_lock = threading.Lock()
        """Held while calling connection watchers, so they hear every change in order."""
        self._connection_events: list[bool] = []
        self._expiries = 0
        """Sessions of this process that expired: a status published before the last one
        is not created again (it reports on a time before the loss)."""

    # ------------------------------------------------------------------ paths
    @property
    def _base(self) -> str:
        return f"{self.root}/datasets/{self.dataset}"

    def _publisher_path(self, datastore: str) -> str:
        return f"{self._base}/publishers/{datastore}"

    def _status_path(self, datastore: str) -> str:
        return f"{self._base}/status/{datastore}"

    def _app_path(self, app: str) -> str:
        return f"{self._base}/applications/{app}"

    def _serving_path(self, app: str, datastore: str) -> str:
        return f"{self._base}/serving/{datastore}/{app}"

    def _epochs_path(self, app: str, datastore: str) -> str:
        return f"{self._base}/epochs/{datastore}/{app}"

    def _datamarkers_path(self, app: str, datastore: str) -> str:
        return f"{self._base}/datamarkers/{datastore}/{app}"

    def application_path(self, name: str) -> str:
        """Where an application lives, for messages: ``zookeeper HOSTS node PATH``."""
        return f"zookeeper {self.options.hosts} node {self._app_path(name)}"

    # ------------------------------------------------------------- lifecycle
    def describe(self) -> str:
        return f"zookeeper {self.options.hosts}{self.root}"

    def _unreachable(self) -> str:
        hosts = self.options.hosts
        return f"is ZooKeeper running at {hosts}? check registry.hosts"

    def open(self, dataset: str, stop: threading.Event) -> None:
        from kazoo.client import KazooClient
        from kazoo.retry import KazooRetry

        _check_name("dataset", dataset)
        self.dataset = dataset
        hosts = self.options.hosts
        try:
            client = KazooClient(
                hosts=hosts,
                timeout=self.options.session_timeout_ms / 1000,
                connection_retry=KazooRetry(max_tries=-1, delay=0.1, max_delay=2.0),
            )
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"registry.hosts {hosts!r}: {exc}") from None
        self._client = client
        client.add_listener(self._on_state)
        client.start_async()
        started = time.monotonic()
        deadline = started + self.options.connect_timeout_s
        next_warning = started + 1.0
        while not self._connected.wait(0.1):
            now = time.monotonic()
            if stop.is_set() or now >= deadline:
                self._client = None
                client.remove_listener(self._on_state)
                client.stop()
                client.close()
                if stop.is_set():
                    raise Stopped(f"stopped while connecting to the registry, ZooKeeper at {hosts}")
                raise StateError(
                    f"cannot connect to the registry, ZooKeeper at {hosts} (no answer within "
                    f"{self.options.connect_timeout_s:g}s): {self._unreachable()}"
                )
            if now >= next_warning:
                log.warning(
                    "cannot reach ZooKeeper at %s yet; retrying (%.0fs left)",
                    hosts,
                    deadline - now,
                )
                next_warning = now + min(5.0, 2 * (now - started))
        with self._cond:
            self._reconnected = False  # the first connection: nothing to register again
        try:
            self._retrying(
                "create the registry's nodes",
                lambda: [
                    self._do("ensure_path", f"{self._base}/{part}")
                    for part in ("publishers", "status", "applications")
                ],
                stop,
            )
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(
            target=self._run, name=f"wormhole-zookeeper-{dataset}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._cond.notify_all()
        client = self._client
        if client is None:
            return
        with self._writes:
            owned = [
                *self._publishers.values(),
                *self._statuses.values(),
                *self._subscribers.values(),
            ]
            sid = self._session_id()
            with self._claims_lock:
                claims = [c.path for c in self._claims.values() if c.session == sid]
                claims += [path for path, _, session in self._abandoned if session == sid]
                self._claims.clear()
                self._abandoned = []
            paths = [o.path for o in owned if o.session == sid] + self._orphans + claims
            self._publishers.clear()
            self._statuses.clear()
            self._subscribers.clear()
            self._orphans = []
            if self._connected.is_set():
                for path in paths:
                    try:
                        self._delete_own(path, sid, timeout=2.0)
                    except Exception as exc:  # goes with the session anyway
                        log.debug("could not delete %s: %r", path, exc)
        if self._thread is not None:
            self._thread.join(timeout=self.options.session_timeout_ms / 1000 + 1)
        client.remove_listener(self._on_state)
        try:
            client.stop()
        finally:
            client.close()
            self._client = None

    # ----------------------------------------------------------- operations
    def _errors(self) -> tuple[type[BaseException], ...]:
        """The errors that mean ZooKeeper cannot be reached (retry once connected)."""
        from kazoo.exceptions import (
            ConnectionClosedError,
            ConnectionLoss,
            OperationTimeoutError,
            SessionExpiredError,
        )

        return (
            ConnectionLoss,
            ConnectionClosedError,
            OperationTimeoutError,
            SessionExpiredError,
            self._client.handler.timeout_exception,
        )

    def _do(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """``client.<method>(...)``, waiting at most ``timeout`` for the answer (a request
        queued while disconnected may otherwise never be answered)."""
        client = self._client
        if client is None:
            from kazoo.exceptions import ConnectionClosedError

            raise ConnectionClosedError("the registry is closed")
        result = getattr(client, f"{method}_async")(*args, **kwargs)
        wait = timeout if timeout is not None else self.options.session_timeout_ms / 1000
        return result.get(timeout=wait)

    def _retrying(self, what: str, op: Callable[[], T], stop: threading.Event | None = None) -> T:
        """``op()``, again while ZooKeeper cannot be reached, up to ``connect_timeout_s``;
        then StateError (Stopped once ``stop`` is set)."""
        deadline = time.monotonic() + self.options.connect_timeout_s
        errors = self._errors()
        while True:
            if self._closed:
                raise StateError(f"cannot {what}: the registry ({self.describe()}) is closed")
            if stop is not None and stop.is_set():
                raise Stopped(f"stopped while trying to {what} in {self.describe()}")
            try:
                return op()
            except errors as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StateError(
                        f"cannot {what} in the registry: ZooKeeper at {self.options.hosts} "
                        f"did not answer for {self.options.connect_timeout_s:g}s "
                        f"({type(exc).__name__}): {self._unreachable()}"
                    ) from None
                log.warning(
                    "cannot %s: ZooKeeper at %s unreachable (%s); retrying",
                    what,
                    self.options.hosts,
                    type(exc).__name__,
                )
                self._connected.wait(min(remaining, 1.0))
                if self._connected.is_set():
                    time.sleep(min(0.1, max(remaining, 0)))

    def _delete_own(self, path: str, sid: int | None, timeout: float | None = None) -> None:
        """Delete ``path`` if session ``sid`` (this process's) holds it: a node of an
        earlier session may meanwhile be another process's."""
        from kazoo.exceptions import BadVersionError, NoNodeError

        try:
            stat = self._do("exists", path, timeout=timeout)
            if stat is not None and sid is not None and stat.ephemeralOwner == sid:
                self._do("delete", path, version=stat.version, timeout=timeout)
        except (NoNodeError, BadVersionError):
            pass

    def _session_id(self) -> int | None:
        client = self._client
        if client is None or not client.client_id:
            return None
        sid: int = client.client_id[0]
        return sid

    # ------------------------------------------------------------ our nodes
    def _holder(self, path: str, data: bytes | None) -> str:
        try:
            raw = _decode_object(data)
        except ValueError:
            return f"another process (node {path})"
        host = raw.get("host") or "?"
        pid = raw.get("pid") or "?"
        address = raw.get("address") or "none"
        return f"{host}:{pid} (address {address})"

    def _claim(self, owned: _Owned, sid: int | None) -> None:
        """Create ``owned``'s ephemeral node, or update it if this session holds it.
        StateError if another session holds it."""
        from kazoo.exceptions import NodeExistsError, NoNodeError

        for _ in range(5):
            try:
                self._do("create", owned.path, owned.data, ephemeral=True, makepath=True)
            except NodeExistsError:
                try:
                    data, stat = self._do("get", owned.path)
                except NoNodeError:
                    continue  # gone meanwhile: create it again
                if sid is None or stat.ephemeralOwner != sid:
                    raise DatastoreHeld(
                        self._held_message(owned.path, data),
                        self._entry_of(data),
                        owned.path,
                        self.options.session_timeout_ms / 1000.0,
                    ) from None
                try:
                    self._do("set", owned.path, owned.data, version=stat.version)
                except NoNodeError:
                    continue
            owned.session = sid
            owned.synced = True
            return
        raise StateError(f"node {owned.path} keeps appearing and disappearing; try again")

    def _entry_of(self, data: bytes | None) -> PublisherEntry | None:
        try:
            raw = _decode_object(data)
            return PublisherEntry(**_field_values(PublisherEntry, raw))
        except (ValueError, TypeError):
            return None

    def release_publisher(self, datastore: str, holder: PublisherEntry) -> bool:
        """Remove ``holder``'s registration: its publisher and status nodes, named by
        ``holder.node`` (``datastore`` or ``datastore@copy``)."""
        from kazoo.exceptions import BadVersionError, NoNodeError

        _check_name("datastore", datastore)
        node = holder.node
        released = False
        publisher = self._publisher_path(node)
        for path in (publisher, self._status_path(node)):
            try:
                data, stat = self._do("get", path)
            except NoNodeError:
                continue
            found = self._entry_of(data) if path == publisher else None
            if found is not None and (found.host, found.pid) != (holder.host, holder.pid):
                return False  # someone else's now
            if stat.ephemeralOwner == self._session_id():
                continue
            try:
                self._do("delete", path, version=stat.version)
                released = True
            except (NoNodeError, BadVersionError):
                pass
        return released

    def _held_message(self, path: str, data: bytes | None) -> str:
        kind = path.rsplit("/", 2)[-2]
        datastore, _, copy_ = path.rsplit("/", 1)[-1].partition("@")
        if copy_:
            datastore = f"{datastore} (copy {copy_})"
        what = "published" if kind == "publishers" else "reporting status"
        return (
            f"datastore {datastore} of dataset {self.dataset} is already {what} by "
            f"{self._holder(path, data)} — node {path}; stop that publisher or give this "
            f"one another datastore"
        )

    def _create_subscriber(self, app: str, owned: _Owned, sid: int | None) -> None:
        """Create (or find again) the ephemeral sequential node of a subscriber."""
        from kazoo.exceptions import NodeExistsError, NoNodeError

        app_path = self._app_path(app)
        parent = f"{app_path}/subscribers"
        instance = json.loads(owned.data)["instance"]
        # A create whose answer was lost may have made the node: adopt it.
        try:
            children = self._do("get_children", parent)
        except NoNodeError:
            children = []
        for child in children:
            if child.rsplit("-", 1)[0] == instance:
                stat = self._do("exists", f"{parent}/{child}")
                if stat is not None and sid is not None and stat.ephemeralOwner == sid:
                    owned.path = f"{parent}/{child}"
                    owned.session = sid
                    owned.synced = True
                    return
        for _ in range(5):
            try:
                self._do("create", parent, b"")
            except NodeExistsError:
                pass
            except NoNodeError:
                raise ConfigError(self._unknown_app(app)) from None
            try:
                path = self._do(
                    "create", f"{parent}/{instance}-", owned.data, ephemeral=True, sequence=True
                )
            except NoNodeError:
                continue  # the application went meanwhile, or its subscribers node
            owned.path = path
            owned.session = sid
            owned.synced = True
            return
        raise ConfigError(self._unknown_app(app))

    def _unknown_app(self, app: str) -> str:
        return (
            f"unknown application {app!r} of dataset {self.dataset} in {self.describe()}: "
            f"add it with `wormhole apps add`"
        )

    def _reregister(self) -> None:
        """Create again the nodes of ours that are missing (a new session) or stale."""
        sid = self._session_id()
        with self._writes:
            if self._closed:
                return
            for path in list(self._orphans):
                self._delete_own(path, sid)
                self._orphans.remove(path)
            if sid is not None:
                self._forget_claims(keep=sid)
                self._release_abandoned(sid)
            for kind, table in (("publisher", self._publishers), ("status", self._statuses)):
                for datastore, owned in table.items():
                    if owned.session == sid and owned.synced:
                        continue
                    if kind == "status" and owned.expiries != self._expiries:
                        continue  # from before the session expired: created once published
                    try:
                        self._claim(owned, sid)
                        log.info("registered %s %s again as %s", kind, datastore, owned.path)
                    except StateError as exc:
                        log.error("could not register %s again: %s", kind, exc)
            for (app, instance), owned in self._subscribers.items():
                if owned.session == sid:
                    continue
                try:
                    self._create_subscriber(app, owned, sid)
                    log.info("registered subscriber %s of %s again", instance, app)
                except ConfigError as exc:
                    log.error("could not register subscriber %s again: %s", instance, exc)

    # ------------------------------------------------------- state + thread
    def _on_state(self, state: str) -> None:
        """kazoo's connection listener: must not block."""
        if self._closed:
            return
        if state == "CONNECTED":
            with self._cond:
                self._connected.set()
                self._reconnected = True
                self._connection_events.append(True)
                self._cond.notify_all()
        elif state == "SUSPENDED":
            self._connected.clear()
            self._connection_changed(False)
            log.warning(
                "lost the connection to ZooKeeper at %s; reconnecting (registrations hold "
                "for the session timeout, %dms)",
                self.options.hosts,
                self.options.session_timeout_ms,
            )
        else:  # LOST
            self._connected.clear()
            self._expiries += 1
            # Serving claims went with the session: they are not made again.
            self._forget_claims(keep=None)
            self._connection_changed(False)
            log.warning(
                "the ZooKeeper session with %s expired: this process's registrations are "
                "gone until it reconnects and registers them again",
                self.options.hosts,
            )

    def _schedule(self, watch: _Watch[Any]) -> None:
        with self._cond:
            self._pending[id(watch)] = watch
            self._cond.notify_all()

    def _resync_later(self) -> None:
        """A registration could not be written now: the thread tries again."""
        with self._cond:
            self._resync = True
            self._cond.notify_all()

    def _run(self) -> None:
        errors = self._errors()
        backlog: list[_Watch[Any]] = []  # failed while connected: again after a pause
        pause = False
        while True:
            with self._cond:
                if pause:
                    self._cond.wait(timeout=1.0)
                    pause = False
                while not (
                    self._closed
                    or self._reconnected
                    or self._resync
                    or self._pending
                    or self._connection_events
                ):
                    if not self._cond.wait(timeout=1.0 if backlog else None):
                        break
                if self._closed:
                    return
                events, self._connection_events = self._connection_events, []
            if events:
                self._tell_connection(events)
            with self._cond:
                if self._closed:
                    return
                if not self._connected.is_set():
                    # Everything is registered and read again on CONNECTED.
                    self._reconnected = self._resync = False
                    self._pending.clear()
                    backlog = []
                    continue
                reconnected = self._reconnected
                resync = self._resync or reconnected
                self._reconnected = self._resync = False
                if reconnected:
                    watches = list(self._watches)
                else:
                    watches = list(self._pending.values())
                    watches += [w for w in backlog if w not in watches]
                self._pending.clear()
                backlog = []
            if resync:
                try:
                    self._reregister()
                except errors as exc:
                    log.debug("registering again interrupted: %r", exc)
                    self._resync = pause = True
                except Exception:
                    log.exception("registering again in %s failed", self.describe())
                    self._resync = pause = True
            for watch in watches:
                if self._closed:
                    return
                try:
                    watch.refresh(force=reconnected)
                except errors as exc:
                    log.debug("watch of %s interrupted: %r", watch.what, exc)
                    backlog.append(watch)
                except Exception:
                    log.exception("watch of %s failed", watch.what)
                    backlog.append(watch)

    def _watch(
        self, what: str, read: Callable[[Callable[[Any], None]], T], fn: Callable[[T], None]
    ) -> None:
        watch = _Watch(self, what, read, fn)
        with self._cond:
            self._watches.append(watch)
        try:
            if not self._connected.is_set():
                raise self._errors()[0]()
            watch.refresh()
        except self._errors() as exc:
            log.warning(
                "cannot read %s from ZooKeeper at %s now (%s); the watch starts once it "
                "is reachable",
                what,
                self.options.hosts,
                type(exc).__name__,
            )
            self._schedule(watch)

    def _warn_invalid(self, path: str, version: int, reason: str) -> None:
        if (path, version) not in self._warned:
            self._warned.add((path, version))
            log.warning("registry node %s skipped: %s", path, reason)

    # ------------------------------------------------------------ publishers
    def register_publisher(self, entry: PublisherEntry) -> None:
        _check_node(entry.datastore, entry.copy)
        node = entry.node
        path = self._publisher_path(node)
        data = _encode(dataclasses.asdict(entry))
        with self._writes:
            owned = self._publishers.get(node)
            if owned is None:
                owned = _Owned(path, data)
                self._publishers[node] = owned
                new = True
            else:
                owned.data, owned.synced, new = data, False, False
            try:
                if not self._connected.is_set():
                    raise self._errors()[0]("not connected")
                self._claim(owned, self._session_id())
            except StateError:
                if new:
                    del self._publishers[node]
                raise
            except self._errors() as exc:
                log.warning(
                    "cannot register publisher %s in ZooKeeper at %s now (%s); it is "
                    "registered once the registry is back",
                    node,
                    self.options.hosts,
                    type(exc).__name__,
                )
                self._resync_later()

    def _read_publishers(self, watcher: Callable[[Any], None] | None) -> list[PublisherEntry]:
        from kazoo.exceptions import NoNodeError

        parent = f"{self._base}/publishers"
        try:
            children = self._do("get_children", parent, watch=watcher)
        except NoNodeError:
            self._do("exists", parent, watch=watcher)
            return []
        entries: list[PublisherEntry] = []
        for child in sorted(children):
            path = f"{parent}/{child}"
            try:
                data, stat = self._do("get", path, watch=watcher)
            except NoNodeError:
                continue
            try:
                raw = _decode_object(data)
                entries.append(
                    PublisherEntry(
                        **_field_values(PublisherEntry, raw, datastore=_datastore_of(child, raw))
                    )
                )
            except (ValueError, TypeError) as exc:
                self._warn_invalid(path, stat.mzxid, str(exc))
        return entries

    def watch_publishers(self, fn: Callable[[list[PublisherEntry]], None]) -> None:
        self._watch(f"the publishers of {self.dataset}", self._read_publishers, fn)

    def publish_status(self, datastore: str, status: dict[str, Any]) -> None:
        _check_name("datastore", datastore)
        data = _encode(status)
        with self._writes:
            owned = self._statuses.get(datastore)
            if owned is None:
                owned = self._statuses[datastore] = _Owned(self._status_path(datastore), data)
            else:
                owned.data, owned.synced = data, False
            owned.expiries = self._expiries
            if not self._connected.is_set():
                return  # written once connected again
            try:
                self._claim(owned, self._session_id())
            except StateError as exc:
                del self._statuses[datastore]
                log.error("status not shared: %s", exc)
            except self._errors() as exc:
                log.debug("status of %s not shared now: %r", datastore, exc)
                self._resync_later()

    def statuses(self) -> dict[str, dict[str, Any]]:
        from kazoo.exceptions import NoNodeError

        parent = f"{self._base}/status"

        def read() -> dict[str, dict[str, Any]]:
            out: dict[str, dict[str, Any]] = {}
            try:
                children = self._do("get_children", parent)
            except NoNodeError:
                return out
            for child in sorted(children):
                try:
                    data, stat = self._do("get", f"{parent}/{child}")
                except NoNodeError:
                    continue
                try:
                    out[child] = _decode_object(data)
                except ValueError as exc:
                    self._warn_invalid(f"{parent}/{child}", stat.mzxid, str(exc))
            return out

        return self._retrying("read the publishers' status", read)

    # ---------------------------------------------------------- applications
    def holds_applications(self) -> bool:
        return True

    def seed_applications(self, raw: dict[str, Any]) -> bool:
        from kazoo.exceptions import NodeExistsError

        encoded = {name: self._encode_app(name, app) for name, app in raw.items()}
        parent = f"{self._base}/applications"
        marker = f"{self._base}/seeded"

        def seed() -> bool:
            if self._do("get_children", parent) or self._do("exists", marker) is not None:
                return False
            transaction = self._client.transaction()
            transaction.create(marker, b"")
            for name, data in encoded.items():
                transaction.create(f"{parent}/{name}", data)
            results = transaction.commit_async().get(timeout=self.options.session_timeout_ms / 1000)
            failures = [r for r in results if isinstance(r, Exception)]
            if not failures:
                return True
            if any(isinstance(r, NodeExistsError) for r in failures):
                return False  # another publisher seeded (or an application was added) first
            raise StateError(
                f"cannot store the applications in {self.describe()}: "
                + ", ".join(type(r).__name__ for r in failures)
            )

        return self._retrying("store the pipeline file's applications", seed)

    def _encode_app(self, name: str, raw: Any) -> bytes:
        _check_name("application", name)
        if not isinstance(raw, dict):
            raise ConfigError(f"application {name!r} must be a mapping, not {raw!r}")
        try:
            return _encode(raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"application {name!r} cannot be stored as JSON: {exc}") from None

    def _read_applications(self, watcher: Callable[[Any], None] | None) -> Applications:
        from kazoo.exceptions import NoNodeError

        parent = f"{self._base}/applications"
        try:
            children = self._do("get_children", parent, watch=watcher)
        except NoNodeError:
            if watcher is not None:
                self._do("exists", parent, watch=watcher)
            return {}
        out: Applications = {}
        for child in sorted(children):
            path = f"{parent}/{child}"
            try:
                data, _stat = self._do("get", path, watch=watcher)
            except NoNodeError:
                continue
            try:
                out[child] = _decode_object(data)
            except ValueError as exc:
                out[child] = InvalidEntry(path, str(exc))
        return out

    def applications(self) -> Applications:
        return self._retrying("read the applications", lambda: self._read_applications(None))

    def watch_applications(self, fn: Callable[[Applications], None]) -> None:
        self._watch(f"the applications of {self.dataset}", self._read_applications, fn)

    def put_application(self, name: str, raw: dict[str, Any]) -> None:
        from kazoo.exceptions import NodeExistsError, NoNodeError

        data = self._encode_app(name, raw)
        path = self._app_path(name)

        def put() -> None:
            while True:
                try:
                    self._do("create", path, data, makepath=True)
                    return
                except NodeExistsError:
                    pass
                try:
                    self._do("set", path, data)
                    return
                except NoNodeError:
                    continue  # removed meanwhile

        self._retrying(f"store application {name}", put)

    def remove_application(self, name: str) -> bool:
        _check_name("application", name)
        with self._writes:
            for key in [k for k in self._subscribers if k[0] == name]:
                del self._subscribers[key]
        return self._retrying(
            f"remove application {name}", lambda: self._delete_tree(self._app_path(name))
        )

    def _delete_tree(self, path: str) -> bool:
        """Delete ``path`` and everything under it; False if it did not exist."""
        from kazoo.exceptions import NoNodeError, NotEmptyError

        for _ in range(10):
            try:
                children = self._do("get_children", path)
            except NoNodeError:
                return False
            for child in children:
                self._delete_tree(f"{path}/{child}")
            try:
                self._do("delete", path)
                return True
            except NoNodeError:
                return False
            except NotEmptyError:
                continue  # a subscriber registered meanwhile
        raise StateError(f"cannot delete {path}: nodes keep appearing under it; try again")

    # ----------------------------------------------------------- subscribers
    def register_subscriber(self, application: str, entry: SubscriberEntry) -> None:
        _check_name("application", application)
        _check_name("subscriber instance", entry.instance)
        data = _encode({"instance": entry.instance, "host": entry.host, "pid": entry.pid})
        parent = f"{self._app_path(application)}/subscribers"
        key = (application, entry.instance)
        with self._writes:
            sid = self._session_id()
            owned = self._subscribers.get(key)
            if owned is not None and owned.session is not None and owned.session == sid:
                return  # registered already, in this session
            if owned is None:
                owned = _Owned(f"{parent}/{entry.instance}-", data, sequential=True)
            try:
                if not self._connected.is_set():
                    raise self._errors()[0]("not connected")
                if self._do("exists", self._app_path(application)) is None:
                    raise ConfigError(self._unknown_app(application))
                self._create_subscriber(application, owned, sid)
            except self._errors() as exc:
                log.warning(
                    "cannot register subscriber %s of %s in ZooKeeper at %s now (%s); it is "
                    "registered once the registry is back",
                    entry.instance,
                    application,
                    self.options.hosts,
                    type(exc).__name__,
                )
                self._resync_later()
            self._subscribers[key] = owned

    def unregister_subscriber(self, application: str, instance: str) -> None:
        with self._writes:
            owned = self._subscribers.pop((application, instance), None)
            if owned is None or owned.session is None:
                return
            sid = self._session_id()
            if owned.session != sid:
                return  # went with its session
            try:
                self._delete_own(owned.path, sid)
            except self._errors():
                self._orphans.append(owned.path)
                self._resync_later()

    def _read_subscribers(
        self, application: str, watcher: Callable[[Any], None] | None
    ) -> list[SubscriberEntry]:
        from kazoo.exceptions import NoNodeError

        app_path = self._app_path(application)
        parent = f"{app_path}/subscribers"
        if self._do("exists", app_path, watch=watcher) is None:
            return []
        if self._do("exists", parent, watch=watcher) is None:
            return []
        try:
            children = self._do("get_children", parent, watch=watcher)
        except NoNodeError:
            return []
        entries: list[SubscriberEntry] = []
        for child in children:
            path = f"{parent}/{child}"
            name, _, seq = child.rpartition("-")
            try:
                order = int(seq)
                data, stat = self._do("get", path)
            except ValueError:
                self._warn_invalid(path, 0, "not a sequential node <instance>-<seq>")
                continue
            except NoNodeError:
                continue
            try:
                raw = _decode_object(data)
                raw.setdefault("instance", name)
                entries.append(SubscriberEntry(**_field_values(SubscriberEntry, raw, order=order)))
            except (ValueError, TypeError) as exc:
                self._warn_invalid(path, stat.mzxid, str(exc))
        entries.sort(key=lambda e: e.order)
        return entries

    def watch_subscribers(
        self, application: str, fn: Callable[[list[SubscriberEntry]], None]
    ) -> None:
        self._watch(
            f"the subscribers of {application}",
            lambda watcher: self._read_subscribers(application, watcher),
            fn,
        )

    # -------------------------------------------- serving claims (multiple-copy)
    @property
    def _quick(self) -> float:
        """How long a claim operation waits for ZooKeeper: the publisher calls them about
        every second from its loop, which must not stall."""
        return min(2.0, self.options.session_timeout_ms / 2000)

    def _ensure_parent(self, path: str) -> None:
        parent = path.rsplit("/", 1)[0]
        if parent not in self._parents:
            self._do("ensure_path", parent, timeout=self._quick)
            self._parents.add(parent)

    def _epoch_value(self, path: str, data: bytes | None) -> int:
        try:
            value = json.loads(data or b"")
        except (ValueError, UnicodeDecodeError):
            value = None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise StateError(
                f"the epochs counter znode {path} holds {data!r}, not a JSON integer: fix or "
                f"delete it (in {self.describe()})"
            )
        return value

    def claim_serving(self, application: str, datastore: str, copy: str) -> int | None:
        """The serving node is created in one transaction with the bump of the epochs
        counter (a compare-and-set on its version): the counter moves only with a claim
        made, so its version after the bump fences every later write of the claim."""
        from kazoo.exceptions import (
            BadVersionError,
            NodeExistsError,
            NoNodeError,
            RolledBackError,
        )

        _check_name("application", application)
        _check_name("datastore", datastore)
        _check_name("copy", copy)
        key = (application, datastore)
        serving = self._serving_path(application, datastore)
        epochs = self._epochs_path(application, datastore)
        sid = self._session_id()
        if not self._connected.is_set() or sid is None:
            return None
        errors = self._errors()
        epoch = 0
        try:
            for _ in range(10):
                if self._do("exists", serving, timeout=self._quick) is not None:
                    return None  # held (perhaps by this process, under another epoch)
                self._ensure_parent(serving)
                self._ensure_parent(epochs)
                try:
                    data, stat = self._do("get", epochs, timeout=self._quick)
                    last, version = self._epoch_value(epochs, data), stat.version
                except NoNodeError:
                    last, version = 0, None
                epoch = last + 1
                node = _encode(
                    {"copy": copy, "epoch": epoch, "host": socket.gethostname(), "pid": os.getpid()}
                )
                transaction = self._client.transaction()
                if version is None:
                    transaction.create(epochs, _encode(epoch))
                else:
                    transaction.set_data(epochs, _encode(epoch), version=version)
                transaction.create(serving, node, ephemeral=True)
                results = transaction.commit_async().get(timeout=self._quick)
                counter, created = results
                if not isinstance(counter, Exception) and not isinstance(created, Exception):
                    claim = _Claim(serving, epoch, sid, 0, 0 if version is None else version + 1)
                    with self._claims_lock:
                        self._claims[key] = claim
                    return epoch
                if isinstance(created, NodeExistsError):
                    return None
                if isinstance(counter, NoNodeError) and version is None:
                    self._parents.discard(epochs.rsplit("/", 1)[0])  # removed meanwhile
                    continue
                if isinstance(counter, BadVersionError | NodeExistsError | NoNodeError):
                    continue  # another claim moved the counter meanwhile: read it again
                if isinstance(created, NoNodeError):
                    self._parents.discard(serving.rsplit("/", 1)[0])  # removed meanwhile
                    continue
                failed = [r for r in results if not isinstance(r, RolledBackError)]
                raise StateError(f"cannot claim {serving}: {failed}")
        except errors as exc:
            # The claim may have been made without this process hearing so: give it up.
            log.debug("claim of %s interrupted: %r", serving, exc)
            if epoch:
                self._abandon(None, serving, epoch, sid)
            return None
        raise StateError(f"cannot claim {serving}: the epochs counter {epochs} keeps changing")

    def release_serving(self, application: str, datastore: str, epoch: int) -> None:
        from kazoo.exceptions import BadVersionError, NoNodeError

        _check_name("application", application)
        _check_name("datastore", datastore)
        key = (application, datastore)
        path = self._serving_path(application, datastore)
        with self._claims_lock:
            claim = self._claims.get(key)
            if claim is not None and claim.epoch == epoch:
                del self._claims[key]
            else:
                claim = None
        sid = self._session_id()  # None while disconnected
        if sid is None or not self._connected.is_set():
            if claim is not None:
                self._abandon(None, path, epoch, claim.session)
            return
        try:
            self._delete_claim(path, epoch, sid)
        except self._errors():
            self._abandon(None, path, epoch, sid)
        except (NoNodeError, BadVersionError):
            pass

    def _delete_claim(self, path: str, epoch: int, sid: int) -> bool:
        """Delete serving node ``path`` if session ``sid`` holds it under ``epoch``; whether
        it did."""
        from kazoo.exceptions import BadVersionError, NoNodeError

        try:
            data, stat = self._do("get", path, timeout=self._quick)
            if stat.ephemeralOwner != sid or self._claim_epoch(data) != epoch:
                return False
            self._do("delete", path, version=stat.version, timeout=self._quick)
            return True
        except (NoNodeError, BadVersionError):
            return False

    @staticmethod
    def _claim_epoch(data: bytes | None) -> int | None:
        try:
            epoch = _decode_object(data).get("epoch")
        except ValueError:
            return None
        return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None

    def _abandon(self, key: tuple[str, str] | None, path: str, epoch: int, sid: int) -> None:
        """Give up a claim that cannot be checked or deleted now: the thread deletes its node
        once ZooKeeper answers (if this session still holds it under ``epoch``)."""
        with self._claims_lock:
            if key is not None:
                claim = self._claims.get(key)
                if claim is not None and claim.epoch == epoch:
                    del self._claims[key]
            if (path, epoch, sid) not in self._abandoned:
                self._abandoned.append((path, epoch, sid))
        self._resync_later()

    def _forget_claims(self, keep: int | None) -> None:
        """Forget the claims of every session but ``keep`` (gone with their session)."""
        with self._claims_lock:
            for key, claim in list(self._claims.items()):
                if claim.session != keep:
                    log.warning(
                        "the serving claim %s (epoch %d) went with its ZooKeeper session",
                        claim.path,
                        claim.epoch,
                    )
                    del self._claims[key]
            self._abandoned = [a for a in self._abandoned if a[2] == keep]

    def _release_abandoned(self, sid: int | None) -> None:
        with self._claims_lock:
            abandoned = list(self._abandoned)
        for path, epoch, session in abandoned:
            if session == sid and sid is not None and self._delete_claim(path, epoch, sid):
                log.info("gave up the serving claim %s (epoch %d)", path, epoch)
            with self._claims_lock:
                if (path, epoch, session) in self._abandoned:
                    self._abandoned.remove((path, epoch, session))

    def _read_serving(
        self, path: str, watcher: Callable[[Any], None] | None
    ) -> ServingClaim | None:
        from kazoo.exceptions import NoNodeError

        for _ in range(10):
            try:
                data, stat = self._do("get", path, watch=watcher)
            except NoNodeError:
                if self._do("exists", path, watch=watcher) is None:
                    return None
                continue  # created meanwhile
            try:
                return _serving_claim(_decode_object(data))
            except ValueError as exc:
                self._warn_invalid(path, stat.mzxid, str(exc))
                return ServingClaim(copy="", epoch=0)  # held, by something unreadable
        raise StateError(f"node {path} keeps appearing and disappearing")

    def watch_serving(
        self, application: str, datastore: str, fn: Callable[[ServingClaim | None], None]
    ) -> None:
        _check_name("application", application)
        _check_name("datastore", datastore)
        path = self._serving_path(application, datastore)
        self._watch(
            f"the serving claim of {application} on {datastore}",
            lambda watcher: self._read_serving(path, watcher),
            fn,
        )

    def _decode_datamarkers(self, path: str, data: bytes | None) -> dict[int, SharedDatamarker]:
        if not data:
            return {}
        out: dict[int, SharedDatamarker] = {}
        try:
            raw = _decode_object(data)
            for shard, value in raw.items():
                try:
                    number = int(shard)
                except ValueError:
                    raise ValueError(f"shard {shard!r} is not a number") from None
                if not isinstance(value, dict):
                    raise ValueError(f"shard {shard}: not a JSON object")
                logical = value.get("logical", "")
                version = value.get("version")
                epoch = value.get("epoch", 0)
                if not isinstance(logical, str):
                    raise ValueError(f"shard {shard}: logical is {logical!r}, not a string")
                if not isinstance(version, list) or not all(
                    isinstance(v, int) and not isinstance(v, bool) for v in version
                ):
                    raise ValueError(f"shard {shard}: version is {version!r}, not a list of ints")
                if not isinstance(epoch, int) or isinstance(epoch, bool):
                    raise ValueError(f"shard {shard}: epoch is {epoch!r}, not an int")
                out[number] = SharedDatamarker(logical, tuple(version), epoch)
        except ValueError as exc:
            raise StateError(
                f"the shared datamarkers in znode {path} ({self.describe()}) cannot be read: {exc}"
            ) from None
        return out

    @staticmethod
    def _encode_datamarkers(datamarkers: dict[int, SharedDatamarker]) -> bytes:
        return _encode(
            {
                str(shard): {"logical": d.logical, "version": list(d.version), "epoch": d.epoch}
                for shard, d in sorted(datamarkers.items())
            }
        )

    def load_datamarkers(self, application: str, datastore: str) -> dict[int, SharedDatamarker]:
        from kazoo.exceptions import NoNodeError

        _check_name("application", application)
        _check_name("datastore", datastore)
        path = self._datamarkers_path(application, datastore)

        def load() -> dict[int, SharedDatamarker]:
            try:
                data, _stat = self._do("get", path)
            except NoNodeError:
                return {}
            return self._decode_datamarkers(path, data)

        return self._retrying(f"read the shared datamarkers of {application}", load)

    def save_datamarkers(
        self,
        application: str,
        datastore: str,
        epoch: int,
        datamarkers: dict[int, SharedDatamarker],
    ) -> bool:
        """One transaction checks that the serving node is unchanged and that no claim was
        made since this one (the epochs counter's version), and writes the datamarkers.
        False when the claim is not this session's under ``epoch`` any more; also when
        ZooKeeper cannot be reached now (never waiting long): the claim is then given up,
        its node deleted once ZooKeeper answers."""
        from kazoo.exceptions import (
            BadVersionError,
            NodeExistsError,
            NoNodeError,
            RolledBackError,
        )

        _check_name("application", application)
        _check_name("datastore", datastore)
        key = (application, datastore)
        serving = self._serving_path(application, datastore)
        epochs = self._epochs_path(application, datastore)
        path = self._datamarkers_path(application, datastore)
        with self._claims_lock:
            claim = self._claims.get(key)
        if claim is None or claim.epoch != epoch:
            return False
        sid = self._session_id()  # None while disconnected
        if sid is None or not self._connected.is_set():
            self._abandon(key, serving, epoch, claim.session)
            return False
        if claim.session != sid:
            self._fenced(key, claim, "it went with its ZooKeeper session")
            return False
        try:
            data, stat = self._do("get", serving, timeout=self._quick)
            if stat.ephemeralOwner != sid or self._claim_epoch(data) != epoch:
                self._fenced(key, claim, "its serving node is another's now")
                return False
            for _ in range(10):
                try:
                    data, stat = self._do("get", path, timeout=self._quick)
                    stored, version = self._decode_datamarkers(path, data), stat.version
                except NoNodeError:
                    stored, version = {}, None
                merged = self._encode_datamarkers({**stored, **datamarkers})
                transaction = self._client.transaction()
                transaction.check(serving, claim.version)
                transaction.check(epochs, claim.epochs_version)
                if version is None:
                    transaction.create(path, merged)
                else:
                    transaction.set_data(path, merged, version=version)
                results = transaction.commit_async().get(timeout=self._quick)
                failed = [r for r in results if isinstance(r, Exception)]
                if not failed:
                    return True
                held, fence, write = results
                if not isinstance(held, RolledBackError) or not isinstance(fence, RolledBackError):
                    self._fenced(key, claim, "its serving node or the epochs counter changed")
                    return False
                if isinstance(write, NoNodeError) and version is None:
                    self._parents.discard(path.rsplit("/", 1)[0])
                    self._ensure_parent(path)
                    continue
                if isinstance(write, BadVersionError | NodeExistsError | NoNodeError):
                    continue  # the datamarkers changed meanwhile: merge again
                raise StateError(f"cannot write {path}: {failed}")
        except self._errors() as exc:
            log.warning(
                "cannot share the datamarkers of %s in ZooKeeper at %s now (%s): its serving "
                "claim (epoch %d) is given up",
                application,
                self.options.hosts,
                type(exc).__name__,
                epoch,
            )
            self._abandon(key, serving, epoch, sid)
            return False
        except NoNodeError:
            self._fenced(key, claim, "its serving node is gone")
            return False
        raise StateError(f"cannot write {path}: it keeps changing")

    def _fenced(self, key: tuple[str, str], claim: _Claim, why: str) -> None:
        log.warning("the serving claim %s (epoch %d) is lost: %s", claim.path, claim.epoch, why)
        with self._claims_lock:
            if self._claims.get(key) == claim:
                del self._claims[key]

    # --------------------------------------------------------- the connection
    def watch_connection(self, fn: Callable[[bool], None]) -> None:
        watcher = _ConnectionWatch(fn)
        with self._connection_lock:
            self._connection_watchers.append(watcher)
            if self._connected.is_set():
                self._tell(watcher, True)

    def _connection_changed(self, connected: bool) -> None:
        """From kazoo's listener: the registry's thread tells the watchers."""
        with self._cond:
            self._connection_events.append(connected)
            self._cond.notify_all()

    def _tell_connection(self, events: list[bool]) -> None:
        with self._connection_lock:
            for connected in events:
                for watcher in list(self._connection_watchers):
                    self._tell(watcher, connected)

    @staticmethod
    def _tell(watcher: _ConnectionWatch, connected: bool) -> None:
        if watcher.last == connected:
            return
        watcher.last = connected
        try:
            watcher.fn(connected)
        except Exception:
            log.exception("a watcher of the registry connection failed")
