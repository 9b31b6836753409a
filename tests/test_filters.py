"""Publisher-side row filters: the `where` language and column projection."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from wormhole.core.expressions import Expression, ExpressionError
from wormhole.testing import read_envelopes, run_cli, write_pipeline


@pytest.mark.parametrize(
    ("text", "row", "expected"),
    [
        ("status = 'active' and amount > 100", {"status": "active", "amount": 150}, True),
        ("status = 'active' and amount > 100", {"status": "active", "amount": 50}, False),
        # DECIMAL columns travel as text: compared with a number, as numbers.
        ("amount > 100", {"amount": "100.50"}, True),
        ("amount > 100", {"amount": "99.99"}, False),
        ("amount >= 100.5", {"amount": "100.50"}, True),
        # null never compares; `is null` does.
        ("amount > 1", {"amount": None}, False),
        ("amount != 1", {"amount": None}, False),
        ("amount is null", {"amount": None}, True),
        ("amount is not null", {"amount": 0}, True),
        ("missing is null", {}, True),
        ("n in (1, 2, 3)", {"n": 2}, True),
        ("n not in (1, 2, 3)", {"n": 2}, False),
        ("n not in (1, 2)", {"n": None}, False),
        ("name like 'a%'", {"name": "ada"}, True),
        ("name like 'a_a'", {"name": "ada"}, True),
        ("name not like 'a%'", {"name": "grace"}, True),
        ("name = 'O''Neil'", {"name": "O'Neil"}, True),
        ("not (a = 1 or b = 2)", {"a": 1, "b": 0}, False),
        ("a = 1 or b = 2 and c = 3", {"a": 1, "b": 0, "c": 0}, True),
        ("flag", {"flag": True}, True),
        ("flag = false", {"flag": False}, True),
        ('"Odd Name" = 1 and `x y` = 2', {"Odd Name": 1, "x y": 2}, True),
        ("_table like 'public.%' and _op = 'u'", {"_table": "public.t", "_op": "u"}, True),
        ("STATUS = 'x' AND n > 1", {"STATUS": "x", "n": 2}, True),
        ("n < 'abc'", {"n": 1}, False),  # a number against text that is not a number
    ],
)
def test_the_where_language(text: str, row: dict[str, Any], expected: bool) -> None:
    assert Expression(text)(row) is expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("status = ", "expected a value at column 10, found the end"),
        ("a = 1 and", "expected a value at column 10"),
        ("a === 1", "expected a value at column 5"),
        ("a not 1", "expected 'in' or 'like' at column 7"),
        ("a = 'x", 'unexpected "\'x" at column 5'),
        ("a = 1)", "unexpected ')' at column 6"),
        ("a in 1", "expected '(' at column 6"),
        ("a like 1", "expected string at column 8"),
        ("__import__('os')", "unexpected '(' at column 11"),
        ("", "the expression is empty"),
    ],
)
def test_bad_expressions_name_the_column(text: str, message: str) -> None:
    with pytest.raises(ExpressionError, match=None) as raised:
        Expression(text)
    assert message in str(raised.value)


def _orders(path: Path) -> None:
    rows: list[dict[str, Any]] = []
    for i in range(1, 21):
        status = "active" if i % 2 else "closed"
        after = {"id": i, "status": status, "amount": f"{i * 10}.50", "note": f"n{i}"}
        rows.append({"table": "orders", "op": "c", "key": {"id": i}, "after": after})
    # Order 15 (active, 150.50) drops to 5.00: it leaves the set and must be seen leaving.
    after = {"id": 15, "status": "active", "amount": "5.00", "note": "cut"}
    before = {"id": 15, "status": "active", "amount": "150.50", "note": "n15"}
    rows.append({"table": "orders", "op": "u", "key": {"id": 15}, "before": before, "after": after})
    # Order 3 (active, 30.50) grows into the set.
    after = {"id": 3, "status": "active", "amount": "300.00", "note": "grown"}
    rows.append({"table": "orders", "op": "u", "key": {"id": 3}, "after": after})
    rows.append({"table": "orders", "op": "d", "key": {"id": 11}, "before": {"id": 11}})
    rows.append({"table": "orders", "op": "d", "key": {"id": 1}, "before": dict(rows[0]["after"])})
    rows.append({"table": "customers", "op": "c", "key": {"id": 1}, "after": {"id": 1, "vip": 1}})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _pipeline(tmp_path: Path, applications: dict[str, Any]) -> Path:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    _orders(data / "orders.jsonl")
    return write_pipeline(
        tmp_path / "filters.yml",
        {
            "pipeline": "filters",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(data / "orders.jsonl")},
            "transport": {"type": "inprocess"},
            "applications": applications,
        },
    )


def _jsonl(tmp_path: Path, name: str) -> dict[str, Any]:
    return {"type": "jsonl", "path": str(tmp_path / f"{name}.jsonl")}


def test_where_and_columns_filter_on_the_publisher_side(tmp_path: Path) -> None:
    pipeline = _pipeline(
        tmp_path,
        {
            "big": {
                "filter": {
                    "where": {"orders": "status = 'active' and amount > 100"},
                    "columns": {"orders": ["id", "amount"]},
                },
                "sink": _jsonl(tmp_path, "big"),
            },
            "everything": {"sink": _jsonl(tmp_path, "everything")},
        },
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    everything = read_envelopes(tmp_path / "everything.jsonl")
    assert len(everything) == 25
    assert everything[0]["after"] == {"id": 1, "status": "active", "amount": "10.50", "note": "n1"}
    big = read_envelopes(tmp_path / "big.jsonl")
    got = [(e["op"], e["key"]["id"], e["source"]["table"]) for e in big]
    active_big = [i for i in range(1, 21) if i % 2 and i * 10.5 > 100 and i * 10 + 0.5 > 100]
    assert got == [
        *[("c", i, "orders") for i in active_big],
        ("u", 15, "orders"),  # leaves the set: kept, its old image matched
        ("u", 3, "orders"),  # enters the set
        ("d", 11, "orders"),  # a key-only old image cannot be judged: kept
        ("c", 1, "customers"),  # no predicate for this table
    ]
    # Projection: only id and amount, in both images; other tables untouched.
    assert big[0]["after"] == {"id": 11, "amount": "110.50"}
    assert big[len(active_big)]["before"] == {"id": 15, "amount": "150.50"}
    assert big[len(active_big)]["after"] == {"id": 15, "amount": "5.00"}
    assert big[-1]["after"] == {"id": 1, "vip": 1}
    # The datamarkers moved past the filtered updates.
    status = run_cli("status", str(pipeline), "--json", cwd=tmp_path)
    flows = json.loads(status.stdout)["flows"]
    assert {f["lag"] for f in flows if f["application"] == "big"} == {0}


def test_an_unknown_column_stops_only_its_application(tmp_path: Path) -> None:
    pipeline = _pipeline(
        tmp_path,
        {
            "bad": {"filter": {"where": "colour = 'red'"}, "sink": _jsonl(tmp_path, "bad")},
            "fine": {"sink": _jsonl(tmp_path, "fine")},
        },
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 2, result
    assert (
        "applications.bad.filter.where: 'colour' is not a column of table orders "
        "(its columns: id, status, amount, note)"
    ) in result.stderr
    assert "Traceback" not in result.stderr
    # The other application received everything.
    assert len(read_envelopes(tmp_path / "fine.jsonl")) == 25
    assert read_envelopes(tmp_path / "bad.jsonl") == []


def test_an_unparsable_where_is_a_validation_error(tmp_path: Path) -> None:
    pipeline = _pipeline(
        tmp_path,
        {"bad": {"filter": {"where": "amount >> 3"}, "sink": _jsonl(tmp_path, "bad")}},
    )
    result = run_cli("validate", str(pipeline), cwd=tmp_path)
    assert result.returncode == 2, result
    assert "applications.bad.filter.where: cannot parse 'amount >> 3'" in result.stderr
    assert "expected a value at column 9, found '>'" in result.stderr
