"""Registry: where the publishers, applications and subscribers of a dataset meet.

The publisher's side of it (:class:`PublisherMembership`): claim this publisher's datastore,
take the dataset's applications from the registry (seeded from the pipeline file by the
dataset's first publisher), tell the hub which datastores are live and which subscribers
each application has (so flows are spread over all of them), and share the live status.

Losing the registry is not an outage: the last known datastores and subscribers stand, the
publisher keeps serving its connected subscribers and keeps datamarkers locally; the
registry component registers again when it is back.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from wormhole.core.errors import ConfigError, Stopped
from wormhole.core.pipeline import Application, Component, Pipeline, parse_application
from wormhole.plugins.components import (
    DatasetRegistry,
    DatastoreHeld,
    InvalidEntry,
    PublisherEntry,
    SubscriberEntry,
)
from wormhole.plugins.engine import RawApplications, wait_for_application
from wormhole.plugins.views import ComponentView

log = logging.getLogger("wormhole.registry")


def open_registry(component: ComponentView, dataset: str, stop: threading.Event) -> DatasetRegistry:
    """Create and open the pipeline's registry component (:class:`Stopped` when ``stop`` is
    set before it is open: not a failure)."""
    registry: DatasetRegistry = component.create()
    registry.open(dataset, stop)
    if stop.is_set():
        registry.close()
        raise Stopped(f"stopped while connecting to {registry.describe()}")
    return registry


def registry_component(url: str, plugins: Any = None) -> Component:
    """A registry component from a URL: ``TYPE://HOSTS/ROOT``, e.g.
    ``zookeeper://zk1:2181,zk2:2181/wormhole`` is ``{type: zookeeper, hosts:
    "zk1:2181,zk2:2181", root: /wormhole}``."""
    from wormhole.core.pipeline import _component

    if plugins is None:
        from wormhole.plugins.manager import default_registry

        plugins = default_registry()
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc:
        raise ConfigError(
            f"registry {url!r}: expected TYPE://HOSTS/ROOT, e.g. "
            f"zookeeper://zk1:2181,zk2:2181/wormhole"
        )
    raw: dict[str, Any] = {"type": parts.scheme, "hosts": parts.netloc}
    if parts.path not in ("", "/"):
        raw["root"] = parts.path
    problems: list[str] = []
    component = _component(plugins, "registry", raw, "registry", problems)
    if component is None:
        raise ConfigError(problems)
    return component


def application_path(registry: DatasetRegistry, name: str) -> str:
    """Where an application lives in the registry, for messages."""
    store = registry.application_store()
    if store is None:
        return f"{registry.describe()}: application {name}"
    return store.application_path(name)


def registered_applications(
    pipeline: Pipeline, registry: DatasetRegistry, raw: RawApplications
) -> tuple[dict[str, Application], dict[str, str]]:
    """The registry's applications, validated: (the valid ones, problems of the others)."""
    apps: dict[str, Application] = {}
    problems: dict[str, str] = {}
    for name, value in sorted(raw.items()):
        if isinstance(value, InvalidEntry):
            problems[name] = f"{value.path}: {value.reason}"
            continue
        app, errors = parse_application(pipeline, name, value, application_path(registry, name))
        if app is None:
            problems[name] = "; ".join(errors)
        else:
            apps[name] = app
    return apps, problems


def subscriber_application(pipeline: Pipeline, name: str, library: str) -> Application:
    """The application ``wormhole subscribe --app NAME`` runs, from the registry when the
    registry holds applications (else from the file); it must have a sink."""
    from wormhole.core.pipeline import sink_application

    component = pipeline.dataset_registry
    if component is None or not component.capabilities.shared_registry:
        return sink_application(pipeline, name, library)[0]
    from wormhole.subscriber.handlers import stop_signalled

    registry = open_registry(component, pipeline.name, stop_signalled)
    try:
        store = registry.application_store()
        if store is None:
            return sink_application(pipeline, name, library)[0]
        raw = wait_for_application(registry, pipeline.name, name, stop_signalled.is_set)
        if raw is None:
            raise Stopped(f"stopped while waiting for application {name} to be registered")
        apps, problems = registered_applications(pipeline, registry, {name: raw[name]})
    finally:
        registry.close()
    if name in problems:
        raise ConfigError(problems[name], pipeline.file)
    app = apps[name]
    if app.sink is None:
        raise ConfigError(
            f"{application_path(registry, name)}: no sink; this application's subscribers are "
            f"programs using {library}",
            pipeline.file,
        )
    return app


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie, killed but not yet reaped by
    its parent, does not)."""
    if pid <= 0:
        return True  # unknown: assume it is
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # pid (comm) state ...: comm may hold spaces and parentheses
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


def advertised(address: str) -> str:
    """A listen address as others reach it: the host name for a wildcard host."""
    if not address:
        return ""
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::", ""):
        return f"{socket.gethostname()}:{port}"
    return address


class PublisherMembership:
    """A publisher in its dataset's registry."""

    def __init__(self, pipeline: Pipeline, stop: threading.Event) -> None:
        assert pipeline.dataset_registry is not None
        self.pipeline = pipeline
        self.registry = open_registry(pipeline.dataset_registry, pipeline.name, stop)
        self.entry = PublisherEntry(
            datastore=pipeline.datastore,
            shards=pipeline.shards,
            transport=pipeline.transport.type,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_ms=int(time.time() * 1000),
            copy=pipeline.copy,
        )
        self.lock = threading.Lock()
        self.pending: RawApplications | None = None
        """Applications as last seen in the registry, not yet applied."""
        self.changed = threading.Event()
        self.watched: dict[str, Callable[[], None] | None] = {}
        """What ends the subscriber watch of each application (None: being set up)."""
        self.reported: dict[str, str] = {}
        """Problems of registry applications already reported, by application."""
        self.hub: Any = None
        self._last_status = 0.0
        self._last_standing: tuple[Any, Any] = (None, None)
        """What the last shared status said this copy serves and could take over."""

    def claim(self, stop: threading.Event) -> None:
        """Claim this publisher's datastore (StateError if another publisher holds it).

        A registration left by a publisher of this host whose process is gone (killed with
        -9, say) is removed at once; one from another host may be a dead publisher whose
        registration has not expired yet: it is waited for, up to its expiry."""
        try:
            self._claim(stop)
        except BaseException:
            self.registry.close()
            raise

    def _claim(self, stop: threading.Event) -> None:
        deadline: float | None = None
        while True:
            try:
                self.registry.register_publisher(self.entry)
                return
            except DatastoreHeld as exc:
                holder = exc.holder
                if holder is not None and holder.host == self.entry.host:
                    if not _alive(holder.pid):
                        log.warning(
                            "datastore %s: replacing the registration of publisher pid %d of "
                            "this host, which is gone (%s)",
                            self.entry.datastore,
                            holder.pid,
                            exc.path,
                        )
                        self.registry.release_publisher(self.entry.datastore, holder)
                        continue
                    raise  # alive, here: a second publisher of the datastore
                if deadline is None:
                    deadline = time.monotonic() + exc.expiry_s + 2.0
                    log.warning(
                        "%s; waiting up to %.0fs in case that publisher is dead and its "
                        "registration has not expired yet",
                        exc,
                        exc.expiry_s + 2.0,
                    )
                if stop.is_set() or (time.monotonic() < deadline and stop.wait(0.5)):
                    raise Stopped(
                        f"stopped while waiting for datastore {self.entry.datastore} to be free"
                    ) from exc
                if time.monotonic() >= deadline:
                    raise

    # -------------------------------------------------------- applications
    def applications(self) -> tuple[dict[str, Application], dict[str, str]] | None:
        """The applications to run (valid ones, problems of the others), or None when the
        registry does not hold applications (the file's are used)."""
        registry = self.registry
        store = registry.application_store()
        if store is None:
            return None
        raw_file = self.pipeline.raw.get("applications") or {}
        if store.seed_applications(raw_file):
            log.info(
                "registered the applications of %s in %s: %s",
                self.pipeline.file,
                registry.describe(),
                ", ".join(sorted(raw_file)),
            )
        raw = store.applications()
        apps, problems = registered_applications(self.pipeline, registry, raw)
        self.reported = dict(problems)
        missing = sorted(set(raw_file) - set(raw))
        if missing:
            log.warning(
                "applications %s are in %s but not in %s: they do not run; add them with "
                "`wormhole apps add %s NAME --from-file`",
                ", ".join(missing),
                self.pipeline.file,
                registry.describe(),
                self.pipeline.file,
            )
        return apps, problems

    def _applications_changed(self, raw: RawApplications) -> None:
        with self.lock:
            self.pending = raw
        self.changed.set()

    def take_changes(self) -> tuple[dict[str, Application], dict[str, str]] | None:
        """Applications changed in the registry since the last call (None if not)."""
        if not self.changed.is_set():
            return None
        self.changed.clear()
        with self.lock:
            raw, self.pending = self.pending, None
        if raw is None:
            return None
        log.debug("applications changed in %s: %s", self.registry.describe(), sorted(raw))
        apps, problems = registered_applications(self.pipeline, self.registry, raw)
        # Each problem is reported once, not again on every change of another application.
        fresh = {n: p for n, p in problems.items() if self.reported.get(n) != p}
        self.reported = dict(problems)
        return apps, fresh

    # ---------------------------------------------------------------- hub
    def attach(self, hub: Any, address: str, protocol: int = 0) -> None:
        """Publish the transport's address; feed the hub datastores and subscribers."""
        self.hub = hub
        self.entry = dataclasses.replace(self.entry, address=advertised(address), protocol=protocol)
        self.registry.register_publisher(self.entry)
        self.registry.watch_publishers(self._publishers_changed)
        for name in list(hub.applications):
            self.watch_subscribers(name)
        store = self.registry.application_store()
        if store is not None:
            store.watch_applications(self._applications_changed)

    def watch_subscribers(self, application: str) -> None:
        with self.lock:
            if application in self.watched:
                return
            self.watched[application] = None

        def changed(entries: list[SubscriberEntry]) -> None:
            self.hub.set_registered(application, [e.instance for e in entries])

        unwatch = self.registry.watch_subscribers(application, changed)
        with self.lock:
            if application in self.watched:
                self.watched[application] = unwatch
                return
        unwatch()  # removed meanwhile

    def unwatch_subscribers(self, application: str) -> None:
        """The application was removed: its subscribers are not watched any more."""
        with self.lock:
            unwatch = self.watched.pop(application, None)
        if unwatch is not None:
            unwatch()

    def _publishers_changed(self, entries: list[PublisherEntry]) -> None:
        datastores = {e.datastore: e.shards for e in entries}
        self.hub.set_datastores(datastores)

    def publish_status(self, status: dict[str, Any], interval: float = 1.0) -> None:
        """Share the status about once every ``interval`` seconds, and at once when what
        this copy serves or could take over changed: another copy waits for that to hand
        it an application (a copy back from a partition is ready a moment after it
        reconnects)."""
        now = time.monotonic()
        copies = status.get("copies") or {}
        standing = (copies.get("serving"), copies.get("copies_ready"))
        if now - self._last_status < interval and standing == self._last_standing:
            return
        self._last_status = now
        self._last_standing = standing
        try:
            # By node: each copy of a datastore shares its own.
            self.registry.publish_status(self.entry.node, status)
        except Exception as exc:  # status only: never fatal
            log.debug("cannot share the status in %s: %s", self.registry.describe(), exc)

    def close(self) -> None:
        self.registry.close()


__all__ = [
    "PublisherMembership",
    "advertised",
    "open_registry",
    "registered_applications",
    "registry_component",
    "subscriber_application",
]
