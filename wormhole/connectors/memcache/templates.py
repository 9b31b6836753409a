"""Key templates: ``"user:{id}"`` rendered from the columns of an update.

A template is literal text with ``{column}`` placeholders; ``{{`` and ``}}`` are
literal braces, and ``{@table}`` is the update's table name. A placeholder names
a column as it is, so ``{a.b}`` is the column called ``a.b`` (no attribute or
index lookup, no format specs). Values become text the same way in every
template: a string as it is, any other value as its JSON text (``42``, ``true``,
``null``, ``1.5``).
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

TABLE = "@table"
"""The placeholder for the update's table name."""

MAX_KEY_BYTES = 250
"""memcached's limit on a key's length."""

_formatter = string.Formatter()
_encode = msgspec.json.encode


class TemplateError(ValueError):
    """A template that cannot be parsed; the message says how to write it."""


@dataclass(frozen=True)
class KeyTemplate:
    """A parsed template: ``literals[0] + value(fields[0]) + literals[1] + ...``."""

    text: str
    literals: tuple[str, ...]
    fields: tuple[str, ...]

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns the template reads (``{@table}`` is not a column)."""
        return tuple(f for f in self.fields if f != TABLE)

    def render(self, table: str, first: Mapping[str, Any], second: Mapping[str, Any] | None) -> str:
        """The key for a row whose values are looked up in ``first``, then ``second``.

        Raises :class:`KeyError` with the column name when neither has it.
        """
        fields = self.fields
        literals = self.literals
        if len(fields) == 1 and fields[0] != TABLE:  # "user:{id}": the common case
            field = fields[0]
            if field in first:
                value = first[field]
            elif second is not None and field in second:
                value = second[field]
            else:
                raise KeyError(field)
            return literals[0] + (value if type(value) is str else text_of(value)) + literals[1]
        out = [literals[0]]
        for i, field in enumerate(fields, 1):
            if field == TABLE:
                out.append(table)
            else:
                if field in first:
                    value = first[field]
                elif second is not None and field in second:
                    value = second[field]
                else:
                    raise KeyError(field)
                out.append(value if type(value) is str else text_of(value))
            out.append(literals[i])
        return "".join(out)


def text_of(value: Any) -> str:
    """A column value as key text: a string as it is, anything else as its JSON text."""
    if type(value) is str:
        return value
    if type(value) is int:
        return str(value)
    return _encode(value).decode()


def parse_template(text: str) -> KeyTemplate:
    """Parse ``text``; raises :class:`TemplateError` with a fix when it is malformed."""
    literals: list[str] = []
    fields: list[str] = []
    pending = ""
    try:
        parsed = list(_formatter.parse(text))
    except ValueError as exc:
        reason = str(exc)
        raise TemplateError(
            f"template {text!r} is malformed ({reason[:1].lower()}{reason[1:]}); write "
            f"placeholders as {{column}} and literal braces as {{{{ and }}}}"
        ) from None
    for literal, field, spec, conversion in parsed:
        pending += literal
        if field is None:
            continue
        if field == "":
            raise TemplateError(
                f"template {text!r} has an empty placeholder {{}}; name a column, e.g. {{id}}"
            )
        if spec or conversion:
            written = "{" + field + (f"!{conversion}" if conversion else "")
            written += (f":{spec}" if spec else "") + "}"
            raise TemplateError(
                f"template {text!r}: {written} has a format spec or conversion, which key "
                f"templates do not support; write {{{field}}}"
            )
        if field.startswith("@") and field != TABLE:
            raise TemplateError(
                f"template {text!r}: unknown placeholder {{{field}}}; the only placeholder that "
                f"is not a column is {{{TABLE}}}"
            )
        literals.append(pending)
        fields.append(field)
        pending = ""
    literals.append(pending)
    if not any(f != TABLE for f in fields):
        example = text if not text or text.endswith((":", "/", "-", "_", ".")) else text + ":"
        raise TemplateError(
            f"template {text!r} names no column, so every row would map to one key; "
            f"add the row's key columns, e.g. {example}{{id}}"
        )
    return KeyTemplate(text, tuple(literals), tuple(fields))


def key_problem(key: str) -> str | None:
    """Why memcached cannot store ``key`` (too long, whitespace or control characters)."""
    if key.isascii():
        if len(key) <= MAX_KEY_BYTES and key.isprintable() and " " not in key:
            return None
        size = len(key)
    else:
        size = len(key.encode())
    if size > MAX_KEY_BYTES:
        return f"it is {size} bytes long (memcached allows {MAX_KEY_BYTES})"
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in key):
        return "it contains a space or a control character"
    return None
