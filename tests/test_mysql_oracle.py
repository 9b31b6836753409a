"""The mysql source against the server's own binlog decoder.

A workload of many column types runs on a real MariaDB server; the same binlog is then
decoded by the ``mysql`` source and by ``mariadb-binlog -vv --base64-output=DECODE-ROWS
--print-table-metadata``, and the two are compared change by change, value by value.
Only the renderings docs/mysql.md documents are normalised (``normalise``): the server's
tool prints raw bytes, ENUM indexes, SET bitmasks, TIMESTAMP seconds and YEAR 0 as 1900,
where the source gives text, members, UTC datetimes and ``0000``. Text bytes are turned
into text by the server itself (``CONVERT ... USING utf8mb4``), not by the source's code.
"""

from __future__ import annotations

import datetime
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from test_mysql_values import open_source

from wormhole.testing.helpers import read_updates
from wormhole.testing.mysql import MariaDBServer

FSPS = range(7)
TEMPORALS = (
    ", ".join(f"dt{n} DATETIME({n}), ts{n} TIMESTAMP({n}) NULL, tm{n} TIME({n})" for n in FSPS)
    + ", d DATE, y YEAR"
)


def temporal_row(i: int, dt: str, ts: str, tm: str, d: str, y: str) -> str:
    parts = ", ".join(f"'{dt}', '{ts}', '{tm}'" for _ in FSPS)
    return f"({i}, {parts}, '{d}', {y})"


CHARSETS = ("latin1", "utf8mb3", "utf8mb4", "ucs2", "utf16", "utf16le", "utf32", "cp1251", "sjis")
TEXT = "abc é Ж ü ｶ €"

WORKLOAD = [
    "SET SESSION sql_mode = 'ALLOW_INVALID_DATES', time_zone = '+00:00'",
    # Numbers at their limits.
    "CREATE TABLE n (id INT PRIMARY KEY, ti TINYINT, tu TINYINT UNSIGNED, si SMALLINT, "
    "su SMALLINT UNSIGNED, mi MEDIUMINT, mu MEDIUMINT UNSIGNED, i INT, iu INT UNSIGNED, "
    "bi BIGINT, bu BIGINT UNSIGNED, d65 DECIMAL(65,30), d10 DECIMAL(10,0), "
    "d5 DECIMAL(5,5) UNSIGNED, d18 DECIMAL(18,9), f FLOAT, db DOUBLE, b1 BIT(1), b7 BIT(7), "
    "b8 BIT(8), b9 BIT(9), b63 BIT(63), b64 BIT(64))",
    "INSERT INTO n VALUES (1, -128, 255, -32768, 65535, -8388608, 16777215, -2147483648, "
    "4294967295, -9223372036854775808, 18446744073709551615, "
    "-99999999999999999999999999999999999.999999999999999999999999999999, -9999999999, 0.99999, "
    "-123456789.000000001, -3.4e38, -1.7976931348623157e308, 1, 127, 255, 511, "
    "9223372036854775807, 18446744073709551615)",
    "INSERT INTO n VALUES (2, 127, 0, 32767, 0, 8388607, 0, 2147483647, 0, 9223372036854775807, "
    "0, 0.000000000000000000000000000001, 0, 0, 0.5, 1.17549e-38, 2.2250738585072014e-308, 0, 0, "
    "0, 0, 0, 0)",
    "INSERT INTO n (id, f, db, d18) VALUES (3, 0.1, 0.1, 1.5)",
    "UPDATE n SET f = 3.25, db = -2.5e-300, d65 = 1, b9 = b'101' WHERE id = 3",
    "DELETE FROM n WHERE id = 2",
    # Every temporal type at every precision: zero, invalid and negative values.
    f"CREATE TABLE t (id INT PRIMARY KEY, {TEMPORALS})",
    "INSERT INTO t VALUES "
    + ", ".join(
        [
            temporal_row(
                1,
                "2024-02-29 23:59:59.999999",
                "2038-01-19 03:14:07.999999",
                "-838:59:59.999999",
                "2024-02-29",
                "2155",
            ),
            temporal_row(
                2, "0000-00-00 00:00:00", "0000-00-00 00:00:00", "-00:00:00.6", "0000-00-00", "0"
            ),
            temporal_row(
                3,
                "2024-00-15 10:00:00.5",
                "1970-01-01 00:00:01.5",
                "838:59:59.999999",
                "2024-05-00",
                "1901",
            ),
            temporal_row(
                4,
                "0000-01-01 23:59:59.999999",
                "2001-02-03 04:05:06.123456",
                "-01:02:03.04",
                "2001-02-29",
                "2000",
            ),
        ]
    ),
    "UPDATE t SET tm3 = '-00:00:00.001', dt6 = '2001-02-31 00:00:00.000001' WHERE id = 1",
    # Text in several character sets, bytes, JSON, geometry, INET6/UUID, generated columns.
    "CREATE TABLE s (id INT PRIMARY KEY, "
    + ", ".join(
        f"c_{c} CHAR(20) CHARACTER SET {c}, v_{c} VARCHAR(300) CHARACTER SET {c}, "
        f"t_{c} TEXT CHARACTER SET {c}"
        for c in CHARSETS
    )
    + ", bn BINARY(4), vb VARBINARY(20), tb TINYBLOB, bl BLOB, mb MEDIUMBLOB, lb LONGBLOB, "
    "js JSON, p POINT, g GEOMETRY, i6 INET6, u UUID, cw CHAR(100) CHARACTER SET utf8mb4, "
    "gv INT AS (id * 2) VIRTUAL, gs VARCHAR(30) AS (CONCAT('v', id)) STORED)",
    "INSERT INTO s (id, "
    + ", ".join(f"c_{c}, v_{c}, t_{c}" for c in CHARSETS)
    + ", bn, vb, tb, bl, mb, lb, js, p, g, i6, u, cw) VALUES (1, "
    + ", ".join(f"'{TEXT}', '{TEXT}  ', '{TEXT}'" for _ in CHARSETS)
    + ", x'0100', x'00ff00', x'', x'deadbeef', REPEAT(x'ab', 300), x'00', "
    "'{\"k\": [1, \"é\", null]}', POINT(1, 2), ST_GeomFromText('LINESTRING(0 0, 1 1)'), "
    "'::1', '123e4567-e89b-12d3-a456-426655440000', 'wide é 🐍')",
    "INSERT INTO s (id, c_latin1, v_latin1) VALUES (2, x'81', x'818d8f909d')",
    "INSERT INTO s (id) VALUES (3)",
    "UPDATE s SET v_utf32 = 'x', bn = x'ff', js = '[]' WHERE id = 1",
    # ENUM and SET before and after ALTER TABLE.
    "CREATE TABLE e (id INT PRIMARY KEY, e ENUM('x','y'), s SET('a','b','c'), b BINARY(2))",
    "INSERT INTO e VALUES (1, 'y', 'a,c', 'q'), (2, NULL, '', NULL)",
    "ALTER TABLE e MODIFY e ENUM('w','x','y','z'), MODIFY s SET('a','b','c','d'), "
    "MODIFY b BINARY(5)",
    "INSERT INTO e VALUES (3, 'w', 'd,a', 'qq'), (4, 'z', 'b', '')",
    "UPDATE e SET s = 'a,b,c,d', e = 'x' WHERE id = 1",
    # SET and ENUM values of 2 to 8 bytes.
    "CREATE TABLE w (id INT PRIMARY KEY, s SET("
    + ", ".join(f"'m{i}'" for i in range(64))
    + "), e ENUM("
    + ", ".join(f"'e{i}'" for i in range(300))
    + "), s9 SET("
    + ", ".join(f"'n{i}'" for i in range(9))
    + "))",
    "INSERT INTO w VALUES (1, 'm0,m31,m63', 'e299', 'n8'), (2, '', 'e0', 'n0,n8')",
    # A table without a primary key: keyed by every column, duplicates included.
    "CREATE TABLE nk (a INT, b VARCHAR(10), c DATETIME(3))",
    "INSERT INTO nk VALUES (1, 'x', '2024-01-01 00:00:00.5'), (1, 'x', '2024-01-01 00:00:00.5'), "
    "(NULL, NULL, NULL)",
    "UPDATE nk SET b = 'y' WHERE a = 1",
    "DELETE FROM nk WHERE a IS NULL",
]


# ------------------------------------------------------------------ the server's decoder
@dataclass
class Column:
    name: str
    type: str  # as --print-table-metadata shows it

    @property
    def base(self) -> str:
        return self.type.split("(")[0].split(" ")[0].upper()

    @property
    def charset(self) -> str | None:
        found = re.search(r" CHARSET (\w+)", self.type)
        return found.group(1) if found else None

    @property
    def members(self) -> list[str]:
        inside = self.type[self.type.index("(") + 1 : self.type.index(")")]
        return [m.strip("'") for m in inside.split(",")]

    @property
    def length(self) -> int:
        found = re.match(r"\w+\((\d+)", self.type)
        return int(found.group(1)) if found else 0


@dataclass
class Change:
    op: str  # INSERT, UPDATE, DELETE
    table: str
    columns: list[Column]
    key: list[str]
    images: list[dict[int, bytes | None]] = field(default_factory=list)


def server_decoded(server: MariaDBServer, file: str, start: int) -> list[Change]:
    """The row changes of the binlog after ``file:start``, as ``mariadb-binlog`` prints them."""
    tool = shutil.which("mariadb-binlog") or shutil.which("mysqlbinlog")
    if tool is None:
        pytest.skip("mariadb-binlog (Debian package mariadb-client) is not installed")
    printed = subprocess.run(
        [
            tool,
            "--read-from-remote-server",
            f"--host={server.host}",
            f"--port={server.port}",
            f"--user={server.user}",
            f"--start-position={start}",
            "-vv",
            "--base64-output=DECODE-ROWS",
            "--print-table-metadata",
            file,
        ],
        check=True,
        capture_output=True,
        timeout=60,
    ).stdout
    changes: list[Change] = []
    columns: list[Column] = []
    key: list[str] = []
    in_columns = False
    for line in printed.split(b"\n"):
        if line.startswith(b"# Columns("):
            columns, key, in_columns = [], [], True
            line = b"#" + line[len(b"# Columns(") :]
        if in_columns and line.startswith(b"#") and b"`" in line:
            text = line.decode("utf-8", "replace").strip("# ")
            name, _, rest = text[1:].partition("` ")
            columns.append(Column(name, rest[:-1]))
            in_columns = not text.endswith(")") or text.endswith(",")
            continue
        in_columns = False
        if line.startswith(b"# Primary Key("):
            key = [k.strip() for k in line[len(b"# Primary Key(") : -1].decode().split(",")]
        match = re.match(rb"^### (INSERT INTO|UPDATE|DELETE FROM) `([^`]+)`\.`([^`]+)`$", line)
        if match:
            op = match.group(1).split(b" ")[0].decode()
            table = f"{match.group(2).decode()}.{match.group(3).decode()}"
            changes.append(Change(op, table, columns, key))
        elif line in (b"### SET", b"### WHERE"):
            changes[-1].images.append({})
        elif line.startswith(b"###   @"):
            value = re.match(rb"^###   @(\d+)=(.*) /\* [^*]* \*/$", line, re.S)
            assert value is not None, line
            printed_value = value.group(2).rstrip()
            changes[-1].images[-1][int(value.group(1))] = (
                None if printed_value == b"NULL" else printed_value
            )
    return changes


def _unquote(printed: bytes) -> bytes:
    """The bytes of a string as ``mariadb-binlog`` quotes it: bytes below 0x20 as \\xNN."""
    assert printed[:1] == b"'" and printed[-1:] == b"'", printed
    return re.sub(rb"\\x([0-9a-f]{2})", lambda m: bytes.fromhex(m.group(1).decode()), printed[1:-1])


class Normaliser:
    """The server tool's printed values, rendered as docs/mysql.md documents."""

    def __init__(
        self,
        server: MariaDBServer,
        unsigned: set[tuple[str, str]],
        members: dict[tuple[str, str], list[str]],
    ) -> None:
        self.conn = server.connect()
        self.unsigned = unsigned
        self.members_now = members

    def members(self, table: str, column: Column) -> list[str]:
        """The members the table map had; the tool shortens long lists (``'m1...``), whose
        tables the workload does not alter: then the catalog's."""
        if "..." in column.type:
            return self.members_now[(table, column.name)]
        return column.members

    def text(self, raw: bytes, charset: str) -> tuple[str, bool]:
        """The server's conversion of ``raw`` to text; whether it lost a character."""
        with self.conn.cursor() as cur:
            cur.execute(
                f"SELECT CONVERT(CAST(UNHEX(%s) AS CHAR CHARACTER SET {charset}) USING utf8mb4)",
                (raw.hex(),),
            )
            (text,) = cur.fetchone()
        return text, text.count("?") > raw.count(b"?")

    def value(self, table: str, column: Column, printed: bytes | None, ours: Any) -> Any:
        if printed is None:
            return None
        base, text = column.base, printed.decode("latin-1")
        if base in ("TINYINT", "SMALLINT", "MEDIUMINT", "INT", "BIGINT"):
            signed, _, unsigned = text.partition(" (")
            return int(
                unsigned[:-1] if unsigned and (table, column.name) in self.unsigned else signed
            )
        if base == "FLOAT":  # printed with %g: the source's shortest decimal, printed so
            assert isinstance(ours, float) and f"{ours:g}" == text.strip()
            return ours
        if base == "DOUBLE":  # printed with %.20g
            assert isinstance(ours, float) and f"{ours:.20g}" == text
            return ours
        if base == "DECIMAL":
            return text
        if base == "BIT":
            return text[2:-1]
        if base == "YEAR":
            return "0000" if text == "1900" else text
        if base == "ENUM":
            return ["", *self.members(table, column)][int(text)]
        if base == "SET":  # the stored bytes (little-endian), each printed in binary
            bits = text[2:-1]
            stored = bytes(int(bits[i : i + 8], 2) for i in range(0, len(bits), 8))
            mask = int.from_bytes(stored, "little")
            members = self.members(table, column)
            return ",".join(m for i, m in enumerate(members) if mask >> i & 1)
        if base == "TIMESTAMP":
            seconds, _, frac = text.partition(".")
            fsp = column.length
            if int(seconds) == 0 and not frac.strip("0"):
                stamp = "0000-00-00 00:00:00"
            else:
                stamp = datetime.datetime.fromtimestamp(int(seconds), datetime.UTC).strftime(
                    "%Y-%m-%d %H:%M:%S"
                )
            return stamp + ("." + frac if fsp else "")
        raw = _unquote(printed)
        if base == "DATE":
            return raw.decode().replace(":", "-")
        if base in ("DATETIME", "TIME"):
            return raw.decode()
        charset = column.charset
        if charset is None or charset == "binary":  # BINARY(n) is padded to n bytes
            padded = raw.ljust(column.length, b"\0") if base == "BINARY" else raw
            return "\\x" + padded.hex()
        decoded, lossy = self.text(raw, charset)
        if lossy:  # a byte the server itself cannot convert: the source gives the bytes
            return {"undecoded": raw.hex()}
        return decoded


def test_values_agree_with_the_servers_own_binlog_decoder(
    tmp_path: Path, mariadb_server: MariaDBServer, mysql_database: str
) -> None:
    db = mysql_database
    ((file, start, *_),) = mariadb_server.sql("SHOW MASTER STATUS")
    source = open_source(tmp_path, mariadb_server, db)
    try:
        mariadb_server.sql(*WORKLOAD, database=db)
        theirs = [c for c in server_decoded(mariadb_server, file, start) if c.table.startswith(db)]
        unsigned = {
            (f"{db}.{t}", c)
            for t, c in mariadb_server.sql(
                "SELECT TABLE_NAME, COLUMN_NAME FROM information_schema.COLUMNS WHERE "
                f"TABLE_SCHEMA = '{db}' AND COLUMN_TYPE LIKE '%unsigned%'"
            )
        }
        members = {
            (f"{db}.{t}", c): [m.strip("'") for m in kind[kind.index("(") + 1 : -1].split(",")]
            for t, c, kind in mariadb_server.sql(
                "SELECT TABLE_NAME, COLUMN_NAME, COLUMN_TYPE FROM information_schema.COLUMNS "
                f"WHERE TABLE_SCHEMA = '{db}' AND DATA_TYPE IN ('enum', 'set')"
            )
        }
        expected = expand(theirs)
        ours = read_updates(source, len(expected))
    finally:
        source.close()
    normaliser = Normaliser(mariadb_server, unsigned, members)
    compared = 0
    for (op, change, images), update in zip(expected, ours, strict=True):
        assert update.table == change.table and update.op == op, (update, change.op)
        for image, raw in zip(images, (update.before, update.after), strict=True):
            got = msgspec.json.decode(bytes(raw))
            if image is None:
                assert got is None
                continue
            assert list(got) == [c.name for c in change.columns]
            for i, column in enumerate(change.columns, start=1):
                mine = got[column.name]
                want = normaliser.value(change.table, column, image[i], mine)
                assert mine == want, (change.table, column.name, column.type, image[i])
                compared += 1
        key = change.key or [c.name for c in change.columns]
        row = msgspec.json.decode(bytes(update.after if op == "c" else update.before))
        assert msgspec.json.decode(msgspec.json.encode(update.key)) == {k: row[k] for k in key}
    assert compared > 500


def expand(theirs: list[Change]) -> list[tuple[str, Change, list[dict[int, bytes | None] | None]]]:
    """The server tool's changes as the source's ops: (op, change, [before, after])."""
    out: list[tuple[str, Change, list[dict[int, bytes | None] | None]]] = []
    for change in theirs:
        if change.op == "INSERT":
            out += [("c", change, [None, image]) for image in change.images]
        elif change.op == "DELETE":
            out += [("d", change, [image, None]) for image in change.images]
        else:
            names = [c.name for c in change.columns]
            key = [names.index(k) + 1 for k in (change.key or names)]
            for old, new in zip(change.images[::2], change.images[1::2], strict=True):
                if [old[k] for k in key] == [new[k] for k in key]:
                    out.append(("u", change, [old, new]))
                else:  # a key change: a delete of the old key, an insert of the new
                    out += [("d", change, [old, None]), ("c", change, [None, new])]
    return out
