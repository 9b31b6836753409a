"""The deployment as a shared registry sees it: publishers (which copy serves what),
applications, subscribers, and every flow's datamarker and lag across publishers.

``wormhole status`` shows it; whatever else wants the whole picture reads it from here.
"""

from __future__ import annotations

import threading
from typing import Any

from wormhole.core.errors import WormholeError
from wormhole.core.lag import behind
from wormhole.core.pipeline import Pipeline
from wormhole.core.registry import open_registry
from wormhole.plugins.components import InvalidEntry


def shared(pipeline: Pipeline) -> bool:
    """Whether the pipeline's registry is shared across machines."""
    component = pipeline.dataset_registry
    return component is not None and component.capabilities.shared_registry


def open_shared_registry(pipeline: Pipeline, what: str) -> Any:
    """The pipeline's registry, opened, when it is shared across machines (else an error
    naming ``what`` needed it)."""
    component = pipeline.dataset_registry
    if component is None or not shared(pipeline):
        raise WormholeError(
            f"{what}: the applications of {pipeline.name} are in {pipeline.file} (no shared "
            f"registry configured): edit the file and send the publisher SIGHUP, or configure "
            f"registry: {{type: zookeeper, hosts: ..., root: ...}}"
        )
    return open_registry(component, pipeline.name, threading.Event())


def application_names(pipeline: Pipeline) -> tuple[set[str], str | None]:
    """The dataset's applications, and the registry holding them (None: the file)."""
    if not shared(pipeline):
        return set(pipeline.applications), None
    registry = open_shared_registry(pipeline, "registry")
    try:
        store = registry.application_store()
        if store is None:
            return set(pipeline.applications), None
        return set(store.applications()), str(registry.describe())
    finally:
        registry.close()


def shown_applications(raw: dict[str, Any]) -> dict[str, Any]:
    """Registered applications as shown: an unreadable entry is told apart from an
    application's mapping."""
    return {
        name: {"invalid": value.__dict__} if isinstance(value, InvalidEntry) else value
        for name, value in sorted(raw.items())
    }


def deployment(pipeline: Pipeline) -> dict[str, Any] | None:
    """The whole deployment as the shared registry sees it (None without one)."""
    if not shared(pipeline):
        return None
    registry = open_shared_registry(pipeline, "wormhole status")
    try:
        publishers: list[Any] = []
        # Watches fire at once with the current value (and again on changes): keep the last.
        registry.watch_publishers(lambda found: publishers.__setitem__(slice(None), found))
        statuses = registry.statuses()
        store = registry.application_store()
        raw = store.applications() if store is not None else {}
        names = sorted(set(raw) | set(pipeline.applications))
        claims = _serving_claims(registry, publishers, names)
        return {
            "registry": registry.describe(),
            "publishers": [_publisher(entry, statuses, claims) for entry in publishers],
            "applications": shown_applications(raw),
            "subscribers": _subscribers(registry, names),
            "flows": _flows(publishers, statuses),
        }
    finally:
        registry.close()


def _subscribers(registry: Any, names: list[str]) -> dict[str, list[str]]:
    """Each application's live subscriber instances."""
    subscribers: dict[str, list[str]] = {}
    for name in names:
        found: list[Any] = []
        registry.watch_subscribers(
            name, lambda entries, found=found: found.__setitem__(slice(None), entries)
        )
        subscribers[name] = [e.instance for e in found]
    return subscribers


def _serving_claims(
    registry: Any, publishers: list[Any], names: list[str]
) -> dict[tuple[str, str], Any]:
    """(application, datastore) -> the claim of the copy serving it."""
    claims: dict[tuple[str, str], Any] = {}
    serving_claims = registry.serving_claims()
    copied = {e.datastore for e in publishers if e.copy} if serving_claims else set()
    for datastore in sorted(copied):
        for name in names:
            serving_claims.watch_serving(
                name,
                datastore,
                lambda claim, key=(name, datastore): claims.__setitem__(key, claim),
            )
    return claims


def _publisher(
    entry: Any, statuses: dict[str, Any], claims: dict[tuple[str, str], Any]
) -> dict[str, Any]:
    copies = statuses.get(entry.node, {}).get("copies", {})
    # Which copy serves what: the claim, confirmed by the copy's own status (a copy holds
    # the claim a moment before it serves, and its status lags its release).
    serving = sorted(
        app
        for app in copies.get("serving", {})
        if (claim := claims.get((app, entry.datastore))) is not None and claim.copy == entry.copy
    )
    return {
        "datastore": entry.datastore,
        "copy": entry.copy,
        "serving": serving,
        "ready": sorted(name for name, ready in copies.get("copies_ready", {}).items() if ready),
        "address": entry.address,
        "host": entry.host,
        "pid": entry.pid,
        "alive": True,
        "status": entry.node in statuses,
    }


def _flows(publishers: list[Any], statuses: dict[str, Any]) -> list[dict[str, Any]]:
    """Every flow each publisher serves, with its datamarker and lag in that publisher's log
    (and the shared logical datamarker of a copy)."""
    flows = []
    for entry in publishers:
        status = statuses.get(entry.node, {})
        end = status.get("log", {}).get("end")
        copies = status.get("copies")
        for app, app_flows in sorted(status.get("flows", {}).items()):
            if copies is not None and app not in copies.get("serving", {}):
                continue  # a standby copy: the serving copy's flows are listed
            logical = (copies or {}).get("shared_datamarkers", {}).get(app, {})
            for flow in app_flows:
                marker = flow["datamarker"]
                flows.append(
                    {
                        "application": app,
                        "datastore": entry.datastore,
                        "copy": entry.copy,
                        "shard": flow["shard"],
                        "owner": flow["owner"],
                        "datamarker": marker,
                        "lag": None if end is None else behind(end, marker),
                        "logical": (logical.get(str(flow["shard"])) or [None])[0],
                    }
                )
    return flows
