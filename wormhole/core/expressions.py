"""Row predicates for publisher-side filters: a small, safe expression language.

``where: "status = 'active' and amount > 100"`` is parsed once into a tree of
Python closures; nothing is ever passed to ``eval``. Grammar (keywords are
case-insensitive)::

    expr       := or
    or         := and ("or" and)*
    and        := not ("and" not)*
    not        := "not" not | test
    test       := value [ cmp value
                        | "is" ["not"] "null"
                        | ["not"] "in" "(" value ("," value)* ")"
                        | ["not"] "like" string ]
    cmp        := "=" | "==" | "!=" | "<>" | "<" | "<=" | ">" | ">="
    value      := number | 'string' | true | false | null | column | "(" expr ")"
    column     := name | "quoted name" | `quoted name`

Columns are the row's columns; ``_table`` and ``_op`` are the update's table
and op. Comparisons follow SQL where it matters: anything compared with null
is false (use ``is null``); a number compared with text that holds a number
(DECIMAL and NUMERIC columns travel as text) compares as numbers; ``like``
takes ``%`` and ``_``.
"""

from __future__ import annotations

import decimal
import re
from collections.abc import Callable
from typing import Any

Row = dict[str, Any]
Predicate = Callable[[Row], Any]

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<number>-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)
      | '(?P<string>(?:[^']|'')*)'
      | "(?P<dquoted>(?:[^"]|"")*)"
      | `(?P<bquoted>(?:[^`]|``)*)`
      | (?P<op><=|>=|<>|!=|==|=|<|>|\(|\)|,)
      | (?P<name>[A-Za-z_][A-Za-z0-9_$.]*)
    )""",
    re.VERBOSE,
)
_KEYWORDS = frozenset({"and", "or", "not", "is", "null", "in", "like", "true", "false"})


class ExpressionError(ValueError):
    """A ``where`` expression that does not parse; the message names the position."""


class _Tokens:
    def __init__(self, text: str) -> None:
        self.text = text
        self.items: list[tuple[str, Any, int]] = []
        position = 0
        while position < len(text):
            if text[position:].strip() == "":
                break
            match = _TOKEN.match(text, position)
            if match is None or match.end() == position:
                start = position + len(text[position:]) - len(text[position:].lstrip())
                raise ExpressionError(
                    f"unexpected {text[start : start + 10]!r} at column {start + 1}"
                )
            kind = match.lastgroup or ""
            value: Any = match.group(kind)
            start = match.start(kind) - (1 if kind in ("string", "dquoted", "bquoted") else 0)
            if kind == "number":
                value = (
                    decimal.Decimal(value) if "." in value or "e" in value.lower() else int(value)
                )
            elif kind == "string":
                value = value.replace("''", "'")
            elif kind == "dquoted":
                kind, value = "column", value.replace('""', '"')
            elif kind == "bquoted":
                kind, value = "column", value.replace("``", "`")
            elif kind == "name":
                if value.lower() in _KEYWORDS:
                    kind, value = "keyword", value.lower()
                else:
                    kind = "column"
            self.items.append((kind, value, start))
            position = match.end()
        self.index = 0

    def peek(self) -> tuple[str, Any, int]:
        if self.index < len(self.items):
            return self.items[self.index]
        return ("end", None, len(self.text))

    def take(self) -> tuple[str, Any, int]:
        token = self.peek()
        self.index += 1
        return token

    def keyword(self, *words: str) -> bool:
        kind, value, _ = self.peek()
        if kind == "keyword" and value in words:
            self.index += 1
            return True
        return False

    def expect(self, kind: str, value: Any = None) -> tuple[str, Any, int]:
        token = self.take()
        if token[0] != kind or (value is not None and token[1] != value):
            want = repr(value) if value is not None else kind
            raise ExpressionError(f"expected {want} at column {token[2] + 1}, found {_show(token)}")
        return token


def _show(token: tuple[str, Any, int]) -> str:
    kind, value, _ = token
    return "the end" if kind == "end" else repr(str(value))


def _number(value: Any) -> Any:
    """A number for comparisons: numbers as they are, numeric text as a Decimal."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float, decimal.Decimal)):
        return value
    if isinstance(value, str):
        try:
            return decimal.Decimal(value)
        except decimal.InvalidOperation:
            return None
    return None


def _compare(op: str, left: Any, right: Any) -> bool:
    if left is None or right is None:
        return False
    if isinstance(left, (int, float, decimal.Decimal)) != isinstance(
        right, (int, float, decimal.Decimal)
    ) or isinstance(left, bool) != isinstance(right, bool):
        # A number against text that holds a number compares as numbers.
        a, b = _number(left), _number(right)
        if a is None or b is None:
            return op in ("!=", "<>") and left != right
        left, right = a, b
    elif isinstance(left, float) or isinstance(right, float):
        left, right = float(left), float(right)
    try:
        if op in ("=", "=="):
            return bool(left == right)
        if op in ("!=", "<>"):
            return bool(left != right)
        if op == "<":
            return bool(left < right)
        if op == "<=":
            return bool(left <= right)
        if op == ">":
            return bool(left > right)
        return bool(left >= right)
    except TypeError:
        return False


MAX_DEPTH = 100
"""Parentheses and ``not`` nest at most this deep: the parser and the predicate it builds
recurse once per level."""


class Expression:
    """A parsed ``where`` expression: ``expr(row)`` is True when the row matches."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.columns: set[str] = set()
        self._depth = 0
        tokens = _Tokens(text)
        if not tokens.items:
            raise ExpressionError("the expression is empty")
        self._tokens = tokens
        self._predicate = self._or()
        if tokens.peek()[0] != "end":
            token = tokens.peek()
            raise ExpressionError(f"unexpected {_show(token)} at column {token[2] + 1}")
        del self._tokens

    def __call__(self, row: Row) -> bool:
        return bool(self._predicate(row))

    # ------------------------------------------------------------- parser
    def _or(self) -> Predicate:
        parts = [self._and()]
        while self._tokens.keyword("or"):
            parts.append(self._and())
        if len(parts) == 1:
            return parts[0]
        return lambda row: any(p(row) for p in parts)

    def _and(self) -> Predicate:
        parts = [self._not()]
        while self._tokens.keyword("and"):
            parts.append(self._not())
        if len(parts) == 1:
            return parts[0]
        return lambda row: all(p(row) for p in parts)

    def _nested(self, parse: Callable[[], Predicate], start: int) -> Predicate:
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise ExpressionError(f"nested more than {MAX_DEPTH} levels deep at column {start + 1}")
        inner = parse()
        self._depth -= 1
        return inner

    def _not(self) -> Predicate:
        start = self._tokens.peek()[2]
        if self._tokens.keyword("not"):
            inner = self._nested(self._not, start)
            return lambda row: not inner(row)
        return self._test()

    def _test(self) -> Predicate:
        tokens = self._tokens
        left = self._value()
        kind, value, _ = tokens.peek()
        if kind == "op" and value in ("=", "==", "!=", "<>", "<", "<=", ">", ">="):
            tokens.take()
            right = self._value()
            return lambda row: _compare(value, left(row), right(row))
        if tokens.keyword("is"):
            negate = tokens.keyword("not")
            tokens.expect("keyword", "null")
            if negate:
                return lambda row: left(row) is not None
            return lambda row: left(row) is None
        negate = tokens.keyword("not")
        if tokens.keyword("in"):
            tokens.expect("op", "(")
            choices = [self._value()]
            while tokens.peek()[:2] == ("op", ","):
                tokens.take()
                choices.append(self._value())
            tokens.expect("op", ")")

            def member(row: Row) -> bool:
                v = left(row)
                return v is not None and any(_compare("=", v, c(row)) for c in choices)

            return (lambda row: left(row) is not None and not member(row)) if negate else member
        if tokens.keyword("like"):
            _, pattern, _ = tokens.expect("string")
            regex = re.compile(
                "".join(
                    ".*" if ch == "%" else "." if ch == "_" else re.escape(ch) for ch in pattern
                ),
                re.S,
            )

            def like(row: Row) -> bool:
                v = left(row)
                return isinstance(v, str) and regex.fullmatch(v) is not None

            return (lambda row: left(row) is not None and not like(row)) if negate else like
        if negate:
            token = tokens.peek()
            raise ExpressionError(f"expected 'in' or 'like' at column {token[2] + 1}")
        return left

    def _value(self) -> Predicate:
        kind, value, start = self._tokens.take()
        if kind in ("number", "string"):
            return lambda row: value
        if kind == "keyword" and value in ("true", "false", "null"):
            constant = {"true": True, "false": False, "null": None}[value]
            return lambda row: constant
        if kind == "column":
            self.columns.add(value)
            name = value
            return lambda row: row.get(name)
        if kind == "op" and value == "(":
            inner = self._nested(self._or, start)
            self._tokens.expect("op", ")")
            return inner
        raise ExpressionError(
            f"expected a value at column {start + 1}, found {_show((kind, value, start))}"
        )


__all__ = ["Expression", "ExpressionError"]
