"""What the ``postgres`` source reads from PostgreSQL's catalog: the base types of domains
(for each column's JSON kind), each table's key at a point of the WAL (the Relation message's
flags, the schema history, the catalog), and the column descriptions of typed envelopes."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from wormhole.connectors.postgres import pgoutput as pg
from wormhole.connectors.postgres.schema_history import Columns, Entry
from wormhole.connectors.postgres.sql import constant
from wormhole.core.update import ColumnType, encode_columns

if TYPE_CHECKING:
    from wormhole.connectors.postgres.source import PostgresSource

log = logging.getLogger("wormhole.postgres")


# The first minor release of each major version that writes an unchanged TOASTed
# replica identity value to the WAL (as part of the old key) when an update leaves it
# alone; before it, such an update carries no value of the key at all.
_LOGS_UNCHANGED_TOASTED_KEYS = {10: 21, 11: 16, 12: 11, 13: 7, 14: 3}


def logs_unchanged_toasted_keys(server_version_num: int) -> bool:
    """Whether a server of this version writes an update's unchanged TOASTed key to the WAL."""
    major, minor = divmod(server_version_num, 10000)
    if major >= 15:
        return True
    return minor >= _LOGS_UNCHANGED_TOASTED_KEYS.get(major, 10**4)


def signature(relation: pg.Relation) -> Columns:
    return [(c.name, c.type_oid, c.typmod) for c in relation.columns]


class CatalogTable(NamedTuple):
    """A table as the catalog describes it (now, or in the snapshot being read)."""

    identity: str
    columns: Columns
    primary_key: list[str]
    identity_index: list[str]
    """The columns of the REPLICA IDENTITY USING INDEX index."""


class Catalog:
    """The catalog as one :class:`PostgresSource` reads it, on the source's connection (in
    the snapshot's transaction while there is one), at the transaction the stream is in."""

    def __init__(self, source: PostgresSource) -> None:
        self.source = source
        self.base_types: dict[int, int] = {}
        """Type oid -> base type oid (a domain's base; every other type itself)."""
        # What typed envelopes need (Update.columns and Update.details): per relation oid
        # its columns and the details' "schema"/"table" part.
        self.relation_columns: dict[int, msgspec.Raw] = {}
        self.relation_details: dict[int, str] = {}

    def resolve_types(self, relation: pg.Relation) -> None:
        """Resolve domain types to their base types, for the columns' JSON kinds."""
        source = self.source
        unknown = [c.type_oid for c in relation.columns if c.type_oid not in self.base_types]
        if unknown:
            rows = source._query(
                "WITH RECURSIVE t(oid, base) AS (SELECT oid, CASE WHEN typtype = 'd' THEN "
                "typbasetype ELSE oid END FROM pg_type WHERE oid = ANY(%s) UNION ALL "
                "SELECT t.oid, p.typbasetype FROM t JOIN pg_type p ON p.oid = t.base "
                "WHERE p.typtype = 'd') SELECT oid, base FROM t",
                (unknown,),
            )
            for oid, base in rows:
                self.base_types[oid] = base
        for column in relation.columns:
            column.kind = pg.value_kind(self.base_types.get(column.type_oid, column.type_oid))
        relation.refresh()

    def describe(self, relation: pg.Relation) -> None:
        """A Relation message: its columns' kinds, and its key at this point of the WAL."""
        self.resolve_types(relation)
        relation.key_columns = self.stream_key(relation)
        self.describe_columns(relation)

    def describe_columns(self, relation: pg.Relation) -> None:
        """The relation's ``columns`` and its part of ``details`` (see Update)."""
        if not self.source.describe:
            return
        columns, part = self.column_description(relation)
        self.relation_columns[relation.oid] = columns
        self.relation_details[relation.oid] = part

    def column_description(self, relation: pg.Relation) -> tuple[msgspec.Raw, str]:
        """``Update.columns`` of the relation's columns, and the "schema"/"table" part of
        its ``details``."""
        source = self.source
        oids = [self.base_types.get(c.type_oid, c.type_oid) for c in relation.columns]
        mods = [c.typmod for c in relation.columns]
        types = source._query(
            "SELECT format_type(t.oid, NULLIF(t.mod, -1)) FROM unnest(%s::oid[], %s::int4[]) "
            "WITH ORDINALITY AS t(oid, mod, n) ORDER BY t.n",
            (oids, mods),
        )
        catalog = {
            name: (not_null, constant(default))
            for name, not_null, default in source._query(
                "SELECT a.attname::text, a.attnotnull, pg_get_expr(d.adbin, d.adrelid) FROM "
                "pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = "
                "a.attnum WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped",
                (relation.oid,),
            )
        }
        described = []
        for column, (type_name,) in zip(relation.columns, types, strict=True):
            not_null, default = catalog.get(column.name, (False, None))
            described.append(ColumnType(column.name, type_name, not not_null, default))
        part = f'"schema":{json.dumps(relation.schema)},"table":{json.dumps(relation.name)},'
        return encode_columns(described), part

    def stream_key(self, relation: pg.Relation) -> list[str]:
        source = self.source
        # One rule for snapshot and stream, so a row always lands in the same shard: the
        # replica identity index (USING INDEX), else the primary key, else every column.
        # The Relation message flags the identity columns as they were when the change
        # was made, so DEFAULT and USING INDEX need no catalog (which may have moved on).
        names = [c.name for c in relation.columns]
        identity = relation.replica_identity
        if identity in ("f", "n"):
            return self._recorded_primary_key(relation) or names
        flagged = [c.name for c in relation.columns if c.key]
        if identity == "d":
            assert source.history is not None
            source.history.record(
                relation.oid, Entry(source.txn_lsn, identity, signature(relation), flagged)
            )
        # DEFAULT without flags: no primary key. USING INDEX without flags: the index
        # was dropped, which PostgreSQL treats as NOTHING.
        return flagged or names

    def _recorded_primary_key(self, relation: pg.Relation) -> list[str]:
        """The primary key of a FULL or NOTHING table as it was when its change was made.

        The Relation message does not say it: the catalog does while it still describes
        the table the message describes, and the schema history keeps what was known.
        """
        source = self.source
        history = source.history
        assert history is not None
        oid, lsn = relation.oid, source.txn_lsn
        columns = signature(relation)
        names = [c.name for c in relation.columns]
        written = history.in_band_at(oid, lsn, source.txn.index + 1)
        if (
            written is not None
            and written.identity == relation.replica_identity
            and set(columns) <= set(written.columns)
        ):
            # The schema trigger wrote the table's version into the WAL: exact.
            return [n for n in names if n in written.primary_key]
        table = self.tables([oid]).get(oid)
        if (
            table is not None
            and table.identity == relation.replica_identity
            and table.columns == columns
        ):
            key = table.primary_key
        else:
            entry = history.with_columns(oid, lsn, columns)
            if entry is not None:
                key = entry.primary_key
            else:
                key, how = self._guess_primary_key(relation, table, set(names))
                log.warning(
                    "the primary key of %s at %s is not known: the table was altered or "
                    "dropped before this part of the WAL was decoded, and the schema history "
                    "holds no version of it with these columns; keying its changes by %s (%s)",
                    relation.table,
                    pg.lsn_text(lsn),
                    how,
                    ", ".join(key or names),
                )
        key = [n for n in names if n in key]  # in column order, as for DEFAULT tables
        history.record(oid, Entry(lsn, relation.replica_identity, columns, key))
        return key

    def _guess_primary_key(
        self, relation: pg.Relation, table: CatalogTable | None, names: set[str]
    ) -> tuple[list[str], str]:
        source = self.source
        assert source.history is not None
        for entry in source.history.nearest(relation.oid, source.txn_lsn):
            if set(entry.primary_key) <= names:
                return entry.primary_key, f"the primary key recorded at {pg.lsn_text(entry.lsn)}"
        if table is not None and table.primary_key and set(table.primary_key) <= names:
            return table.primary_key, "the current primary key"
        return [], "every column"

    def tables(self, oids: list[int] | None = None) -> dict[int, CatalogTable]:
        """The catalog's description of tables: of ``oids``, or of the publication's."""
        source = self.source
        generated = " AND a.attgenerated = ''" if source.server_version >= 120000 else ""
        columns = (
            "FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT "
            f"a.attisdropped{generated} ORDER BY a.attnum"
        )
        index = (
            "FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = "
            "ANY(i.indkey) WHERE i.indrelid = c.oid AND i.{} ORDER BY a.attnum"
        )
        if oids is None:
            where = (
                "c.oid IN (SELECT (quote_ident(schemaname) || '.' || quote_ident(tablename))"
                "::regclass FROM pg_publication_tables WHERE pubname = %s)"
            )
            args: tuple[Any, ...] = (source.publication,)
        else:
            where, args = "c.oid = ANY(%s::oid[])", (oids,)
        rows = source._query(
            f"SELECT c.oid::int8, c.relreplident::text, "
            f"ARRAY(SELECT a.attname::text {columns}), ARRAY(SELECT a.atttypid::int8 {columns}), "
            f"ARRAY(SELECT a.atttypmod {columns}), "
            f"ARRAY(SELECT a.attname::text {index.format('indisprimary')}), "
            f"ARRAY(SELECT a.attname::text {index.format('indisreplident')}) "
            f"FROM pg_class c WHERE {where}",
            args,
        )
        return {
            oid: CatalogTable(
                identity,
                list(zip(names, types, typmods, strict=True)),
                primary_key,
                identity_index,
            )
            for oid, identity, names, types, typmods, primary_key, identity_index in rows
        }

    def record_published_tables(self) -> None:
        """The schema history starts with the publication's tables at the slot's start."""
        source = self.source
        assert source.history is not None
        source.history.reset(
            {
                oid: Entry(source.snapshot_lsn, table.identity, table.columns, table.primary_key)
                for oid, table in self.tables().items()
            }
        )
        source.history.save()

    def warn_about_out_of_line_keys(self) -> None:
        source = self.source
        if logs_unchanged_toasted_keys(source.server_version):
            return
        tables = self._out_of_line_key_tables()
        if tables:
            log.warning(
                "PostgreSQL %s does not write a key value stored out of line (TOAST) "
                "to the WAL when an update leaves it unchanged, and such an update stops the "
                "pipeline (its key is unknown). The key columns of these tables can be stored "
                "out of line: %s. Set ALTER TABLE <table> REPLICA IDENTITY FULL on them, or "
                "upgrade to a minor release that writes the value (10.21, 11.16, 12.11, 13.7, "
                "14.3 or later)",
                source.server_version,
                ", ".join(tables),
            )

    def _out_of_line_key_tables(self) -> list[str]:
        """Published tables keyed by their replica identity whose key can be TOASTed."""
        source = self.source
        rows = source._query(
            "SELECT DISTINCT t.schemaname, t.tablename FROM pg_publication_tables t "
            "JOIN pg_namespace n ON n.nspname = t.schemaname JOIN pg_class c ON "
            "c.relnamespace = n.oid AND c.relname = t.tablename JOIN pg_index i ON "
            "i.indrelid = c.oid AND CASE c.relreplident WHEN 'd' THEN i.indisprimary "
            "WHEN 'i' THEN i.indisreplident ELSE false END JOIN pg_attribute a ON "
            "a.attrelid = c.oid AND a.attnum = ANY(i.indkey) WHERE t.pubname = %s AND "
            "a.attstorage <> 'p' ORDER BY 1, 2",
            (source.publication,),
        )
        return [f"{schema}.{name}" for schema, name in rows]
