"""Rows/s into the search sink (Tantivy engine), against a plain Tantivy writer loop.

Run: ``python bench/search_sink.py`` (``--rows 200000 --batch 5000 --repeat 3``).
Needs the ``search`` extra (``pip install 'wormhole-cdc[search]'``).

Both sides index the same rows (6 typed fields, and the row stored as JSON)
into a new index on local disk and commit after every batch of ``--batch``
rows; the time is from the first document to the last commit.

* raw: a loop over prepared Python values: build a ``tantivy.Document`` with
  the same fields the sink writes, ``add_document``, ``commit`` per batch (for
  the update pass, ``delete_documents_by_term`` on the id before each add).
  The ceiling for any Python writer.
* sink: ``SearchSink.write(batch)`` with updates as a source delivers them
  (rows as raw JSON): document ids from a template, versions from positions,
  the lookup of what the index holds, row decoding, typed values, commit.

Two passes: inserts of new keys, then one update of every key (newer versions).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from wormhole.connectors.search import SearchOptions, make_sink
from wormhole.connectors.search.tantivy_engine import build_schema, import_tantivy
from wormhole.core.publisher import tune_gc
from wormhole.core.update import Update
from wormhole.plugins.components import SinkContext

FIELDS = {
    "name": "text",
    "city": "string",
    "age": "i64",
    "balance": "f64",
    "active": "bool",
    "joined": "date",
}
CITIES = ["Bengaluru", "Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn"]
WORDS = ["ada", "grace", "alan", "edsger", "barbara", "donald", "frances", "ken", "tony"]


def make_rows(count: int, generation: int) -> list[dict[str, Any]]:
    return [
        {
            "id": i,
            "name": f"{WORDS[i % 9]} {WORDS[(i // 9) % 9]} {generation}",
            "city": CITIES[i % 6],
            "age": 18 + i % 70,
            "balance": i * 0.25,
            "active": i % 3 != 0,
            "joined": f"2024-{1 + i % 12:02d}-{1 + i % 28:02d}T10:00:00+00:00",
        }
        for i in range(count)
    ]


def make_updates(rows: list[dict[str, Any]], generation: int) -> list[Update]:
    file = f"{generation:04d}.jsonl"
    return [
        Update.create(
            op="c" if generation == 0 else "u",
            key={"id": row["id"]},
            table="users",
            after=row,
            connector="filelog",
            position=f"{file}:{i * 160}",
            logical=f"{file}:{i * 160}",
            shard=row["id"] % 16,
        )
        for i, row in enumerate(rows)
    ]


def raw_pass(
    tantivy: Any, index: Any, writer: Any, rows: list[dict[str, Any]], batch: int, update: bool
) -> float:
    encode = msgspec.json.Encoder().encode
    # Prepared outside the timing, as the sink gets them: the row's JSON and its values.
    prepared = [
        (
            f"user:{row['id']}",
            encode(row),
            encode([1, row["id"]]),
            dt.datetime.fromisoformat(row["joined"]),
            row,
        )
        for row in rows
    ]
    started = time.perf_counter()
    for start in range(0, len(prepared), batch):
        for doc_id, raw, version, joined, row in prepared[start : start + batch]:
            if update:
                writer.delete_documents_by_term("_id", doc_id)
            doc = tantivy.Document()
            doc.add_text("_id", doc_id)
            doc.add_text("_kind", "doc")
            doc.add_text("_part", "0:users")
            doc.add_text("_table", "users")
            doc.add_bytes("_version", version)
            doc.add_bytes("_row", raw)
            doc.add_text("name", row["name"])
            doc.add_text("city", row["city"])
            doc.add_integer("age", row["age"])
            doc.add_float("balance", row["balance"])
            doc.add_boolean("active", row["active"])
            doc.add_date("joined", joined)
            writer.add_document(doc)
        writer.commit()
    elapsed = time.perf_counter() - started
    return len(rows) / elapsed


def sink_pass(sink: Any, updates: list[Update], batch: int) -> float:
    started = time.perf_counter()
    for start in range(0, len(updates), batch):
        sink.write(updates[start : start + batch])
    elapsed = time.perf_counter() - started
    return len(updates) / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    tantivy = import_tantivy()
    tune_gc()  # as `wormhole run`
    rows = [make_rows(args.rows, 0), make_rows(args.rows, 1)]
    updates = [make_updates(rows[0], 0), make_updates(rows[1], 1)]
    work = Path(tempfile.mkdtemp(prefix="wormhole-bench-search-"))
    options = SearchOptions.model_validate(
        {"path": str(work / "index"), "fields": FIELDS, "ids": {"users": "user:{id}"}}
    )
    rates: dict[str, list[float]] = {k: [] for k in ("raw-c", "sink-c", "raw-u", "sink-u")}
    try:
        for attempt in range(args.repeat):
            raw_dir = work / f"raw{attempt}"
            raw_dir.mkdir()
            index = tantivy.Index(build_schema(tantivy, FIELDS), str(raw_dir))
            writer = index.writer(heap_size=64 << 20, num_threads=1)
            gc.collect()
            rates["raw-c"].append(raw_pass(tantivy, index, writer, rows[0], args.batch, False))
            rates["raw-u"].append(raw_pass(tantivy, index, writer, rows[1], args.batch, True))
            writer.wait_merging_threads()

            sink = make_sink(options.model_copy(update={"path": str(work / f"sink{attempt}")}))
            sink.open(SinkContext("bench", "search", 0, 1, work, logging.getLogger("bench.search")))
            gc.collect()
            rates["sink-c"].append(sink_pass(sink, updates[0], args.batch))
            rates["sink-u"].append(sink_pass(sink, updates[1], args.batch))
            sink.close()
            shutil.rmtree(raw_dir, ignore_errors=True)
            shutil.rmtree(work / f"sink{attempt}", ignore_errors=True)
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(
            f"{args.rows:,} rows (6 typed fields + the row as JSON), commit every "
            f"{args.batch:,} rows, median of {args.repeat} runs"
        )
        print(f"{'measure':<46}  {'rows/s':>10}  {'ratio':>6}")
        for raw_label, sink_label, raw, ours in (
            ("raw tantivy loop, inserts", "search sink, inserts", "raw-c", "sink-c"),
            (
                "raw tantivy loop, updates (delete + add)",
                "search sink, updates (newer versions)",
                "raw-u",
                "sink-u",
            ),
        ):
            print(f"{raw_label:<46}  {med[raw]:>10,.0f}  {1.0:>6.2f}")
            print(f"{sink_label:<46}  {med[ours]:>10,.0f}  {med[ours] / med[raw]:>6.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
