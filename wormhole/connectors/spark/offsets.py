"""Offsets of the Spark source: an external application's datamarkers, read and committed
through the pipeline's datamarker store (file mode) or through its publishers (network mode)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wormhole.connectors.spark.ranges import FlowRange, ShardRange, _remote_log


def _limit(options: dict[str, str]) -> int | None:
    """Option ``maxUpdatesPerTrigger``: at most this many log positions a micro-batch."""
    limit = options.get("maxUpdatesPerTrigger", "")
    if limit and (not limit.isdigit() or int(limit) < 1):
        raise ValueError(
            f"wormhole source: option maxUpdatesPerTrigger: {limit!r} is not a positive number"
        )
    return int(limit) if limit else None


class FileFlows:
    """The external application's datamarkers, through the pipeline's datamarker store."""

    def __init__(self, options: dict[str, str]) -> None:
        from wormhole.core.errors import ConfigError
        from wormhole.plugins.engine import load_pipeline

        path = options.get("pipeline", "")
        self.application = options.get("application", "")
        if not self.application:
            raise ValueError(
                'the wormhole source needs .option("application", NAME) naming an external '
                "application of the pipeline"
            )
        try:
            pipeline = load_pipeline(path)
        except ConfigError as exc:
            raise ValueError(str(exc)) from exc
        app = pipeline.applications.get(self.application)
        if app is None or not app.external:
            known = [n for n, a in pipeline.applications.items() if a.external]
            raise ValueError(
                f"{path}: applications.{self.application} is not an external application "
                f"(external ones: {', '.join(known) or 'none'}); declare it with "
                f"'external: true' so the publisher keeps the log for it"
            )
        self.pipeline = pipeline
        self.state_dir = Path(options.get("stateDir") or pipeline.state_dir)
        self.log_dir = str(self.state_dir / "log")
        self.shards = pipeline.shards
        self.limit = _limit(options)

    def _store(self) -> Any:
        store = self.pipeline.datamarker_store.create()
        store.open(self.pipeline.name, self.state_dir)
        return store

    def stored(self) -> dict[str, int]:
        from wormhole.plugins.engine import log_range

        store = self._store()
        try:
            markers = store.load()
        finally:
            store.close()
        first, _ = log_range(self.log_dir)
        out = {}
        for shard in range(self.shards):
            marker = markers.get((self.application, shard))
            out[str(shard)] = marker.position if marker is not None else first
        return out

    def end(self) -> int:
        from wormhole.plugins.engine import log_range

        return log_range(self.log_dir)[1]

    def save(self, offsets: dict[str, int]) -> None:
        from wormhole.plugins.components import Datamarker

        store = self._store()
        try:
            store.save([Datamarker(self.application, int(s), int(p)) for s, p in offsets.items()])
        finally:
            store.close()

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[ShardRange]:
        return [
            ShardRange(
                self.log_dir,
                int(shard),
                int(start.get(shard, 0)),
                int(stop),
                self.pipeline.datastore,
                self.application,
            )
            for shard, stop in sorted(end.items(), key=lambda kv: int(kv[0]))
            if int(start.get(shard, 0)) < int(stop)
        ]


CONNECTION_OPTIONS = ("token", "tls.ca", "tls.serverName", "tls.cert", "tls.key", "timeoutMs")


class NetworkFlows:
    """The external application's flows at its publishers, over the network.

    Built lazily: Spark also creates a reader to plan each batch and pickles it to the
    executors, so nothing here connects before it is asked to.
    """

    def __init__(self, options: dict[str, str]) -> None:
        self.application = options.get("application", "")
        if not self.application:
            raise ValueError(
                'the wormhole source needs .option("application", NAME) naming an external '
                "application of the pipeline"
            )
        self.publishers = [a.strip() for a in options.get("publishers", "").split(",") if a]
        self.registry_url = options.get("registry", "")
        self.dataset = options.get("dataset", "")
        if self.publishers and self.registry_url:
            raise ValueError("wormhole source: give option publishers or registry, not both")
        if self.registry_url and not self.dataset:
            raise ValueError(
                'wormhole source: option registry needs .option("dataset", NAME), the '
                "pipeline name its publishers registered under"
            )
        for address in self.publishers:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(
                    f"wormhole source: option publishers: {address!r} is not host:port"
                )
        self.transport = options.get("transport", "tcp")
        self.options = {k: options[k] for k in CONNECTION_OPTIONS if options.get(k)}
        self.limit = _limit(options)
        self.addresses: dict[str, str] = {}
        """Each datastore's publisher, as last seen (driver only)."""
        self.target: dict[str, int] | None = None
        """Trigger.AvailableNow: each datastore's log end when the query started."""
        self._registry: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_registry"] = None
        return state

    def _remote(self, address: str) -> Any:
        return _remote_log(self.transport, address, self.application, self.options)[0]

    def _registered(self) -> list[str]:
        import threading

        from wormhole.core.errors import WormholeError
        from wormhole.plugins.engine import open_registry

        if self._registry is None:
            try:
                registry = open_registry(self.registry_url, self.dataset, threading.Event())
            except WormholeError as exc:
                raise ValueError(f"wormhole source: option registry: {exc}") from exc
            seen = threading.Event()
            entries: list[Any] = []

            def changed(live: list[Any]) -> None:
                entries[:] = live
                seen.set()

            registry.watch_publishers(changed)
            if not seen.wait(30):
                registry.close()
                raise ValueError(
                    f"wormhole source: option registry: no answer from {registry.describe()} "
                    f"about the publishers of {self.dataset}"
                )
            self._registry = (registry, entries)
        _, entries = self._registry
        addresses = [e.address for e in entries if e.address and not e.copy]
        if not addresses:
            raise ValueError(
                f"wormhole source: no publisher of dataset {self.dataset!r} is registered at "
                f"{self.registry_url} (or none has an address yet): start its publishers, or "
                f"check options registry and dataset"
            )
        return addresses

    def positions(self) -> dict[str, Any]:
        """Each datastore's log positions, and where its publisher is."""
        addresses = self._registered() if self.registry_url else self.publishers
        out: dict[str, Any] = {}
        for address in addresses:
            remote = self._remote(address)
            try:
                positions = remote.positions()
            finally:
                remote.close()
            datastore = positions.datastore or address
            if datastore in out:
                raise ValueError(
                    f"wormhole source: publishers {self.addresses[datastore]} and {address} "
                    f"both publish datastore {datastore!r}; give one publisher per datastore"
                )
            self.addresses[datastore] = address
            out[datastore] = positions
        return out

    def stored(self) -> dict[str, dict[str, int]]:
        return {ds: _stored(pos) for ds, pos in self.positions().items()}

    def prepare_available_now(self) -> None:
        """Trigger.AvailableNow: read up to the end of each log as it is now, no further."""
        self.target = {ds: pos.end for ds, pos in self.positions().items()}

    def latest(
        self, start: dict[str, dict[str, int]] | None, limit: int | None = None
    ) -> dict[str, dict[str, int]]:
        """The end of the next micro-batch: each flow up to the end of its log (or of the
        Trigger.AvailableNow target), at most ``limit`` positions past the lowest of its
        datastore's flows."""
        out: dict[str, dict[str, int]] = {}
        for datastore, pos in self.positions().items():
            base = (start or {}).get(datastore) or _stored(pos)
            end = pos.end
            if self.target is not None:
                end = min(end, self.target.get(datastore, 0))
            for cap in (limit, self.limit):
                if cap is not None:
                    end = min(end, min(int(v) for v in base.values()) + cap)
            out[datastore] = {shard: max(int(v), end) for shard, v in base.items()}
        # A datastore whose publisher is away keeps its offsets: nothing new from it.
        for datastore, flows in (start or {}).items():
            out.setdefault(datastore, dict(flows))
        return out

    def address(self, datastore: str) -> str | None:
        """Where ``datastore``'s publisher is. A reader that has not asked yet asks now: after
        a restart Spark may first replay a planned batch (``partitions``) or commit one,
        before it asks for any offset."""
        if datastore not in self.addresses:
            self.positions()
        return self.addresses.get(datastore)

    def partitions(
        self, start: dict[str, dict[str, int]], end: dict[str, dict[str, int]]
    ) -> list[FlowRange]:
        ranges = []
        for datastore, flows in sorted(end.items()):
            begin = start.get(datastore)
            if begin is None:
                begin = self.stored().get(datastore, {})
            address = self.address(datastore)
            for shard, stop in sorted(flows.items(), key=lambda kv: int(kv[0])):
                first = int(begin.get(shard, stop))
                if first >= int(stop):
                    continue
                if address is None:
                    raise ValueError(
                        f"wormhole source: no publisher of datastore {datastore!r} is reachable "
                        f"to read flow {shard} from {first} to {stop}"
                    )
                ranges.append(
                    FlowRange(
                        self.transport,
                        address,
                        self.application,
                        self.options,
                        datastore,
                        int(shard),
                        first,
                        int(stop),
                    )
                )
        return ranges

    def save(self, end: dict[str, dict[str, int]]) -> None:
        for datastore, flows in end.items():
            address = self.address(datastore)
            if address is None:
                continue  # committed again with a later batch, once it is back
            remote = self._remote(address)
            try:
                remote.commit({int(s): int(v) for s, v in flows.items()})
            finally:
                remote.close()

    def close(self) -> None:
        if self._registry is not None:
            self._registry[0].close()
            self._registry = None


def _stored(positions: Any) -> dict[str, int]:
    return {
        str(shard): positions.datamarkers.get(shard, positions.first)
        for shard in range(positions.shards)
    }


def flows_of(options: dict[str, str]) -> FileFlows | NetworkFlows:
    if options.get("publishers") or options.get("registry"):
        if options.get("pipeline"):
            raise ValueError(
                "wormhole source: give option pipeline (file mode, on the publisher's machine) "
                "or publishers / registry (network mode), not both"
            )
        return NetworkFlows(options)
    if not options.get("pipeline"):
        raise ValueError(
            'the wormhole source needs .option("publishers", "HOST:PORT,...") or '
            '.option("registry", URL) with .option("dataset", NAME) to read over the network, '
            'or .option("pipeline", PATH) to read the publisher log files on this machine; '
            'and .option("application", NAME) naming an external application'
        )
    return FileFlows(options)
