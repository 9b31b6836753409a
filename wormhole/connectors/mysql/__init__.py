"""The ``mysql`` source and position mapper (needs the ``mysql`` extra: mysql-replication)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from wormhole.connectors.mysql.options import MySQLOptions
from wormhole.core.update import Update
from wormhole.plugins.components import Capabilities, Options, Version, log_reader


def _source(options: MySQLOptions) -> Any:
    from wormhole.connectors.mysql.source import MySQLSource

    return MySQLSource(options)


class MapperOptions(Options):
    """Where to look positions up."""

    dsn: str | None = Field(
        None,
        description="the server whose binlog the positions refer to (mysql://...); needed to "
        "map positions, not for versions",
    )


class MySQLPositionMapper:
    """Native ``<binlog file>:<offset of the GTID event>:<index>`` <-> GTID, by asking
    the server (``SHOW BINLOG EVENTS``).

    A GTID names a whole transaction: mapped to native it means "before the first
    change of that transaction" (index -1). Binlog file names and offsets differ
    on every copy of a database; GTIDs do not, so compare logical positions across
    servers.

    Versions (MariaDB): ``logical`` is the transaction's GTID
    ``domain-server-sequence`` and the last part of ``position`` the change's index
    in the transaction; a change's version is ``(sequence, index + 1)``. MariaDB keeps
    a domain's sequence numbers increasing across servers, so versions stay
    comparable after the source moves to a replica. A snapshot read is ``(lowest
    sequence in the snapshot's GTID position, 0)``. A backfilled row (op ``r`` at a
    backfill's high watermark, whose GTID is its logical position) is ``(sequence of the
    watermark's transaction, 0)``: above every change before the watermark, below every
    change after it. Sequence numbers of different
    GTID domains are compared as they are, so rows written through several domains
    get no protection beyond per-key order. MySQL GTIDs (``uuid:sequence``) restart
    with every server uuid: they give no version.
    """

    def __init__(self, options: MapperOptions) -> None:
        self.settings = MySQLOptions(dsn=options.dsn).connection() if options.dsn else None

    def version(self, update: Update) -> Version | None:
        if ":" in update.logical:
            return None  # MySQL uuid:sequence
        if update.op == "r":
            parts = [p for p in update.logical.split(",") if p.strip()]
            if not parts:
                return None
            return (min(_gtid_sequence(p) for p in parts), 0)
        index = update.position.rsplit(":", 1)[1]
        return (_gtid_sequence(update.logical), int(index) + 1)

    def _events(self, sql: str, args: Any = None) -> list[tuple[Any, ...]]:
        import pymysql

        if self.settings is None:
            raise ValueError(
                "position_mapper mysql: set its dsn to the server whose binlog the positions "
                "refer to"
            )
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


def _gtid_sequence(gtid: str) -> int:
    parts = gtid.strip().split("-")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a MariaDB GTID: {gtid!r}")
    return int(parts[2])


def _gtid_of(info: str) -> str:
    # MariaDB shows "BEGIN GTID 0-1-5" or "GTID 0-1-5"; MySQL "SET @@SESSION.GTID_NEXT= 'u:5'".
    text = info.strip().rstrip(";")
    if "GTID_NEXT" in text:
        return text.split("=", 1)[1].strip().strip("'")
    return text.split()[-1]


wormhole_sources, wormhole_position_mappers = log_reader(
    "mysql",
    source=_source,
    options=MySQLOptions,
    description="MariaDB / MySQL row-based binlog, with an initial snapshot and GTIDs.",
    capabilities=Capabilities(backfill=True, snapshot_pending=True, lag=True),
    mapper=MySQLPositionMapper,
    mapper_options=MapperOptions,
    mapper_description="binlog file:offset:index <-> GTID, looked up on the server.",
)
