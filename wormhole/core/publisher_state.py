"""A publisher's state dir: created, locked to one process, its datamarker store opened and
checked against the pipeline (the shard count cannot change in place)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Any

from wormhole.core.errors import StateError, file_problem
from wormhole.core.pipeline import Pipeline
from wormhole.plugins.components import DatamarkerStore


def open_state(pipeline: Pipeline, cleanup: contextlib.ExitStack) -> DatamarkerStore:
    """Create and lock the state dir, open the datamarker store."""
    state_dir = pipeline.state_dir
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise file_problem(exc.filename or state_dir, exc, "create the state_dir") from exc
    cleanup.callback(os.close, lock_state_dir(pipeline))
    store: DatamarkerStore = pipeline.datamarker_store.create()
    store.open(pipeline.name, state_dir)
    cleanup.callback(store.close)
    return store


def lock_state_dir(pipeline: Pipeline) -> int:
    """One process per state dir: two would interleave one log and one set of datamarkers."""
    path = pipeline.state_dir / "lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise file_problem(path, exc, "lock the state_dir") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StateError(
            f"state_dir {pipeline.state_dir} is in use by another wormhole process "
            f"(pid {holder}); stop it, or give this pipeline another state_dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def check_meta(pipeline: Pipeline, store: Any) -> None:
    shards = store.get_meta("shards")
    if shards is not None and int(shards) != pipeline.shards:
        raise StateError(
            f"dataset.shards is {pipeline.shards} but the state in "
            f"{pipeline.state_dir} was built with {shards} shards; datamarkers are per "
            f"shard, so the count cannot change in place: set it back to {shards}, or use a "
            f"new state_dir"
        )
    store.set_meta("shards", str(pipeline.shards))
    store.set_meta("pipeline", pipeline.name)
