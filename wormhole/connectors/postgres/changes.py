"""The updates of the ``postgres`` source's stream: a decoded change as updates (keys,
TOASTed values an update left alone, key changes), the ``columns`` and ``details`` of typed
envelopes, and the schema trigger's messages."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec

from wormhole.connectors.postgres import pgoutput as pg
from wormhole.connectors.postgres import schema_trigger
from wormhole.connectors.postgres.catalog import signature
from wormhole.connectors.postgres.sql import qualified
from wormhole.core.errors import SourceError
from wormhole.core.update import NULL, Update

if TYPE_CHECKING:
    from wormhole.connectors.postgres.source import PostgresSource

log = logging.getLogger("wormhole.postgres")

_encode = msgspec.json.Encoder().encode
_Raw = msgspec.Raw


class ChangeUpdates:
    """The updates of one :class:`PostgresSource`'s changes, at the transaction its stream
    is in (the source's ``txn_*``), with the relations the stream has read."""

    def __init__(self, source: PostgresSource, relations: dict[int, pg.Relation]) -> None:
        self.source = source
        self.relations = relations
        # What typed envelopes need (Update.columns and Update.details) per transaction;
        # per relation, the catalog keeps its part.
        self.txn_details_head = ""
        self.txn_details_mid = ""
        self.txn_details_tail = ""
        self.last_commit_lsn = "null"
        """The end LSN of the last transaction read (JSON-in-JSON), for ``sequence``."""

    def describe_transaction(self, commit_us: int) -> None:
        """The parts of ``details`` that a transaction's changes share."""
        source = self.source
        self.txn_details_head = (
            f'{{"connector":"postgresql","snapshot":"false","db":{source.database_json},'
            f'"sequence":"[{self.last_commit_lsn},\\"'
        )
        self.txn_details_mid = f'\\"]","ts_us":{commit_us},"ts_ns":{commit_us}000,'
        self.txn_details_tail = f'"txId":{source.txn.id},"lsn":'

    def describe_change(self, relation: pg.Relation, lsn: int) -> None:
        """``columns`` and ``details`` of the change at ``lsn`` (the message's own WAL
        position), for :meth:`insert` and the source's ``_update``."""
        source = self.source
        catalog = source.catalog
        source.txn.columns = catalog.relation_columns.get(relation.oid, NULL)
        source.txn.details = _Raw(
            f"{self.txn_details_head}{lsn}{self.txn_details_mid}"
            f"{catalog.relation_details.get(relation.oid, '')}{self.txn_details_tail}"
            f'{lsn},"xmin":null,"origin":null,"origin_lsn":null}}'.encode()
        )

    def undecodable(self, relation: pg.Relation, bad: list[tuple[str, bytes]]) -> None:
        """Text values of a change that are not UTF-8 (already rendered as undecoded by
        the parser): a warning and the metric for each, or a stop."""
        source = self.source
        at = f"{source.txn.position}:{source.txn.index}"
        try:
            for column, raw in bad:
                source.decode_errors.value(relation.table, column, raw, at)
        finally:
            bad.clear()

    def insert(self, relation: pg.Relation, after: Any) -> Update:
        # The common case, kept short: an insert holds every value (never a TOAST
        # placeholder), and its key is in it.
        source = self.source
        return Update(
            op="c",
            key={k: after[k] for k in relation.key_columns},
            after=_Raw(_encode(after)),
            table=relation.table,
            connector="postgres",
            position=f"{source.txn.position}:{source.txn.index}",
            logical=source.txn.logical,
            txid=source.txn.id,
            ts_ms=source.txn.ts_ms,
            columns=source.txn.columns,
            details=source.txn.details,
        )

    def change(
        self,
        op: str,
        relation: pg.Relation,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        unchanged: list[str],
        full: bool,
    ) -> list[Update]:
        """An update or a delete; an update that changed the key becomes a delete + insert.

        ``before`` is the old row (``full``, REPLICA IDENTITY FULL) or the old key
        columns, or None when the update left the key alone. ``unchanged`` names the
        TOASTed columns the update left alone, which are not in ``after``.
        """
        update = self.source._update
        keys = relation.key_columns
        if op == "d":
            assert before is not None
            old_key = {k: before[k] for k in keys}
            return [update("d", relation.table, old_key, before if full else old_key, None)]
        assert after is not None
        if unchanged and before is not None:
            # The old image holds what the update left alone: the whole old row (FULL),
            # or the key columns, which PostgreSQL logs when they are stored out of line.
            for name in unchanged:
                if full or name in keys:
                    after[name] = before[name]
        key = {k: after[k] for k in keys}
        if before is None:
            if unchanged and any(key[k] == pg.UNCHANGED_TOAST for k in keys):
                raise self.unknown_key(relation, [k for k in keys if k in unchanged])
            return [update("u", relation.table, key, key, after)]
        old_key = {k: before[k] for k in keys}
        if old_key == key:
            return [update("u", relation.table, key, before if full else old_key, after)]
        # The old key may live in another shard: it gets a delete, the new key an
        # insert, so both flows see the change (as for any key-value store).
        return [
            update("d", relation.table, old_key, before if full else old_key, None),
            update("c", relation.table, key, None, after),
        ]

    def unknown_key(self, relation: pg.Relation, columns: list[str]) -> SourceError:
        source = self.source
        return SourceError(
            f"source: the update of {relation.table} at {source.txn.position}:"
            f"{source.txn.index} left its key column(s) {', '.join(columns)} unchanged and "
            f"stored out of line (TOAST), and this server did not write their value to the "
            f"WAL, so the key of the change is unknown and it cannot be delivered. Set REPLICA "
            f"IDENTITY FULL on the table (ALTER TABLE {qualified(relation.table)} REPLICA "
            f"IDENTITY FULL) or upgrade PostgreSQL to a minor release that writes the value "
            f"(10.21, 11.16, 12.11, 13.7, 14.3 or later), then remove the state_dir to start "
            f"over with a new initial snapshot: this change stays in the slot's WAL"
        )

    def truncate(self, relation: pg.Relation) -> Update:
        return self.source.txn.update("t", relation.table, {}, None, None)

    def schema_change(self, content: bytes, emit: bool) -> Update | None:
        """A message of the schema trigger: the table's version after a DDL, exact at
        this point of the WAL; with ``schema_events`` (and ``emit``), its event."""
        source = self.source
        history = source.history
        assert history is not None
        try:
            message = schema_trigger.parse(content)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning(
                "ignoring a message with prefix %s at %s:%s that the schema trigger did not "
                "write (%s)",
                schema_trigger.PREFIX,
                source.txn.position,
                source.txn.index,
                exc,
            )
            return None
        if message.dropped:
            published = history.published(message.oid)
        else:
            published = source.publication in message.publications
        entry = message.entry(source.txn_lsn, source.txn.index, published)
        history.record_in_band(message.oid, entry)
        relation = self.relations.get(message.oid)
        if (
            relation is not None
            and relation.replica_identity in ("f", "n")
            and entry.identity == relation.replica_identity
            and entry.columns == signature(relation)
        ):
            # Its primary key changed and nothing the Relation message says did: the next
            # change is keyed by the new one whether or not a Relation message comes first.
            relation.key_columns = source.catalog.stream_key(relation)
        options = source.options
        if not (emit and published and options.schema_events):
            return None
        if message.table in options.heartbeat_tables:
            return None
        # Not a row of a described table: no columns or details of the last change.
        source.txn.columns = source.txn.details = NULL
        return source.txn.update(
            "c", schema_trigger.EVENTS_TABLE, {"table": message.table}, None, message.event()
        )
