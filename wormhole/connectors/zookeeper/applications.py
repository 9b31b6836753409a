"""The application store: a dataset's applications as persistent nodes,
``applications/<app>``, each holding the application's mapping as JSON (the keys of a
pipeline file's ``applications.<app>``).

The dataset's first publisher seeds them from its pipeline file in one transaction that
also creates the ``seeded`` marker, so racing publishers store them once and a dataset
whose applications were all removed is not seeded again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from wormhole.connectors.zookeeper.nodes import Layout, check_name, decode_object, encode
from wormhole.connectors.zookeeper.session import Session
from wormhole.core.errors import ConfigError, StateError
from wormhole.plugins.components import InvalidEntry

RawApplications = dict[str, dict[str, Any] | InvalidEntry]


class Applications:
    """A dataset's applications in ZooKeeper."""

    def __init__(self, session: Session, layout: Layout) -> None:
        self.session = session
        self.layout = layout

    def path(self, name: str) -> str:
        """Where an application lives, for messages: ``zookeeper HOSTS node PATH``."""
        return f"zookeeper {self.session.options.hosts} node {self.layout.application(name)}"

    def seed(self, raw: dict[str, Any]) -> bool:
        from kazoo.exceptions import NodeExistsError

        encoded = {name: _encode_app(name, app) for name, app in raw.items()}
        layout, session = self.layout, self.session

        def seed() -> bool:
            if (
                session.do("get_children", layout.applications)
                or session.do("exists", layout.seeded) is not None
            ):
                return False
            transaction = session.client.transaction()
            transaction.create(layout.seeded, b"")
            for name, data in encoded.items():
                transaction.create(layout.application(name), data)
            failures = [r for r in session.commit(transaction) if isinstance(r, Exception)]
            if not failures:
                return True
            if any(isinstance(r, NodeExistsError) for r in failures):
                return False  # another publisher seeded (or an application was added) first
            raise StateError(
                f"cannot store the applications in {session.describe()}: "
                + ", ".join(type(r).__name__ for r in failures)
            )

        return session.retrying("store the pipeline file's applications", seed)

    def read(self, watcher: Callable[[Any], None] | None) -> RawApplications:
        out: RawApplications = {}
        for child, path, data, _stat in self.session.children(self.layout.applications, watcher):
            try:
                out[child] = decode_object(data)
            except ValueError as exc:
                out[child] = InvalidEntry(path, str(exc))
        return out

    def all(self) -> RawApplications:
        return self.session.retrying("read the applications", lambda: self.read(None))

    def watch(self, fn: Callable[[RawApplications], None]) -> None:
        self.session.dispatcher.watch(f"the applications of {self.layout.dataset}", self.read, fn)

    def put(self, name: str, raw: dict[str, Any]) -> None:
        from kazoo.exceptions import NodeExistsError, NoNodeError

        data = _encode_app(name, raw)
        path = self.layout.application(name)
        do = self.session.do

        def put() -> None:
            while True:
                try:
                    do("create", path, data, makepath=True)
                    return
                except NodeExistsError:
                    pass
                try:
                    do("set", path, data)
                    return
                except NoNodeError:
                    continue  # removed meanwhile

        self.session.retrying(f"store application {name}", put)

    def remove(self, name: str) -> bool:
        """Delete the application and its subscribers' nodes; False if there was none."""
        check_name("application", name)
        return self.session.retrying(
            f"remove application {name}", lambda: self._delete_tree(self.layout.application(name))
        )

    def _delete_tree(self, path: str) -> bool:
        """Delete ``path`` and everything under it; False if it did not exist."""
        from kazoo.exceptions import NoNodeError, NotEmptyError

        do = self.session.do
        for _ in range(10):
            try:
                children = do("get_children", path)
            except NoNodeError:
                return False
            for child in children:
                self._delete_tree(f"{path}/{child}")
            try:
                do("delete", path)
                return True
            except NoNodeError:
                return False
            except NotEmptyError:
                continue  # a subscriber registered meanwhile
        raise StateError(f"cannot delete {path}: nodes keep appearing under it; try again")


def _encode_app(name: str, raw: Any) -> bytes:
    check_name("application", name)
    if not isinstance(raw, dict):
        raise ConfigError(f"application {name!r} must be a mapping, not {raw!r}")
    try:
        return encode(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"application {name!r} cannot be stored as JSON: {exc}") from None
