"""Sinks that misbehave on purpose, loaded by tests through WORMHOLE_PLUGINS.

* ``gate``: writes nothing until the file named by ``gate`` exists (an application
  that falls behind); with ``entered``, creates that file when its first write begins.
* ``flaky``: fails its first ``failures`` writes with an OSError, then appends
  envelopes to ``path`` like jsonl (retry with backoff).
* ``broken``: raises SinkError on open (a fatal sink problem).
* ``picky``: writes like jsonl, but rejects (OSError) every batch holding an update whose
  key ``id`` is listed in the file ``reject`` (one id a line; no file: takes everything),
  so a test can make one update poison and later "fix" the sink; each write takes at
  least ``write_ms``.
* ``closing``: writes like jsonl; its ``close`` computes for ``busy_s`` seconds (a long
  final refresh), or waits ``idle_s`` seconds doing nothing (a hung close), or fails
  (``fail``), and then appends ``closed <pid>`` to ``marker``.
"""

from __future__ import annotations

import os
import time

from wormhole.connectors.jsonl import JsonlOptions, JsonlSink
from wormhole.core.errors import SinkError
from wormhole.core.update import Update
from wormhole.plugins.components import ComponentSpec, Options, SinkContext
from wormhole.plugins.hookspecs import hookimpl


class GateOptions(Options):
    gate: str
    entered: str | None = None


class GateSink:
    def __init__(self, options: GateOptions) -> None:
        self.options = options

    def open(self, context: SinkContext) -> None:
        pass

    def write(self, updates: list[Update]) -> None:
        if self.options.entered is not None:
            open(self.options.entered, "a").close()
        while not os.path.exists(self.options.gate):
            time.sleep(0.02)

    def close(self) -> None:
        pass


class FlakyOptions(JsonlOptions):
    failures: int = 2


class FlakySink(JsonlSink):
    def __init__(self, options: FlakyOptions) -> None:
        super().__init__(options)
        self.remaining = options.failures

    def write(self, updates: list[Update]) -> None:
        if self.remaining > 0:
            self.remaining -= 1
            raise OSError("simulated outage of the sink's storage")
        super().write(updates)


class BrokenSink:
    def __init__(self, options: Options) -> None:
        pass

    def open(self, context: SinkContext) -> None:
        raise SinkError(f"applications.{context.application}.sink: broken on purpose")

    def write(self, updates: list[Update]) -> None:
        raise AssertionError("never opened")

    def close(self) -> None:
        pass


class ClosingOptions(JsonlOptions):
    marker: str
    busy_s: float = 0.0
    idle_s: float = 0.0
    fail: bool = False


class ClosingSink(JsonlSink):
    def __init__(self, options: ClosingOptions) -> None:
        super().__init__(options)
        self.closing = options

    def close(self) -> None:
        super().close()
        until = time.monotonic() + self.closing.busy_s
        while time.monotonic() < until:
            sum(i * i for i in range(10_000))
        time.sleep(self.closing.idle_s)
        if self.closing.fail:
            raise OSError("simulated failure to close the sink")
        with open(self.closing.marker, "a") as f:
            f.write(f"closed {os.getpid()}\n")


class PickyOptions(JsonlOptions):
    reject: str
    write_ms: int = 0


class PickySink(JsonlSink):
    def __init__(self, options: PickyOptions) -> None:
        super().__init__(options)
        self.reject = options.reject
        self.write_s = options.write_ms / 1000

    def write(self, updates: list[Update]) -> None:
        try:
            with open(self.reject) as f:
                rejected = {int(line) for line in f if line.strip()}
        except FileNotFoundError:
            rejected = set()
        for u in updates:
            if u.key.get("id") in rejected:
                raise OSError(f"the sink refuses key id {u.key['id']}")
        super().write(updates)
        time.sleep(self.write_s)  # a slow sink: each write takes this long


@hookimpl
def wormhole_sinks() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            "sink", "gate", GateSink, GateOptions, "holds every write until a file exists"
        ),
        ComponentSpec("sink", "flaky", FlakySink, FlakyOptions, "fails its first writes"),
        ComponentSpec("sink", "broken", BrokenSink, Options, "fails to open"),
        ComponentSpec("sink", "picky", PickySink, PickyOptions, "rejects listed keys"),
        ComponentSpec("sink", "closing", ClosingSink, ClosingOptions, "a slow or failing close"),
    ]
