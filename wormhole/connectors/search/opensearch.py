"""The OpenSearch / Elasticsearch engine: the ``_bulk`` API with external versions.

Each document's source is the row, plus ``@wormhole: {table, shard, version}``.
Upserts are ``index`` actions and deletes ``delete`` actions, both with
``version_type=external`` and the update's version as one number
(:func:`wormhole.plugins.versions.version_number`): the cluster applies an action
only if its version is higher than the document's, so a replayed older update
gets a 409 version conflict, which counts as done. A truncate deletes the
documents of its table and shard whose ``@wormhole.version`` is older than it
(``_delete_by_query``).

Failures: a connection error, a 429, a 5xx or a cluster block (for the request
or for one item) raises an ordinary exception, so the subscriber retries the
batch with backoff; actions already applied come back as 409 and count as done.
A document the mapping refuses (400), bad credentials and a missing index are a
:class:`SinkError`.
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import urllib.parse
from typing import Any

import msgspec

from wormhole.connectors.search.documents import DocumentIds
from wormhole.connectors.search.options import INDEX_NAME, SearchOptions
from wormhole.connectors.search.tantivy_engine import Hit, QueryError
from wormhole.core.errors import SinkError
from wormhole.core.update import Update
from wormhole.plugins.components import SinkContext
from wormhole.plugins.versions import version_number, version_of

META = "@wormhole"
_encode = msgspec.json.Encoder().encode

MAPPING_TYPES: dict[str, dict[str, Any]] = {
    "text": {"type": "text"},
    "string": {"type": "keyword"},
    "keyword": {"type": "keyword"},
    "i64": {"type": "long", "ignore_malformed": True},
    "u64": {"type": "unsigned_long", "ignore_malformed": True},
    "f64": {"type": "double", "ignore_malformed": True},
    "bool": {"type": "boolean"},
    "date": {"type": "date", "ignore_malformed": True},
}


class OpenSearchUnavailable(Exception):
    """The cluster could not take the batch now (429, 5xx): retried with backoff."""


class Client:
    """A small keep-alive HTTP client for one cluster."""

    def __init__(self, options: SearchOptions) -> None:
        assert options.url is not None
        url = urllib.parse.urlsplit(options.url)
        self.https = url.scheme == "https"
        self.host = url.hostname or "localhost"
        self.port = url.port or (443 if self.https else 80)
        self.base = url.path.rstrip("/")
        self.timeout = options.timeout_s
        self.headers = {"Accept": "application/json"}
        if options.username is not None:
            token = f"{options.username}:{options.password or ''}".encode()
            self.headers["Authorization"] = "Basic " + base64.b64encode(token).decode()
        elif options.api_key is not None:
            self.headers["Authorization"] = "ApiKey " + options.api_key
        self.tls: ssl.SSLContext | None = None
        if self.https:
            tls = ssl.create_default_context(cafile=options.ca)
            if not options.verify_tls:
                tls.check_hostname = False
                tls.verify_mode = ssl.CERT_NONE
            if options.client_cert:
                tls.load_cert_chain(options.client_cert, options.client_key)
            self.tls = tls
        self.conn: http.client.HTTPConnection | None = None

    def request(
        self, method: str, path: str, body: bytes | None = None, ndjson: bool = False
    ) -> tuple[int, Any]:
        """Send one request; returns (status, decoded JSON body or None)."""
        headers = dict(self.headers)
        if body is not None:
            headers["Content-Type"] = "application/x-ndjson" if ndjson else "application/json"
        for attempt in (1, 2):
            conn = self.conn or self._connect()
            try:
                conn.request(method, self.base + path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                break
            except (OSError, http.client.HTTPException):
                self.close()
                if attempt == 2:
                    raise
                # A kept-alive connection the server closed: once more on a new one.
        if response.getheader("Connection", "").lower() == "close":
            self.close()
        try:
            decoded = json.loads(data) if data else None
        except ValueError:
            decoded = data.decode(errors="replace")
        return response.status, decoded

    def _connect(self) -> http.client.HTTPConnection:
        if self.https:
            self.conn = http.client.HTTPSConnection(
                self.host, self.port, timeout=self.timeout, context=self.tls
            )
        else:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def index_name(options: SearchOptions, application: str) -> str:
    if options.index is None:
        return application.lower()
    return options.index.format(application=application)


def mapping(options: SearchOptions) -> dict[str, Any]:
    properties: dict[str, Any] = {
        name: dict(MAPPING_TYPES[kind]) for name, kind in options.fields.items()
    }
    properties[META] = {
        "properties": {
            "table": {"type": "keyword"},
            "shard": {"type": "integer"},
            "version": {"type": "long"},
        }
    }
    return {
        "settings": {"index": {"gc_deletes": options.gc_deletes}},
        "mappings": {"properties": properties},
    }


def _reason(body: Any) -> str:
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            cause = error.get("caused_by")
            text = f"{error.get('type', 'error')}: {error.get('reason', '')}".strip()
            if isinstance(cause, dict) and cause.get("reason"):
                text += f" ({cause.get('type')}: {cause.get('reason')})"
            return text
        return str(error)
    return str(body)[:500]


class OpenSearchSink:
    """Bulk index and delete actions with external versions; commit = the bulk response."""

    def __init__(self, options: SearchOptions) -> None:
        self.options = options
        self.client: Client | None = None
        self.index = ""
        self.where = ""
        self.ids: DocumentIds | None = None
        self.ready = False

    def open(self, context: SinkContext) -> None:
        self.where = f"applications.{context.application}.sink"
        self.index = index_name(self.options, context.application)
        if not INDEX_NAME.match(self.index):
            raise SinkError(
                f"{self.where}.index: {self.index!r} is not a valid index name (lowercase, "
                f'without spaces or any of \\ / * ? " < > | , # :); set index'
            )
        self.ids = DocumentIds(self.options, context.application)
        try:
            self.client = Client(self.options)
        except (OSError, ssl.SSLError) as exc:
            raise SinkError(
                f"{self.where}: cannot load the TLS files (ca, client_cert, client_key): {exc}; "
                f"check the paths"
            ) from exc

    # --------------------------------------------------------------- helpers
    def _request(
        self, method: str, path: str, body: bytes | None = None, ndjson: bool = False
    ) -> tuple[int, Any]:
        assert self.client is not None
        try:
            return self.client.request(method, path, body, ndjson)
        except ssl.SSLCertVerificationError as exc:
            raise SinkError(
                f"{self.where}.url: the server's certificate does not verify "
                f"({exc.verify_message}); set ca to the CA bundle that signed it"
            ) from exc

    def _check(self, status: int, body: Any, what: str) -> None:
        if status < 300:
            return
        if status == 429 or status >= 500 or "cluster_block" in _reason(body):
            raise OpenSearchUnavailable(f"{what}: HTTP {status}: {_reason(body)}")
        if status == 404:
            raise SinkError(
                f"{self.where}.index: {what} failed: index {self.index!r} does not exist "
                f"(HTTP 404: {_reason(body)}); create it, or set create_index: true"
            )
        if status in (401, 403):
            raise SinkError(
                f"{self.where}: {what} was refused (HTTP {status}: {_reason(body)}); check "
                f"username, password or api_key, and the user's privileges on index "
                f"{self.index!r}"
            )
        raise SinkError(f"{self.where}: {what} failed (HTTP {status}: {_reason(body)})")

    def _ensure_index(self) -> None:
        if not self.options.create_index:
            self.ready = True
            return
        path = "/" + urllib.parse.quote(self.index)
        status, body = self._request("HEAD", path)
        if status == 404:
            status, body = self._request("PUT", path, _encode(mapping(self.options)))
            if status == 400 and "resource_already_exists" in json.dumps(body):
                status = 200  # created meanwhile by another subscriber
            self._check(status, body, f"creating index {self.index!r}")
        else:
            self._check(status, body, f"looking up index {self.index!r}")
        self.ready = True

    # ----------------------------------------------------------------- write
    def write(self, updates: list[Update]) -> None:
        if not updates:
            return
        if not self.ready:
            self._ensure_index()
        segment: dict[str, tuple[Update, int | None]] = {}
        for u in updates:
            if u.op == "t":
                self._bulk(segment)
                segment = {}
                self._truncate(u)
                continue
            doc_id = self._doc_id(u)
            segment.pop(doc_id, None)  # only the last action of an id in a bulk request
            segment[doc_id] = (u, version_number(version_of(u)))
        self._bulk(segment)

    def _doc_id(self, update: Update) -> str:
        assert self.ids is not None
        return self.ids(update)

    def _bulk(self, segment: dict[str, tuple[Update, int | None]]) -> None:
        if not segment:
            return
        lines: list[bytes] = []
        for doc_id, (u, version) in segment.items():
            action: dict[str, Any] = {"_index": self.index, "_id": doc_id}
            if version is not None:
                action["version"] = version
                action["version_type"] = "external"
            if u.op == "d":
                lines.append(_encode({"delete": action}))
                continue
            lines.append(_encode({"index": action}))
            meta: dict[str, Any] = {"table": u.table, "shard": u.shard}
            if version is not None:
                meta["version"] = version
            row = bytes(u.after).strip()
            if row[:1] != b"{":
                row = b"{}"
            tail = b"" if row == b"{}" else b","
            lines.append(row[:-1] + tail + b'"' + META.encode() + b'":' + _encode(meta) + b"}")
        body = b"\n".join(lines) + b"\n"
        status, response = self._request("POST", "/_bulk", body, ndjson=True)
        self._check(status, response, f"bulk request of {len(segment)} actions")
        if not isinstance(response, dict):
            raise OpenSearchUnavailable(f"bulk request: unreadable response {response!r}")
        if not response.get("errors"):
            return
        retry = []
        for item in response.get("items", []):
            (op, result), *_ = item.items()
            status = int(result.get("status", 500))
            if status < 300 or status == 409 or (op == "delete" and status == 404):
                continue  # 409: the document already has this version or a newer one
            reason = _reason(result)
            if status == 400:  # the document does not fit the mapping: retrying cannot help
                raise SinkError(
                    f"{self.where}: index {self.index!r} refused document "
                    f"{result.get('_id')!r} ({op}, HTTP 400: {reason}); fix the index mapping "
                    f"or the sink's fields so that the row fits"
                )
            if "index_not_found" in reason:
                raise SinkError(
                    f"{self.where}.index: index {self.index!r} does not exist ({reason}); "
                    f"create it, or set create_index: true"
                )
            # 429, 5xx, a cluster block (403, e.g. a full disk): worth trying again.
            retry.append(f"{result.get('_id')}: HTTP {status} {reason}")
        if retry:
            raise OpenSearchUnavailable(
                f"bulk request: {len(retry)} actions to retry, e.g. {retry[0]}"
            )

    def _truncate(self, update: Update) -> None:
        version = version_number(version_of(update))
        filters: list[dict[str, Any]] = [
            {"term": {f"{META}.table": update.table}},
            {"term": {f"{META}.shard": update.shard}},
        ]
        if version is not None:
            # Only what is older than the truncate: a replayed truncate keeps newer rows.
            filters.append(
                {
                    "bool": {
                        "should": [
                            {"range": {f"{META}.version": {"lt": version}}},
                            {"bool": {"must_not": {"exists": {"field": f"{META}.version"}}}},
                        ],
                        "minimum_should_match": 1,
                    }
                }
            )
        body = _encode({"query": {"bool": {"filter": filters}}})
        path = f"/{urllib.parse.quote(self.index)}/_delete_by_query?conflicts=proceed"
        status, response = self._request("POST", path, body)
        self._check(status, response, f"truncate of {update.table} (shard {update.shard})")
        failures = response.get("failures") if isinstance(response, dict) else None
        if failures:
            raise OpenSearchUnavailable(
                f"truncate of {update.table} (shard {update.shard}): {_reason(failures[0])}"
            )

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


def query(options: SearchOptions, application: str, text: str, limit: int = 10) -> list[Hit]:
    """Rows of the application's OpenSearch index matching ``text`` (query_string syntax)."""
    client = Client(options)
    index = index_name(options, application)
    string_query: dict[str, Any] = {"query": text}
    if options.text_fields():
        string_query["fields"] = options.text_fields()
    body = _encode({"query": {"query_string": string_query}, "size": limit})
    try:
        status, response = client.request(
            "POST", f"/{urllib.parse.quote(index)}/_search", body=body
        )
    except (OSError, http.client.HTTPException) as exc:
        raise QueryError(f"{options.url}: cannot reach the cluster ({exc})") from None
    finally:
        client.close()
    if status >= 300:
        raise QueryError(f"query {text!r} on index {index!r}: HTTP {status}: {_reason(response)}")
    hits = []
    for hit in response.get("hits", {}).get("hits", []):
        source = dict(hit.get("_source") or {})
        meta = source.pop(META, None) or {}
        hits.append(
            Hit(
                id=str(hit.get("_id")),
                table=str(meta.get("table", "")),
                score=float(hit.get("_score") or 0.0),
                row=source,
            )
        )
    return hits
