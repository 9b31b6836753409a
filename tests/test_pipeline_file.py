from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from wormhole.core.errors import ConfigError
from wormhole.core.pipeline import parse_pipeline
from wormhole.testing import CliResult

MINIMAL = """
pipeline: riders
source: {type: filelog, path: data/riders}
applications:
  history:
    sink: {type: jsonl, path: out/history.jsonl}
"""


def problems(text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_pipeline(text, "p.yml", env=env or {})
    return err.value.problems


def test_minimal_pipeline_gets_the_documented_defaults() -> None:
    p = parse_pipeline(MINIMAL, "p.yml", env={})
    assert p.name == "riders"
    assert p.state_dir == Path(".wormhole/riders")
    assert p.shards == 16
    assert p.mode == "single-copy"
    assert p.transport.type == "tcp"
    assert p.datamarker_store.type == "sqlite"
    app = p.applications["history"]
    assert (app.start, app.subscribers, app.tables, app.ops) == ("earliest", 1, None, None)
    assert app.sink.options.path == "out/history.jsonl"
    assert int(p.log.roll_size) == 1 << 30


def test_environment_interpolation_with_defaults_and_escapes() -> None:
    text = """
pipeline: ${NAME}
state_dir: ${STATE:-/var/lib/wormhole}
dataset: {shards: "${SHARDS:-8}"}
source: {type: filelog, path: "$${literal}/${DATA}"}
applications:
  a: {sink: {type: jsonl, path: "${OUT:-out}/a.jsonl"}}
"""
    p = parse_pipeline(text, "p.yml", env={"NAME": "n1", "DATA": "d", "OUT": ""})
    assert p.name == "n1"
    assert p.state_dir == Path("/var/lib/wormhole")
    assert p.shards == 8
    assert p.source.options.path == "${literal}/d"
    assert p.applications["a"].sink.options.path == "out/a.jsonl"  # empty uses the default


def test_unset_variable_is_named_with_its_path() -> None:
    text = MINIMAL.replace("data/riders", '"${RIDERS_DIR}"')
    (problem,) = problems(text)
    assert problem.startswith("source.path: environment variable RIDERS_DIR is not set")


def test_every_bad_key_is_named_by_its_path() -> None:
    text = """
pipeline: riders
dataset: {shards: many}
source: {type: filelog, path: data, colour: blue}
applications:
  search:
    start: yesterday
    filter: {ops: [c, x]}
    sink: {type: jsonl}
    subscribers: 0
"""
    found = problems(text)
    joined = "\n".join(found)
    assert "dataset.shards: input should be a valid integer" in joined
    assert "source.colour: unknown option (known: path, format, table, glob, batch_bytes" in joined
    assert "applications.search.sink.path: field required" in joined
    assert "applications.search.start: must be earliest, latest, {position: SEQ}" in joined
    assert "applications.search.filter.ops[1]: input should be 'c', 'u', 'd', 'r' or 't'" in joined
    assert "applications.search.subscribers: input should be greater than or equal to 1" in joined


def test_unknown_type_lists_the_known_ones() -> None:
    (problem,) = problems(MINIMAL.replace("type: jsonl", "type: elastic"))
    assert problem.startswith("applications.history.sink.type: unknown sink type 'elastic'")
    assert "known: jsonl, latest, memcache, null, search, spark" in problem


def test_bare_null_type_gets_a_hint() -> None:
    (problem,) = problems(MINIMAL.replace("{type: jsonl, path: out/history.jsonl}", "{type: null}"))
    assert 'write type: "null"' in problem


def test_missing_required_sections() -> None:
    found = problems("pipeline: x\n")
    assert "source: field required" in found
    assert "applications: field required" in found


def test_malformed_yaml_names_line_and_column() -> None:
    (problem,) = problems("pipeline: x\nsource: {type: filelog\n")
    assert problem.startswith("malformed YAML: line 3, column 1")


def test_multiple_copy_needs_a_shared_registry_and_a_copy() -> None:
    shared, copy = problems(MINIMAL + "delivery: {mode: multiple-copy}\n")
    assert shared.startswith("delivery.mode: multiple-copy keeps datamarkers")
    assert "registry: {type: zookeeper" in shared
    assert copy.startswith("copy: required with delivery.mode: multiple-copy")
    (alone,) = problems(MINIMAL + "copy: primary\n")
    assert alone.startswith("copy: names a copy of the datastore")


def test_filter_plugins_are_validated_by_their_own_options() -> None:
    text = MINIMAL.replace(
        "    sink:", "    filter: {plugins: [{type: sample, fraction: 2}]}\n    sink:"
    )
    (problem,) = problems(text)
    path, message = problem.split(": ", 1)
    assert path == "applications.history.filter.plugins[0].fraction"
    assert message == "input should be less than or equal to 1"


def test_validate_command_exit_codes(
    wormhole_cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    good = tmp_path / "good.yml"
    good.write_text(MINIMAL)
    result = wormhole_cli("validate", str(good))
    assert result.returncode == 0, result
    assert "valid" in result.stdout

    bad = tmp_path / "bad.yml"
    bad.write_text(MINIMAL.replace("path: out/history.jsonl", "pth: out/history.jsonl"))
    result = wormhole_cli("validate", str(bad))
    assert result.returncode == 2, result
    assert "applications.history.sink.path: field required" in result.stderr
    assert (
        "applications.history.sink.pth: unknown option (known: path, fsync, envelope, "
        in result.stderr
    )
    assert "Traceback" not in result.stderr

    result = wormhole_cli("validate", str(tmp_path / "missing.yml"))
    assert result.returncode == 2
    assert "file not found" in result.stderr


def test_on_error_defaults_to_retry_and_bad_values_are_named_by_their_path() -> None:
    app = parse_pipeline(MINIMAL, "p.yml", env={}).applications["history"]
    assert (app.on_error.policy, app.on_error.backoff_ms, app.on_error.max_backoff_ms) == (
        "retry",
        50,
        30_000,
    )
    chosen = MINIMAL + "    on_error: {policy: dead_letter, retries: 5, backoff_ms: 10}\n"
    app = parse_pipeline(chosen, "p.yml", env={}).applications["history"]
    assert (app.on_error.policy, app.on_error.attempts_after_first) == ("dead_letter", 5)
    joined = "\n".join(problems(MINIMAL + "    on_error: {policy: skip, retries: -1}\n"))
    assert "applications.history.on_error.policy: input should be 'retry', 'dead_letter' or" in (
        joined
    )
    assert "applications.history.on_error.retries: input should be greater than or equal to 0" in (
        joined
    )
    (problem,) = problems(MINIMAL + "    on_error: {retries: 2}\n")
    assert problem.startswith("applications.history.on_error: ")
    assert "policy retry retries until the sink takes the batch" in problem
    library = MINIMAL.replace("    sink: {type: jsonl, path: out/history.jsonl}\n", "")
    (problem,) = problems(library + "    on_error: {policy: stop}\n")
    assert "on_error: applies to the application's sink, and it has none" in problem
