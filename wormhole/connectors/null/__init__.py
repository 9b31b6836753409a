"""The ``null`` sink: acknowledges everything at once (benchmarks, dry runs)."""

from __future__ import annotations

from wormhole.core.update import Update
from wormhole.plugins.components import ComponentSpec, NoOptions, SinkContext
from wormhole.plugins.hookspecs import hookimpl


class NullSink:
    """Counts updates and drops them."""

    def __init__(self, options: NoOptions | None = None) -> None:
        self.count = 0

    def open(self, context: SinkContext) -> None:
        pass

    def write(self, updates: list[Update]) -> None:
        self.count += len(updates)

    def close(self) -> None:
        pass


@hookimpl
def wormhole_sinks() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            kind="sink",
            name="null",
            factory=NullSink,
            options=NoOptions,
            description="Discard updates (acknowledges at once).",
        )
    ]
