"""One value never stops the postgres source: text that is not UTF-8 (a SQL_ASCII
database stores any bytes) is delivered as {"undecoded": hex} with a warning and the
metric, or stops the source under on_decode_error: stop."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import psycopg2
import pytest

from wormhole.connectors.postgres.options import PostgresOptions
from wormhole.connectors.postgres.source import PostgresSource
from wormhole.core.errors import SourceError
from wormhole.core.update import Update
from wormhole.plugins.components import SourceContext
from wormhole.plugins.events import UNDECODED
from wormhole.testing.helpers import read_updates
from wormhole.testing.postgres import run_sql as sql

_databases = iter(range(1_000_000))


@pytest.fixture
def ascii_dsn(postgres_server: Any) -> Iterator[str]:
    """A fresh SQL_ASCII database: it stores whatever bytes a client sends."""
    name = f"ascii_{next(_databases)}_{int(time.time() * 1000) % 10**8}"
    sql(
        postgres_server.dsn(),
        f"CREATE DATABASE {name} ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' "
        f"TEMPLATE template0",
    )
    try:
        yield postgres_server.dsn(name)
    finally:
        postgres_server.drop_database(name)


def open_source(tmp_path: Path, dsn: str, name: str, **options: Any) -> PostgresSource:
    source = PostgresSource(PostgresOptions(dsn=dsn, tables=["public.t"], slot=name, **options))
    context = SourceContext(name, tmp_path / name, 4, threading.Event(), logging.getLogger(name))
    source.open(context, None)
    return source


def after(update: Update) -> Any:
    return msgspec.json.decode(bytes(update.after))


def insert_bytes(dsn: str, *rows: tuple[int, bytes]) -> None:
    """Insert (id, text) rows whose text is the given bytes, unchecked (SQL_ASCII)."""
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        for key, raw in rows:
            cur.execute("INSERT INTO t VALUES (%s, convert_from(%s, 'SQL_ASCII'))", (key, raw))
    conn.close()


def test_text_that_is_not_utf8_is_delivered_as_its_bytes_or_stops_the_source(
    tmp_path: Path, ascii_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    sql(ascii_dsn, "CREATE TABLE t (id int PRIMARY KEY, s text, n int)")
    insert_bytes(ascii_dsn, (1, "café".encode()), (2, b"A\xff"))
    counted = UNDECODED.labels("public.t", "s")._value.get()
    stopping = open_source(tmp_path, ascii_dsn, "stopping", on_decode_error="stop")
    source = open_source(tmp_path, ascii_dsn, "falling")
    try:
        with caplog.at_level(logging.WARNING, logger="wormhole.postgres"):
            # The snapshot: valid UTF-8 as text, the rest as its bytes.
            snapshot = read_updates(source, 2)
            assert sorted((after(u)["id"], after(u)["s"]) for u in snapshot) == [
                (1, "café"),
                (2, {"undecoded": "41ff"}),
            ]
            insert_bytes(ascii_dsn, (3, b"\xc3(x"), (4, b"next"))
            sql(ascii_dsn, "UPDATE t SET n = 5 WHERE id = 3")
            changes = read_updates(source, 3)
        assert [(u.op, after(u)) for u in changes] == [
            ("c", {"id": 3, "s": {"undecoded": "c32878"}, "n": None}),
            ("c", {"id": 4, "s": "next", "n": None}),
            ("u", {"id": 3, "s": {"undecoded": "c32878"}, "n": 5}),
        ]
        warnings = [r.getMessage() for r in caplog.records if "cannot decode" in r.getMessage()]
        assert len(warnings) == 3, warnings
        assert "column s of public.t at the snapshot at" in warnings[0]
        assert f"column s of public.t at {changes[0].position}" in warnings[1]
        assert "SQL_ASCII" in warnings[1] and "on_decode_error: stop" in warnings[1]
        assert UNDECODED.labels("public.t", "s")._value.get() == counted + 3
        with pytest.raises(SourceError) as stopped:
            read_updates(stopping, 10)
        assert "cannot decode column s of public.t at the snapshot" in str(stopped.value)
        assert "on_decode_error: fallback" in str(stopped.value)
    finally:
        source.close()
        stopping.close()


def test_the_stream_stops_at_text_that_is_not_utf8_when_asked(
    tmp_path: Path, ascii_dsn: str
) -> None:
    sql(ascii_dsn, "CREATE TABLE t (id int PRIMARY KEY, s text)")
    source = open_source(tmp_path, ascii_dsn, "stopping", on_decode_error="stop")
    try:
        source.read(0.2)  # the (empty) snapshot
        insert_bytes(ascii_dsn, (1, b"ok"), (2, b"\xfe"))
        with pytest.raises(SourceError) as stopped:
            read_updates(source, 10)
        assert "cannot decode column s of public.t at 0/" in str(stopped.value)
        assert "bytes fe" in str(stopped.value)
    finally:
        source.close()


def test_a_watermark_message_that_is_not_utf8_is_ignored_with_a_warning(
    tmp_path: Path, ascii_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    sql(ascii_dsn, "CREATE TABLE t (id int PRIMARY KEY, s text)")
    source = open_source(tmp_path, ascii_dsn, "marks")
    stopping = open_source(tmp_path, ascii_dsn, "marks_stop", on_decode_error="stop")
    try:
        for prefix in ("wormhole.watermark.marks", "wormhole.watermark.marks_stop"):
            sql(
                ascii_dsn,
                f"BEGIN; INSERT INTO t VALUES (1, 'a') ON CONFLICT DO NOTHING; "
                f"SELECT pg_logical_emit_message(true, '{prefix}', '\\xff'::bytea); COMMIT",
            )
        sql(ascii_dsn, "INSERT INTO t VALUES (2, 'b')")
        with caplog.at_level(logging.WARNING, logger="wormhole.postgres"):
            changes = read_updates(source, 2)
        assert [after(u)["id"] for u in changes] == [1, 2]
        assert any(
            "ignoring the logical message with prefix wormhole.watermark.marks at" in r.getMessage()
            for r in caplog.records
        )
        with pytest.raises(SourceError) as stopped:
            read_updates(stopping, 10)
        assert "cannot decode the logical message" in str(stopped.value)
    finally:
        source.close()
        stopping.close()


def test_a_backfill_chunk_delivers_text_that_is_not_utf8_as_its_bytes(
    tmp_path: Path, ascii_dsn: str
) -> None:
    sql(ascii_dsn, "CREATE TABLE t (s text PRIMARY KEY, n int, note text)")
    conn = psycopg2.connect(ascii_dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        for key, note in ((b"a\xff", b'q"\xfe'), ("é".encode(), b"ok")):
            cur.execute(
                "INSERT INTO t VALUES (convert_from(%s, 'SQL_ASCII'), 1, "
                "convert_from(%s, 'SQL_ASCII'))",
                (key, note),
            )
    conn.close()
    source = open_source(tmp_path, ascii_dsn, "chunks", snapshot="never")
    try:
        plan = source.backfill_plan("chunks", "public.t", None)
        rows = source.backfill_chunk(plan, None, 10)
        by_n = sorted(((u.key, after(u)) for u in rows), key=str)
        assert by_n == sorted(
            [
                (
                    {"s": {"undecoded": "61ff"}},
                    {"s": {"undecoded": "61ff"}, "n": 1, "note": {"undecoded": "7122fe"}},
                ),
                ({"s": "é"}, {"s": "é", "n": 1, "note": "ok"}),
            ],
            key=str,
        )
    finally:
        source.close()
