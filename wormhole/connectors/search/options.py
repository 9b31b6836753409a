"""Options of the ``search`` sink, checked by ``wormhole validate``."""

from __future__ import annotations

import re
import string
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ByteSize, Field, ValidationInfo, field_validator

from wormhole.plugins.components import Options

FieldType = Literal["text", "string", "keyword", "i64", "u64", "f64", "bool", "date"]
"""``text`` is tokenized (words, lowercased); ``string`` and ``keyword`` are one exact term."""

TEXT_TYPES = frozenset({"text", "string", "keyword"})
FIELD_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
PLACEHOLDER = re.compile(r"^[^\s{}\[\].!:]+$")
INDEX_NAME = re.compile(r'^[^-_+A-Z\\/*?"<>| ,#:][^A-Z\\/*?"<>| ,#:]*$')

TANTIVY_ONLY = ("writer_memory", "writer_threads")
OPENSEARCH_ONLY = (
    "index",
    "username",
    "password",
    "api_key",
    "ca",
    "verify_tls",
    "client_cert",
    "client_key",
    "timeout_s",
    "create_index",
    "gc_deletes",
)


def template_fields(template: str) -> list[str]:
    """The column names a document id template uses; ValueError if it is malformed."""
    names = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(
            f"template {template!r} is malformed ({exc}); write literal braces as {{{{ and }}}}"
        ) from None
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name or not PLACEHOLDER.match(name) or spec or conversion:
            shown = name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise ValueError(
                f"template {template!r}: placeholder {{{shown}}} must be a bare column name, "
                f"as in user:{{id}}"
            )
        names.append(name)
    if not names:
        raise ValueError(
            f"template {template!r} names no column, so every row would get the same id; "
            f"name the key columns, as in user:{{id}}"
        )
    return names


def _check_template(template: str) -> str:
    template_fields(template)
    return template


Template = Annotated[str, AfterValidator(_check_template)]


class SearchOptions(Options):
    """Keep a full-text index in step with the tables (Tantivy, or OpenSearch / Elasticsearch)."""

    engine: Literal["tantivy", "opensearch"] = Field(
        "tantivy",
        description="tantivy: an embedded index in a directory; opensearch: an OpenSearch or "
        "Elasticsearch cluster, through its _bulk API",
    )
    fields: dict[str, FieldType] = Field(
        default_factory=dict,
        description="columns to index, by type: text (words), string or keyword (exact), i64, "
        "u64, f64, bool, date; every row is also stored whole, as JSON",
    )
    ids: dict[str, Template] = Field(
        default_factory=dict,
        description='document id template per table, e.g. {users: "user:{id}"}; placeholders '
        "are column names. Default: <table>:<key as canonical JSON>",
    )
    default_fields: list[str] | None = Field(
        None,
        description="fields a query term without FIELD: searches (default: every text field)",
    )
    path: str | None = Field(
        None,
        validate_default=True,
        description="engine tantivy: the index directory; may contain {application}",
    )
    writer_memory: ByteSize = Field(
        ByteSize(64 << 20),
        description="engine tantivy: memory for buffering documents between commits, per "
        "thread (at least 15MB)",
    )
    writer_threads: int = Field(1, ge=1, le=64, description="engine tantivy: indexing threads")
    url: str | None = Field(
        None,
        validate_default=True,
        description="engine opensearch: the cluster's base URL, e.g. https://search.internal:9200",
    )
    index: str | None = Field(
        None,
        description="engine opensearch: the index name; may contain {application} "
        "(default: the application name, lowercased)",
    )
    username: str | None = Field(None, description="engine opensearch: basic auth user")
    password: str | None = Field(None, description="engine opensearch: basic auth password")
    api_key: str | None = Field(
        None, description="engine opensearch: API key (sent as Authorization: ApiKey ...)"
    )
    ca: str | None = Field(None, description="engine opensearch: CA bundle (PEM) for https")
    verify_tls: bool = Field(
        True, description="engine opensearch: verify the server's certificate and name"
    )
    client_cert: str | None = Field(
        None, description="engine opensearch: client certificate (PEM) for mutual TLS"
    )
    client_key: str | None = Field(
        None, description="engine opensearch: private key (PEM) for client_cert"
    )
    timeout_s: float = Field(30.0, gt=0, description="engine opensearch: request timeout")
    create_index: bool = Field(
        True,
        description="engine opensearch: create the index with a mapping from `fields` when it "
        "does not exist",
    )
    gc_deletes: str = Field(
        "1d",
        description="engine opensearch: index.gc_deletes of an index the sink creates: how long "
        "a deleted document's version is kept, which is how long a replayed older update "
        "cannot bring it back",
    )

    @field_validator("fields")
    @classmethod
    def _field_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not FIELD_NAME.match(name):
                raise ValueError(
                    f"{name!r} cannot be a field name: use letters, digits and _, starting with "
                    f"a letter (names starting with _ are the sink's own)"
                )
        return value

    @field_validator("default_fields")
    @classmethod
    def _defaults(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        fields = info.data.get("fields")
        if value is None or fields is None:
            return value
        for name in value:
            if fields.get(name) not in TEXT_TYPES:
                text = sorted(n for n, t in fields.items() if t in TEXT_TYPES)
                raise ValueError(
                    f"{name!r} is not a text, string or keyword field in `fields` "
                    f"(those are: {', '.join(text) or 'none'})"
                )
        return value

    @field_validator("path")
    @classmethod
    def _path(cls, value: str | None, info: ValidationInfo) -> str | None:
        engine = info.data.get("engine")
        if engine == "tantivy" and not value:
            raise ValueError(
                "field required with engine: tantivy (the index directory; it may contain "
                "{application})"
            )
        if engine == "opensearch" and value is not None:
            raise ValueError("only for engine: tantivy; with engine: opensearch, set url")
        if value:
            _placeholders(value, {"application"})
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None, info: ValidationInfo) -> str | None:
        engine = info.data.get("engine")
        if engine == "opensearch":
            if not value:
                raise ValueError(
                    "field required with engine: opensearch (e.g. https://search.internal:9200)"
                )
            if not re.match(r"^https?://[^/\s]+", value):
                raise ValueError(f"{value!r} must be an http:// or https:// URL")
        elif engine == "tantivy" and value is not None:
            raise ValueError("only for engine: opensearch; with engine: tantivy, set path")
        return value

    @field_validator("index")
    @classmethod
    def _index(cls, value: str | None) -> str | None:
        if value is not None:
            _placeholders(value, {"application"})
            if "{" not in value and not INDEX_NAME.match(value):
                raise ValueError(
                    f"{value!r} is not a valid index name: lowercase, without spaces or any of "
                    f'\\ / * ? " < > | , # :, not starting with -, _ or +'
                )
        return value

    @field_validator(*TANTIVY_ONLY)
    @classmethod
    def _tantivy_only(cls, value: Any, info: ValidationInfo) -> Any:
        if info.data.get("engine") == "opensearch":
            raise ValueError("only for engine: tantivy")
        if info.field_name == "writer_memory" and value < 15_000_000:
            raise ValueError("must be at least 15MB (Tantivy's minimum per indexing thread)")
        return value

    @field_validator(*OPENSEARCH_ONLY)
    @classmethod
    def _opensearch_only(cls, value: Any, info: ValidationInfo) -> Any:
        if info.data.get("engine") == "tantivy":
            raise ValueError("only for engine: opensearch")
        return value

    def text_fields(self) -> list[str]:
        """The fields a query term without FIELD: searches."""
        if self.default_fields is not None:
            return list(self.default_fields)
        return [n for n, t in self.fields.items() if t == "text"]


def _placeholders(value: str, allowed: set[str]) -> None:
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(value) if name is not None]
    except ValueError as exc:
        raise ValueError(f"{value!r} is malformed ({exc})") from None
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ValueError(
            f"{value!r} has an unknown placeholder {{{unknown[0]}}}; only "
            f"{', '.join('{' + a + '}' for a in sorted(allowed))} is available"
        )
