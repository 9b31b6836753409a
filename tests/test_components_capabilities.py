"""The capabilities record: what the built-ins declare, what a spec written before it gets
from its deprecated flags and its instance, and the checks on a declared record."""

from __future__ import annotations

from typing import Any

import pytest

from wormhole.plugins.components import (
    Capabilities,
    ComponentSpec,
    ComponentUse,
    NoOptions,
    capabilities_of,
    log_reader,
    offer,
    template_problems,
)
from wormhole.plugins.manager import BUILTIN_PLUGINS, default_registry

DECLARING = ("source", "transport", "datamarker_store", "registry")
"""The kinds whose components the engine treats by their record."""


def test_every_built_in_declares_its_record() -> None:
    registry = default_registry()
    undeclared = [
        f"{kind} {name}"
        for kind in DECLARING
        for name, registered in registry.components[kind].items()
        if registered.plugin in BUILTIN_PLUGINS and registered.spec.capabilities is None
    ]
    assert undeclared == []
    assert registry.components["source"]["postgres"].plugin in BUILTIN_PLUGINS
    specs = {
        (kind, name): registered.spec
        for kind in DECLARING
        for name, registered in registry.components[kind].items()
    }
    assert capabilities_of(specs["transport", "kafka"]).reads_log
    assert capabilities_of(specs["transport", "inprocess"]).requires_sink
    assert capabilities_of(specs["transport", "tcp"]).listens
    # The engine starts their subscriber processes; neither starts them itself.
    for transport in ("tcp", "kafka"):
        assert capabilities_of(specs["transport", transport]).subscriber_processes
    assert not capabilities_of(specs["transport", "inprocess"]).subscriber_processes
    assert capabilities_of(specs["transport", "tcp"]).remote_columns
    assert capabilities_of(specs["registry", "zookeeper"]).shared_registry
    assert not capabilities_of(specs["registry", "file"]).shared_registry
    for source in ("postgres", "mysql"):
        record = capabilities_of(specs["source", source])
        assert record.backfill and record.snapshot_pending and record.lag
    assert capabilities_of(specs["source", "filelog"]) == Capabilities(lag=True)


def test_the_built_in_database_sources_have_what_they_declare() -> None:
    from wormhole.connectors.mysql.source import MySQLSource
    from wormhole.connectors.postgres.source import PostgresSource
    from wormhole.plugins.components.capabilities import REQUIRES

    for cls in (MySQLSource, PostgresSource):
        for name in ("backfill", "snapshot_pending", "lag"):
            assert all(hasattr(cls, method) for method in REQUIRES[name]), (cls, name)


class _Old:
    """An instance of a component written before the record."""

    address = "127.0.0.1:7000"
    protocol_version = 3

    def lag(self) -> dict[str, float]:
        return {}

    def snapshot_pending(self) -> list[str]:
        return []


def test_a_spec_without_a_record_keeps_its_flags_and_what_its_instance_has() -> None:
    transport = ComponentSpec("transport", "old", lambda o: _Old(), reads_log=True)
    assert capabilities_of(transport) == Capabilities(reads_log=True)
    assert capabilities_of(transport, _Old()) == Capabilities(
        reads_log=True, listens=True, protocol=3, lag=True, snapshot_pending=True
    )
    sink_runner = ComponentSpec("transport", "old", lambda o: object(), requires_sink=True)
    assert capabilities_of(sink_runner, object()) == Capabilities(requires_sink=True)
    # `shared` meant one thing for a registry, another for a datamarker store.
    registry = ComponentSpec("registry", "old", lambda o: object(), shared=True)
    assert capabilities_of(registry) == Capabilities(shared_registry=True)
    store = ComponentSpec("datamarker_store", "old", lambda o: object(), shared=True)
    assert capabilities_of(store) == Capabilities(shared_datamarkers=True)


def test_a_declared_record_is_read_as_declared_and_checked_against_the_instance() -> None:
    declared = ComponentSpec(
        "source", "new", lambda o: _Old(), capabilities=Capabilities(backfill=True, lag=True)
    )
    assert capabilities_of(declared) == Capabilities(backfill=True, lag=True)
    with pytest.raises(TypeError, match=r"source 'new' declares .*backfill \(backfill_ready"):
        capabilities_of(declared, _Old())
    spawning = ComponentSpec(
        "transport", "new", lambda o: _Old(), capabilities=Capabilities(subscriber_processes=True)
    )
    with pytest.raises(TypeError, match=r"subscriber_processes \(subscriber_args\)"):
        capabilities_of(spawning, _Old())
    # What it does not declare is not looked for: its `address` is not read.
    quiet = ComponentSpec("transport", "new", lambda o: _Old(), capabilities=Capabilities())
    assert capabilities_of(quiet, _Old()) == Capabilities()


def test_a_record_and_the_deprecated_flags_together_are_an_error() -> None:
    with pytest.raises(TypeError, match="not also as the deprecated flags"):
        ComponentSpec(
            "transport", "both", lambda o: None, reads_log=True, capabilities=Capabilities()
        )


def test_the_declaring_helpers() -> None:
    spec = ComponentSpec("sink", "a", lambda o: None)
    hook = offer(spec)
    assert hook() == [spec] and hook() is not hook()
    with pytest.raises(TypeError, match="one kind"):
        offer(spec, ComponentSpec("source", "b", lambda o: None))
    sources, mappers = log_reader(
        "db",
        source=lambda o: None,
        options=NoOptions,
        description="a source",
        capabilities=Capabilities(lag=True),
        mapper=lambda o: None,
        mapper_description="its positions",
    )
    [source], [mapper] = sources(), mappers()
    assert (source.kind, source.name, source.capabilities) == (
        "source",
        "db",
        Capabilities(lag=True),
    )
    assert (mapper.kind, mapper.name, mapper.description) == (
        "position_mapper",
        "db",
        "its positions",
    )
    use = ComponentUse("applications.a.sink")
    values: dict[str, Any] = {"application": "a"}
    assert template_problems(use, "path", "{application}.x", "hint", **values) == []
    assert template_problems(use, "path", "{app}.x", "use {application}", **values) == [
        "applications.a.sink.path: '{app}.x' has an unknown placeholder ('app'); use {application}"
    ]
