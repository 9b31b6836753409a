"""Values of the mysql source exactly as MariaDB has them: every temporal type at every
precision, zero and invalid dates, every character set the server ships, SET and BINARY
after ALTER TABLE, and a value that cannot be decoded never stopping the stream."""

from __future__ import annotations

import logging
import threading
import warnings
from pathlib import Path
from typing import Any

import msgspec
import pytest

from wormhole.connectors.mysql.options import MySQLOptions
from wormhole.connectors.mysql.source import MySQLSource
from wormhole.core.errors import SourceError
from wormhole.core.update import Update
from wormhole.plugins.components import SourceContext
from wormhole.testing.helpers import read_updates
from wormhole.testing.mysql import MariaDBServer

FSPS = range(7)


def open_source(tmp_path: Path, server: MariaDBServer, db: str, **options: Any) -> MySQLSource:
    """A source of ``db``'s tables streaming from the current end of the binlog."""
    source = MySQLSource(
        MySQLOptions(dsn=server.dsn(), tables=[f"{db}.*"], snapshot="never", **options)
    )
    context = SourceContext(
        "values", tmp_path / "values", 4, threading.Event(), logging.getLogger("values")
    )
    source.open(context, None)
    source.read(0.1)  # the start position
    return source


def after(update: Update) -> Any:
    return msgspec.json.decode(bytes(update.after))


def before(update: Update) -> Any:
    return msgspec.json.decode(bytes(update.before))


def stream(
    tmp_path: Path, server: MariaDBServer, db: str, *statements: str, changes: int
) -> list[Any]:
    """The ``after`` rows of the changes ``statements`` make, as the source reads them."""
    source = open_source(tmp_path, server, db)
    try:
        server.sql(*statements, database=db)
        return [after(u) for u in read_updates(source, changes)]
    finally:
        source.close()


def test_a_value_the_library_could_not_decode_no_longer_stops_the_stream(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    # latin1 as MariaDB defines it maps every byte (0x81 is U+0081); utf32 text; a date
    # that only ALLOW_INVALID_DATES accepts. Each used to end the stream for good.
    rows = stream(
        tmp_path,
        mariadb_server,
        mysql_database,
        "SET SESSION sql_mode = 'ALLOW_INVALID_DATES'",
        "CREATE TABLE l (id INT PRIMARY KEY, a VARCHAR(8) CHARACTER SET latin1, "
        "b VARCHAR(5) CHARACTER SET utf32, d DATE)",
        "INSERT INTO l VALUES (1, 0x81, NULL, NULL), (2, NULL, 'abc', NULL), "
        "(3, NULL, NULL, '2001-02-29'), (4, 0x818D8F909D80, 'x', '2024-02-29')",
        "INSERT INTO l VALUES (5, 'after', 'after', '2000-01-01')",
        changes=5,
    )
    assert rows == [
        {"id": 1, "a": "\x81", "b": None, "d": None},
        {"id": 2, "a": None, "b": "abc", "d": None},
        {"id": 3, "a": None, "b": None, "d": "2001-02-29"},
        {"id": 4, "a": "\x81\x8d\x8f\x90\x9d€", "b": "x", "d": "2024-02-29"},
        {"id": 5, "a": "after", "b": "after", "d": "2000-01-01"},
    ]
    assert snapshot_rows(tmp_path, mariadb_server, mysql_database, "l") == rows


def test_timestamp_zero_is_the_zero_datetime_at_every_precision(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    columns = ", ".join(f"t{n} TIMESTAMP({n}) NULL" for n in FSPS)
    zeros = ", ".join("'0000-00-00 00:00:00'" for _ in FSPS)
    ones = ", ".join("'1970-01-01 00:00:01'" for _ in FSPS)
    rows = stream(
        tmp_path,
        mariadb_server,
        mysql_database,
        "SET SESSION sql_mode = '', time_zone = '+00:00'",
        f"CREATE TABLE z (id INT PRIMARY KEY, {columns})",
        f"INSERT INTO z VALUES (1, {zeros}), (2, {ones})",
        changes=2,
    )
    assert rows[0] == {"id": 1} | {
        f"t{n}": "0000-00-00 00:00:00" + ("." + "0" * n if n else "") for n in FSPS
    }
    assert rows[1] == {"id": 2} | {
        f"t{n}": "1970-01-01 00:00:01" + ("." + "0" * n if n else "") for n in FSPS
    }
    assert snapshot_rows(tmp_path, mariadb_server, mysql_database, "z") == rows


def test_negative_time_keeps_its_fraction_at_every_precision(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    values = ["-00:00:00.6", "-838:59:59.9", "-00:00:00.000001", "-01:02:03.123456", "-12:00:00"]
    columns = ", ".join(f"t{n} TIME({n})" for n in FSPS)
    inserts = ", ".join(
        f"({i}, " + ", ".join(f"'{v}'" for _ in FSPS) + ")" for i, v in enumerate(values)
    )
    rows = stream(
        tmp_path,
        mariadb_server,
        mysql_database,
        f"CREATE TABLE t (id INT PRIMARY KEY, {columns})",
        f"INSERT INTO t VALUES {inserts}",
        changes=len(values),
    )
    expected = mariadb_server.sql(
        "SELECT id, " + ", ".join(f"CAST(t{n} AS CHAR)" for n in FSPS) + " FROM t ORDER BY id",
        database=mysql_database,
    )
    assert rows == [{"id": r[0]} | {f"t{n}": r[n + 1] for n in FSPS} for r in expected]
    # The server's own text, spelled out for the reproductions:
    assert rows[0]["t1"] == "-00:00:00.6" and rows[1]["t1"] == "-838:59:59.9"
    assert snapshot_rows(tmp_path, mariadb_server, mysql_database, "t") == rows
    assert rows[3]["t6"] == "-01:02:03.123456" and rows[3]["t3"] == "-01:02:03.123"


def test_dates_with_zero_parts_year_0_or_invalid_days_keep_their_parts_and_fraction(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    values = [
        "2024-00-15 10:00:00.5",
        "2024-05-00 10:00:00.5",
        "0000-01-01 23:59:59.999999",
        "2001-02-29 12:34:56.25",
        "0000-00-00 00:00:00",
        "9999-12-31 23:59:59.999999",
    ]
    columns = ", ".join(f"dt{n} DATETIME({n})" for n in FSPS)
    inserts = ", ".join(
        f"({i}, '{v}', " + ", ".join(f"'{v}'" for _ in FSPS) + ")" for i, v in enumerate(values)
    )
    rows = stream(
        tmp_path,
        mariadb_server,
        mysql_database,
        "SET SESSION sql_mode = 'ALLOW_INVALID_DATES'",
        f"CREATE TABLE d (id INT PRIMARY KEY, d DATE, {columns})",
        f"INSERT INTO d VALUES {inserts}",
        changes=len(values),
    )
    expected = mariadb_server.sql(
        "SELECT id, CAST(d AS CHAR), "
        + ", ".join(f"CAST(dt{n} AS CHAR)" for n in FSPS)
        + " FROM d ORDER BY id",
        database=mysql_database,
    )
    assert rows == [{"id": r[0], "d": r[1]} | {f"dt{n}": r[n + 2] for n in FSPS} for r in expected]
    assert rows[0]["d"] == "2024-00-15" and rows[1]["dt6"] == "2024-05-00 10:00:00.500000"
    assert rows[2]["dt6"] == "0000-01-01 23:59:59.999999" and rows[3]["d"] == "2001-02-29"
    assert snapshot_rows(tmp_path, mariadb_server, mysql_database, "d") == rows


def test_set_members_and_binary_length_follow_alter_table(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    rows = stream(
        tmp_path,
        mariadb_server,
        mysql_database,
        "CREATE TABLE s (id INT PRIMARY KEY, a SET('a'), b BINARY(2), e ENUM('x'))",
        "INSERT INTO s VALUES (1, 'a', 'y', 'x')",
        "ALTER TABLE s MODIFY a SET('a','b'), MODIFY b BINARY(4), MODIFY e ENUM('x','y')",
        "INSERT INTO s VALUES (2, 'b', 'y', 'y'), (3, 'a,b', 'yz', 'x')",
        changes=3,
    )
    assert rows == [
        {"id": 1, "a": "a", "b": "\\x7900", "e": "x"},
        {"id": 2, "a": "b", "b": "\\x79000000", "e": "y"},
        {"id": 3, "a": "a,b", "b": "\\x797a0000", "e": "x"},
    ]


def test_year_0_is_0000(tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str) -> None:
    rows = stream(
        tmp_path,
        mariadb_server,
        mysql_database,
        "CREATE TABLE y (id INT PRIMARY KEY, y YEAR)",
        "INSERT INTO y VALUES (1, 0), (2, 1901), (3, 2155), (4, '0000')",
        changes=4,
    )
    assert [r["y"] for r in rows] == ["0000", "1901", "2155", "0000"]
    assert snapshot_rows(tmp_path, mariadb_server, mysql_database, "y") == rows


def test_the_binlog_reader_passes_pymysql_no_deprecated_argument(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    """The replication library names its control connection's database ``db``, which
    PyMySQL deprecates for ``database`` (and says it will drop): the source connects for
    the library and names it ``database``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = stream(
            tmp_path,
            mariadb_server,
            mysql_database,
            "CREATE TABLE w (id INT PRIMARY KEY)",
            "INSERT INTO w VALUES (1)",
            changes=1,
        )
    assert rows == [{"id": 1}]
    deprecated = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert deprecated == []


@pytest.mark.parametrize("charset", ["ucs2", "utf16", "utf16le", "utf32"])
def test_unicode_character_sets_decode_by_their_byte_order(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str, charset: str
) -> None:
    text = "abc é ü" if charset == "ucs2" else "abc é 🐍"
    rows = stream(
        tmp_path,
        mariadb_server,
        mysql_database,
        f"CREATE TABLE u (id INT PRIMARY KEY, c CHAR(10) CHARACTER SET {charset}, "
        f"v VARCHAR(10) CHARACTER SET {charset}, t TEXT CHARACTER SET {charset})",
        f"INSERT INTO u VALUES (1, '{text}', '{text}', '{text}')",
        changes=1,
    )
    assert rows == [{"id": 1, "c": text, "v": text, "t": text}]
    assert snapshot_rows(tmp_path, mariadb_server, mysql_database, "u") == rows


@pytest.mark.parametrize("charset", ["utf8mb3", "utf8mb4", "ucs2", "utf16", "utf32"])
def test_text_of_a_collation_shared_by_several_character_sets_decodes(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str, charset: str
) -> None:
    # MariaDB 10.10+ lists the uca1400 collations once, without an id; each character
    # set's id of them (2048 and up) is only in COLLATION_CHARACTER_SET_APPLICABILITY.
    text = "abc é ü" if charset in ("ucs2", "utf8mb3") else "abc é 🐍"
    collation = f"{charset}_uca1400_ai_ci"
    rows = stream(
        tmp_path,
        mariadb_server,
        mysql_database,
        f"CREATE TABLE c (id INT PRIMARY KEY, v VARCHAR(10) CHARACTER SET {charset} "
        f"COLLATE {collation}, e ENUM('é', 'x') CHARACTER SET {charset} COLLATE {collation})",
        f"INSERT INTO c VALUES (1, '{text}', 'é')",
        changes=1,
    )
    assert rows == [{"id": 1, "v": text, "e": "é"}]
    assert snapshot_rows(tmp_path, mariadb_server, mysql_database, "c") == rows


SAMPLE = "abc é ü ß Ω Ж א ع ก ą ğ ő ™ € 日本語 한국어 中文 ｶﾅ 🐍"


def test_every_character_set_of_the_server_decodes_as_the_server_converts_it(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    db = mysql_database
    charsets = mariadb_server.sql(
        "SELECT CHARACTER_SET_NAME, MAXLEN FROM information_schema.CHARACTER_SETS "
        "WHERE CHARACTER_SET_NAME <> 'binary' ORDER BY 1"
    )
    assert len(charsets) >= 39  # MariaDB 10.11 ships 40 with binary
    columns = ", ".join(f"c_{name} VARCHAR(300) CHARACTER SET {name}" for name, _ in charsets)
    sample = ", ".join(f"CONVERT('{SAMPLE}' USING {name})" for name, _ in charsets)
    # Every byte a single-byte character set has, as the column's bytes.
    every_byte = ", ".join(
        "x'" + bytes(range(0x20, 0x100)).hex() + "'" if maxlen == 1 else "NULL"
        for _, maxlen in charsets
    )
    rows = stream(
        tmp_path,
        mariadb_server,
        db,
        "SET SESSION sql_mode = ''",  # a character a set lacks converts to '?'
        f"CREATE TABLE cs (id INT PRIMARY KEY, {columns})",
        f"INSERT INTO cs VALUES (1, {sample}), (2, {every_byte})",
        changes=2,
    )
    names = [name for name, _ in charsets]
    server = mariadb_server.sql(
        "SELECT "
        + ", ".join(f"CONVERT(c_{n} USING utf8mb4), HEX(c_{n})" for n in names)
        + " FROM cs ORDER BY id",
        database=db,
    )
    undecoded = set()
    for got, converted in zip(rows, server, strict=True):
        for i, name in enumerate(names):
            text, hexed = converted[2 * i], converted[2 * i + 1]
            value = got[f"c_{name}"]
            if text is None:
                assert value is None
            elif text.count("?") > bytes.fromhex(hexed).count(b"?"):
                # A byte the server itself cannot convert: delivered as the bytes it is.
                assert value == {"undecoded": hexed.lower()}, name
                undecoded.add(name)
            else:
                assert value == text, name
    # latin1 as MariaDB defines it maps every byte; ascii maps none above 0x7f.
    assert "latin1" not in undecoded and "ascii" in undecoded
    assert rows[0]["c_utf8mb4"] == SAMPLE and rows[0]["c_utf32"] == SAMPLE
    assert snapshot_rows(tmp_path, mariadb_server, db, "cs") == rows


def test_an_undecodable_value_is_delivered_as_its_bytes_with_a_warning_or_stops_the_source(
    tmp_path: Path,
    mariadb_server: MariaDBServer,
    mysql_database: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from wormhole.plugins.events import UNDECODED

    db = mysql_database
    mariadb_server.sql(
        "CREATE TABLE a (id INT PRIMARY KEY, v VARCHAR(5) CHARACTER SET ascii)", database=db
    )
    counted = UNDECODED.labels(f"{db}.a", "v")._value.get()
    stopping = open_source(tmp_path / "stop", mariadb_server, db, on_decode_error="stop")
    source = open_source(tmp_path, mariadb_server, db)
    try:
        mariadb_server.sql(
            "INSERT INTO a VALUES (1, x'41ff'), (2, 'ok')",
            "INSERT INTO a VALUES (3, 'next')",
            database=db,
        )
        with caplog.at_level(logging.WARNING, logger="wormhole.mysql"):
            updates = read_updates(source, 3)
        assert [after(u) for u in updates] == [
            {"id": 1, "v": {"undecoded": "41ff"}},
            {"id": 2, "v": "ok"},
            {"id": 3, "v": "next"},
        ]
        warning = [r.getMessage() for r in caplog.records if "cannot decode" in r.getMessage()]
        assert len(warning) == 1, warning
        assert f"column v of {db}.a at {updates[0].position}" in warning[0]
        assert "not valid ascii" in warning[0] and "on_decode_error: stop" in warning[0]
        assert UNDECODED.labels(f"{db}.a", "v")._value.get() == counted + 1
        with pytest.raises(SourceError) as stopped:
            read_updates(stopping, 1)
        assert f"cannot decode column v of {db}.a at {updates[0].position}" in str(stopped.value)
        assert "on_decode_error: fallback" in str(stopped.value)
        # The snapshot reads the column's bytes and decodes them the same way.
        snapshot = snapshot_rows(tmp_path, mariadb_server, db, "a")
        assert snapshot[0] == {"id": 1, "v": {"undecoded": "41ff"}}
        assert UNDECODED.labels(f"{db}.a", "v")._value.get() == counted + 2
    finally:
        source.close()
        stopping.close()


def test_enum_and_set_members_are_decoded_by_their_columns_character_set(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    rows = stream(
        tmp_path,
        mariadb_server,
        mysql_database,
        "CREATE TABLE m (id INT PRIMARY KEY, "
        "e1 ENUM('é', 'ü') CHARACTER SET latin1, s1 SET('é', 'ü') CHARACTER SET latin1, "
        "e2 ENUM('a', 'ж') CHARACTER SET ucs2, s2 SET('a', '🐍') CHARACTER SET utf32, "
        "e3 ENUM('Ω', 'ж') CHARACTER SET utf8mb4)",
        "INSERT INTO m VALUES (1, 'ü', 'é,ü', 'ж', 'a,🐍', 'Ω')",
        changes=1,
    )
    assert rows == [{"id": 1, "e1": "ü", "s1": "é,ü", "e2": "ж", "s2": "a,🐍", "e3": "Ω"}]
    assert snapshot_rows(tmp_path, mariadb_server, mysql_database, "m") == rows


def snapshot_rows(tmp_path: Path, server: MariaDBServer, db: str, table: str) -> list[Any]:
    """The initial snapshot's rows of ``db.table``, in key order."""
    source = MySQLSource(MySQLOptions(dsn=server.dsn(), tables=[f"{db}.{table}"]))
    context = SourceContext(
        "snap", tmp_path / "snap", 4, threading.Event(), logging.getLogger("snap")
    )
    source.open(context, None)
    try:
        rows = []
        while (batch := source.read(0.5)) is not None:
            rows += [after(u) for u in batch.updates if u.op == "r"]
        return sorted(rows, key=lambda r: r["id"])
    finally:
        source.close()


def test_temporals_of_the_pre_10_1_format_decode_or_stop_with_the_fix(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    db = mysql_database
    source = open_source(tmp_path, mariadb_server, db)
    try:
        mariadb_server.sql("SET GLOBAL mysql56_temporal_format = OFF")
        try:
            mariadb_server.sql(
                "CREATE TABLE old0 (id INT PRIMARY KEY, t TIME, d DATETIME, s TIMESTAMP NULL)",
                "CREATE TABLE old3 (id INT PRIMARY KEY, t TIME(3))",
                database=db,
            )
        finally:
            mariadb_server.sql("SET GLOBAL mysql56_temporal_format = ON")
        mariadb_server.sql(
            "SET SESSION sql_mode = '', time_zone = '+00:00'",
            "INSERT INTO old0 VALUES (1, '-01:02:03', '2024-00-29 01:02:03', "
            "'2024-01-01 00:00:01'), (2, '838:59:59', '0000-00-00 00:00:00', 0)",
            database=db,
        )
        rows = [after(u) for u in read_updates(source, 2)]
        assert rows == [
            {"id": 1, "t": "-01:02:03", "d": "2024-00-29 01:02:03", "s": "2024-01-01 00:00:01"},
            {"id": 2, "t": "838:59:59", "d": "0000-00-00 00:00:00", "s": "0000-00-00 00:00:00"},
        ]
        mariadb_server.sql("INSERT INTO old3 VALUES (1, '01:02:03.5')", database=db)
        with pytest.raises(SourceError) as stopped:
            read_updates(source, 1)
        message = str(stopped.value)
        assert f"{db}.old3 has columns in the temporal format of MariaDB before 10.1" in message
        assert f"ALTER TABLE `{db}`.`old3` FORCE" in message
    finally:
        source.close()


@pytest.mark.parametrize("image", ["MINIMAL", "NOBLOB"])
def test_a_partial_row_image_stops_the_source_naming_the_setting(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str, image: str
) -> None:
    # The server is checked for binlog_row_image=FULL at connect, but a session may set its
    # own: its images lack columns, which must not arrive as NULL (nor as a key change).
    mariadb_server.sql(
        "CREATE TABLE p (id INT PRIMARY KEY, n INT, b BLOB)",
        "INSERT INTO p VALUES (7, 1, 'kept')",
        database=mysql_database,
    )
    source = open_source(tmp_path, mariadb_server, mysql_database)
    try:
        mariadb_server.sql(
            f"SET SESSION binlog_row_image = '{image}'",
            "UPDATE p SET n = 2 WHERE id = 7",
            database=mysql_database,
        )
        with pytest.raises(SourceError, match="binlog_row_image") as raised:
            read_updates(source, 1)
        assert "the rows of" in str(raised.value) and ".p at " in str(raised.value)
    finally:
        source.close()


def test_compressed_binlog_events_stop_the_source_naming_the_setting(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    # With log_bin_compress=ON MariaDB writes *_COMPRESSED_EVENT row and query events, which
    # the replication library does not know: they were skipped, and their rows lost.
    db = mysql_database
    mariadb_server.sql("CREATE TABLE c (id INT PRIMARY KEY, t TEXT)", database=db)
    source = open_source(tmp_path, mariadb_server, db)
    try:
        try:
            mariadb_server.sql(
                "SET GLOBAL log_bin_compress_min_len = 10", "SET GLOBAL log_bin_compress = ON"
            )
            mariadb_server.sql(f"INSERT INTO c VALUES (1, '{'x' * 200}')", database=db)
        finally:
            mariadb_server.sql(
                "SET GLOBAL log_bin_compress = OFF", "SET GLOBAL log_bin_compress_min_len = 256"
            )
        mariadb_server.sql("INSERT INTO c VALUES (2, 'after')", database=db)
        with pytest.raises(SourceError, match="log_bin_compress") as raised:
            read_updates(source, 2)
        assert "compressed" in str(raised.value), raised.value
    finally:
        source.close()
    # A server that compresses is refused at the start, with the fix.
    try:
        mariadb_server.sql("SET GLOBAL log_bin_compress = ON")
        with pytest.raises(SourceError, match="SET GLOBAL log_bin_compress=OFF"):
            open_source(tmp_path, mariadb_server, db).close()
    finally:
        mariadb_server.sql("SET GLOBAL log_bin_compress = OFF")
