"""Schema changes recorded in the WAL, at their own position: the schema trigger.

pgoutput's Relation message does not say which columns are a ``REPLICA IDENTITY FULL``
or ``NOTHING`` table's primary key, and the catalog says it only for the table as it is
now. An event trigger (``ddl_command_end`` and ``sql_drop``) closes the gap: inside the
DDL's own transaction it writes a transactional logical decoding message (prefix
:data:`PREFIX`) describing each table the command created, altered or dropped, *after*
the command. The message reaches the stream between the changes before the command and
the changes after it, so the source knows every table's columns, primary key and replica
identity at every point of the WAL, however late it decodes it.

One trigger serves every pipeline of the database. Creating an event trigger needs a
superuser; the function runs as its owner (``SECURITY DEFINER``), so DDL by any user is
recorded. The function has no exception handler: with one, logical decoding (PostgreSQL 15)
returned the message, emitted in the handler's subtransaction, after the changes its
transaction made later rather than at its own position. An error in it fails the DDL, as in
any event trigger.
"""

from __future__ import annotations

from typing import Any

import msgspec

from wormhole.connectors.postgres.schema_history import Entry

PREFIX = "wormhole.schema"
"""The logical decoding message prefix of the schema trigger's messages."""

FUNCTION = "public.wormhole_schema_change"
TRIGGERS = ("wormhole_schema_change_end", "wormhole_schema_change_drop")

MINIMUM_VERSION = 140000
"""pgoutput sends logical decoding messages from PostgreSQL 14 on."""

_COLUMNS = (
    "SELECT coalesce(json_agg(json_build_array(a.attname, a.atttypid::int8, a.atttypmod) "
    "ORDER BY a.attnum), '[]') FROM pg_catalog.pg_attribute a WHERE a.attrelid = rel "
    "AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''"
)
_TYPES = (
    "SELECT coalesce(json_agg(format_type(a.atttypid, a.atttypmod) ORDER BY a.attnum), '[]') "
    "FROM pg_catalog.pg_attribute a WHERE a.attrelid = rel AND a.attnum > 0 AND NOT "
    "a.attisdropped AND a.attgenerated = ''"
)
_INDEX = (
    "SELECT coalesce(json_agg(a.attname ORDER BY a.attnum), '[]') FROM pg_catalog.pg_index i "
    "JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
    "WHERE i.indrelid = rel AND i.{}"
)

INSTALL = f"""
CREATE OR REPLACE FUNCTION {FUNCTION}() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $wormhole$
DECLARE
  r record;
  rel oid;
  seen oid[] := '{{}}';
BEGIN
  IF tg_event = 'sql_drop' THEN
    FOR r IN SELECT * FROM pg_event_trigger_dropped_objects()
             WHERE classid = 'pg_class'::regclass AND objsubid = 0
               AND object_type IN ('table', 'partitioned table') LOOP
      PERFORM pg_logical_emit_message(true, '{PREFIX}', json_build_object(
        'tag', tg_tag, 'oid', r.objid::int8, 'schema', r.schema_name, 'name', r.object_name,
        'dropped', true, 'ddl', current_query())::text);
    END LOOP;
    RETURN;
  END IF;
  FOR r IN SELECT * FROM pg_event_trigger_ddl_commands()
           WHERE classid = 'pg_class'::regclass LOOP
    SELECT CASE WHEN c.relkind IN ('i', 'I') THEN i.indrelid ELSE c.oid END INTO rel
      FROM pg_class c LEFT JOIN pg_index i ON i.indexrelid = c.oid WHERE c.oid = r.objid;
    IF rel IS NULL THEN
      CONTINUE;
    END IF;
    -- The table and the tables under it (partitions, inheritance children): a command on
    -- a parent changes them too, and their changes are streamed under their own names.
    FOR rel IN WITH RECURSIVE tree(oid) AS (
                 SELECT rel UNION SELECT i.inhrelid FROM pg_inherits i
                 JOIN tree ON i.inhparent = tree.oid)
               SELECT tree.oid FROM tree WHERE tree.oid <> ALL(seen) LOOP
      seen := seen || rel;
      PERFORM pg_logical_emit_message(true, '{PREFIX}', json_build_object(
        'tag', r.command_tag, 'oid', rel::int8, 'schema', n.nspname, 'name', c.relname,
        'identity', c.relreplident,
        'columns', ({_COLUMNS}),
        'primary_key', ({_INDEX.format("indisprimary")}),
        'identity_index', ({_INDEX.format("indisreplident")}),
        'types', ({_TYPES}),
        'publications', (SELECT coalesce(json_agg(p.pubname), '[]')
                         FROM pg_publication_tables p
                         WHERE p.schemaname = n.nspname AND p.tablename = c.relname),
        'ddl', current_query())::text)
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE c.oid = rel AND c.relkind IN ('r', 'p');
    END LOOP;
  END LOOP;
END
$wormhole$;
DO $wormhole$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_event_trigger WHERE evtname = '{TRIGGERS[0]}') THEN
    CREATE EVENT TRIGGER {TRIGGERS[0]} ON ddl_command_end EXECUTE FUNCTION {FUNCTION}();
  END IF;
  IF NOT EXISTS (SELECT 1 FROM pg_event_trigger WHERE evtname = '{TRIGGERS[1]}') THEN
    CREATE EVENT TRIGGER {TRIGGERS[1]} ON sql_drop EXECUTE FUNCTION {FUNCTION}();
  END IF;
END
$wormhole$;
"""
"""SQL that installs the schema trigger (idempotent; run as a superuser)."""

REMOVE = f"""
DROP EVENT TRIGGER IF EXISTS {TRIGGERS[0]};
DROP EVENT TRIGGER IF EXISTS {TRIGGERS[1]};
DROP FUNCTION IF EXISTS {FUNCTION}();
"""
"""SQL that removes the schema trigger."""

INSTALLED = (
    "SELECT count(*) FROM pg_event_trigger WHERE evtname IN %s AND evtenabled <> 'D'",
    (TRIGGERS,),
)
"""A query (with its arguments) whose one value is 2 when the trigger is installed."""

PRIVILEGE_HINT = (
    "creating an event trigger needs a superuser; connect as one (or have one run "
    "`wormhole postgres-schema-trigger PIPELINE --sql` and the SQL it prints)"
)


class SchemaMessage(msgspec.Struct):
    """One message of the schema trigger."""

    tag: str
    oid: int
    schema: str
    name: str
    ddl: str = ""
    dropped: bool = False
    identity: str = ""
    columns: list[tuple[str, int, int]] = msgspec.field(default_factory=list)
    primary_key: list[str] = msgspec.field(default_factory=list)
    identity_index: list[str] = msgspec.field(default_factory=list)
    types: list[str] = msgspec.field(default_factory=list)
    """Each column's type as SQL writes it (``character varying(20)``)."""
    publications: list[str] = msgspec.field(default_factory=list)
    """The publications that published the table after the command."""

    @property
    def table(self) -> str:
        return f"{self.schema}.{self.name}"

    def entry(self, lsn: int, index: int, published: bool) -> Entry:
        """The table's version after the command, at (commit LSN, index of the message in
        its transaction); a drop is an entry without identity."""
        identity = "" if self.dropped else self.identity
        return Entry(lsn, identity, list(self.columns), self.primary_key, index, True, published)

    def event(self) -> dict[str, Any]:
        """The row of the schema-change event (see docs/postgres.md)."""
        row: dict[str, Any] = {"table": self.table, "tag": self.tag, "ddl": self.ddl}
        if self.dropped:
            row["dropped"] = True
            return row
        row["columns"] = [
            {"name": name, "type": type_}
            for (name, _oid, _typmod), type_ in zip(self.columns, self.types, strict=False)
        ]
        row["primary_key"] = self.primary_key
        row["replica_identity"] = _IDENTITIES.get(self.identity, self.identity)
        if self.identity == "i":
            row["identity_index"] = self.identity_index
        return row


_IDENTITIES = {"d": "default", "f": "full", "n": "nothing", "i": "index"}

EVENTS_TABLE = "wormhole.schema_changes"
"""The table name of schema-change events (``schema_events``)."""


_decode = msgspec.json.Decoder(SchemaMessage).decode


def parse(content: bytes) -> SchemaMessage:
    """A message's content; ``msgspec.ValidationError``/``DecodeError`` if it is not one."""
    return _decode(content)


def installed(query: Any) -> bool:
    """Whether the trigger is installed and enabled (``query(sql, args)`` returns rows)."""
    return bool(query(*INSTALLED)[0][0] == len(TRIGGERS))
