"""Rows/s into the memcache sink (3 local memcached servers), against raw pymemcache.

Run: ``make bench`` (or ``python bench/memcache_sink.py --rows 200000``).
Needs memcached (Debian package memcached) and pymemcache
(``pip install 'wormhole-cdc[memcache]'``).

Three throwaway memcached servers are started. Each measure handles the same N
distinct keys (``user:{id}``, one update each), in both modes:

* raw: pymemcache ``Client.delete_many`` / ``set_many`` per server, 1,000 keys per
  call, the keys grouped by server beforehand (not timed): the I/O floor of any
  Python invalidator. The second raw line also times the grouping, done with
  pymemcache's own ``RendezvousHash`` (what ``HashClient`` uses);
* sink: ``MemcacheSink.write`` on batches of 8,192 prebuilt updates, in this process:
  render each key from its template, pick its server by rendezvous hashing, keep the
  last action per key, send, wait for every reply;
* end to end: ``wormhole run --once`` semantics on a prewritten JSON-lines file:
  the filelog source, the publisher log (fsync), the tcp transport and 1 or 2
  subscriber processes, each with its memcache sink; timed from start until every
  flow acknowledged the end and the subscribers stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pymemcache.client.base import Client
from pymemcache.client.rendezvous import RendezvousHash

from wormhole.connectors.memcache import MemcacheOptions, MemcacheSink
from wormhole.core.pipeline import parse_pipeline
from wormhole.core.publisher import Publisher
from wormhole.core.update import Update
from wormhole.plugins.components import SinkContext
from wormhole.testing.memcached import MemcachedServer, start_memcached

BATCH = 8192
CHUNK = 1000


def row(i: int) -> dict[str, Any]:
    return {"id": i, "name": f"user {i}", "email": f"user{i}@example.org", "plan": "pro"}


def flush(servers: list[MemcachedServer]) -> None:
    for server in servers:
        client = server.client()
        client.flush_all(noreply=False)
        client.close()


def raw_rate(servers: list[MemcachedServer], rows: int, mode: str, hashed: bool = False) -> float:
    """pymemcache alone; ``hashed``: its own RendezvousHash picks each key's server, timed."""
    nodes = [s.address for s in servers]
    hasher = RendezvousHash(list(nodes))
    values = [json.dumps(row(i), separators=(",", ":")).encode() for i in range(rows)]
    clients = [Client((s.host, s.port), no_delay=True, default_noreply=False) for s in servers]
    started = time.perf_counter()
    groups: list[list[int]] = [[] for _ in servers]
    for i in range(rows):
        groups[nodes.index(hasher.get_node(f"user:{i}"))].append(i)
    if not hashed:
        started = time.perf_counter()
    for client, ids in zip(clients, groups, strict=True):
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start : start + CHUNK]
            if mode == "delete":
                client.delete_many([f"user:{i}" for i in chunk], noreply=False)
            else:
                client.set_many({f"user:{i}": values[i] for i in chunk}, noreply=False)
    elapsed = time.perf_counter() - started
    for client in clients:
        client.close()
    return rows / elapsed


def sink_rate(servers: list[MemcachedServer], rows: int, mode: str) -> float:
    updates = [
        Update.create(op="u", key={"id": i}, table="users", after=row(i)) for i in range(rows)
    ]
    options = MemcacheOptions.model_validate(
        {"servers": [s.address for s in servers], "keys": {"users": "user:{id}"}, "mode": mode}
    )
    sink = MemcacheSink(options)
    sink.open(SinkContext("bench", "cache", 0, 1, Path("."), logging.getLogger("bench")))
    gc.collect()
    started = time.perf_counter()
    for start in range(0, rows, BATCH):
        sink.write(updates[start : start + BATCH])
    elapsed = time.perf_counter() - started
    sink.close()
    return rows / elapsed


def write_source(path: Path, rows: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(rows):
            line = {"table": "users", "op": "u", "key": {"id": i}, "after": row(i)}
            f.write(json.dumps(line, separators=(",", ":")) + "\n")


def pipeline_rate(
    servers: list[MemcachedServer], work: Path, source: Path, mode: str, subscribers: int
) -> float:
    state = work / "state"
    shutil.rmtree(state, ignore_errors=True)
    servers_list = ",".join(s.address for s in servers)
    text = f"""
pipeline: bench
state_dir: {state}
source: {{type: filelog, path: {source}, poll_interval_ms: 5}}
applications:
  cache:
    sink:
      type: memcache
      servers: "{servers_list}"
      mode: {mode}
      keys: {{users: "user:{{id}}"}}
    subscribers: {subscribers}
"""
    file = work / "bench.yml"
    file.write_text(text)
    pipeline = parse_pipeline(text, str(file), env={})
    gc.collect()
    started = time.perf_counter()
    summary = Publisher(pipeline, once=True).run()
    elapsed = time.perf_counter() - started
    assert summary.applications["cache"].lag == 0, summary
    return summary.source_updates / elapsed


@contextlib.contextmanager
def memcached(count: int) -> Iterator[list[MemcachedServer]]:
    generators = [start_memcached(["-m", "256"]) for _ in range(count)]
    try:
        yield [next(g) for g in generators]
    finally:
        for g in generators:
            g.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="wormhole-bench-memcache-"))
    source = work / "data" / "users.jsonl"
    write_source(source, args.rows)
    results: list[tuple[str, float, float]] = []
    try:
        with memcached(3) as servers:
            for mode in ("delete", "set"):
                samples: dict[str, list[float]] = {}
                measures = {
                    f"raw pymemcache {mode}_many, pre-grouped by server": lambda mode=mode: (
                        raw_rate(servers, args.rows, mode)
                    ),
                    f"raw pymemcache {mode}_many + its RendezvousHash": lambda mode=mode: raw_rate(
                        servers, args.rows, mode, hashed=True
                    ),
                    f"memcache sink write(), mode {mode}": lambda mode=mode: sink_rate(
                        servers, args.rows, mode
                    ),
                    f"end to end, tcp, 1 subscriber, mode {mode}": lambda mode=mode: pipeline_rate(
                        servers, work, source, mode, 1
                    ),
                    f"end to end, tcp, 2 subscribers, mode {mode}": lambda mode=mode: pipeline_rate(
                        servers, work, source, mode, 2
                    ),
                }
                for _ in range(args.repeat):
                    for name, measure in measures.items():
                        if mode == "delete":
                            # Deleting keys that exist: the work an invalidation does.
                            raw_rate(servers, args.rows, "set")
                        else:
                            flush(servers)
                        samples.setdefault(name, []).append(measure())
                raw = statistics.median(next(iter(samples.values())))
                for name, rates in samples.items():
                    rate = statistics.median(rates)
                    results.append((name, rate, rate / raw))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"{args.rows:,} distinct keys, one update each, 3 local memcached servers, "
        f"median of {args.repeat} runs"
    )
    print(f"{'measure':<52}  {'rows/s':>10}  {'ratio':>6}")
    for name, rate, ratio in results:
        print(f"{name:<52}  {rate:>10,.0f}  {ratio:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
