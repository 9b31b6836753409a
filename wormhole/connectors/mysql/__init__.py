"""The ``mysql`` source and position mapper (needs the ``mysql`` extra: mysql-replication)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from wormhole.connectors.mysql.options import MySQLOptions
from wormhole.plugins.components import ComponentSpec, Options
from wormhole.plugins.hookspecs import hookimpl


def _source(options: MySQLOptions) -> Any:
    from wormhole.connectors.mysql.source import MySQLSource

    return MySQLSource(options)


class MapperOptions(Options):
    """Where to look positions up."""

    dsn: str = Field(description="the server whose binlog the positions refer to (mysql://...)")


class MySQLPositionMapper:
    """Native ``<binlog file>:<offset of the GTID event>:<index>`` <-> GTID, by asking
    the server (``SHOW BINLOG EVENTS``).

    A GTID names a whole transaction: mapped to native it means "before the first
    change of that transaction" (index -1). Binlog file names and offsets differ
    on every copy of a database; GTIDs do not, so compare logical positions across
    servers.
    """

    def __init__(self, options: MapperOptions) -> None:
        self.settings = MySQLOptions(dsn=options.dsn).connection()

    def _events(self, sql: str, args: Any = None) -> list[tuple[Any, ...]]:
        import pymysql

        conn = pymysql.connect(**self.settings, autocommit=True)
        try:
            with conn.cursor() as cur:
                cur.execute(sql, args)
                return list(cur.fetchall())
        finally:
            conn.close()

    def to_logical(self, native: str) -> str:
        file, _, rest = native.partition(":")
        pos = int(rest.partition(":")[0])
        for row in self._events(f"SHOW BINLOG EVENTS IN %s FROM {pos} LIMIT 1", (file,)):
            if str(row[2]).lower() == "gtid":
                return _gtid_of(str(row[5]))
        raise ValueError(f"no GTID event at {file}:{pos} (purged, or not a transaction start)")

    def to_native(self, logical: str) -> str:
        files = [str(r[0]) for r in self._events("SHOW BINARY LOGS")]
        for file in reversed(files):
            for row in self._events("SHOW BINLOG EVENTS IN %s", (file,)):
                if str(row[2]).lower() == "gtid" and _gtid_of(str(row[5])) == logical:
                    return f"{file}:{row[1]}:-1"
        raise ValueError(f"GTID {logical} is not in the server's binlogs (purged?)")


def _gtid_of(info: str) -> str:
    # MariaDB shows "BEGIN GTID 0-1-5" or "GTID 0-1-5"; MySQL "SET @@SESSION.GTID_NEXT= 'u:5'".
    text = info.strip().rstrip(";")
    if "GTID_NEXT" in text:
        return text.split("=", 1)[1].strip().strip("'")
    return text.split()[-1]


@hookimpl
def wormhole_sources() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            kind="source",
            name="mysql",
            factory=_source,
            options=MySQLOptions,
            description="MariaDB / MySQL row-based binlog, with an initial snapshot and GTIDs.",
        )
    ]


@hookimpl
def wormhole_position_mappers() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            kind="position_mapper",
            name="mysql",
            factory=MySQLPositionMapper,
            options=MapperOptions,
            description="binlog file:offset:index <-> GTID, looked up on the server.",
        )
    ]
