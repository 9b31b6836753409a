"""What both engines share: document ids from templates, and typed field values."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable
from typing import Any

import msgspec

from wormhole.connectors.search.options import SearchOptions, template_fields
from wormhole.core.errors import SinkError
from wormhole.core.shard import canonical_key
from wormhole.core.update import Update

_json = msgspec.json.Encoder().encode
_I64 = (-(1 << 63), (1 << 63) - 1)
_U64 = (0, (1 << 64) - 1)
_TRUE = frozenset({"true", "t", "yes", "y", "on", "1"})
_FALSE = frozenset({"false", "f", "no", "n", "off", "0"})


def _text(value: Any) -> str:
    return value if isinstance(value, str) else _json(value).decode()


class DocumentIds:
    """Document ids: a template per table, else ``<table>:<key as canonical JSON>``."""

    def __init__(self, options: SearchOptions, application: str) -> None:
        self.application = application
        self.templates = {
            table: (template, template_fields(template)) for table, template in options.ids.items()
        }

    def __call__(self, update: Update) -> str:
        spec = self.templates.get(update.table)
        if spec is None:
            return f"{update.table}:{canonical_key(update.key).decode()}"
        template, names = spec
        values = update.key
        if not all(n in values for n in names):
            row = update.before_row() if update.op == "d" else update.after_row()
            values = {**(row or {}), **update.key}
            missing = [n for n in names if n not in values]
            if missing:
                raise SinkError(
                    f"applications.{self.application}.sink.ids.{update.table}: template "
                    f"{template!r} uses column {missing[0]!r}, which a {update.op!r} update of "
                    f"table {update.table} (key {_text(update.key)}) does not have; name key "
                    f"columns only (deletes carry just the key)"
                )
        return template.format_map({n: _text(values[n]) for n in names})


def _integer(value: Any, bounds: tuple[int, int]) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        if not value.is_integer():
            return None
        value = int(value)
    elif isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            return None
    if isinstance(value, int) and bounds[0] <= value <= bounds[1]:
        return value
    return None


def _float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def _bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    return None


def _date(value: Any) -> dt.datetime | None:
    """ISO 8601 text (naive means UTC), or a number of milliseconds since the Unix epoch."""
    try:
        if isinstance(value, bool):
            return None
        if isinstance(value, int | float):
            if not math.isfinite(value):
                return None
            return dt.datetime.fromtimestamp(value / 1000, dt.UTC)
        if isinstance(value, str):
            parsed = dt.datetime.fromisoformat(value.strip())
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=dt.UTC)
            return parsed.astimezone(dt.UTC)
    except (ValueError, OverflowError, OSError):
        return None
    return None


CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "text": lambda v: v if isinstance(v, str) else _text(v),
    "string": lambda v: v if isinstance(v, str) else _text(v),
    "keyword": lambda v: v if isinstance(v, str) else _text(v),
    "i64": lambda v: _integer(v, _I64),
    "u64": lambda v: _integer(v, _U64),
    "f64": _float,
    "bool": _bool,
    "date": _date,
}


def field_values(kind: str, value: Any) -> tuple[list[Any], bool]:
    """The values to index for one column (a JSON array gives several), and whether all converted.

    ``None`` (SQL NULL) indexes nothing. A value that does not convert to the
    field's type is left out of the index (the row keeps it).
    """
    if value is None:
        return [], True
    convert = CONVERTERS[kind]
    items = value if isinstance(value, list) else [value]
    out = []
    ok = True
    for item in items:
        if item is None:
            continue
        converted = convert(item)
        if converted is None:
            ok = False
        else:
            out.append(converted)
    return out, ok
