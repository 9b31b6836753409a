"""Stored datamarkers read by commands that only look (``status``, lag), through the
pipeline's datamarker store (the built-in one is the ``sqlite`` connector's)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from wormhole.plugins.components import Datamarker

# core.backfill_queue opens its SQLite file with these two, imported from here.
from wormhole.plugins.sqlite import connect_durable as connect_durable
from wormhole.plugins.sqlite import connect_read_only as connect_read_only


def load_stored(
    component: Any, pipeline: str, state_dir: Path
) -> dict[tuple[str, int], Datamarker]:
    """The stored datamarkers of a pipeline's store, opened read-only when the store can
    (``open_read_only``, optional for a store plugin), for commands that only look."""
    store = component.create()
    opener = getattr(store, "open_read_only", None) or store.open
    opener(pipeline, state_dir)
    try:
        markers: dict[tuple[str, int], Datamarker] = store.load()
        return markers
    finally:
        store.close()


def read_datamarkers(state_dir: Path) -> dict[tuple[str, int], Datamarker]:
    """Datamarkers of a state dir, read-only (for ``wormhole status``)."""
    path = state_dir / "state.db"
    if not path.exists():
        return {}
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT application, shard, position, logical FROM datamarkers")
        return {(a, s): Datamarker(a, s, p, lg) for a, s, p, lg in rows}
    except sqlite3.OperationalError:
        return {}  # created but not initialised yet
    finally:
        db.close()
