"""The ``memcache`` sink: cache invalidation (or refresh) from the change stream.

Every update of a table with a key template invalidates the cache keys rendered
from its rows: ``keys: {public.users: "user:{id}"}`` deletes ``user:7`` when row 7
changes. With ``mode: set`` the sink stores the new row (the after image, as JSON)
instead, and deletes the key on a delete. Keys are spread over several servers
by rendezvous hashing, compatible with pymemcache's ``HashClient``
(:mod:`.servers`).

A batch is acknowledged only once every server that holds one of its keys has
answered every command. A server that does not answer makes :meth:`write` raise
an ordinary exception, so the subscriber retries the whole batch with backoff and
nothing after it is acknowledged. Re-sending a delete, or the same final value, is
harmless, so retries and replays after a crash converge.
"""

from __future__ import annotations

import contextlib
import fnmatch
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, field_validator

from wormhole.connectors.memcache.servers import Rendezvous, node_name, parse_server
from wormhole.connectors.memcache.templates import (
    KeyTemplate,
    TemplateError,
    key_problem,
    parse_template,
)
from wormhole.core.errors import SinkError
from wormhole.core.update import NULL, Update
from wormhole.plugins.components import ComponentSpec, Options, SinkContext
from wormhole.plugins.hookspecs import hookimpl

_INSTALL = "pip install 'wormhole-cdc[memcache]'"

_CHUNK = 1000
"""Commands sent to a server in one pipelined round trip. The replies of a chunk fit
in the socket buffers, so neither side blocks on the other."""

_RELATIVE_EXPIRY_LIMIT = 30 * 24 * 3600

_UNSEEN = object()
"""A table not looked up in ``keys`` yet (``None`` there means: no template)."""

_DELETE = object()
"""The final action for a key is a delete (in a batch plan's ``key -> value`` map)."""


# ----------------------------------------------------------------- options
def _server_list(value: Any) -> Any:
    # One string (handy with ${VAR:-...}) is a comma-separated list.
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def _check_server(value: str) -> str:
    parse_server(value)
    return value


def _template_shape(value: Any) -> Any:
    if isinstance(value, str) or (
        isinstance(value, list) and value and all(isinstance(v, str) for v in value)
    ):
        return value
    raise ValueError('must be a key template such as "user:{id}", or a non-empty list of templates')


def _check_templates(value: str | list[str]) -> str | list[str]:
    for text in [value] if isinstance(value, str) else value:
        try:
            parse_template(text)
        except TemplateError as exc:
            raise ValueError(str(exc)) from None
    return value


Templates = Annotated[
    str | list[str], BeforeValidator(_template_shape), AfterValidator(_check_templates)
]


class MemcacheOptions(Options):
    """Delete (or set) memcached keys rendered from each changed row."""

    servers: Annotated[
        list[Annotated[str, AfterValidator(_check_server)]], BeforeValidator(_server_list)
    ] = Field(
        min_length=1,
        description="memcached servers as host:port (a list, or one comma-separated string); "
        "keys are spread over them by rendezvous hashing, as pymemcache's HashClient does",
    )
    keys: dict[str, Templates] = Field(
        min_length=1,
        description='table -> key template, e.g. {public.users: "user:{id}"}, or a list of '
        'templates; placeholders are column names, {@table} is the table; a "*" or other '
        "shell-style pattern matches tables that have no exact entry",
    )
    mode: Literal["delete", "set"] = Field(
        "delete",
        description="delete: delete the keys of every changed row; set: store the after image "
        "as JSON (and delete on a delete)",
    )
    expire_s: int = Field(
        0, ge=0, description="with mode: set, expiry of stored rows in seconds (0: never)"
    )
    flush_on_truncate: bool = Field(
        False,
        description="on a truncate, flush_all every server (true), or log a warning and leave "
        "the table's keys to expire (false)",
    )
    max_value_bytes: int = Field(
        1_000_000,
        ge=1,
        description="with mode: set, rows whose JSON is longer are deleted instead of stored "
        "(memcached's default item limit is 1 MiB, memcached -I)",
    )
    timeout_s: float = Field(
        1.0, gt=0, description="connect and reply timeout for each server, in seconds"
    )
    retries: int = Field(
        2,
        ge=0,
        description="quick retries per server within one write, before the batch fails and is "
        "retried by the subscriber with growing delays",
    )
    retry_backoff_ms: int = Field(
        50, ge=1, description="delay before the first quick retry; doubles with each retry"
    )

    @field_validator("servers")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        seen: dict[tuple[str, int], str] = {}
        for text in value:
            parsed = parse_server(text)
            if parsed in seen:
                raise ValueError(
                    f"{text!r} is listed twice (as {seen[parsed]!r}); list each server once"
                )
            seen[parsed] = text
        return value

    @field_validator("expire_s", "max_value_bytes")
    @classmethod
    def _set_only(cls, value: int, info: Any) -> int:
        default = cls.model_fields[info.field_name].default
        if value != default and info.data.get("mode", "delete") != "set":
            raise ValueError(
                f"applies only to mode: set (rows are not stored in mode: "
                f"{info.data.get('mode', 'delete')}); remove it or set mode: set"
            )
        return value


# ------------------------------------------------------------------- the sink
class MemcacheUnavailable(ConnectionError):
    """A server did not answer: the batch is not acknowledged, and is retried."""


class MemcacheSink:
    """One subscriber's connections to the servers, and its key templates."""

    def __init__(self, options: MemcacheOptions) -> None:
        self.options = options
        self.where = "sink"
        self.log: Any = None
        self.addresses: list[str] = []
        self.clients: list[Any] = []
        self.ring: Rendezvous | None = None
        self.exact: dict[str, list[KeyTemplate]] = {}
        self.patterns: list[tuple[str, list[KeyTemplate]]] = []
        self.by_table: dict[str, list[KeyTemplate] | None] = {}
        self.warned: set[tuple[str, str]] = set()
        self.set_mode = options.mode == "set"
        self.memcache_errors: tuple[type[BaseException], ...] = (OSError,)

    # -------------------------------------------------------------- open
    def open(self, context: SinkContext) -> None:
        self.where = f"applications.{context.application}.sink"
        self.log = context.log
        try:
            from pymemcache.client.base import Client
            from pymemcache.exceptions import MemcacheError
        except ImportError as exc:
            raise SinkError(
                f"{self.where}.type: the memcache sink needs the pymemcache package ({exc}); "
                f"install it with {_INSTALL}"
            ) from None
        self.memcache_errors = (OSError, MemcacheError)
        timeout = self.options.timeout_s
        nodes = []
        for text in self.options.servers:
            host, port = parse_server(text)
            nodes.append(node_name(host, port))
            self.addresses.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
            self.clients.append(
                Client(
                    (host, port),
                    connect_timeout=timeout,
                    timeout=timeout,
                    no_delay=True,
                    allow_unicode_keys=True,
                    default_noreply=False,
                )
            )
        self.ring = Rendezvous(nodes)
        for table, value in self.options.keys.items():
            templates = [parse_template(t) for t in ([value] if isinstance(value, str) else value)]
            if any(c in table for c in "*?["):
                self.patterns.append((table, templates))
            else:
                self.exact[table] = templates

    # ------------------------------------------------------------- write
    def write(self, updates: list[Update]) -> None:
        ring = self.ring
        if ring is None:
            # Never acknowledge a batch that went nowhere.
            raise SinkError(f"{self.where}: write() before open() or after close()")
        if not updates:
            return
        flush, plan = self._plan(updates)
        if not flush and not plan:
            return
        servers = len(self.clients)
        deletes: list[list[str]] = [[] for _ in range(servers)]
        sets: list[dict[str, bytes]] = [{} for _ in range(servers)]
        for key, value in plan.items():
            index = ring.server_of(key)
            if value is _DELETE:
                deletes[index].append(key)
            else:
                sets[index][key] = value
        failures: list[str] = []
        # Every server gets its share even when another one is down: the batch
        # fails (and is retried whole) afterwards, and what reached the healthy
        # servers is correct already.
        for index in range(servers):
            if not (flush or deletes[index] or sets[index]):
                continue
            try:
                self._apply(index, flush, deletes[index], sets[index])
            except self.memcache_errors as exc:
                keys = len(deletes[index]) + len(sets[index])
                share = (
                    "1 key of this batch lives" if keys == 1 else f"{keys} keys of this batch live"
                )
                failures.append(
                    f"memcached {self.addresses[index]} did not answer "
                    f"({type(exc).__name__}: {exc or 'no reply'}) after "
                    f"{self.options.retries + 1} attempts"
                    + (", while flushing on a truncate" if flush else "")
                    + f" ({share} there)"
                )
        if failures:
            raise MemcacheUnavailable(
                "; ".join(failures) + "; the batch is not acknowledged and will be retried"
            )

    def _plan(self, updates: list[Update]) -> tuple[bool, dict[str, Any]]:
        """The final action per key (stream order: the last update of a key wins).

        A truncate with ``flush_on_truncate`` empties every server, so actions
        planned before it are dropped: the flush removes their keys anyway.
        """
        set_mode = self.set_mode
        by_table: dict[str, Any] = self.by_table
        plan: dict[str, Any] = {}
        flush = False
        for u in updates:
            op = u.op
            if op == "t":
                if self.options.flush_on_truncate:
                    flush = True
                    plan.clear()
                else:
                    self._warn_once(
                        "truncate",
                        u.table,
                        f"{self.where}: table {u.table} was truncated; its cached keys cannot be "
                        f"listed, so they stay until they expire or are overwritten (set "
                        f"flush_on_truncate: true to flush every server on a truncate)",
                    )
                continue
            templates = by_table.get(u.table, _UNSEEN)
            if templates is _UNSEEN:
                templates = self._templates_of(u.table)
            if not templates:
                continue
            if op == "d":
                old = self._old_image(u)
                for template in templates:
                    self._add(plan, u, self._render(template, u, u.key, old, "old"), _DELETE)
                continue
            after: dict[str, Any] | None = None
            before: dict[str, Any] | None = None
            for template in templates:
                try:
                    key = template.render(u.table, u.key, None)
                except KeyError:
                    if after is None:
                        after = u.after_row() or {}
                    key = self._render(template, u, after, u.key, "new")
                if op == "u" and u.before != NULL:
                    # The old row's key, when it differs (a changed e-mail in
                    # "user_by_email:{email}", a changed primary key), is stale too.
                    if before is None:
                        before = u.before_row() or {}
                    try:
                        old_key = template.render(u.table, before, u.key)
                    except KeyError:
                        old_key = key  # a partial before image: the old key is unknown
                    if old_key != key:
                        self._add(plan, u, old_key, _DELETE)
                if not set_mode:
                    self._add(plan, u, key, _DELETE)
                    continue
                value = bytes(u.after)
                if len(value) <= self.options.max_value_bytes:
                    self._add(plan, u, key, value)
                    continue
                self._warn_once(
                    "size",
                    u.table,
                    f"{self.where}.max_value_bytes: a row of {u.table} is {len(value)} bytes of "
                    f"JSON, more than {self.options.max_value_bytes}; such rows are deleted from "
                    f"the cache instead of stored",
                )
                self._add(plan, u, key, _DELETE)
        return flush, plan

    def _templates_of(self, table: str) -> list[KeyTemplate] | None:
        templates = self.exact.get(table)
        if templates is None:
            for pattern, candidates in self.patterns:
                if fnmatch.fnmatchcase(table, pattern):
                    templates = candidates
                    break
        if templates is None:
            self._warn_once(
                "table",
                table,
                f"{self.where}.keys: no key template for table {table}, so its updates are "
                f'skipped; add keys.{table} (or a "*" entry) to invalidate its keys',
            )
        self.by_table[table] = templates
        return templates

    @staticmethod
    def _old_image(u: Update) -> dict[str, Any]:
        before = u.before_row() if u.before != NULL else None
        return before or {}

    def _render(
        self,
        template: KeyTemplate,
        u: Update,
        first: dict[str, Any],
        second: dict[str, Any] | None,
        image: str,
    ) -> str:
        try:
            return template.render(u.table, first, second)
        except KeyError as exc:
            column = exc.args[0]
        columns = sorted({*first, *(second or {})})
        path = f"{self.where}.keys.{self._entry_of(u.table)}"
        if image == "old":
            hint = (
                "a delete's key is built from the key columns and the before image; use key "
                "columns in the template, or have the source send full before images "
                "(PostgreSQL: ALTER TABLE ... REPLICA IDENTITY FULL)"
            )
        else:
            hint = "fix the column name in the template"
        raise SinkError(
            f"{path}: template {template.text!r} names column {column!r}, which the "
            f"{'delete' if u.op == 'd' else 'row'} of {u.table}"
            f"{f' at {u.position}' if u.position else ''} does not have (it has: "
            f"{', '.join(columns) or 'no columns'}); {hint}"
        )

    def _entry_of(self, table: str) -> str:
        if table in self.exact:
            return table
        for pattern, _ in self.patterns:
            if fnmatch.fnmatchcase(table, pattern):
                return pattern
        return table

    def _add(self, plan: dict[str, Any], u: Update, key: str, value: Any) -> None:
        problem = key_problem(key)
        if problem is None:
            plan[key] = value
            return
        # No client can have stored this key, so there is nothing to invalidate.
        self._warn_once(
            "key",
            u.table,
            f"{self.where}.keys.{self._entry_of(u.table)}: skipping key {key[:80]!r} of table "
            f"{u.table}: {problem}, so memcached cannot hold it (further such keys of this "
            f"table are skipped without a warning)",
        )

    def _warn_once(self, kind: str, table: str, message: str) -> None:
        if (kind, table) not in self.warned:
            self.warned.add((kind, table))
            self.log.warning(message)

    # ----------------------------------------------------------- servers
    def _apply(self, index: int, flush: bool, deletes: list[str], sets: dict[str, bytes]) -> None:
        """Send one server its share of the batch; returns once it answered every command."""
        client = self.clients[index]
        if flush:
            self._with_retries(client, "flush", None)
        for start in range(0, len(deletes), _CHUNK):
            self._with_retries(client, "delete", deletes[start : start + _CHUNK])
        if sets:
            items = list(sets.items())
            for start in range(0, len(items), _CHUNK):
                self._with_retries(client, "set", dict(items[start : start + _CHUNK]))

    def _with_retries(self, client: Any, command: str, payload: Any) -> None:
        delay = self.options.retry_backoff_ms / 1000.0
        attempts = self.options.retries + 1
        for attempt in range(attempts):
            try:
                if command == "delete":
                    client.delete_many(payload, noreply=False)
                elif command == "set":
                    failed = client.set_many(payload, expire=self._expire(), noreply=False)
                    if failed:
                        raise ConnectionError(
                            f"the server did not store {len(failed)} keys (first: {failed[0]!r})"
                        )
                else:
                    client.flush_all(noreply=False)
                return
            except self.memcache_errors:
                # A broken connection (a restarted server, say) is reopened by the
                # next command; a quick retry also rides out a short hiccup.
                client.close()
                if attempt + 1 == attempts:
                    raise
                time.sleep(delay)
                delay *= 2

    def _expire(self) -> int:
        expire = self.options.expire_s
        # memcached reads an expiry over 30 days as a Unix time, not a duration.
        return expire if expire <= _RELATIVE_EXPIRY_LIMIT else int(time.time()) + expire

    def close(self) -> None:
        for client in self.clients:
            with contextlib.suppress(Exception):  # closing what may already be broken
                client.close()
        self.clients = []
        self.ring = None


@hookimpl
def wormhole_sinks() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            kind="sink",
            name="memcache",
            factory=MemcacheSink,
            options=MemcacheOptions,
            description="Invalidate (delete) or refresh (set) memcached keys of changed rows.",
        )
    ]
