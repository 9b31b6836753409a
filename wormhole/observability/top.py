"""``wormhole top``: a live view of a running pipeline.

What it shows comes from where ``wormhole status`` looks, the state directory: the running
publisher's ``live.json`` (rewritten every datamarker interval, with each application's
counts, rates, subscribers and lag, the caravans, the source's reads and the progress of long
work), or, when no publisher runs, the stored datamarkers and the publisher log. The
source's own lag (how far it is behind its datastore) is asked of the source only at a
metrics scrape, so when the publisher serves metrics (``metrics.listen``) the view scrapes
its endpoint and shows every ``wormhole_source_*`` gauge it finds there, whatever the source.
"""

from __future__ import annotations

import contextlib
import os
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wormhole.core.lag import Lag, behind, measure, stored_datamarkers
from wormhole.core.offline_log import inspect_log
from wormhole.core.pipeline import Pipeline
from wormhole.observability.status import read_live_status
from wormhole.subscriber.dead_letter_log import count_dead_letters

SCRAPE_TIMEOUT_S = 2.0


@dataclass
class Reading:
    """One look at a pipeline: what a frame shows."""

    pipeline: str
    state_dir: Path
    live: dict[str, Any] | None
    log_first: int
    log_end: int
    log_segments: int
    log_bytes: int
    applications: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per application: subscribers, rates, counts, lag (updates, seconds), caravan."""
    source_gauges: dict[str, float] = field(default_factory=dict)
    """The source's ``wormhole_source_*`` gauges (lag_bytes ...), when metrics are served."""
    source_type: str = ""
    """The source's ``type`` (shown, never acted on)."""
    source_note: str = ""
    """Why there are no source gauges, if there are none."""
    lag_of: str = ""
    """With a transport that counts lag at its destination: what the lag column counts."""
    lag_error: str = ""
    """Why that lag is unknown, if it is."""
    taken: float = field(default_factory=time.time)


def scrape_source_gauges(address: str) -> dict[str, float]:
    """The ``wormhole_source_<name>`` gauges of the metrics endpoint at ``address``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=SCRAPE_TIMEOUT_S) as r:
        text = r.read().decode("utf-8")
    gauges: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "gauge" or not family.name.startswith("wormhole_source_"):
            continue
        for sample in family.samples:
            gauges[sample.name.removeprefix("wormhole_source_")] = float(sample.value)
    return gauges


def read(pipeline: Pipeline) -> Reading:
    """What a frame of ``pipeline`` shows now."""
    state_dir = pipeline.state_dir
    info = inspect_log(state_dir / "log")
    reading = Reading(
        pipeline=pipeline.name,
        state_dir=state_dir,
        live=read_live_status(state_dir),
        log_first=info.first_seq,
        log_end=info.next_seq,
        log_segments=len(info.segments),
        log_bytes=sum(size for _, _, size in info.segments),
        source_type=pipeline.source.type,
    )
    live = reading.live
    if live is None:
        lag = measure(pipeline, stored_datamarkers(pipeline), info.next_seq)
        reading.applications = {
            name: {"datamarker": lag.oldest(name), "lag_updates": lag.behind(name)}
            for name in sorted(pipeline.applications)
        }
        _count_dead_letters(pipeline, reading)
        _destination_lag(pipeline, reading, lag)
        return reading
    end = int(live.get("log", {}).get("end", info.next_seq))
    carried: dict[str, tuple[int, int]] = {}
    for number, caravan in enumerate(live.get("caravans", [])):
        for name in caravan["applications"]:
            carried[name] = (number, behind(end, int(caravan["position"])))
    figures = live.get("application_figures", {})
    failed = live.get("failed", {})
    for name in sorted(set(figures) | set(failed)):
        app = dict(figures.get(name, {}))
        caravan = carried.get(name)
        app["caravan"] = None if caravan is None else caravan[0]
        app["caravan_lag"] = None if caravan is None else caravan[1]
        app["failed"] = failed.get(name)
        reading.applications[name] = app
    _count_dead_letters(pipeline, reading)
    # Live figures hold the publisher-log lag; only the destination's is measured here.
    _destination_lag(pipeline, reading, measure(pipeline, {}, end))
    address = live.get("metrics")
    if address:
        try:
            reading.source_gauges = scrape_source_gauges(str(address))
        except (OSError, ValueError) as exc:
            reading.source_note = f"metrics at {address} did not answer ({exc})"
    else:
        reading.source_note = "serve metrics (metrics.listen) to see the source's lag"
    return reading


def _destination_lag(pipeline: Pipeline, reading: Reading, lag: Lag) -> None:
    """A transport that counts lag at its destination (Kafka: consumer groups' committed
    offsets) gives each application's lag; the publisher's datamarkers only say what it
    handed over."""
    if lag.destination is None:
        return
    reading.lag_of, reading.lag_error = lag.what, lag.error
    for name in sorted(n for n, a in pipeline.applications.items() if not a.external):
        app = reading.applications.setdefault(name, {})
        app["lag_updates"] = lag.at_destination(name)
        app["lag_seconds"] = None


def _count_dead_letters(pipeline: Pipeline, reading: Reading) -> None:
    """Each application's dead letters in this state dir (as ``wormhole status`` counts them):
    a number where its policy is ``dead_letter`` or it has a log, else nothing."""
    counts = count_dead_letters(pipeline.state_dir)
    for name, app in reading.applications.items():
        config = pipeline.applications.get(name)
        keeps = config is not None and config.on_error.policy == "dead_letter"
        app["dead_letters"] = counts.get(name, 0) if keeps or name in counts else None


# ---------------------------------------------------------------- rendering
def _number(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def _bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return f"{value:,.1f} TiB"  # pragma: no cover - unreachable


def _gauge(name: str, value: float) -> str:
    if name.endswith("_bytes"):
        return _bytes(value)
    if name.endswith("_seconds"):
        return f"{value:,.1f} s"
    return f"{value:,.0f}"


def render(reading: Reading) -> Any:
    """The frame of ``reading``: a rich renderable."""
    from rich.console import Group
    from rich.text import Text

    parts: list[Any] = [_head(reading), _applications(reading)]
    if reading.lag_of:
        parts.append(Text(f"lag: {reading.lag_of}"))
    if reading.lag_error:
        parts.append(Text(f"lag unknown: {reading.lag_error}", style="red"))
    live = reading.live
    if live is not None:
        parts += [_source(reading, live), _caravans(reading, live)]
        parts += _progress(live)
        for name, error in (live.get("failed") or {}).items():
            parts.append(Text(f"application {name} stopped: {error}", style="red"))
    return Group(*parts)


def _head(reading: Reading) -> Any:
    from rich.text import Text

    live = reading.live
    clock = time.strftime("%H:%M:%S", time.localtime(reading.taken))
    head = Text(f"wormhole top: pipeline {reading.pipeline}   {clock}\n", style="bold")
    if live is None:
        head.append(
            f"publisher NOT RUNNING (no live publisher in {reading.state_dir}); "
            f"lag from the stored datamarkers\n",
            style="bold red",
        )
    else:
        age = max(0.0, reading.taken - int(live.get("updated_ms", 0)) / 1000)
        head.append(f"publisher running, pid {live['pid']}, status {age:.1f}s old\n")
    head.append(
        f"publisher log {reading.log_first:,} .. {reading.log_end:,}, "
        f"{reading.log_segments} segment(s), {_bytes(reading.log_bytes)}"
    )
    return head


def _applications(reading: Reading) -> Any:
    from rich import box
    from rich.table import Table

    apps = Table(title="applications", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("application", "subscribers", "updates/s", "delivered", "acknowledged"):
        apps.add_column(column, justify="left" if column == "application" else "right")
    for column in ("dead letters", "lag", "lag (s)", "caravan", "caravan lag"):
        apps.add_column(column, justify="right")
    for name, app in reading.applications.items():
        failed = app.get("failed")
        apps.add_row(
            name + (" (stopped)" if failed else ""),
            _number(app.get("subscribers")),
            _number(app.get("acknowledged_rate"), 1),
            _number(app.get("delivered")),
            _number(app.get("acknowledged")),
            _number(app.get("dead_letters")),
            _number(app.get("lag_updates")),
            _number(app.get("lag_seconds"), 1),
            "-" if app.get("caravan") is None else f"#{app['caravan']}",
            _number(app.get("caravan_lag")),
        )
    return apps


def _source(reading: Reading, live: dict[str, Any]) -> Any:
    from rich.text import Text

    source = live.get("source") or {}
    lines = Text(f"source ({reading.source_type}): ", style="bold")
    lines.append(
        f"{_number(source.get('updates'))} updates read, "
        f"{_number(source.get('read_rate'), 1)} updates/s"
    )
    if reading.source_gauges:
        lines.append(
            "; "
            + ", ".join(
                f"{name.replace('_', ' ')} {_gauge(name, value)}"
                for name, value in sorted(reading.source_gauges.items())
            )
        )
    elif reading.source_note:
        lines.append(f"; lag: {reading.source_note}")
    return lines


def _caravans(reading: Reading, live: dict[str, Any]) -> Any:
    from rich import box
    from rich.table import Table

    caravans = Table(title="caravans", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("caravan", "applications", "position", "lag", "read/s", "from disk"):
        caravans.add_column(column, justify="left" if column == "applications" else "right")
    for number, caravan in enumerate(live.get("caravans", [])):
        caravans.add_row(
            f"#{number}",
            ", ".join(caravan["applications"]),
            _number(caravan["position"]),
            _number(behind(reading.log_end, int(caravan["position"]))),
            _number(float(caravan.get("read_rate", 0.0)), 1),
            _bytes(float(caravan.get("bytes_read_from_disk", 0))),
        )
    if not live.get("caravans"):
        caravans.add_row("-", "(none: no subscriber connected)", "", "", "", "")
    return caravans


def _progress(live: dict[str, Any]) -> list[Any]:
    from rich.text import Text

    lines = []
    for task in live.get("progress", []):
        total = task.get("total")  # None once the work went past an estimate
        about = "~" if task.get("estimate", True) else ""
        of = f" of {about}{total:,}" if total else ""
        eta = task.get("eta_seconds")
        lines.append(
            Text(
                f"{task['name']}: {task['done']:,}{of} {task['unit']}, "
                f"{task['rate']:,.0f} {task['unit']}/s"
                + (f", ETA {eta:,.0f}s" if eta is not None else "")
                + (f" ({task['detail']})" if task.get("detail") else "")
            )
        )
    return lines


def run(pipeline: Pipeline, interval: float, once: bool, out: Any = None) -> None:
    """Show the view: one frame (``once``), or one refreshed in place every ``interval``
    seconds until interrupted."""
    import sys

    from rich.console import Console

    stream = out or sys.stdout
    terminal = bool(getattr(stream, "isatty", lambda: False)())
    # Not a terminal: plain text, wide enough that the tables do not wrap.
    console = Console(file=stream) if terminal else Console(file=stream, width=200)
    if once:
        console.print(render(read(pipeline)))
        return
    from rich.live import Live

    with (
        _keys() as quit_pressed,
        Live(render(read(pipeline)), console=console, auto_refresh=False, screen=False) as view,
    ):
        while not quit_pressed(interval):
            view.update(render(read(pipeline)), refresh=True)


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[float], bool]]:
    """``wait(seconds)``: wait that long, True as soon as ``q`` is pressed. On a terminal,
    stdin is read key by key meanwhile (and restored after); elsewhere it is not read."""
    import sys

    stdin = sys.stdin
    if stdin is None or not stdin.isatty():

        def sleep(seconds: float) -> bool:
            time.sleep(seconds)
            return False

        yield sleep
        return
    import select
    import termios
    import tty

    fd = stdin.fileno()
    saved = termios.tcgetattr(fd)

    def wait(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([fd], [], [], left)
            if ready and os.read(fd, 1) in (b"q", b"Q"):
                return True
        return False

    try:
        tty.setcbreak(fd)
        yield wait
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


__all__ = ["Reading", "read", "render", "run", "scrape_source_gauges"]
