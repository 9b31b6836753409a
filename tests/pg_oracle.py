"""Parse PostgreSQL's test_decoding output: the oracle for the postgres source; and read
the changes of that oracle's slot."""

from __future__ import annotations

from typing import Any

import psycopg2

UNCHANGED = object()


def parse_values(text: str) -> dict[str, Any]:
    """``name[type]:value ...`` into {name: text value, None for null, UNCHANGED}."""
    out: dict[str, Any] = {}
    i = 0
    n = len(text)
    while i < n:
        if text[i] == " ":
            i += 1
            continue
        bracket = text.index("[", i)
        name = text[i:bracket]
        close = text.index("]:", bracket)
        i = close + 2
        if text.startswith("null", i) and (i + 4 == n or text[i + 4] == " "):
            out[name] = None
            i += 4
        elif text.startswith("unchanged-toast-datum", i):
            out[name] = UNCHANGED
            i += len("unchanged-toast-datum")
        elif text.startswith("B'", i):  # bit and varbit: B'0101'
            end = text.index("'", i + 2)
            out[name] = text[i + 2 : end]
            i = end + 1
        elif text[i] == "'":
            i += 1
            value = []
            while True:
                quote = text.index("'", i)
                value.append(text[i:quote])
                if quote + 1 < n and text[quote + 1] == "'":
                    value.append("'")
                    i = quote + 2
                    continue
                i = quote + 1
                break
            out[name] = "".join(value)
        else:
            end = text.find(" ", i)
            end = n if end < 0 else end
            out[name] = text[i:end]
            i = end
    return out


def parse_change(line: str) -> tuple[str, str, dict[str, Any] | None, dict[str, Any] | None]:
    """One test_decoding line: (op, table, old values or None, new values or None)."""
    assert line.startswith("table "), line
    table, _, rest = line[6:].partition(": ")
    action, _, values = rest.partition(": ")
    if action == "INSERT":
        return "c", table, None, parse_values(values)
    if action == "DELETE":
        return "d", table, parse_values(values), None
    if action == "TRUNCATE":
        return "t", table, None, None
    assert action == "UPDATE", line
    if values.startswith("old-key: "):
        old, _, new = values[len("old-key: ") :].partition(" new-tuple: ")
        return "u", table, parse_values(old), parse_values(new)
    return "u", table, None, parse_values(values)


def same_row(
    ours: dict[str, Any],
    oracle: dict[str, Any],
    old: dict[str, Any] | None = None,
    skip_nulls: bool = False,
) -> bool:
    """Our row equals the oracle's: text compared as text, floats as numbers.

    Where the oracle says a TOASTed value was unchanged, we may have carried it
    from the old row image (REPLICA IDENTITY FULL): ``old`` is that image.
    """
    if skip_nulls:  # test_decoding leaves NULL columns out of old row images
        ours = {k: v for k, v in ours.items() if v is not None or k in oracle}
    if set(ours) != set(oracle):
        return False
    for name, value in ours.items():
        expected = oracle[name]
        if expected is UNCHANGED and old is not None and old.get(name) not in (None, UNCHANGED):
            expected = old[name]
        if isinstance(value, float) and isinstance(expected, str):
            if float(expected) != value:
                return False
        elif as_text(value) != expected:
            return False
    return True


def as_text(value: Any) -> Any:
    """An envelope value as test_decoding would print it."""
    if value is None:
        return None
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, (int, float)):
        return repr(value) if isinstance(value, float) else str(value)
    if value == "__unchanged_toast__":
        return UNCHANGED
    return value


def oracle_lines(dsn: str) -> list[str]:
    """The row changes test_decoding's slot ``oracle`` holds (consumed), as its lines."""
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT data FROM pg_logical_slot_get_changes('oracle', NULL, NULL, "
                "'skip-empty-xacts', '1')"
            )
            lines = [row[0] for row in cur.fetchall()]
    finally:
        conn.close()
    return [line for line in lines if line.startswith("table ")]
