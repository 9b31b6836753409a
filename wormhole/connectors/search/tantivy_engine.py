"""The embedded engine: one Tantivy index in a directory.

Besides the configured fields, every entry of the index has these fields of
the sink's own (names start with ``_``):

``_id``       the document id (exact term; stored)
``_kind``     ``doc`` (a live row), ``tomb`` (a deleted key) or ``mark`` (a truncate)
``_table``    the update's table (exact term; stored)
``_part``     ``<shard>:<table>``, what a truncate deletes
``_version``  the version of the update that wrote the entry (stored, JSON)
``_row``      the row after the update (stored, JSON)

A delete replaces the document with a tombstone (``_kind: tomb``) that keeps
the delete's version, so a replayed older upsert cannot bring the row back. A
truncate deletes every entry of its ``_part`` and leaves a mark with its
version: an upsert of that part older than the mark is skipped. Entries, marks
and tombstones change together in one commit per batch, so they always agree.

``wormhole-search.json`` in the directory records the fields and their types
for :func:`query`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from wormhole.connectors.search.documents import DocumentIds, field_values
from wormhole.connectors.search.options import SearchOptions
from wormhole.core.errors import SinkError, WormholeError
from wormhole.core.update import Update
from wormhole.plugins.components import SinkContext
from wormhole.plugins.versions import Version, is_older, version_of

META_FILE = "wormhole-search.json"
META_FORMAT = 1
LOCK_WAIT_S = 10.0
CACHE_ENTRIES = 1_000_000
MARK_PREFIX = "\x1ftruncate:"

_encode = msgspec.json.Encoder().encode
_decode_version = msgspec.json.Decoder(list[int]).decode


class QueryError(WormholeError):
    """A query that cannot run: no index at the path, or a malformed query."""


@dataclass(frozen=True)
class Hit:
    """One matching row: its document id, table, score and the row itself."""

    id: str
    table: str
    score: float
    row: dict[str, Any]


def import_tantivy() -> Any:
    """The ``tantivy`` module, or SinkError saying how to install it."""
    try:
        import tantivy
    except ImportError as exc:
        raise SinkError(
            "the search sink's tantivy engine needs the tantivy package: "
            "pip install 'wormhole-cdc[search]'"
        ) from exc
    return tantivy


def build_schema(tantivy: Any, fields: Mapping[str, str]) -> Any:
    builder = tantivy.SchemaBuilder()
    builder.add_text_field("_id", stored=True, tokenizer_name="raw", index_option="basic")
    builder.add_text_field("_kind", stored=True, tokenizer_name="raw", index_option="basic")
    builder.add_text_field("_table", stored=True, tokenizer_name="raw", index_option="basic")
    builder.add_text_field("_part", tokenizer_name="raw", index_option="basic")
    builder.add_bytes_field("_version", stored=True)
    builder.add_bytes_field("_row", stored=True)
    for name, kind in fields.items():
        if kind == "text":
            builder.add_text_field(name, tokenizer_name="default")
        elif kind in ("string", "keyword"):
            builder.add_text_field(name, tokenizer_name="raw")
        elif kind == "i64":
            builder.add_integer_field(name, indexed=True, fast=True)
        elif kind == "u64":
            builder.add_unsigned_field(name, indexed=True, fast=True)
        elif kind == "f64":
            builder.add_float_field(name, indexed=True, fast=True)
        elif kind == "bool":
            builder.add_boolean_field(name, indexed=True, fast=True)
        elif kind == "date":
            builder.add_date_field(name, indexed=True, fast=True)
        else:  # pragma: no cover - the options model allows no other type
            raise AssertionError(kind)
    return builder.build()


_ADD = {
    "text": "add_text",
    "string": "add_text",
    "keyword": "add_text",
    "i64": "add_integer",
    "u64": "add_unsigned",
    "f64": "add_float",
    "bool": "add_boolean",
    "date": "add_date",
}

# Python types a field takes as they are (a value out of range goes through conversion).
_FAST: dict[str, frozenset[type]] = {
    "text": frozenset({str}),
    "string": frozenset({str}),
    "keyword": frozenset({str}),
    "i64": frozenset({int}),
    "u64": frozenset({int}),
    "f64": frozenset({float}),
    "bool": frozenset({bool}),
    "date": frozenset(),
}

# What the sink knows about a document id: (kind, version). kind is "doc", "tomb" or
# "none" (no entry in the index).
State = tuple[str, Version | None]
_NONE: State = ("none", None)


class TantivySink:
    """Upsert on c/u/r, tombstone on d, delete a table's shard on t; commit per batch."""

    def __init__(self, options: SearchOptions) -> None:
        self.options = options
        self.tantivy: Any = None
        self.index: Any = None
        self.schema: Any = None
        self.writer: Any = None
        self.path = Path()
        self.application = ""
        self.ids: DocumentIds | None = None
        self.fields: list[tuple[str, str, Any, frozenset[type]]] = []
        self.marks: dict[str, Version | None] = {}
        self.cache: dict[str, State] = {}
        self.stale = True
        self.warned: set[tuple[str, str]] = set()
        self.log: Any = None

    # ------------------------------------------------------------------ open
    def open(self, context: SinkContext) -> None:
        app = self.application = context.application
        self.log = context.log
        where = f"applications.{app}.sink"
        if context.subscribers > 1:
            raise SinkError(
                f"applications.{app}.subscribers: the search sink's tantivy engine writes one "
                f"index, and a Tantivy index has one writer; set subscribers: 1 (or use engine: "
                f"opensearch, which takes any number)"
            )
        assert self.options.path is not None
        self.path = Path(self.options.path.format(application=app))
        self.tantivy = tantivy = import_tantivy()
        self.fields = [
            (name, kind, getattr(tantivy.Document, _ADD[kind]), _FAST[kind])
            for name, kind in self.options.fields.items()
        ]
        self.ids = DocumentIds(self.options, app)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SinkError(
                f"{where}.path: cannot create the index directory {str(self.path)!r} ({exc}); "
                f"fix the path or its permissions"
            ) from exc
        self.schema = build_schema(tantivy, self.options.fields)
        try:
            self.index = tantivy.Index(self.schema, str(self.path))
        except ValueError as exc:
            if "schema does not match" in str(exc):
                raise SinkError(
                    f"{where}.fields: the index in {str(self.path)!r} was built with other "
                    f"fields ({_describe_meta(self.path)}); an index's fields cannot change. "
                    f"Remove the directory and deliver the tables again (a new state_dir, or a "
                    f"new application)"
                ) from exc
            raise SinkError(f"{where}.path: cannot open the index in {self.path} ({exc})") from exc
        self.index.config_reader(reload_policy="manual")
        self.writer = self._open_writer(where)
        write_meta(self.path, self.options)
        self._load_marks()

    def _open_writer(self, where: str) -> Any:
        deadline = time.monotonic() + LOCK_WAIT_S
        memory = int(self.options.writer_memory)
        while True:
            try:
                return self.index.writer(
                    heap_size=memory * self.options.writer_threads,
                    num_threads=self.options.writer_threads,
                )
            except ValueError as exc:
                if "LockBusy" not in str(exc):
                    raise SinkError(
                        f"{where}: cannot write the index in {self.path} ({exc})"
                    ) from exc
                if time.monotonic() >= deadline:
                    raise SinkError(
                        f"{where}.path: another process is writing the index in "
                        f"{str(self.path)!r} (a Tantivy index has one writer); stop it, or give "
                        f"this application its own path"
                    ) from exc
                time.sleep(0.1)  # a subscriber that was just killed is releasing its lock

    def _searcher(self) -> Any:
        if self.stale:
            self.index.reload()
            self.stale = False
        return self.index.searcher()

    def _load_marks(self) -> None:
        searcher = self._searcher()
        count = searcher.doc_freq("_kind", "mark")
        self.marks = {}
        if not count:
            return
        query = self.tantivy.Query.term_query(self.schema, "_kind", "mark")
        for _, address in searcher.search(query, limit=count, count=False).hits:
            doc = searcher.doc(address)
            part = str(doc.get_first("_id"))[len(MARK_PREFIX) :]
            self.marks[part] = _version(doc)

    # ----------------------------------------------------------------- write
    def write(self, updates: list[Update]) -> None:
        if not updates:
            return
        if self.writer is None:
            self.writer = self._open_writer(f"applications.{self.application}.sink")
        try:
            self._write(updates)
        except BaseException:
            self._rollback()
            raise

    def _rollback(self) -> None:
        try:
            self.writer.rollback()
        except Exception:  # the writer is unusable: open a new one for the retry
            self.writer = None
        self.cache.clear()
        self.stale = True

    def _write(self, updates: list[Update]) -> None:
        ids = self.ids
        assert ids is not None
        # 1. What each update is: (op, doc id, part, version).
        items: list[tuple[Update, str, str, Version | None]] = []
        parts: dict[str, str] = {}
        for u in updates:
            part = f"{u.shard}:{u.table}"
            if u.op == "t":
                items.append((u, "", part, version_of(u)))
                continue
            doc_id = ids(u)
            parts[doc_id] = part
            items.append((u, doc_id, part, version_of(u)))
        # 2. What the index holds for those ids.
        state = self._states(list(parts))
        before = dict(state)
        # 3. Apply in stream order: the final action per id, and the truncated parts.
        marks = dict(self.marks)
        final: dict[str, tuple[Update, str, Version | None]] = {}
        truncated: list[str] = []
        for u, doc_id, part, version in items:
            if u.op == "t":
                mark = marks.get(part)
                if version is not None and mark is not None and version <= mark:
                    continue  # this truncate (or a later one) is already applied
                marks[part] = version
                truncated.append(part)
                for other, other_part in parts.items():
                    if other_part == part:
                        state[other] = _NONE
                        final.pop(other, None)
                continue
            if is_older(version, marks.get(part)) or is_older(version, state[doc_id][1]):
                continue  # a replay of something older than what the index holds
            if u.op != "d":
                state[doc_id] = ("doc", version)
            elif version is not None:
                state[doc_id] = ("tomb", version)
            else:
                state[doc_id] = _NONE  # nothing to compare a later update with: no tombstone
            final[doc_id] = (u, part, version)
        # 4. Write it: truncates first (entries of this batch after them come next).
        writer = self.writer
        for part in truncated:
            writer.delete_documents_by_term("_part", part)
        for part in dict.fromkeys(truncated):
            mark_id = MARK_PREFIX + part
            writer.delete_documents_by_term("_id", mark_id)
            writer.add_document(self._entry(mark_id, "mark", part, marks[part], None))
        cleared = set(truncated)
        for doc_id, (u, part, version) in final.items():
            if before[doc_id][0] != "none" and part not in cleared:
                writer.delete_documents_by_term("_id", doc_id)
            if u.op == "d":
                if version is not None:
                    writer.add_document(self._entry(doc_id, "tomb", part, version, None))
            else:
                writer.add_document(self._entry(doc_id, "doc", part, version, u))
        # 5. Durable before write returns: that is when the batch is acknowledged.
        writer.commit()
        self.stale = True
        self.marks = marks
        if truncated or len(self.cache) + len(state) > CACHE_ENTRIES:
            self.cache.clear()
        if not truncated:
            self.cache.update(state)

    def _states(self, doc_ids: list[str]) -> dict[str, State]:
        state: dict[str, State] = {}
        unknown = []
        cache = self.cache
        for doc_id in doc_ids:
            known = cache.get(doc_id)
            if known is None:
                unknown.append(doc_id)
                state[doc_id] = _NONE
            else:
                state[doc_id] = known
        if unknown:
            searcher = self._searcher()
            query = self.tantivy.Query.term_set_query(self.schema, "_id", unknown)
            for _, address in searcher.search(query, limit=len(unknown), count=False).hits:
                doc = searcher.doc(address)
                state[str(doc.get_first("_id"))] = (str(doc.get_first("_kind")), _version(doc))
        return state

    def _entry(
        self, doc_id: str, kind: str, part: str, version: Version | None, update: Update | None
    ) -> Any:
        doc = self.tantivy.Document()
        doc.add_text("_id", doc_id)
        doc.add_text("_kind", kind)
        if kind != "mark":
            doc.add_text("_part", part)
            doc.add_text("_table", part.split(":", 1)[1])
        if version is not None:
            doc.add_bytes("_version", _encode(version))
        if update is not None:
            doc.add_bytes("_row", bytes(update.after))
            if self.fields:
                row = update.after_row() or {}
                for name, kind_, add, fast in self.fields:
                    value = row.get(name)
                    if value is None:
                        continue
                    if type(value) in fast:  # already the field's type: no conversion
                        try:
                            add(doc, name, value)
                            continue
                        except (OverflowError, ValueError, TypeError):
                            pass  # out of the field's range: reported below
                    values, ok = field_values(kind_, value)
                    for v in values:
                        add(doc, name, v)
                    if not ok:
                        self._warn_value(update.table, name, kind_, value)
        return doc

    def _warn_value(self, table: str, name: str, kind: str, value: Any) -> None:
        if (table, name) in self.warned:
            return
        self.warned.add((table, name))
        self.log.warning(
            "search sink of %s: table %s column %s: %r is not a %s value, so it is not indexed "
            "(the row keeps it); further such values of this column are not reported",
            self.application,
            table,
            name,
            value,
            kind,
        )

    # ----------------------------------------------------------------- close
    def close(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.rollback()  # nothing is pending after a write returned
                writer.wait_merging_threads()
            except Exception as exc:  # a merge that fails is redone by the next writer
                if self.log is not None:
                    self.log.warning("search sink: closing the index writer: %s", exc)
        self.index = None


def _version(doc: Any) -> Version | None:
    raw = doc.get_first("_version")
    return None if raw is None else tuple(_decode_version(bytes(raw)))


def _describe_meta(path: Path) -> str:
    try:
        meta = json.loads((path / META_FILE).read_text())
        fields = meta.get("fields", {})
        return ", ".join(f"{n}: {t}" for n, t in fields.items()) or "no fields"
    except (OSError, ValueError):
        return "see its meta.json"


def write_meta(path: Path, options: SearchOptions) -> None:
    meta = {
        "format": META_FORMAT,
        "fields": dict(options.fields),
        "default_fields": options.text_fields(),
    }
    target = path / META_FILE
    text = json.dumps(meta, indent=2) + "\n"
    try:
        if target.exists() and target.read_text() == text:
            return
        temp = path / (META_FILE + ".tmp")
        with open(temp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, target)
    except OSError as exc:
        raise SinkError(f"cannot write {target} ({exc}); fix the path or its permissions") from exc


# ------------------------------------------------------------------- query
def query(path: str | os.PathLike[str], text: str, limit: int = 10) -> list[Hit]:
    """The live rows of the index in ``path`` that match ``text``, best first.

    ``text`` uses Tantivy's query syntax: ``name:ada``, ``ada lovelace`` (in the
    default fields), ``age:[30 TO 40]``, ``_table:users AND active:true``, ``*``.
    Raises :class:`QueryError` when there is no index at ``path`` or the query
    is malformed.
    """
    try:
        tantivy = import_tantivy()
    except SinkError as exc:
        raise QueryError(str(exc)) from None
    where = str(path)
    if not Path(where, "meta.json").exists() or not tantivy.Index.exists(where):
        raise QueryError(
            f"{where}: no search index here yet; run the application's pipeline first (or "
            f"check the sink's path)"
        )
    if limit < 1:
        raise QueryError(f"limit: must be at least 1, not {limit}")
    index = tantivy.Index.open(where)
    try:
        meta = json.loads(Path(where, META_FILE).read_text())
        defaults = list(meta.get("default_fields", []))
        fields = dict(meta.get("fields", {}))
    except (OSError, ValueError):
        defaults, fields = [], {}
    try:
        parsed = index.parse_query(text, defaults)
    except ValueError as exc:
        known = ", ".join(["_table", "_id", *fields]) if fields else "_table, _id"
        raise QueryError(
            f"query {text!r}: {exc} (fields: {known}; terms without FIELD: search "
            f"{', '.join(defaults) or 'no field, so name one'})"
        ) from None
    live = tantivy.Query.const_score_query(
        tantivy.Query.term_query(index.schema, "_kind", "doc"), 0.0
    )
    combined = tantivy.Query.boolean_query(
        [(tantivy.Occur.Must, parsed), (tantivy.Occur.Must, live)]
    )
    searcher = index.searcher()
    hits = []
    for score, address in searcher.search(combined, limit=limit, count=False).hits:
        doc = searcher.doc(address)
        hits.append(
            Hit(
                id=str(doc.get_first("_id")),
                table=str(doc.get_first("_table")),
                score=float(score),
                row=json.loads(bytes(doc.get_first("_row"))),
            )
        )
    return hits
