"""The ``wormhole`` command: run, publish, subscribe, validate, plugins, status, top, forget,
apps, dead-letters, and the commands plugins add."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from wormhole.core.backfill import summary as backfill_summary
from wormhole.core.datamarkers import load_stored
from wormhole.core.dead_letters import count_dead_letters
from wormhole.core.errors import ConfigError, Stopped, WormholeError, file_problem
from wormhole.core.metrics import count_errors, parse_listen, serve
from wormhole.core.pipeline import READ_STATE_UNUSED, MetricsSettings, Pipeline, load_pipeline
from wormhole.core.publisher import Publisher, RunSummary, tune_gc
from wormhole.core.publisher_log import inspect_log
from wormhole.core.status import read_live_status
from wormhole.core.subscriber import catch_stop_signals
from wormhole.plugins.components import KINDS, InvalidEntry, SubscribeRequest

PLURALS = {"registry": "registries"}

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_INCOMPLETE = 3
"""``run --once`` stopped (SIGINT, SIGTERM) before every application had its end position."""


def _load(path: str, reads_state_only: bool = False) -> Pipeline:
    """The pipeline file; a command that only reads the state dir needs no variables of the
    source, transport or sinks (their secrets)."""
    return load_pipeline(path, unused=READ_STATE_UNUSED if reads_state_only else ())


def _print_summary(summary: RunSummary, out: Any = sys.stdout) -> None:
    print(
        f"pipeline {summary.pipeline}: {summary.source_updates:,} updates read from the source "
        f"in {summary.elapsed:.2f}s ({summary.rate:,.0f} updates/s); publisher log at "
        f"{summary.log_end:,}",
        file=out,
    )
    width = max([len("application")] + [len(n) for n in summary.applications])
    print(f"  {'application':<{width}}  {'updates':>12}  {'datamarker':>12}  {'lag':>10}", file=out)
    for app in summary.applications.values():
        print(
            f"  {app.name:<{width}}  {app.updates:>12,}  {app.datamarker:>12,}  {app.lag:>10,}",
            file=out,
        )
    if summary.truncated:
        print(f"  recovered torn tails: {', '.join(summary.truncated)}", file=out)
    if summary.removed_segments:
        print(f"  garbage-collected: {', '.join(summary.removed_segments)}", file=out)
    if summary.complete:
        print("  complete: every application acknowledged the end position", file=out)
    elif summary.complete is False:
        print(f"  incomplete: {_incomplete_text(summary)}", file=out)


def _incomplete_text(summary: RunSummary) -> str:
    """What an interrupted ``run --once`` left undone, in one line."""
    left = []
    if summary.source_left:
        left.append("the source was not read to its end position")
    left += [
        f"{name}: {count:,} updates not acknowledged"
        for name, count in summary.applications_left.items()
    ]
    return (
        f"run --once stopped before its end ({'; '.join(left) or 'nothing left'}); "
        f"run it again to deliver the rest"
    )


def _metrics_option(pipeline: Pipeline, address: str | None) -> None:
    """``--metrics HOST:PORT``: serve metrics there (over the file's ``metrics.listen``)."""
    if address is None:
        return
    flows = pipeline.metrics.flows if pipeline.metrics is not None else True
    pipeline.metrics = MetricsSettings(parse_listen(address, "--metrics"), flows)


def cmd_run(args: argparse.Namespace) -> int:
    pipeline = _load(args.pipeline)
    _metrics_option(pipeline, args.metrics)
    publisher = Publisher(pipeline, once=args.once, local_subscribers=args.command == "run")
    signals = {"count": 0}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        signals["count"] += 1
        if signals["count"] > 1:
            # State on disk is always consistent; a second signal need not wait.
            os._exit(128 + signum)
        logging.getLogger("wormhole").info(
            "%s: draining and persisting datamarkers (again to exit at once)",
            signal.Signals(signum).name,
        )
        publisher.request_stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, lambda signum, frame: publisher.request_reload())
    tune_gc()
    try:
        summary = publisher.run()
    except Stopped as exc:
        if not args.once:
            raise
        # Stopped while starting: nothing was delivered, the end was not reached.
        report_error(f"error: run --once stopped before its end: {exc}; run it again")
        return EXIT_INCOMPLETE
    if args.json:
        print(json.dumps(_summary_json(summary)))
    elif not args.quiet:
        _print_summary(summary)
    if summary.complete is False:
        report_error(f"error: {_incomplete_text(summary)}")
        return EXIT_INCOMPLETE
    return EXIT_OK


def _summary_json(summary: RunSummary) -> dict[str, Any]:
    return {
        "pipeline": summary.pipeline,
        "elapsed": summary.elapsed,
        "source_updates": summary.source_updates,
        "log_end": summary.log_end,
        "applications": {
            a.name: {"updates": a.updates, "datamarker": a.datamarker, "lag": a.lag}
            for a in summary.applications.values()
        },
        "truncated": summary.truncated,
        "removed_segments": summary.removed_segments,
        "log_bytes_read": summary.log_bytes_read,
        "caravans": {"merges": summary.caravan_merges, "splits": summary.caravan_splits},
        "complete": summary.complete,
        "remaining": {"source": summary.source_left, "applications": summary.applications_left}
        if summary.once
        else None,
    }


def _exit_with_parent(parent: int) -> None:
    """Die at once when the publisher that started us dies (even by kill -9).

    Anything this subscriber had not acknowledged is sent again to the next
    owner; carrying on alone could only write it out of order with that owner.
    """
    import ctypes
    import threading
    import time

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:  # for systems without PR_SET_PDEATHSIG
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent watch", daemon=True).start()


def cmd_subscribe(args: argparse.Namespace) -> int:
    catch_stop_signals()
    if args.exit_with_parent:
        _exit_with_parent(args.exit_with_parent)
    pipeline = _load(args.pipeline)
    if args.metrics is not None:
        # For the life of the process (a daemon thread): the sink's figures, retries, ...
        serve(parse_listen(args.metrics, "--metrics"))
    tune_gc()  # a subscriber decodes many short-lived objects too
    subscribe = pipeline.transport.registered.spec.subscribe
    if subscribe is None:
        raise ConfigError(
            f"transport.type: {pipeline.transport.type} has no separate subscribers; "
            f"`wormhole subscribe` needs a transport that has them",
            pipeline.file,
        )
    subscribe(SubscribeRequest(pipeline, args.app, args.instance, args.publisher or []))
    return EXIT_OK


def cmd_validate(args: argparse.Namespace) -> int:
    pipeline = _load(args.pipeline)
    apps = ", ".join(
        f"{a.name} ({a.sink.type if a.sink else 'library'} x{a.subscribers})"
        for a in pipeline.applications.values()
    )
    print(
        f"{args.pipeline}: valid. pipeline {pipeline.name}: source {pipeline.source.type}, "
        f"transport {pipeline.transport.type}, {pipeline.shards} shards, "
        f"applications: {apps}"
    )
    return EXIT_OK


def cmd_plugins(args: argparse.Namespace) -> int:
    from wormhole.plugins.manager import default_registry

    registry = default_registry()
    if args.json:
        print(
            json.dumps(
                {
                    kind: {
                        name: {
                            "distribution": r.distribution,
                            "version": r.version,
                            "description": r.spec.description,
                            "options": r.spec.options.model_json_schema(),
                        }
                        for name, r in sorted(registry.components[kind].items())
                    }
                    for kind in KINDS
                },
                indent=2,
            )
        )
        return EXIT_OK
    for kind in KINDS:
        print(f"{PLURALS.get(kind, kind.replace('_', ' ') + 's')}:")
        entries = sorted(registry.components[kind].items())
        if not entries:
            print("  (none)")
        width = max((len(name) for name, _ in entries), default=0)
        for name, registered in entries:
            dist = f"{registered.distribution} {registered.version}".strip()
            print(f"  {name:<{width}}  [{dist}]  {registered.spec.description}")
    return EXIT_OK


def _live_status(state_dir: Path) -> dict[str, Any] | None:
    return read_live_status(state_dir)


def _deployment(pipeline: Pipeline) -> dict[str, Any] | None:
    """The whole deployment as the shared registry sees it (None without one)."""
    component = pipeline.dataset_registry
    if component is None or not component.registered.spec.shared:
        return None
    registry = _shared_registry(pipeline, "wormhole status")
    try:
        publishers: list[Any] = []
        # Watches fire at once with the current value (and again on changes): keep the last.
        registry.watch_publishers(lambda found: publishers.__setitem__(slice(None), found))
        statuses = registry.statuses()
        store = registry.application_store()
        raw = store.applications() if store is not None else {}
        names = sorted(set(raw) | set(pipeline.applications))
        subscribers: dict[str, list[str]] = {}
        for name in names:
            found: list[Any] = []
            registry.watch_subscribers(
                name, lambda entries, found=found: found.__setitem__(slice(None), entries)
            )
            subscribers[name] = [e.instance for e in found]
        # Which copy serves what: the claim, confirmed by the copy's own status (a copy
        # holds the claim a moment before it serves, and its status lags its release).
        claims: dict[tuple[str, str], Any] = {}
        serving_claims = registry.serving_claims()
        copied = {e.datastore for e in publishers if e.copy} if serving_claims else set()
        for datastore in sorted(copied):
            for name in names:
                serving_claims.watch_serving(
                    name,
                    datastore,
                    lambda claim, key=(name, datastore): claims.__setitem__(key, claim),
                )

        def serving(entry: Any) -> list[str]:
            said = statuses.get(entry.node, {}).get("copies", {}).get("serving", {})
            return sorted(
                app
                for app in said
                if (claim := claims.get((app, entry.datastore))) is not None
                and claim.copy == entry.copy
            )

        flows = []
        for entry in publishers:
            status = statuses.get(entry.node, {})
            end = status.get("log", {}).get("end")
            copies = status.get("copies")
            for app, app_flows in sorted(status.get("flows", {}).items()):
                if copies is not None and app not in copies.get("serving", {}):
                    continue  # a standby copy: the serving copy's flows are listed
                shared = (copies or {}).get("shared_datamarkers", {}).get(app, {})
                for flow in app_flows:
                    marker = flow["datamarker"]
                    flows.append(
                        {
                            "application": app,
                            "datastore": entry.datastore,
                            "copy": entry.copy,
                            "shard": flow["shard"],
                            "owner": flow["owner"],
                            "datamarker": marker,
                            "lag": None if end is None else max(0, end - marker),
                            "logical": (shared.get(str(flow["shard"])) or [None])[0],
                        }
                    )
        return {
            "registry": registry.describe(),
            "publishers": [
                {
                    "datastore": e.datastore,
                    "copy": e.copy,
                    "serving": serving(e),
                    "ready": sorted(
                        name
                        for name, ready in statuses.get(e.node, {})
                        .get("copies", {})
                        .get("copies_ready", {})
                        .items()
                        if ready
                    ),
                    "address": e.address,
                    "host": e.host,
                    "pid": e.pid,
                    "alive": True,
                    "status": e.node in statuses,
                }
                for e in publishers
            ],
            "applications": {
                n: {"invalid": v.__dict__} if isinstance(v, InvalidEntry) else v
                for n, v in sorted(raw.items())
            },
            "subscribers": subscribers,
            "flows": flows,
        }
    finally:
        registry.close()


def _print_deployment(deployment: dict[str, Any]) -> None:
    print(f"deployment ({deployment['registry']}):")
    for entry in deployment["publishers"]:
        node = f"{entry['datastore']}@{entry['copy']}" if entry["copy"] else entry["datastore"]
        serving = f"  serving {', '.join(entry['serving'])}" if entry["serving"] else ""
        print(
            f"  publisher {node:<16} {entry['address']:<22} "
            f"{entry['host']}:{entry['pid']} alive{serving}"
        )
    if not deployment["publishers"]:
        print("  no live publisher")
    for name, instances in deployment["subscribers"].items():
        owned: dict[str, int] = {}
        for flow in deployment["flows"]:
            if flow["application"] == name and flow["owner"]:
                owned[flow["owner"]] = owned.get(flow["owner"], 0) + 1
        listed = ", ".join(f"{i} ({owned.get(i, 0)} flows)" for i in instances) or "none"
        print(f"  application {name}: subscribers {listed}")
    if deployment["flows"]:
        print(
            f"  {'application':<16} {'datastore':<12} {'shard':>5} {'owner':<28} "
            f"{'datamarker':>12} {'lag':>10}"
        )
    for flow in deployment["flows"]:
        print(
            f"  {flow['application']:<16} {flow['datastore']:<12} {flow['shard']:>5} "
            f"{flow['owner'] or '-':<28} {flow['datamarker']:>12,} "
            f"{'-' if flow['lag'] is None else format(flow['lag'], ','):>10}"
        )


def cmd_status(args: argparse.Namespace) -> int:
    pipeline = _load(args.pipeline, reads_state_only=True)
    deployment = _deployment(pipeline)
    if deployment is not None and not pipeline.state_dir.is_dir():
        # A machine without this publisher's state: the registry's view only.
        if args.json:
            print(json.dumps({"pipeline": pipeline.name, "deployment": deployment}))
        else:
            _print_deployment(deployment)
        return EXIT_OK
    info = inspect_log(pipeline.state_dir / "log")
    markers = {}
    if pipeline.state_dir.is_dir():
        # The pipeline's own datamarker store, whichever it is, read-only.
        markers = load_stored(pipeline.datamarker_store, pipeline.name, pipeline.state_dir)
    flows = []
    for name in sorted(pipeline.applications):
        for shard in range(pipeline.shards):
            marker = markers.get((name, shard))
            position = marker.position if marker else None
            lag = None if position is None else max(0, info.next_seq - position)
            flows.append({"application": name, "shard": shard, "datamarker": position, "lag": lag})
    lag_of, lag_error = _destination_lag(pipeline, flows)
    live = _live_status(pipeline.state_dir)
    names, registry = (
        (set(deployment["applications"]), deployment["registry"])
        if deployment is not None and deployment["applications"]
        else (set(pipeline.applications), None)
    )
    removed = _removed_applications(names, markers, info.next_seq)
    dead_letters = {
        name: 0 for name, a in pipeline.applications.items() if a.on_error.policy == "dead_letter"
    }
    dead_letters.update(count_dead_letters(pipeline.state_dir))
    backfills = backfill_summary(pipeline.state_dir)
    if args.json:
        print(
            json.dumps(
                {
                    "pipeline": pipeline.name,
                    "state_dir": str(pipeline.state_dir),
                    "running": live is not None,
                    "caravans": live["caravans"] if live else [],
                    "failed": live["failed"] if live else {},
                    "log": {
                        "first": info.first_seq,
                        "end": info.next_seq,
                        "segments": [
                            {"name": n, "first": f, "bytes": s} for n, f, s in info.segments
                        ],
                    },
                    "flows": flows,
                    "lag_of": lag_of,
                    "lag_error": lag_error,
                    "removed_applications": removed,
                    "dead_letters": dead_letters,
                    "backfills": backfills,
                    "deployment": deployment,
                }
            )
        )
        return EXIT_OK
    total = sum(s for _, _, s in info.segments)
    print(
        f"pipeline {pipeline.name} (state {pipeline.state_dir}): publisher log {info.first_seq:,}"
        f" .. {info.next_seq:,} in {len(info.segments)} segment(s), {total:,} bytes"
    )
    if live is not None:
        print(f"  running (pid {live['pid']}); caravans:")
        for c in live["caravans"]:
            print(
                f"    {','.join(c['applications']):<24} position {c['position']:>12,}  "
                f"{c['read_rate']:>10,.0f} updates/s  {c['bytes_read_from_disk']:,} bytes "
                f"from disk"
            )
        for name, error in live["failed"].items():
            print(f"  application {name} stopped: {error}")
    else:
        print("  not running")
    if lag_error:
        print(f"  warning: lag unknown: {lag_error}")
    print(f"  lag: {lag_of}")
    print(f"  {'application':<16} {'shard':>5} {'datamarker':>12} {'lag':>10}")
    for flow in flows:
        marker_text = "-" if flow["datamarker"] is None else f"{flow['datamarker']:,}"
        lag_text = "-" if flow["lag"] is None else f"{flow['lag']:,}"
        print(f"  {flow['application']:<16} {flow['shard']:>5} {marker_text:>12} {lag_text:>10}")
    for app_name, count in dead_letters.items():
        print(
            f"  application {app_name}: {count:,} dead letters (wormhole dead-letters list "
            f"{pipeline.file} --app {app_name})"
        )
    _print_backfills(backfills, every=False)
    for entry in removed:
        print(
            f"  warning: application {entry['application']} is not in "
            f"{registry or pipeline.file}, but its "
            f"datamarkers keep the publisher log from position {entry['datamarker']:,} "
            f"({entry['lag']:,} updates); it resumes there if added back. To release the log, "
            f"run: wormhole forget {pipeline.file} {entry['application']}"
        )
    if deployment is not None:
        _print_deployment(deployment)
    return EXIT_OK


PUBLISHER_LAG = "publisher-log updates after the datamarker"


def _destination_lag(pipeline: Pipeline, flows: list[dict[str, Any]]) -> tuple[str, str]:
    """With a transport that counts lag at its destination (Kafka: consumer groups), each
    flow's lag from there. Returns what the lag counts, and why it is unknown ("" if not)."""
    measure = pipeline.transport.registered.spec.lag
    if measure is None:
        return PUBLISHER_LAG, ""
    found = measure(pipeline.transport.options, pipeline)
    for flow in flows:
        flow["lag"] = found.shards.get(flow["application"], {}).get(flow["shard"])
    return found.what, found.error


def cmd_top(args: argparse.Namespace) -> int:
    from wormhole.core import top

    if args.interval <= 0:
        raise ConfigError(f"--interval: {args.interval} must be a positive number of seconds")
    pipeline = _load(args.pipeline, reads_state_only=True)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how the view ends
        top.run(pipeline, args.interval, args.once)
    return EXIT_OK


def _removed_applications(
    names: set[str], markers: dict[tuple[str, int], Any], end: int
) -> list[dict[str, Any]]:
    """Applications with stored datamarkers that the dataset no longer has: they hold the
    publisher log back until added again or forgotten."""
    lowest: dict[str, int] = {}
    for (name, _), marker in markers.items():
        if name not in names:
            lowest[name] = min(lowest.get(name, marker.position), marker.position)
    return [
        {"application": name, "datamarker": position, "lag": max(0, end - position)}
        for name, position in sorted(lowest.items())
    ]


def _shared_registry(pipeline: Pipeline, what: str) -> Any:
    """The pipeline's registry, opened, when it is shared across machines (else an error)."""
    from wormhole.core.registry import open_registry

    component = pipeline.dataset_registry
    if component is None or not component.registered.spec.shared:
        raise WormholeError(
            f"{what}: the applications of {pipeline.name} are in {pipeline.file} (no shared "
            f"registry configured): edit the file and send the publisher SIGHUP, or configure "
            f"registry: {{type: zookeeper, hosts: ..., root: ...}}"
        )
    import threading

    return open_registry(component, pipeline.name, threading.Event())


def cmd_apps(args: argparse.Namespace) -> int:
    import yaml

    from wormhole.core.pipeline import parse_application
    from wormhole.core.registry import application_path

    pipeline = _load(args.pipeline)
    what = f"wormhole apps {args.action}"
    registry = _shared_registry(pipeline, what)
    try:
        store = registry.application_store()
        if store is None:
            raise WormholeError(
                f"{what}: {registry.describe()} holds no applications: those of "
                f"{pipeline.name} are in {pipeline.file}"
            )
        if args.action == "list":
            raw = store.applications()
            shown = {
                # An unreadable entry is told apart from an application's mapping.
                n: {"invalid": v.__dict__} if isinstance(v, InvalidEntry) else v
                for n, v in sorted(raw.items())
            }
            if args.json:
                print(json.dumps(shown))
                return EXIT_OK
            print(f"applications of {pipeline.name} in {registry.describe()}:")
            for name, value in shown.items():
                print(f"  {name}: {json.dumps(value)}")
            return EXIT_OK
        name = args.app
        if args.action == "move":
            raw = store.applications()
            current = raw.get(name)
            if not isinstance(current, dict):
                raise WormholeError(f"no application {name!r} in {registry.describe()}")
            import time

            order = [args.copy] + [c for c in current.get("copies") or [] if c != args.copy]
            move = {"to": args.copy, "requested": int(time.time() * 1000)}
            store.put_application(name, {**current, "copies": order, "move": move})
            print(
                f"application {name}: moves to copy {args.copy} (now preferred: "
                f"{', '.join(order)}); the copy serving it hands it over once {args.copy} has "
                f"caught up"
            )
            return EXIT_OK
        if args.action == "remove":
            if not store.remove_application(name):
                raise WormholeError(f"no application {name!r} in {registry.describe()}")
            print(f"removed application {name}; its datamarkers are kept by each publisher")
            return EXIT_OK
        raw_app: dict[str, Any] = {}
        if args.from_file:
            found = (pipeline.raw.get("applications") or {}).get(name)
            if found is None:
                raise ConfigError(f"--from-file: no applications.{name} in the file", pipeline.file)
            raw_app.update(found)
        for key in ("sink", "filter"):
            text = getattr(args, key)
            if text is not None:
                value = yaml.safe_load(text)
                if not isinstance(value, dict):
                    raise ConfigError(f"--{key}: must be a YAML mapping, e.g. {{type: jsonl}}")
                raw_app[key] = value
        if args.start is not None:
            raw_app["start"] = yaml.safe_load(args.start)
        if args.subscribers is not None:
            raw_app["subscribers"] = args.subscribers
        if name in store.applications() and not args.replace:
            raise WormholeError(
                f"application {name} is already registered ({application_path(registry, name)}); "
                f"remove it first, or pass --replace (a running application's changes apply "
                f"when its publishers restart)"
            )
        app, problems = parse_application(pipeline, name, raw_app, f"application {name}")
        if app is None:
            raise ConfigError(problems)
        store.put_application(name, raw_app)
        print(f"registered application {name} for every publisher of {pipeline.name}")
        return EXIT_OK
    finally:
        registry.close()


def _application_names(pipeline: Pipeline) -> tuple[set[str], str | None]:
    """The dataset's applications, and the registry holding them (None: the file)."""
    component = pipeline.dataset_registry
    if component is None or not component.registered.spec.shared:
        return set(pipeline.applications), None
    registry = _shared_registry(pipeline, "registry")
    try:
        store = registry.application_store()
        if store is None:
            return set(pipeline.applications), None
        return set(store.applications()), str(registry.describe())
    finally:
        registry.close()


def cmd_forget(args: argparse.Namespace) -> int:
    pipeline = _load(args.pipeline)
    name = args.app
    names, registry = _application_names(pipeline)
    if name in names and registry is not None:
        raise WormholeError(
            f"application {name} is still registered in {registry}: forgetting it would only "
            f"make it start again from its start point. Remove it first: wormhole apps remove "
            f"{pipeline.file} {name}"
        )
    if name in names:
        raise WormholeError(
            f"applications.{name} is still in {pipeline.file}: forgetting it would only make it "
            f"start again from its start point. Remove it from the file first (and send a "
            f"running publisher SIGHUP)"
        )
    live = _live_status(pipeline.state_dir)
    if live is not None and name in live.get("applications", []):
        how = (
            "wait for it to apply the registry's change"
            if registry is not None
            else f"send it SIGHUP to apply {pipeline.file}"
        )
        raise WormholeError(
            f"application {name} is still served by the running publisher (pid {live['pid']}): "
            f"{how}, then forget {name}"
        )
    store = pipeline.datamarker_store.create()
    store.open(pipeline.name, pipeline.state_dir)
    try:
        count = store.forget(name)
    finally:
        store.close()
    if count == 0:
        raise WormholeError(
            f"application {name} has no stored datamarkers in {pipeline.state_dir}: nothing to "
            f"forget (`wormhole status {pipeline.file}` lists removed applications)"
        )
    print(
        f"forgot application {name}: {count} datamarkers deleted; the publisher log it held is "
        f"collected as the other flows move on"
    )
    return EXIT_OK


class JsonFormatter(logging.Formatter):
    """``--log-format json``: one JSON object a line with ``time`` (UTC, ISO 8601),
    ``level``, ``logger``, ``message`` and, for an exception, ``exception``."""

    def format(self, record: logging.LogRecord) -> str:
        import datetime

        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


def _dead_letter_row(entry: Any) -> dict[str, Any]:
    import datetime

    from wormhole.core.update import envelope

    return {
        "id": entry.id,
        "datastore": entry.datastore or None,
        "shard": entry.shard,
        "table": entry.table,
        "key": entry.key,
        "position": entry.position,
        "logical": entry.logical,
        "error": entry.error,
        "parked_behind": entry.parked_behind or None,
        "time": datetime.datetime.fromtimestamp(entry.ts_ms / 1000, datetime.UTC).isoformat(),
        "update": json.loads(msgspec_json(envelope(entry.update))),
    }


def msgspec_json(value: Any) -> bytes:
    import msgspec

    return msgspec.json.encode(value)


def cmd_dead_letters(args: argparse.Namespace) -> int:
    from wormhole.core import dead_letters as dl

    pipeline = _load(args.pipeline)
    name = args.app
    names, _ = _application_names(pipeline)
    dead = dl.DeadLetterLog(pipeline.state_dir, name)
    if name not in names and not dead.path.exists():
        raise WormholeError(
            f"application {name} is not in {pipeline.file} and has no dead-letter log in "
            f"{pipeline.state_dir}; the applications are: {', '.join(sorted(names))}"
        )
    try:
        if args.action in ("list", "show"):
            dead.refresh()
            entries = list(dead.entries.values())
            if args.action == "show":
                entry = dead.entries.get(args.id)
                if entry is None:
                    raise WormholeError(
                        f"application {name} has no dead letter {args.id} in {dead.path} "
                        f"(`wormhole dead-letters list {args.pipeline} --app {name}` lists them)"
                    )
                print(json.dumps(_dead_letter_row(entry), indent=2))
                return EXIT_OK
            if args.json:
                print(json.dumps([_dead_letter_row(e) for e in entries]))
                return EXIT_OK
            parked = sum(1 for e in entries if e.parked_behind)
            print(
                f"application {name}: {len(entries)} dead letters ({parked} parked behind "
                f"another of their key) in {dead.path}"
            )
            for e in entries:
                why = f"parked behind {e.parked_behind}" if e.parked_behind else e.error
                key = json.dumps(e.key, separators=(",", ":"))
                flow = f"{e.datastore}/{e.shard}" if e.datastore else str(e.shard)
                print(
                    f"  {e.id:>6}  shard {flow:<4} {e.table} {key} at "
                    f"{e.position or e.logical or '?'}: {why}"
                )
            return EXIT_OK
        if args.action == "purge":
            if not args.id and not args.yes:
                raise WormholeError(
                    "purge: name the dead letters to remove (--id ID, repeatable) or remove "
                    "them all with --yes; what is purged is never delivered"
                )
            removed = dl.purge(dead, set(args.id) if args.id else None)
            print(f"application {name}: purged {len(removed)} dead letters")
            return EXIT_OK
        # replay
        from wormhole.core.registry import subscriber_application
        from wormhole.core.subscriber import open_sink

        app = subscriber_application(pipeline, name, "wormhole.Subscriber")
        assert app.sink is not None
        sink = open_sink(app.sink, pipeline, app, args.instance)
        try:
            result = dl.replay(dead, sink, set(args.id) if args.id else None)
        finally:
            sink.close()
        print(
            f"application {name}: replayed {len(result.replayed)} dead letters through its sink"
            f"; {len(dead.entries)} left"
        )
        for entry_id, error in result.failed:
            print(f"  dead letter {entry_id} rejected again (its key stays parked): {error}")
        return EXIT_OK if not result.failed else 1
    finally:
        dead.close()


def cmd_backfill(args: argparse.Namespace) -> int:
    from wormhole.core import backfill as bf
    from wormhole.core.errors import BackfillError
    from wormhole.plugins.components import SourceBackfill

    pipeline = _load(args.pipeline)
    if args.list:
        requests = bf.summary(pipeline.state_dir)
        if args.json:
            print(json.dumps(requests))
        else:
            _print_backfills(requests, every=True)
        return EXIT_OK
    if args.cancel is not None:
        if not bf.BackfillStore.exists(pipeline.state_dir):
            raise BackfillError(f"--cancel {args.cancel}: {pipeline.state_dir} holds no backfills")
        store = bf.BackfillStore(pipeline.state_dir)
        try:
            request = store.cancel(args.cancel)
        finally:
            store.close()
        print(f"{request.describe()} cancelled after {request.rows:,} rows")
        return EXIT_OK
    if not args.table:
        raise BackfillError(
            "name the table to backfill (--table schema.table), or use --list or --cancel ID"
        )
    if args.app is not None:
        names, where = _application_names(pipeline)
        if args.app not in names:
            raise BackfillError(
                f"--app {args.app}: no such application in {where or pipeline.file}; the "
                f"applications are: {', '.join(sorted(names))}"
            )
    chunk_size = pipeline.backfill.chunk_size if args.chunk_size is None else args.chunk_size
    pause_ms = pipeline.backfill.pause_ms if args.pause_ms is None else args.pause_ms
    if not 1 <= chunk_size <= 1_000_000 or not 0 <= pause_ms <= 3_600_000:
        raise BackfillError(
            f"--chunk-size {chunk_size} --pause-ms {pause_ms}: a chunk holds 1 to 1,000,000 "
            f"rows and the pause is 0 to 3,600,000 ms"
        )
    created: Any = pipeline.source.create()
    source = created
    if not isinstance(source, SourceBackfill):
        raise BackfillError(
            f"source.type {pipeline.source.type}: this source cannot backfill tables: it "
            f"reads a log of changes, not tables it could read again. Backfills need a "
            f"database source (postgres, mysql)"
        )
    try:
        plan = source.backfill_plan(pipeline.name, args.table, args.where)
    finally:
        created.close()
    store = bf.BackfillStore(pipeline.state_dir)
    try:
        request = store.add(plan.table, plan.where, args.app, chunk_size, pause_ms, plan.estimate)
        about = "" if plan.estimate is None else f", about {plan.estimate:,} rows"
        print(f"{request.describe()} queued (id {request.id}{about})")
        if _live_status(pipeline.state_dir) is None:
            print(
                f"  the publisher is not running: it starts the backfill when it runs "
                f"(wormhole run {pipeline.file})"
            )
        if not args.wait:
            return EXIT_OK
        return _wait_for_backfill(store, request.id)
    finally:
        store.close()


def _wait_for_backfill(store: Any, request_id: int) -> int:
    """Follow a backfill to its end: 0 when done, 1 when cancelled or failed."""
    import time

    next_line = 0.0
    while True:
        request = store.get(request_id)
        if request is None:
            return 1
        if request.state in ("done", "cancelled", "failed"):
            why = f": {request.error}" if request.error else ""
            print(
                f"{request.describe()} {request.state}: {request.rows:,} rows emitted, "
                f"{request.read:,} read, {request.dropped:,} dropped as changed meanwhile, "
                f"{request.chunks:,} chunks{why}"
            )
            return EXIT_OK if request.state == "done" else 1
        now = time.monotonic()
        if now >= next_line:
            next_line = now + 5.0
            total = _of_estimate(request.read, request.estimate, "of about")
            print(f"  {request.state}: {request.read:,} rows read{total}", flush=True)
        time.sleep(0.2)


def _of_estimate(done: int, estimate: int | None, of: str) -> str:
    """`` of ~N`` while the work is within the estimate; past it, say so (never done > N)."""
    if not estimate:
        return ""
    if done <= estimate:
        return f" {of}{'' if of.endswith('~') else ' '}{estimate:,}"
    return f" (more than the estimated {estimate:,})"


def _print_backfills(requests: list[dict[str, Any]], every: bool) -> None:
    shown = [r for r in requests if every or r["state"] in ("queued", "running")]
    if not shown:
        if every:
            print("no backfills")
        return
    print("  backfills:")
    for r in shown:
        whom = r["application"] or "every application"
        where = f" where {r['where']}" if r["where"] else ""
        total = _of_estimate(r["read"], r["estimate"], "of ~")
        error = f": {r['error']}" if r["error"] else ""
        print(
            f"    {r['id']:>4}  {r['state']:<9} {r['table']}{where} for {whom}: "
            f"{r['read']:,}{total} rows read, {r['rows']:,} emitted, {r['dropped']:,} dropped, "
            f"{r['chunks']:,} chunks{error}"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wormhole",
        description="Change data capture and reliable pub-sub: database logs to ordered, "
        "sharded, acknowledged streams of key-value updates.",
    )
    from wormhole.plugins.manager import DISTRIBUTION, builtin_version

    parser.add_argument(
        "--version",
        action="version",
        version=f"wormhole {builtin_version()} ({DISTRIBUTION}, Python {sys.version.split()[0]})",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("WORMHOLE_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
        help="log level (default: $WORMHOLE_LOG_LEVEL or info); subscribers started by "
        "`run` inherit it",
    )
    parser.add_argument(
        "--log-format",
        default=os.environ.get("WORMHOLE_LOG_FORMAT", "text"),
        choices=["text", "json"],
        help="log lines as text, or as one JSON object a line (time, level, logger, message); "
        "default: $WORMHOLE_LOG_FORMAT or text; subscribers started by `run` inherit it",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for name, help_text, once_help in (
        (
            "run",
            "run a pipeline until stopped (or --once)",
            "deliver everything the source holds now to every application, then exit",
        ),
        (
            "publish",
            "run only the publisher; subscribers connect to it (tcp transport)",
            "as for run",
        ),
    ):
        command = sub.add_parser(
            name,
            help=help_text,
            description=f"{help_text[0].upper()}{help_text[1:]}.",
            epilog="exit status: 0 when stopped or done; 2 on an error (named on an `error:` "
            "line); 3 when stopped (SIGINT, SIGTERM) before the end of --once, saying what "
            "was left (run it again to deliver the rest); 128+N on a second signal N.",
        )
        command.add_argument("pipeline", help="pipeline file (YAML)")
        command.add_argument("--once", action="store_true", help=once_help)
        command.add_argument("-q", "--quiet", action="store_true", help="no summary")
        command.add_argument("--json", action="store_true", help="print the summary as JSON")
        command.add_argument(
            "--metrics",
            metavar="HOST:PORT",
            help="serve Prometheus metrics here (instead of the file's metrics.listen; "
            "subscriber processes `run` starts use the ports after it)",
        )
        command.set_defaults(func=cmd_run)

    subscribe = sub.add_parser(
        "subscribe", help="run one subscriber of an application, with its sink, on any machine"
    )
    subscribe.add_argument("pipeline", help="pipeline file (YAML)")
    subscribe.add_argument("--app", required=True, help="the application to subscribe as")
    subscribe.add_argument(
        "--publisher",
        action="append",
        metavar="HOST:PORT",
        help="publisher address (repeat for several; default: from the pipeline or state dir)",
    )
    subscribe.add_argument(
        "--instance", type=int, default=0, help="this subscriber's number (the sink's {subscriber})"
    )
    subscribe.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve this subscriber's Prometheus metrics here (sink latency, retries, ...)",
    )
    subscribe.add_argument("--exit-with-parent", type=int, metavar="PID", help=argparse.SUPPRESS)
    subscribe.set_defaults(func=cmd_subscribe)

    validate = sub.add_parser("validate", help="check a pipeline file")
    validate.add_argument("pipeline", help="pipeline file (YAML)")
    validate.set_defaults(func=cmd_validate)

    plugins = sub.add_parser("plugins", help="list components by kind and their distribution")
    plugins.add_argument("--json", action="store_true", help="with option schemas, as JSON")
    plugins.set_defaults(func=cmd_plugins)

    status = sub.add_parser("status", help="datamarker and lag of every flow")
    status.add_argument("pipeline", help="pipeline file (YAML)")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.set_defaults(func=cmd_status)

    top = sub.add_parser(
        "top",
        help="a live view: per application throughput, lag, subscribers, caravans; source lag",
    )
    top.add_argument("pipeline", help="pipeline file (YAML)")
    top.add_argument(
        "--interval", type=float, default=2.0, help="seconds between refreshes (default 2)"
    )
    top.add_argument(
        "--once", action="store_true", help="print one frame and exit (plain text off a terminal)"
    )
    top.set_defaults(func=cmd_top)

    forget = sub.add_parser(
        "forget",
        help="delete the datamarkers of an application removed from the pipeline file, "
        "releasing the publisher log it holds",
    )
    forget.add_argument("pipeline", help="pipeline file (YAML)")
    forget.add_argument("app", help="an application no longer in the file")
    forget.set_defaults(func=cmd_forget)

    apps = sub.add_parser(
        "apps", help="list, add or remove the applications of a dataset in its registry"
    )
    apps_sub = apps.add_subparsers(dest="action", required=True, metavar="ACTION")
    apps_list = apps_sub.add_parser("list", help="the registered applications")
    apps_list.add_argument("pipeline", help="pipeline file (YAML) naming the registry")
    apps_list.add_argument("--json", action="store_true", help="print the list as JSON")
    apps_add = apps_sub.add_parser(
        "add", help="register an application for every publisher of the dataset"
    )
    apps_add.add_argument("pipeline", help="pipeline file (YAML) naming the registry")
    apps_add.add_argument("app", help="application name")
    apps_add.add_argument("--start", help="earliest | latest | {position: SEQ} | {time: T}")
    apps_add.add_argument("--sink", metavar="YAML", help="sink mapping, e.g. '{type: jsonl, ...}'")
    apps_add.add_argument("--filter", metavar="YAML", help="filter mapping, as in the file")
    apps_add.add_argument("--subscribers", type=int, help="subscriber instances")
    apps_add.add_argument(
        "--from-file", action="store_true", help="start from the file's applications.APP"
    )
    apps_add.add_argument(
        "--replace", action="store_true", help="overwrite an application already registered"
    )
    apps_remove = apps_sub.add_parser(
        "remove", help="remove an application: its subscribers finish what they hold and leave"
    )
    apps_remove.add_argument("pipeline", help="pipeline file (YAML) naming the registry")
    apps_remove.add_argument("app", help="application name")
    apps_move = apps_sub.add_parser(
        "move",
        help="multiple-copy: serve an application from another copy of its datastores",
    )
    apps_move.add_argument("pipeline", help="pipeline file (YAML) naming the registry")
    apps_move.add_argument("app", help="application name")
    apps_move.add_argument("copy", help="the copy to serve it from")
    apps.set_defaults(func=cmd_apps)

    dead = sub.add_parser(
        "dead-letters",
        help="list, show, replay or purge the updates an application's sink rejected "
        "(on_error: {policy: dead_letter})",
    )
    dead_sub = dead.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, help_text in (
        ("list", "the application's dead letters, oldest first"),
        ("show", "one dead letter in full: error, position, flow, time and the update"),
        (
            "replay",
            "deliver them again through the application's sink, in order per key; "
            "removes what it takes",
        ),
        ("purge", "remove dead letters without delivering them (--id ID or --yes for all)"),
    ):
        command = dead_sub.add_parser(action, help=help_text)
        command.add_argument("pipeline", help="pipeline file (YAML)")
        command.add_argument("--app", required=True, help="the application")
        if action == "show":
            command.add_argument("id", type=int, help="the dead letter's id")
        if action == "list":
            command.add_argument("--json", action="store_true", help="print the list as JSON")
        if action == "replay":
            command.add_argument(
                "--id",
                type=int,
                action="append",
                help="only this dead letter (repeatable); replay takes its whole key",
            )
        if action == "purge":
            command.add_argument(
                "--id",
                type=int,
                action="append",
                help="only this dead letter (repeatable); the others stay",
            )
        if action == "purge":
            command.add_argument("--yes", action="store_true", help="purge every dead letter")
        if action == "replay":
            command.add_argument(
                "--instance", type=int, default=0, help="open the sink as this subscriber number"
            )
    dead.set_defaults(func=cmd_dead_letters)

    backfill = sub.add_parser(
        "backfill",
        help="re-read a table in key-order chunks while the stream flows, for every "
        "application or one (--list, --cancel ID)",
    )
    backfill.add_argument("pipeline", help="pipeline file (YAML)")
    backfill.add_argument("--table", help="the table, as schema.table")
    backfill.add_argument(
        "--where", help="SQL condition on the table's rows: only those are backfilled"
    )
    backfill.add_argument("--app", help="only this application receives the rows")
    backfill.add_argument(
        "--chunk-size", type=int, help="rows per chunk (default: the file's backfill.chunk_size)"
    )
    backfill.add_argument(
        "--pause-ms", type=int, help="pause between chunks (default: backfill.pause_ms)"
    )
    backfill.add_argument(
        "--wait", action="store_true", help="follow the backfill to its end (exit 1 unless done)"
    )
    backfill.add_argument("--list", action="store_true", help="every backfill and its progress")
    backfill.add_argument("--cancel", type=int, metavar="ID", help="stop a backfill")
    backfill.add_argument("--json", action="store_true", help="--list as JSON")
    backfill.set_defaults(func=cmd_backfill)

    # Commands that plugins add (the search connector's `wormhole search`, say).
    from wormhole.plugins.manager import default_registry

    default_registry().pm.hook.wormhole_commands(commands=sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except WormholeError as exc:  # a plugin that fails to load
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    args = parser.parse_args(argv)
    import faulthandler

    # `kill -USR1 PID` prints every thread's stack to stderr: what a stuck process is doing.
    # (Not where stderr is no real file: main() called in-process with it captured.)
    with contextlib.suppress(ValueError, OSError, AttributeError):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    level = "debug" if args.verbose else args.log_level
    os.environ["WORMHOLE_LOG_LEVEL"] = level  # for subscriber processes we start
    os.environ["WORMHOLE_LOG_FORMAT"] = args.log_format
    handler = logging.StreamHandler(sys.stderr)
    if args.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])
    count_errors()
    global _json_errors
    _json_errors = args.log_format == "json"
    try:
        code: int = args.func(args)
        return code
    except ConfigError as exc:
        report_error(exc.render())
        return EXIT_USAGE
    except Stopped as exc:  # a stop asked for while starting: not a failure
        logging.getLogger("wormhole").info("%s", exc)
        return EXIT_OK
    except WormholeError as exc:
        report_error(f"error: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Output piped into `head` and the like: not an error.
        sys.stderr.close()
        return EXIT_OK
    except OSError as exc:
        if exc.filename is None:
            raise
        # A file-system error no code path above named: still the path and the fix.
        logging.getLogger("wormhole").debug("file-system error", exc_info=True)
        problem = file_problem(exc.filename, exc, "use")
        report_error(f"error: {problem}")
        return problem.exit_code


_json_errors = False
"""``--log-format json``: the final error is a JSON log line too."""


def report_error(text: str) -> None:
    """The command's final error on stderr: as given, or with ``--log-format json`` one JSON
    object (``level`` error, ``logger`` wormhole, ``message`` without the ``error:``)."""
    if not _json_errors:
        print(text, file=sys.stderr)
        return
    record = logging.LogRecord("wormhole", logging.ERROR, "", 0, text.removeprefix("error: "),
                               None, None)  # fmt: skip
    print(JsonFormatter().format(record), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
