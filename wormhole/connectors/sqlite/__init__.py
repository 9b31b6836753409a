"""The built-in ``sqlite`` datamarker store: ``<state_dir>/state.db``."""

from __future__ import annotations

from wormhole.connectors.sqlite.store import SqliteDatamarkerStore
from wormhole.plugins.components import Capabilities, ComponentSpec, Options
from wormhole.plugins.hookspecs import hookimpl


class SqliteStoreOptions(Options):
    """Datamarkers in a SQLite file in the state dir."""

    filename: str = "state.db"


@hookimpl
def wormhole_datamarker_stores() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            kind="datamarker_store",
            name="sqlite",
            factory=lambda o: SqliteDatamarkerStore(o.filename),
            options=SqliteStoreOptions,
            description="Datamarkers in SQLite in the state dir (single-copy delivery).",
            default=True,
            capabilities=Capabilities(),
        )
    ]
